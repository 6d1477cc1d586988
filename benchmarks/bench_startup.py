"""Warm start: seconds from starting `tokenloom generate` to its first generated token on stdout.

Each run is a fresh process, as a user types the command; the configurations alternate, round
by round (the first round is discarded: it warms the page cache). The prompt is not echoed
(--no-display-prompt), so the first byte on stdout is the first token. The yardstick is
llama.cpp's `llama-completion` on the same GGUF file, 2 threads (give its folder with
--llama-bin, or $LLAMA_CPP_BIN; skipped if absent). Also checks that no run prints a
"compiling" line (kernels are built by `make setup`).

    python benchmarks/bench_startup.py [--runs 5] [--llama-bin DIR]
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


def first_token_seconds(cmd: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """(seconds to the first byte on stdout, seconds to exit, stderr) of one run of `cmd`."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, bufsize=0, env=env
    )
    first = os.read(proc.stdout.fileno(), 1)
    first_at = time.perf_counter() - start
    proc.stdout.read()
    err = proc.stderr.read().decode(errors="replace")
    if proc.wait() != 0 or not first:
        raise RuntimeError(f"{cmd[0]} failed: {err[-500:]}")
    return first_at, time.perf_counter() - start, err


def configurations(args) -> dict[str, tuple[list[str], dict | None]]:
    from tokenloom.loader import hub

    folder, gguf = hub.float32_folder(), hub.pull()
    ours = [sys.executable, "-m", "tokenloom", "generate", "--temp", "0", "-n", "8", "--no-display-prompt"]
    runs = {
        # the floor of any engine on torch: a process that prints once torch is imported
        "python -c 'import torch' (no engine)": ([sys.executable, "-c", "import torch; print('x')"], None),
        "tokenloom (HF folder, float32)": (ours + ["-m", str(folder), PROMPT], None),
        f"tokenloom ({gguf.name})": (ours + ["-m", str(gguf), PROMPT], None),
    }
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
    p = parser(__doc__)
    p.add_argument("--runs", type=int, default=5, help="measured runs per configuration (default: 5)")
    p.add_argument("--llama-bin", default=None, help="folder with llama.cpp's llama-completion")
    args = p.parse_args()
    configs = configurations(args)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    compiled = dict.fromkeys(configs, False)
    with tqdm(total=len(configs) * (args.runs + 1), desc="starting processes", unit="run") as bar:
        for i in range(args.runs + 1):  # the engines alternate, so a drift of the machine hits them alike
            for name, (cmd, env) in configs.items():
                first, total, err = first_token_seconds(cmd, env)
                compiled[name] |= "compiling" in err
                if i:  # the first round only warms the page cache
                    samples[name].append((first, total))
                bar.update()
    rows = [
        {
            "engine": name,
            "first_token_s": statistics.median(s[0] for s in runs),
            "total_s": statistics.median(s[1] for s in runs),
            "first_token_runs_s": [round(s[0], 3) for s in runs],
            "compile_line": compiled[name],
        }
        for name, runs in samples.items()
    ]
    base = rows[-1]["first_token_s"]
    print(f"\nWarm start on {cpu_name()}: `generate -n 8`, medians of {args.runs} fresh processes\n")
    print("| engine | first token (s) | whole run (s) | vs last row | compile line |")
    print("|---|---:|---:|---:|---|")
    for r in rows:
        print(
            f"| {r['engine']} | {r['first_token_s']:.2f} | {r['total_s']:.2f} | "
            f"{r['first_token_s'] / base:.1f}x | {'yes' if r['compile_line'] else 'no'} |"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "startup.json").write_text(json.dumps({"cpu": cpu_name(), "runs": args.runs, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
