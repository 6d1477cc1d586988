"""The step thread's thread count follows the cores other processes leave free (engine/cpu_share.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from tokenloom.engine import cpu_share
from tokenloom.engine.cpu_share import CpuShare


class FakeMachine:
    """/proc as a test sets it: busy ticks of the machine and of this process, and a clock."""

    def __init__(self) -> None:
        self.now, self.busy, self.ours = 0.0, 0, 0

    def run(self, seconds: float, ours_cores: float, others_cores: float) -> None:
        ticks = 100 * seconds
        self.now += seconds
        self.ours += round(ticks * ours_cores)
        self.busy += round(ticks * (ours_cores + others_cores))

    def read(self, cpus):
        return self.busy, self.ours


@pytest.fixture
def machine(monkeypatch):
    fake = FakeMachine()
    monkeypatch.setattr(cpu_share, "_allowed_cpus", lambda: {0, 1})
    threads = torch.get_num_threads()
    yield fake
    torch.set_num_threads(threads)


def test_the_count_follows_the_free_cores_and_comes_back(machine):
    share = CpuShare(2, read=machine.read, clock=lambda: machine.now)
    share.ticks_per_s = 100
    machine.run(0.3, ours_cores=2.0, others_cores=0.05)  # quiet: system noise only
    share.before_step()
    assert share.threads == 2
    machine.run(0.3, ours_cores=1.0, others_cores=1.0)  # one busy process beside
    share.before_step()
    assert share.threads == 1 and torch.get_num_threads() == 1
    machine.run(0.1, ours_cores=1.0, others_cores=1.0)  # not yet time to count again
    share.before_step()
    machine.run(0.3, ours_cores=1.0, others_cores=0.0)  # it stopped
    share.before_step()
    assert share.threads == 2 and torch.get_num_threads() == 2


def test_a_step_that_jumps_is_counted_at_once(machine):
    share = CpuShare(2, read=machine.read, clock=lambda: machine.now)
    share.ticks_per_s = 100
    for _ in range(6):
        share.after_step(0.004)
    machine.run(0.06, ours_cores=1.0, others_cores=1.0)  # under the interval, over the minimum
    share.before_step()
    assert share.threads == 2  # no jump: waits for the interval
    share.after_step(0.050)
    machine.run(0.06, ours_cores=1.0, others_cores=1.0)
    share.before_step()
    assert share.threads == 1


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or len(cpu_share._allowed_cpus()) < 2, reason="counts /proc/stat on 2+ cores"
)
def test_a_real_busy_process_is_seen():
    """A child spinning on a core is counted (at least most of a core busy besides this process)."""
    threads = torch.get_num_threads()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        share = CpuShare(len(cpu_share._allowed_cpus()))
        time.sleep(0.5)
        others = share.others_busy()
    finally:
        busy.kill()
        busy.wait()
        torch.set_num_threads(threads)
    assert others > 0.7
