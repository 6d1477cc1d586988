"""How many CPU threads a step runs on: the cores other processes leave free.

A step splits each operation over OpenMP threads that meet at a barrier after it (a few hundred
times a step). When another process takes one of the cores, the thread that lost it stalls every
barrier until the scheduler gives it a time slice back: a decode on as many threads as cores
slows several-fold beside one busy process and all but stops beside a second tokenloom, where
one thread fewer keeps over half its quiet speed (docs/BENCHMARKS.md, 'Measurements behind
design choices'). So the engine counts, every ``INTERVAL_S`` of steps, the CPU time the rest
of the machine used on the cores this process may run on (``/proc/stat`` less this process's own,
``/proc/self/stat``), and runs its next steps on the cores left: at least one, at most its
maximum. A step that takes over ``JUMP`` times the recent ones has it counted again at once.
On a quiet machine nothing changes (the maximum stays). Where /proc cannot be read (not Linux),
the maximum is kept.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

INTERVAL_S = 0.25  # how often the other processes' use of the cores is counted
MIN_WINDOW_S = 0.05  # a count needs at least this much time to average over
JUMP = 2.0  # a step this many times the recent median is counted at once


def _allowed_cpus() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def read_proc_ticks(cpus: set[int]) -> tuple[int, int] | None:
    """(busy ticks of `cpus` in all, this process's ticks) since boot, or None off Linux."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    busy = 0
    for name, *values in lines:
        if int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in values[:8])
            busy += user + nice + system + irq + softirq + steal
    return busy, int(fields[11]) + int(fields[12])  # utime + stime


class CpuShare:
    """The step thread's thread count, kept at the cores others leave free (see the module doc)."""

    def __init__(
        self,
        max_threads: int,
        read: Callable[[set[int]], tuple[int, int] | None] = read_proc_ticks,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_threads = max_threads
        self.cpus = _allowed_cpus()
        self.read, self.clock = read, clock
        self.ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.threads = max_threads
        torch.set_num_threads(max_threads)  # set as -t sets it: the same thread pools on a quiet machine
        self.recent: list[float] = []  # the last steps' seconds
        self.last = (self.clock(), self.read(self.cpus))

    def others_busy(self) -> float | None:
        """Cores' worth of CPU the other processes used since the last count (None: unknown)."""
        now, ticks = self.clock(), self.read(self.cpus)
        (then, before), self.last = self.last, (now, ticks)
        if ticks is None or before is None or now <= then:
            return None
        busy, ours = ticks[0] - before[0], ticks[1] - before[1]
        return max(0.0, (busy - ours) / self.ticks_per_s / (now - then))

    def target(self, others: float) -> int:
        """Threads for the cores left when others use `others` cores' worth (rounded to nearest)."""
        return max(1, min(self.max_threads, int(len(self.cpus) - others + 0.5)))

    def before_step(self) -> None:
        """On the step thread, before a step: recount when it is time, and move to the new count."""
        elapsed = self.clock() - self.last[0]
        jumped = len(self.recent) >= 4 and self.recent[-1] > JUMP * sorted(self.recent)[len(self.recent) // 2]
        if elapsed < INTERVAL_S and not (jumped and elapsed >= MIN_WINDOW_S):
            return
        others = self.others_busy()
        if others is None:
            return
        threads = self.target(others)
        if threads != self.threads:
            self.threads = threads
            self.recent.clear()  # step times change with the count
            torch.set_num_threads(threads)

    def after_step(self, seconds: float) -> None:
        self.recent = [*self.recent[-15:], seconds]
