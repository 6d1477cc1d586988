"""The ranks' process groups: a control group on which rank 0 broadcasts commands (waiting on
it may last as long as the engine is idle), and a step group for the collectives inside a model
call, whose timeout turns a rank that died mid-step into an error instead of a hang."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

STEP_TIMEOUT_S = 120.0            # a collective inside a step waits this long for the other ranks
IDLE_TIMEOUT = timedelta(days=7)  # a worker waits this long for rank 0's next command


class ParallelRankError(RuntimeError):
    """Another rank stopped answering (it died, or its link did)."""


@dataclass
class ParallelGroup:
    """This process's place among the tensor-parallel ranks."""

    rank: int
    size: int
    step: Any                     # the ProcessGroup of the collectives inside a model call

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (x contiguous); returns x."""
        _guarded(dist.all_reduce, x, group=self.step)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """x (T, C) from every rank -> on rank 0 (T, size x C), rank r's at columns r C ..; None elsewhere."""
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        _guarded(dist.gather, x, parts, dst=0, group=self.step)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (same shape and dtype), in place; returns x."""
        _guarded(dist.broadcast, x, src=0, group=self.step)
        return x

    def isend(self, x: torch.Tensor, dst: int, tag: int):
        """Send x to rank `dst` without waiting (the returned work's ``wait()`` does); x must live till then."""
        try:
            return dist.isend(x.contiguous(), dst, group=self.step, tag=tag)
        except (RuntimeError, dist.DistError) as e:
            raise _rank_error(e) from e

    def recv(self, into: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        """Rank `src`'s matching isend into `into`; returns it."""
        _guarded(dist.recv, into, src, group=self.step, tag=tag)
        return into

    def send(self, kind: str, payload: Any = None) -> None:
        """Rank 0: tell the other ranks what to do next (worker.py's commands)."""
        _guarded(dist.broadcast_object_list, [(kind, payload)], src=0)

    def receive(self) -> tuple[str, Any]:
        """A rank other than 0: rank 0's next command, (kind, payload)."""
        box: list[Any] = [None]
        _guarded(dist.broadcast_object_list, box, src=0)
        return box[0]


def _guarded(collective, *args, **kwargs) -> None:
    try:
        collective(*args, **kwargs)
    except (RuntimeError, dist.DistError) as e:
        raise _rank_error(e) from e


def _rank_error(e: Exception) -> ParallelRankError:
    first_line = str(e).splitlines()[0] if str(e) else "no message"
    return ParallelRankError(f"a rank of the split model (tensor or pipeline parallel) stopped answering "
                             f"({type(e).__name__}: {first_line}); the engine cannot go on without it")


def free_port() -> int:
    """A TCP port free on the loopback interface now (for rank 0's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, size: int, init_method: str, backend: str = "gloo",
               step_timeout_s: float = STEP_TIMEOUT_S) -> ParallelGroup:
    """Join the `size` ranks at `init_method` (tcp://host:port, or env:// under torchrun) as `rank`."""
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=IDLE_TIMEOUT)
    step = dist.new_group(list(range(size)), timeout=timedelta(seconds=step_timeout_s), backend=backend)
    return ParallelGroup(rank, size, step)
