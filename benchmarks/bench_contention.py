#!/usr/bin/env python
"""Decode speed when other work shares the CPU: tokenloom and llama.cpp measured the same way in the
same run, on the same GGUF file.

Scenarios: a quiet machine; 1 and 2 busy processes beside (each a Python loop spinning on a core);
two copies of the engine at once (a server and a CLI run, say). Each engine is a separate process
timing a batch-1 greedy decode of --new-tokens after a 128-token prompt: tokenloom through
`tokenloom bench --json` (its default threads, which follow the free cores; and `-t N` fixed, the
old behaviour, for reference), llama.cpp through `llama-bench -p 0 -n NEW -d 128` (its default
threads). Rounds alternate the engines; the table gives medians, the ratio to the engine's quiet
speed, and tokenloom over llama.cpp under the same load. Writes benchmarks/results/bench_contention.json.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import RESULTS, cpu_name, parser

BUSY = [sys.executable, "-c", "while True: pass"]


def tokenloom_cmd(gguf: str, new_tokens: int, threads: int | None) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "tokenloom",
        "bench",
        "-m",
        gguf,
        "--json",
        "--runs",
        "3",
        "--new-tokens",
        str(new_tokens),
        "--prompt-tokens",
        "128",
        "--log-level",
        "warning",
    ]
    return cmd + (["-t", str(threads)] if threads else [])


def llama_cmd(binary: str, gguf: str, new_tokens: int) -> list[str]:
    return [binary, "-m", gguf, "-p", "0", "-n", str(new_tokens), "-d", "128", "-r", "3", "-o", "json"]


def decode_speed(engine: str, out: str) -> float:
    """tok/s from an engine's JSON output."""
    if engine == "llama.cpp":
        return json.loads(out)[0]["avg_ts"]
    return json.loads(out.strip().splitlines()[-1])["decode_tok_s"]


def run_engines(commands: list[tuple[str, list[str]]], timeout: float = 900) -> list[float]:
    """Start every command at once; each one's decode tok/s."""
    procs = [
        (engine, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for engine, cmd in commands
    ]
    speeds = []
    for engine, proc in procs:
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{engine} failed: {err[-1500:]}")
        speeds.append(decode_speed(engine, out))
    return speeds


def with_busy(n: int, fn):
    """fn() with `n` busy processes spinning beside it."""
    busy = [subprocess.Popen(BUSY) for _ in range(n)]
    try:
        time.sleep(0.5)
        return fn()
    finally:
        for p in busy:
            p.kill()
            p.wait()


def measure(args) -> dict:
    engines = {
        "tokenloom": tokenloom_cmd(args.gguf, args.new_tokens, None),
        f"tokenloom -t {os.cpu_count()}": tokenloom_cmd(args.gguf, args.new_tokens, os.cpu_count()),
    }
    if args.llama_bench:
        engines["llama.cpp"] = llama_cmd(args.llama_bench, args.gguf, args.new_tokens)
    scenarios = {"quiet": 0, "1 busy process": 1, "2 busy processes": 2}
    runs: dict[str, dict[str, list[float]]] = {s: {e: [] for e in engines} for s in [*scenarios, "two at once"]}
    for r in range(args.rounds):
        for scenario, busy in scenarios.items():
            for engine, cmd in engines.items():
                kind = "llama.cpp" if engine == "llama.cpp" else "tokenloom"
                speed = with_busy(busy, lambda: run_engines([(kind, cmd)]))[0]
                runs[scenario][engine].append(speed)
                print(f"round {r + 1}: {scenario:17s} {engine:14s} {speed:7.1f} tok/s", flush=True)
        for engine, cmd in engines.items():
            kind = "llama.cpp" if engine == "llama.cpp" else "tokenloom"
            pair = run_engines([(kind, cmd), (kind, cmd)])
            runs["two at once"][engine].append(min(pair))
            print(f"round {r + 1}: {'two at once':17s} {engine:14s} {pair[0]:7.1f} / {pair[1]:7.1f} tok/s", flush=True)
    return runs


def report(runs: dict, has_llama: bool) -> str:
    med = {s: {e: statistics.median(v) for e, v in by.items()} for s, by in runs.items()}
    engines = list(med["quiet"])
    head = "| beside it | " + " | ".join(engines) + (" | tokenloom / llama.cpp |" if has_llama else " |")
    lines = [head, "|---|" + "---:|" * (len(engines) + has_llama)]
    for scenario, by in med.items():
        cells = [f"{by[e]:.1f} ({by[e] / med['quiet'][e]:.2f}x)" for e in engines]
        if has_llama:
            cells.append(f"{by['tokenloom'] / by['llama.cpp']:.2f}x")
        lines.append(f"| {scenario} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--gguf", default=None, help="the GGUF file both engines run (default: the default model's)")
    p.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench"))
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "bench_contention.json"))
    args = p.parse_args()
    if args.gguf is None:
        from tokenloom.loader import hub

        hub.pull()
        args.gguf = str(hub.default_gguf_path())
    if args.llama_bench and not Path(args.llama_bench).is_file():
        p.error(f"--llama-bench {args.llama_bench}: no such file")
    runs = measure(args)
    table = report(runs, bool(args.llama_bench))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"cpu": cpu_name(), "gguf": args.gguf, "new_tokens": args.new_tokens, "runs": runs}, indent=2)
    )
    print(
        f"\n{cpu_name()}; {Path(args.gguf).name}, batch 1, decode of {args.new_tokens} tokens after 128, "
        f"medians of {args.rounds} rounds (x: of the engine's quiet speed; two at once: the slower of the pair)\n"
    )
    print(table)


if __name__ == "__main__":
    main()
