#!/usr/bin/env python
"""GGUF files as people download them: tokenloom (blocks kept as stored) beside llama.cpp.

For each file, in one run on this machine, each configuration in its own process:
  - tokenloom: `tokenloom bench --json` (batch 1, 128-token prompt, 64 new tokens, median
    of --runs after a warm-up) with a context of 192 tokens, as llama-bench gives itself
    (its n_ctx is n_prompt + n_gen), and the process's peak RSS; then again after a 1-token
    prompt (decode from an empty context);
  - llama.cpp: `llama-bench -p 128 -n 64 -d 0,128 -t <threads>` (its own medians), peak RSS
    by /usr/bin/time; skipped where no llama-bench binary is found (--llama-bench or
    $LLAMA_BENCH; ../shared/MODELS.md says how to build it).
  - the time to read the file's metadata (tokenloom's reader vs gguf.GGUFReader);
  - the machine's memory read bandwidth before each turn (decode is bound by it, and it moves
    between sessions on a shared machine: compare ratios only within a run).
The engines take turns (--rounds, default 2: tokenloom then llama.cpp on a file, then again),
so a minute of noise on a shared machine lands on both; each figure is the median over the
rounds, and each ratio the median of the rounds' ratios (their range shown beside it).
Decode is compared at the same depth: tokenloom's 64 tokens after its 128-token prompt
against llama-bench's tg64 at depth 128 (`-d 128`: the same positions 128-191, attention
over as many cached tokens), and from an empty context: tokenloom after a 1-token prompt
against llama-bench's plain tg64 (positions 0-63). Prefill is pp128 from an empty context.
Prints a table with ratios, writes benchmarks/results/bench_gguf.json and gguf_decode.png.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import RESULTS, cpu_name, finish_plot, parser, read_bandwidth_gbs
from tqdm import tqdm

from tokenloom.loader import hub

PROMPT, NEW = 128, 64


def tokenloom_bench(path: Path, runs: int, prompt: int) -> dict:
    """`tokenloom bench --json` on `path`: batch 1, `prompt` prompt tokens, NEW new tokens."""
    cmd = [
        sys.executable,
        "-m",
        "tokenloom",
        "bench",
        "-m",
        str(path),
        "--json",
        "--runs",
        str(runs),
        "--prompt-tokens",
        str(prompt),
        "--new-tokens",
        str(NEW),
        "--max-model-len",
        str(PROMPT + NEW),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"tokenloom bench failed on {path.name}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_tokenloom(path: Path, runs: int) -> dict:
    """Decode and prefill after a PROMPT-token prompt, peak RSS, and decode from an empty context."""
    r = tokenloom_bench(path, runs, PROMPT)
    empty = tokenloom_bench(path, runs, 1)
    return {
        "decode": r["decode_tok_s"],
        "prefill": r["prefill_tok_s"],
        "rss_mb": r["peak_rss_bytes"] / 1e6,
        "decode_empty": empty["decode_tok_s"],
    }


def run_llama_cpp(binary: str, path: Path, runs: int, threads: int) -> dict:
    """llama-bench's pp PROMPT (empty context), tg NEW at depth PROMPT (as tokenloom decodes after
    its prompt) and from an empty context, and the process's peak RSS."""
    cmd = [
        "/usr/bin/time",
        "-f",
        "maxrss_kb=%M",
        binary,
        "-m",
        str(path),
        "-p",
        str(PROMPT),
        "-n",
        str(NEW),
        "-d",
        f"0,{PROMPT}",
        "-t",
        str(threads),
        "-r",
        str(runs),
        "-o",
        "json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed on {path.name}: {out.stderr[-2000:]}")
    speed = {}
    for r in json.loads(out.stdout):
        if r["n_prompt"] and r["n_depth"] == 0:
            speed["prefill"] = r["avg_ts"]
        elif r["n_gen"]:
            speed["decode" if r["n_depth"] == PROMPT else "decode_empty"] = r["avg_ts"]
    rss = int(re.search(r"maxrss_kb=(\d+)", out.stderr).group(1)) * 1024 / 1e6  # GNU time's %M is KiB
    return speed | {"rss_mb": rss}


def metadata_seconds(path: Path) -> dict:
    import gguf

    from tokenloom.loader.gguf_reader import GGUFReader

    times = {}
    for name, read in (("tokenloom", GGUFReader), ("gguf.GGUFReader", gguf.GGUFReader)):
        start = time.perf_counter()
        read(str(path))
        times[name] = time.perf_counter() - start
    return times


def files(extra: list[str], defaults: bool = True) -> dict[str, Path]:
    found = {"SmolLM2-135M Q4_1": hub.default_gguf_path()} if defaults else {}
    if defaults and hub.is_pulled("qwen2.5-coder-0.5b"):
        found["Qwen2.5-Coder-0.5B Q4_K_M"] = hub.gguf_path("qwen2.5-coder-0.5b")
    for item in extra:
        label, _, file = item.partition("=")
        found[label] = Path(file)
    return found


def paired_ratio(rounds: list[dict], key: str) -> str:
    """The median over rounds of tokenloom / llama.cpp for `key`, with the rounds' range where there
    is more than one."""
    ratios = sorted(r["tokenloom"][key] / r["llama.cpp"][key] for r in rounds if "llama.cpp" in r)
    if not ratios:
        return "-"
    spread = f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if len(ratios) > 1 else ""
    return f"{statistics.median(ratios):.2f}x{spread}"


def medians(rounds: list[dict], engine: str) -> dict | None:
    """Each figure of `engine` as the median over the rounds (None where it did not run)."""
    runs = [r[engine] for r in rounds if engine in r]
    return {k: statistics.median(run[k] for run in runs) for k in runs[0]} if runs else None


def table(results: dict, cpu: str, threads: int) -> str:
    rounds = len(next(iter(results.values()))["rounds"]) if results else 0
    reads = sorted(turn["read_gbs"] for r in results.values() for turn in r["rounds"])
    bandwidth = f"; memory read {reads[0]:.1f}-{reads[-1]:.1f} GB/s (torch sum, 512 MiB)" if reads else ""
    lines = [
        f"CPU: {cpu}; {threads} threads{bandwidth}; batch 1, prompt {PROMPT}, {NEW} new tokens; {rounds} "
        "alternating rounds, medians (ratios: median of the rounds' ratios, range in brackets); decode after "
        f"the {PROMPT}-token prompt (llama-bench tg{NEW} @ d{PROMPT}) and from an empty context (tg{NEW})",
        "",
        f"| file | tokenloom decode tok/s @ d{PROMPT} | llama.cpp | ratio | tokenloom decode @ d0 | llama.cpp "
        "| ratio | tokenloom prefill tok/s | llama.cpp prefill "
        "| ratio | tokenloom peak RSS MB | llama.cpp RSS MB | ratio | metadata s (tokenloom / gguf) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    nan = float("nan")
    for label, r in results.items():
        t, ll, meta = r["tokenloom"], r.get("llama.cpp"), r["metadata_s"]
        lines.append(
            f"| {label} | {t['decode']:.1f} | {ll['decode'] if ll else nan:.1f} "
            f"| {paired_ratio(r['rounds'], 'decode')} "
            f"| {t['decode_empty']:.1f} | {ll['decode_empty'] if ll else nan:.1f} "
            f"| {paired_ratio(r['rounds'], 'decode_empty')} "
            f"| {t['prefill']:.0f} | {ll['prefill'] if ll else nan:.0f} "
            f"| {paired_ratio(r['rounds'], 'prefill')} "
            f"| {t['rss_mb']:.0f} | {ll['rss_mb'] if ll else nan:.0f} | "
            f"{(t['rss_mb'] / ll['rss_mb']) if ll else nan:.2f}x "
            f"| {meta['tokenloom']:.2f} / {meta['gguf.GGUFReader']:.2f} |"
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> bool:
    """Decode tok/s per file, both engines, after the prompt (left) and from an empty context (right)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    xs = range(len(labels))
    top = 0.0
    for ax, key, title in (
        (axes[0], "decode", f"after a {PROMPT}-token prompt (depth {PROMPT})"),
        (axes[1], "decode_empty", "from an empty context (depth 0)"),
    ):
        ours = [results[k]["tokenloom"][key] for k in labels]
        theirs = [results[k].get("llama.cpp", {}).get(key, 0) for k in labels]
        top = max(top, *ours, *theirs)
        ax.bar([x - 0.2 for x in xs], ours, 0.4, label="tokenloom")
        ax.bar([x + 0.2 for x in xs], theirs, 0.4, label="llama.cpp")
        ax.set_xticks(list(xs), labels, rotation=15, fontsize=8)
        ax.set_title(f"GGUF blocks kept as stored: {title}", fontsize=10)
    axes[1].grid(alpha=0.3)  # finish_plot grids and labels the first
    axes[0].set_ylabel(f"batch-1 decode tok/s ({NEW} tokens)")
    axes[0].set_ylim(0, top * 1.3)  # room for the legend above the bars
    return finish_plot(fig, axes[0], path)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--runs", type=int, default=5, help="timed runs per engine per round (after a warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of both engines on each file")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH") or shutil.which("llama-bench"))
    p.add_argument("--file", action="append", default=[], metavar="LABEL=PATH", help="another GGUF file to time")
    p.add_argument("--only-files", action="store_true", help="time the --file files alone (not the default models)")
    args = p.parse_args()
    cpu = cpu_name()
    results = {}
    chosen = files(args.file, defaults=not args.only_files)
    for label, path in chosen.items():
        if not Path(path).is_file():
            p.error(f"--file {label}: {path} is not a file")
    if args.llama_bench and not os.access(args.llama_bench, os.X_OK):
        p.error(f"--llama-bench {args.llama_bench} is not an executable (leave it out to time tokenloom alone)")
    for label, path in chosen.items():
        results[label] = {"path": str(path), "metadata_s": metadata_seconds(path), "rounds": []}
    turns = [label for _ in range(args.rounds) for label in chosen]
    for label in tqdm(turns, desc="rounds x files", unit="file"):
        path = chosen[label]
        turn = {"read_gbs": read_bandwidth_gbs(args.threads), "tokenloom": run_tokenloom(path, args.runs)}
        if args.llama_bench:
            turn["llama.cpp"] = run_llama_cpp(args.llama_bench, path, args.runs, args.threads)
        results[label]["rounds"].append(turn)
    for r in results.values():
        r["tokenloom"] = medians(r["rounds"], "tokenloom")
        if (ll := medians(r["rounds"], "llama.cpp")) is not None:
            r["llama.cpp"] = ll
    print(table(results, cpu, args.threads))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_gguf.json").write_text(
        json.dumps({"cpu": cpu, "threads": args.threads, "results": results}, indent=2)
    )
    plot(results, RESULTS / "gguf_decode.png")


if __name__ == "__main__":
    main()
