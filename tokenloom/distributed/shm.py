"""All-reduce through shared memory, for ranks on one machine.

gloo's all-reduce between two processes on one machine has a fixed latency however small the
tensor (its threads sleep and wake on each of the ring's messages); tensor parallelism runs two
per layer, so a 24-layer model's step waits through 48 of them (docs/BENCHMARKS.md, 'Measurements
behind design choices'). Here each rank copies its tensor into its own slot of a file mapped by
every rank (in /dev/shm), raises its sequence number, waits (spinning, then yielding) until every
rank's number has reached the same one, and adds the slots in rank order: every rank computes the
same sum, bit for bit. Two buffers alternate, so a rank writing call n + 2 cannot overwrite what
another rank still reads of call n (it has seen that rank reach n + 1).

Tensors over the slot size go through gloo instead. A rank that stops raising its number makes
the others' wait end in ParallelRankError: at once where `peers_alive` says a peer process is
gone, else after the step timeout. x86 only (its stores are seen in the order they are made;
elsewhere the ranks use gloo).
"""

from __future__ import annotations

import os
import platform
import time
import uuid
from collections.abc import Callable

import torch

from tokenloom.distributed.errors import ParallelRankError

LIVENESS_EVERY_S = 0.01  # a waiting rank asks whether its peers live this often
FLAG_STRIDE = 8  # int64s between ranks' sequence numbers (64 bytes: no false sharing)
SLOT_BYTES = 1 << 20  # per rank and buffer: a (T, hidden) float32 tensor up to 1 MiB
SPINS_BEFORE_YIELD = 2000


class SharedMemoryAllReduce:
    """One mapping of `path` per rank; rank 0 creates it (``create``), the others ``attach``."""

    def __init__(
        self, path: str, rank: int, size: int, timeout_s: float, peers_alive: Callable[[], bool] | None = None
    ) -> None:
        self.path, self.rank, self.size, self.timeout_s = path, rank, size, timeout_s
        self.peers_alive = peers_alive
        flags_bytes = size * FLAG_STRIDE * 8
        memory = torch.from_file(path, shared=True, size=flags_bytes + 2 * size * SLOT_BYTES, dtype=torch.uint8)
        self.flags = memory[:flags_bytes].view(torch.int64)  # (size x FLAG_STRIDE,)
        self.slots = memory[flags_bytes:].view(2, size, SLOT_BYTES)  # (buffer, rank, bytes)
        self.seq = 0

    @staticmethod
    def usable() -> bool:
        """Shared-memory all-reduce runs here (x86, /dev/shm present)."""
        return platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")

    @classmethod
    def create(cls, size: int) -> str:
        """A fresh zeroed file for `size` ranks; returns its path (for every rank's constructor)."""
        path = f"/dev/shm/tokenloom-allreduce-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        with open(path, "wb") as f:
            f.truncate(size * FLAG_STRIDE * 8 + 2 * size * SLOT_BYTES)
        return path

    def fits(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.is_contiguous() and x.numel() * x.element_size() <= SLOT_BYTES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x (contiguous CPU, at most SLOT_BYTES) over the ranks, in place; returns x."""
        nbytes = x.numel() * x.element_size()
        self.seq += 1
        buffer = self.slots[self.seq % 2]
        buffer[self.rank, :nbytes].copy_(x.view(-1).view(torch.uint8))
        self.flags[self.rank * FLAG_STRIDE] = self.seq  # after the data (x86: in order)
        self._wait_for(self.seq)
        parts = [buffer[r, :nbytes].view(x.dtype).view(x.shape) for r in range(self.size)]
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return x.copy_(total)

    def _wait_for(self, seq: int) -> None:
        numbers = self.flags[::FLAG_STRIDE]
        spins, deadline, next_check = 0, None, 0.0
        while int(numbers.min()) < seq:
            spins += 1
            if spins <= SPINS_BEFORE_YIELD:
                continue
            time.sleep(0)
            now = time.monotonic()
            deadline = deadline or now + self.timeout_s
            gone = now >= next_check and self.peers_alive is not None and not self.peers_alive()
            next_check = now + LIVENESS_EVERY_S if now >= next_check else next_check
            if gone or now > deadline:
                why = "its process ended" if gone else f"no all-reduce {seq} from it in {self.timeout_s:.0f} s"
                raise ParallelRankError(
                    f"a rank of the split model (tensor or pipeline parallel) stopped answering "
                    f"({why}); the engine cannot go on without it"
                )

    def remove(self) -> None:
        """Delete the file's name (rank 0, once every rank has mapped it: the mappings stay valid, and
        nothing is left in /dev/shm however the processes end)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
