#!/usr/bin/env python
"""Long contexts beside llama.cpp, same file, same run: prefill of a `D`-token prompt and decode of
64 tokens after it, for each depth D (default 4096 and 16384), with each KV cache format asked for.

  - tokenloom: `tokenloom bench --json --prompt-tokens D --new-tokens 64` in its own process (one
    timed run after a warm-up: its prefill is the D-token prompt from an empty context, its decode the
    64 tokens at positions D..D+63), context D + 64, and the process's peak RSS;
  - llama.cpp: `llama-bench -p D -n 0` (pp D from an empty context) and `-p 0 -n 64 -d D` (tg64 at
    depth D: the same positions), `-r 1`, with `-ctk/-ctv q8_0` (`q4_0`) for tokenloom's int8 (int4)
    cache (--llama-bench or $LLAMA_BENCH; ../shared/MODELS.md says how to build it).

    python benchmarks/long_context.py [--model FILE.gguf] [--depths 4096,16384] [--kv auto,int8]

Writes results/long_context.json.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

from _common import RESULTS, cpu_name, parser

from tokenloom.loader import hub

NEW = 64
LLAMA_KV = {
    "int8": "q8_0",
    "int4": "q4_0",
    "float16": "f16",
    "bfloat16": "bf16",
}  # tokenloom's stored caches as llama.cpp's types


def tokenloom_row(path: str, depth: int, kv: str) -> dict:
    cmd = [sys.executable, "-m", "tokenloom", "bench", "-m", path, "--json", "--runs", "1"]
    cmd += ["--prompt-tokens", str(depth), "--new-tokens", str(NEW), "--max-model-len", str(depth + NEW)]
    cmd += ["--kv-cache-dtype", kv, "--kv-cache-contexts", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"tokenloom bench failed: {out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return {"prefill": r["prefill_tok_s"], "decode": r["decode_tok_s"], "rss_mb": r["peak_rss_bytes"] / 1e6}


def llama_row(binary: str, path: str, depth: int, kv: str, threads: int) -> dict:
    """pp D from an empty context, then tg64 at depth D, in two llama-bench calls (one call with
    `-p D -n 64 -d 0,D` would also time pp D at depth D, a 2D-token context)."""
    row: dict = {"rss_mb": 0.0}
    for key, shape in (
        ("prefill", ["-p", str(depth), "-n", "0", "-d", "0"]),
        ("decode", ["-p", "0", "-n", str(NEW), "-d", str(depth)]),
    ):
        cmd = [
            "/usr/bin/time",
            "-f",
            "maxrss_kb=%M",
            binary,
            "-m",
            path,
            *shape,
            "-t",
            str(threads),
            "-r",
            "1",
            "-o",
            "json",
        ]
        if kv in LLAMA_KV:
            cmd += ["-ctk", LLAMA_KV[kv], "-ctv", LLAMA_KV[kv]]
            if kv in ("int8", "int4"):  # llama.cpp quantizes V only with flash attention
                cmd += ["-fa", "1"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"llama-bench failed: {out.stderr[-2000:]}")
        (result,) = json.loads(out.stdout)
        row[key] = result["avg_ts"]
        rss = int(re.search(r"maxrss_kb=(\d+)", out.stderr).group(1)) * 1024 / 1e6  # GNU time's %M is KiB
        row["rss_mb"] = max(row["rss_mb"], rss)
    return row


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--depths", default="4096,16384")
    p.add_argument("--kv", default="auto,int8", help="KV cache formats (tokenloom's --kv-cache-dtype)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench"))
    args = p.parse_args()
    path = args.model or str(hub.gguf_path("qwen2.5-coder-0.5b"))
    rows = []
    for kv in args.kv.split(","):
        for depth in map(int, args.depths.split(",")):
            ours = tokenloom_row(path, depth, kv)
            theirs = llama_row(args.llama_bench, path, depth, kv, args.threads) if args.llama_bench else {}
            rows.append({"kv": kv, "depth": depth, "tokenloom": ours, "llama.cpp": theirs})
            print(json.dumps(rows[-1]), flush=True)
    print(f"\n{path} on {cpu_name()}, {args.threads} threads; tokenloom / llama.cpp tok/s (ratio)")
    print("| KV cache | depth | prefill D tokens | decode 64 at depth D | peak RSS MB |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        ours, theirs = r["tokenloom"], r["llama.cpp"]

        def cell(key: str, fmt: str = ".1f") -> str:
            if key not in theirs:
                return f"{ours[key]:{fmt}}"
            return f"{ours[key]:{fmt}} / {theirs[key]:{fmt}} ({ours[key] / theirs[key]:.2f}x)"

        print(f"| {r['kv']} | {r['depth']} | {cell('prefill')} | {cell('decode')} | {cell('rss_mb', '.0f')} |")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "long_context.json"
    out.write_text(json.dumps({"model": path, "cpu": cpu_name(), "threads": args.threads, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
