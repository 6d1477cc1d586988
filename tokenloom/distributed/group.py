"""The ranks' process groups: a control group on which rank 0 broadcasts commands (waiting on
it may last as long as the engine is idle), and a step group for the collectives inside a model
call, whose timeout turns a rank that died mid-step into an error instead of a hang."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tokenloom.distributed.errors import ParallelRankError

STEP_TIMEOUT_S = 120.0  # a collective inside a step waits this long for the other ranks
IDLE_TIMEOUT = timedelta(days=7)  # a worker waits this long for rank 0's next command
EXIT_GRACE_S = 2.0  # after a failed collective, how long to wait for a dying rank's exit to show


@dataclass
class ParallelGroup:
    """This process's place among the ranks of a split model. ``comm_seconds``: the time this rank
    has spent in communication (waiting for the other ranks included), for benchmarks."""

    rank: int
    size: int
    step: Any  # the ProcessGroup of the collectives inside a model call
    comm_seconds: float = 0.0
    shm: Any = None  # SharedMemoryAllReduce where every rank is on this machine (shm.py)
    peers: Any = None  # where this process can see its peers' processes: .alive(), .dead_error(stage)
    store: Any = None  # the rendezvous store (the ranks' start-up stages are keys in it)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (x contiguous); returns x."""
        if self.shm is not None and self.shm.fits(x):
            self._run(self.shm.all_reduce, x)
        else:
            self._run(dist.all_reduce, x, group=self.step)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """x (T, C) from every rank -> on rank 0 (T, size x C), rank r's at columns r C ..; None elsewhere."""
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        self._run(dist.gather, x, parts, dst=0, group=self.step)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape and dtype), in place; returns x."""
        self._run(dist.broadcast, x, src=0, group=self.step)
        return x

    def isend(self, x: torch.Tensor, dst: int, tag: int):
        """Send x to rank `dst` without waiting (the returned work's ``wait()`` does); x must live till then."""
        return self._run(dist.isend, x.contiguous(), dst, group=self.step, tag=tag)

    def wait(self, work) -> None:
        """Until an isend's work is done."""
        self._run(work.wait)

    def recv(self, into: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        """Rank `src`'s matching isend into `into`; returns it."""
        self._run(dist.recv, into, src, group=self.step, tag=tag)
        return into

    def send(self, kind: str, payload: Any = None) -> None:
        """Rank 0: tell the other ranks what to do next (worker.py's commands). A rank this
        process started and that has died is an error here, not a wait on gloo to notice."""
        if self.peers is not None and not self.peers.alive():
            raise self.peers.dead_error(f"rank 0 sent {kind!r}")
        self._run(dist.broadcast_object_list, [(kind, payload)], src=0)

    def receive(self) -> tuple[str, Any]:
        """A rank other than 0: rank 0's next command, (kind, payload)."""
        box: list[Any] = [None]
        self._run(dist.broadcast_object_list, box, src=0)
        return box[0]

    def _run(self, collective, *args, **kwargs):
        """collective(*args, **kwargs), timed; a failure that a lost rank causes as ParallelRankError."""
        start = time.perf_counter()
        try:
            return collective(*args, **kwargs)
        except (RuntimeError, dist.DistError) as e:
            if self.peers is not None and not _alive_after(self.peers.alive, EXIT_GRACE_S):
                raise self.peers.dead_error("in a collective") from e
            raise _rank_error(e) from e
        finally:
            self.comm_seconds += time.perf_counter() - start


def _alive_after(alive: Callable[[], bool], grace_s: float) -> bool:
    """Whether `alive()` still holds after up to `grace_s`: a rank's sockets close as it exits, a
    moment before its exit can be seen, so a broken link waits that long to learn who died."""
    deadline = time.monotonic() + grace_s
    while alive():
        if time.monotonic() > deadline:
            return True
        time.sleep(0.02)
    return False


def _rank_error(e: Exception) -> ParallelRankError:
    first_line = str(e).splitlines()[0] if str(e) else "no message"
    return ParallelRankError(
        f"a rank of the split model (tensor or pipeline parallel) stopped answering "
        f"({type(e).__name__}: {first_line}); the engine cannot go on without it"
    )


def free_port() -> int:
    """A TCP port free on the loopback interface now (for rank 0's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(
    rank: int,
    size: int,
    init_method: str | None,
    device: str = "cpu",
    shm_path: str | None = None,
    peers=None,
    step_timeout_s: float = STEP_TIMEOUT_S,
    store=None,
) -> ParallelGroup:
    """Join the `size` ranks as `rank`, through `store` (a TCPStore rank 0 serves) or at `init_method`
    (env:// under torchrun). Commands always travel over gloo (CPU objects); a step's collectives
    over gloo on the CPU and NCCL on CUDA (written for several GPUs, not run here: the machines at
    hand have one). With `shm_path` (ranks on one machine, CPU), all-reduces go through that shared
    memory file. `peers`: what this process can see of the other ranks' processes (.alive())."""
    if store is not None:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=IDLE_TIMEOUT)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=IDLE_TIMEOUT)
        store = dist.distributed_c10d._get_default_store()
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    step = dist.new_group(list(range(size)), timeout=timedelta(seconds=step_timeout_s), backend=backend)
    shm = None
    if shm_path is not None and backend == "gloo":
        from tokenloom.distributed.shm import SharedMemoryAllReduce

        shm = SharedMemoryAllReduce(shm_path, rank, size, step_timeout_s, None if peers is None else peers.alive)
        dist.barrier()  # every rank has it mapped: the file's name is no longer needed
        if rank == 0:
            shm.remove()
    return ParallelGroup(rank, size, step, shm=shm, peers=peers, store=store)


def report_stage(store, stage: str, rank: int) -> None:
    """Tell rank 0 (waiting in rank_process.LocalRanks.wait_for) that this rank has done `stage`."""
    store.set(f"stage/{stage}/{rank}", "1")


def rank_device(device: str, rank: int) -> str:
    """The device rank `rank` runs on: its own GPU (by its rank on this node) for CUDA, else `device`."""
    if torch.device(device).type != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", rank)) % max(1, torch.cuda.device_count())
    torch.cuda.set_device(local)
    return f"cuda:{local}"
