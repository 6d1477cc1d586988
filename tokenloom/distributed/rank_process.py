"""Ranks started on this machine: each a fresh interpreter running tokenloom's rank entry point
(``python -m tokenloom.distributed.rank_main``), as torchrun starts its ranks, so the caller's
main module is never imported again (multiprocessing's spawn re-imports it: a script that builds
an LLM at module level would start ranks from its ranks).

Rank 0 watches them: a rank that dies, or does not report a stage of its start-up in time, is a
ParallelRankError naming the rank, how it ended and the last lines it printed (each rank's output
goes to a log file beside it for that).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tokenloom.distributed.errors import ParallelRankError

POLL_S = 0.05  # how often rank 0 looks at a stage's keys and at its ranks' processes


class RankProcess:
    """Rank `rank`'s process, started with the keyword arguments of worker.worker_main."""

    def __init__(self, rank: int, folder: Path, worker_kwargs: dict) -> None:
        self.rank = rank
        args = folder / f"rank{rank}.args"
        args.write_bytes(pickle.dumps(worker_kwargs))
        self.log_path = folder / f"rank{rank}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tokenloom.distributed.rank_main", str(args)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.is_alive():
            self.proc.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def last_words(self, lines: int = 8) -> str:
        """The last lines this rank printed (stdout and stderr)."""
        try:
            text = self.log_path.read_text(errors="replace").strip()
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def describe(self) -> str:
        code = self.proc.poll()
        how = "is running" if code is None else (f"was killed by signal {-code}" if code < 0 else f"exited with {code}")
        words = self.last_words()
        return f"rank {self.rank} {how}" + (f"; its last output:\n{words}" if words else " (it printed nothing)")


class LocalRanks:
    """Ranks 1 .. N-1 on this machine and what rank 0 knows of them."""

    def __init__(self, size: int, worker_kwargs: Callable[[int], dict]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="tokenloom-ranks-"))
        self.processes = [RankProcess(rank, self.folder, worker_kwargs(rank)) for rank in range(1, size)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def report(self) -> str:
        """Which ranks have died, and their last words."""
        dead = [p.describe() for p in self.processes if not p.is_alive()]
        return "; ".join(dead) if dead else "every rank process is running"

    def dead_error(self, stage: str) -> ParallelRankError:
        return ParallelRankError(
            f"a rank of the split model (tensor or pipeline parallel) stopped answering while {stage}: {self.report()}"
        )

    def wait_for(self, store, stage: str, timeout_s: float) -> None:
        """Until every rank has set its key of `stage` in `store` (worker.report_stage); a rank that
        dies meanwhile, or a stage not reached in `timeout_s`, is a ParallelRankError naming it."""
        keys = {p.rank: f"stage/{stage}/{p.rank}" for p in self.processes}
        deadline = time.monotonic() + timeout_s
        while keys:
            keys = {rank: key for rank, key in keys.items() if not store.check([key])}
            if not keys:
                return
            if not self.alive():
                raise self.dead_error(stage)
            if time.monotonic() > deadline:
                late = ", ".join(f"rank {r}" for r in keys)
                words = "; ".join(
                    f"rank {p.rank}: {p.last_words(3) or '(no output)'}" for p in self.processes if p.rank in keys
                )
                raise ParallelRankError(
                    f"{late} did not finish {stage} within {timeout_s:.0f} s (see "
                    f"TOKENLOOM_RANK_START_TIMEOUT); last output: {words}"
                )
            time.sleep(POLL_S)

    def stop(self, timeout_s: float = 10) -> None:
        """Wait for the ranks to leave (killing one that does not), then drop their files."""
        for p in self.processes:
            p.join(timeout_s)
            p.kill()
            p.join(5)
        for f in self.folder.iterdir():
            f.unlink(missing_ok=True)
        os.rmdir(self.folder)


def start_timeout_s() -> float:
    """How long rank 0 waits for a rank to reach each stage of its start-up (TOKENLOOM_RANK_START_TIMEOUT)."""
    return float(os.environ.get("TOKENLOOM_RANK_START_TIMEOUT", "600"))
