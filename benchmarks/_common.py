"""Helpers shared by the benchmark scripts (run as `python benchmarks/<script>.py`)."""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def parser(doc: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark takes."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder (default: the prepared SmolLM2)")
    return p


def finish_plot(fig, ax, path: Path) -> bool:
    """Grid, legend, layout, save as PNG."""
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def cpu_name() -> str:
    """The CPU as benchmark tables name it: model, cores, widest vector ISA ("this CPU" if unknown)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        name = re.search(r"model name\s*:\s*(.*)", text).group(1).strip()
        flags = re.search(r"flags\s*:\s*(.*)", text).group(1).split()
    except (OSError, AttributeError):
        return "this CPU"
    isa = "AVX-512 VNNI" if "avx512_vnni" in flags else "AVX-512" if "avx512f" in flags else "AVX2"
    return f"{name} ({os.cpu_count()} cores, {isa})"


def read_bandwidth_gbs(threads: int, mib: int = 512, repeats: int = 9) -> float:
    """This machine's memory read bandwidth now, GB/s: the median over `repeats` of torch summing
    a `mib` MiB float32 tensor on `threads` threads. Batch-1 decode is bound by it, and on a
    shared machine it moves between sessions (27-29 vs ~36 GB/s on the same kind of VM)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(mib << 18)  # mib MiB of float32
        x.sum()
        seconds = median_time(x.sum, repeats)
    finally:
        torch.set_num_threads(previous)
    return (mib << 20) / seconds / 1e9


def median_time(fn, repeats: int) -> float:
    """Median wall time of `repeats` calls of fn(), in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
