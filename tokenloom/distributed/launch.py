"""Rank 0 and the other tensor-parallel ranks: started here as processes on this machine, or
joined through torchrun's rendezvous (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the
environment: the same command on every node, rank 0 serving, the others running worker.py)."""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os

import torch
import torch.distributed as dist

from tokenloom.config import EngineConfig
from tokenloom.distributed.group import ParallelGroup, free_port, init_group
from tokenloom.distributed.shm import SharedMemoryAllReduce
from tokenloom.distributed.worker import threads_per_rank, worker_main


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun (or with its variables); else None."""
    if not all(n in os.environ for n in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


class Ranks:
    """Rank 0's handle on the other ranks: their group, and the processes it started (if any)."""

    def __init__(self, group: ParallelGroup, processes: list | None = None) -> None:
        """`processes`: the ranks started here."""
        self.group, self.processes = group, processes or []
        self._stopped = False
        atexit.register(self.stop)

    def stop(self) -> None:
        """Tell the ranks to leave (a dead one cannot be told), wait for those started here (killing
        one that does not leave), and leave the group."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.group.send("stop")
        except Exception:      # a dead rank: nothing to tell it
            pass
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if dist.is_initialized():
            dist.destroy_process_group()


def start_ranks(config: EngineConfig, model_config) -> Ranks:
    """Joined through torchrun's rendezvous where this process is torchrun's rank 0, else ranks
    1 .. N-1 spawned on this machine (each with cores / N threads, as rank 0 then), handed the
    model's config rank 0 has read so that they do not read it again to plan their share."""
    size = config.world_size
    if dist.is_initialized():
        raise RuntimeError("this process already runs a model split over ranks: stop it first "
                           "(llm.engine.ranks.stop()) or split one model at a time")
    joined = torchrun_rank()
    if joined is not None:
        rank, world = joined
        if world != size or rank != 0:
            raise ValueError(f"torchrun started {world} processes (this one rank {rank}) but the model is split over "
                             f"{size}: give torchrun --nnodes x --nproc-per-node = the tensor (or pipeline) parallel "
                             "size")
        return Ranks(init_group(0, world, "env://", config.device))
    init_method = f"tcp://127.0.0.1:{free_port()}"
    threads = threads_per_rank(size)
    shm_path = SharedMemoryAllReduce.create(size) if SharedMemoryAllReduce.usable() else None
    context = mp.get_context("spawn")
    processes = [context.Process(target=worker_main, name=f"tokenloom-rank-{rank}", daemon=True,
                                 args=(rank, size, init_method, config, threads, shm_path, model_config))
                 for rank in range(1, size)]
    for p in processes:
        p.start()
    torch.set_num_threads(threads)
    group = init_group(0, size, init_method, config.device, shm_path, lambda: all(p.is_alive() for p in processes))
    return Ranks(group, processes)
