"""Rank 0 and the other tensor-parallel ranks: started here as processes on this machine, or
joined through torchrun's rendezvous (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the
environment: the same command on every node, rank 0 serving, the others running worker.py)."""

from __future__ import annotations

import atexit
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenloom.config import EngineConfig
from tokenloom.distributed.errors import ParallelRankError
from tokenloom.distributed.group import ParallelGroup, free_port, init_group
from tokenloom.distributed.rank_process import POLL_S, LocalRanks, start_timeout_s
from tokenloom.distributed.shm import SharedMemoryAllReduce
from tokenloom.distributed.worker import threads_per_rank


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun (or with its variables); else None."""
    if not all(n in os.environ for n in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


class Ranks:
    """Rank 0's handle on the other ranks: their group, and the processes it started (if any)."""

    def __init__(self, group: ParallelGroup, local: LocalRanks | None = None) -> None:
        """`local`: the ranks started here (None: joined through torchrun)."""
        self.group, self.local = group, local
        self._stopped = False
        atexit.register(self.stop)

    @property
    def processes(self) -> list:
        """The rank processes started here (rank_process.RankProcess), rank 1 first."""
        return self.local.processes if self.local is not None else []

    def wait_loaded(self) -> None:
        """Until every rank has loaded its share: a rank that dies or does not report it in time is
        a ParallelRankError naming it (torchrun's ranks, on other machines: only the time limit)."""
        if self.local is not None:
            self.local.wait_for(self.group.store, "loaded", start_timeout_s())
            return
        keys = [f"stage/loaded/{r}" for r in range(1, self.group.size)]
        deadline = time.monotonic() + start_timeout_s()
        while not self.group.store.check(keys):
            if time.monotonic() > deadline:
                raise ParallelRankError(
                    f"the other ranks did not load their shares within {start_timeout_s():.0f} s "
                    "(see TOKENLOOM_RANK_START_TIMEOUT)"
                )
            time.sleep(POLL_S)

    def stop(self) -> None:
        """Tell the ranks to leave (a dead one cannot be told), wait for those started here (killing
        one that does not leave), and leave the group."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.group.send("stop")
        except Exception:  # a dead rank: nothing to tell it
            pass
        if self.local is not None:
            self.local.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_ranks(config: EngineConfig, model_config) -> Ranks:
    """Joined through torchrun's rendezvous where this process is torchrun's rank 0, else ranks
    1 .. N-1 started on this machine (rank_process.py: each a fresh interpreter with cores / N threads,
    as rank 0 then), handed the model's config rank 0 has read so that they do not read it again to
    plan their share. Returns once every rank has joined the group; a rank that dies or does not
    join in time is a ParallelRankError naming it."""
    size = config.world_size
    if dist.is_initialized():
        raise RuntimeError(
            "this process already runs a model split over ranks: stop it first "
            "(llm.engine.ranks.stop()) or split one model at a time"
        )
    joined = torchrun_rank()
    if joined is not None:
        rank, world = joined
        if world != size or rank != 0:
            raise ValueError(
                f"torchrun started {world} processes (this one rank {rank}) but the model is split over "
                f"{size}: give torchrun --nnodes x --nproc-per-node = the tensor (or pipeline) parallel "
                "size"
            )
        return Ranks(init_group(0, world, "env://", config.device))
    threads = threads_per_rank(size)
    shm_path = SharedMemoryAllReduce.create(size) if SharedMemoryAllReduce.usable() else None
    # A store op waits at most this long: a rank that dies inside the group's set-up ends it then.
    store = dist.TCPStore(
        "127.0.0.1", free_port(), size, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    local = LocalRanks(
        size,
        lambda rank: dict(
            rank=rank,
            size=size,
            init_method=None,
            config=config,
            threads=threads,
            shm_path=shm_path,
            model_config=model_config,
            store_addr=("127.0.0.1", store.port),
        ),
    )
    torch.set_num_threads(threads)
    try:
        local.wait_for(store, "joined", start_timeout_s())
        group = init_group(0, size, None, config.device, shm_path, local, store=store)
    except BaseException:
        for p in local.processes:
            p.kill()
        local.stop(timeout_s=0)
        raise
    return Ranks(group, local)
