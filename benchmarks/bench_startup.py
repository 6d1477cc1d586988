"""Warm start and memory: seconds from starting `tokenloom generate` to its first generated token on
stdout, and the process's peak RSS, each engine with its default settings.

Each run is a fresh process, as a user types the command; the configurations alternate, round
by round (the first round is discarded: it warms the page cache). The prompt is not echoed
(--no-display-prompt), so the first byte on stdout is the first token. The yardstick is
llama.cpp's `llama-completion` on the same GGUF file, 2 threads (give its folder with
--llama-bin, or $LLAMA_CPP_BIN; skipped if absent). Also checks that no run prints a
"compiling" line (kernels are built by `make setup`).

    python benchmarks/bench_startup.py [--runs 5] [--llama-bin DIR] [--model FILE.gguf]

--model times that GGUF file instead of the default model's (and skips the float32 folder).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import RESULTS, cpu_name, parser
from tqdm import tqdm

PROMPT = "Once upon a time"


def first_token_seconds(cmd: list[str], env: dict | None = None) -> tuple[float, float, float, str]:
    """(seconds to the first byte on stdout, seconds to exit, peak RSS in MB, stderr) of one run of `cmd`."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, bufsize=0, env=env
    )
    first = os.read(proc.stdout.fileno(), 1)
    first_at = time.perf_counter() - start
    proc.stdout.read()
    err = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: ru_maxrss in KiB on Linux
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or not first:
        raise RuntimeError(f"{cmd[0]} failed: {err[-500:]}")
    return first_at, time.perf_counter() - start, usage.ru_maxrss * 1024 / 1e6, err


def configurations(args) -> dict[str, tuple[list[str], dict | None]]:
    from tokenloom.loader import hub

    gguf = Path(args.model) if args.model else hub.pull()
    ours = [sys.executable, "-m", "tokenloom", "generate", "--temp", "0", "-n", "8", "--no-display-prompt"]
    runs = {
        # the floor of any engine on torch: a process that prints once torch is imported
        "python -c 'import torch' (no engine)": ([sys.executable, "-c", "import torch; print('x')"], None),
    }
    if not args.model:
        runs["tokenloom (HF folder, float32)"] = (ours + ["-m", str(hub.float32_folder()), PROMPT], None)
    runs[f"tokenloom ({gguf.name})"] = (ours + ["-m", str(gguf), PROMPT], None)
    llama_bin = args.llama_bin or os.environ.get("LLAMA_CPP_BIN")
    if llama_bin and (Path(llama_bin) / "llama-completion").exists():
        env = {**os.environ, "LD_LIBRARY_PATH": llama_bin}
        runs[f"llama.cpp llama-completion ({gguf.name})"] = (
            [
                str(Path(llama_bin) / "llama-completion"),
                "-m",
                str(gguf),
                "-p",
                PROMPT,
                "-n",
                "8",
                "-no-cnv",
                "--no-display-prompt",
                "--simple-io",
                "-t",
                "2",
                "--temp",
                "0",
            ],
            env,
        )
    return runs


def main() -> int:
    p = parser(__doc__)  # its --model: here a GGUF file to time (default: the default model's)
    p.add_argument("--runs", type=int, default=5, help="measured runs per configuration (default: 5)")
    p.add_argument("--llama-bin", default=None, help="folder with llama.cpp's llama-completion")
    args = p.parse_args()
    configs = configurations(args)
    samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in configs}
    compiled = dict.fromkeys(configs, False)
    with tqdm(total=len(configs) * (args.runs + 1), desc="starting processes", unit="run") as bar:
        for i in range(args.runs + 1):  # the engines alternate, so a drift of the machine hits them alike
            for name, (cmd, env) in configs.items():
                first, total, rss, err = first_token_seconds(cmd, env)
                compiled[name] |= "compiling" in err
                if i:  # the first round only warms the page cache
                    samples[name].append((first, total, rss))
                bar.update()
    rows = [
        {
            "engine": name,
            "first_token_s": statistics.median(s[0] for s in runs),
            "total_s": statistics.median(s[1] for s in runs),
            "peak_rss_mb": statistics.median(s[2] for s in runs),
            "first_token_runs_s": [round(s[0], 3) for s in runs],
            "compile_line": compiled[name],
        }
        for name, runs in samples.items()
    ]
    base, base_rss = rows[-1]["first_token_s"], rows[-1]["peak_rss_mb"]
    print(f"\nWarm start on {cpu_name()}: `generate -n 8`, medians of {args.runs} fresh processes\n")
    print("| engine | first token (s) | whole run (s) | vs last row | peak RSS (MB) | vs last row | compile line |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['engine']} | {r['first_token_s']:.2f} | {r['total_s']:.2f} | "
            f"{r['first_token_s'] / base:.1f}x | {r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] / base_rss:.2f}x | "
            f"{'yes' if r['compile_line'] else 'no'} |"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "startup.json").write_text(json.dumps({"cpu": cpu_name(), "runs": args.runs, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
