"""A rank other than 0: load this rank's share of the model, then do what rank 0 says.

Commands (rank 0 sends them from ModelRunner and the LM head, group.py's ``send``):
  ("cache", (num_blocks, block_size, dtype, kv_cache_dtype))   allocate the KV cache, as rank 0's
  ("copy", [(src, dst), ...])                                   copy KV blocks (copy-on-write)
  ("forward", [SeqChunk, ...])                                  run the model over the step's chunks
  ("logits", (shape, dtype))                                    take part in the LM head
  ("stop", None)                                                leave
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tokenloom.config import EngineConfig
from tokenloom.distributed.errors import ParallelRankError
from tokenloom.distributed.group import init_group, rank_device, report_stage
from tokenloom.distributed.layers import parallelize
from tokenloom.distributed.pipeline import Pipeline, PipelineStage
from tokenloom.distributed.shard import TensorShard
from tokenloom.models.config import parse_dtype


def threads_per_rank(size: int) -> int:
    """Each of `size` ranks on one machine gets an equal share of its cores."""
    return max(1, (os.cpu_count() or 1) // size)


def parallel_plan(config: EngineConfig, rank: int, model_config) -> TensorShard | PipelineStage:
    """What rank `rank` holds of the model `model_config` describes."""
    if config.tensor_parallel_size > 1:
        return TensorShard(rank, config.tensor_parallel_size)
    return PipelineStage(rank, config.pipeline_parallel_size, model_config.num_layers)


def load_share(config: EngineConfig, plan: TensorShard | PipelineStage, group):
    """This rank's share of the model, made to compute its part of the whole model's results (a
    LoadedModel): tensor parallel, wrapped by layers.parallelize; a pipeline stage, given the
    Pipeline its runner hands each model call to."""
    from tokenloom.loader import load_model

    loaded = load_model(
        config.model, config.dtype, config.device, config.max_model_len, quantization=config.quantization, shard=plan
    )
    if isinstance(plan, TensorShard):
        parallelize(loaded.model, plan, group, loaded.config)
    else:
        loaded.pipeline = Pipeline(loaded.model, plan, group)
    return loaded


class ParentWatch:
    """What a rank started by rank 0 sees of it: its parent process."""

    def __init__(self) -> None:
        self.parent = os.getppid()

    def alive(self) -> bool:
        return os.getppid() == self.parent

    def dead_error(self, stage: str) -> ParallelRankError:
        return ParallelRankError(f"rank 0 is gone ({stage})")


def fault_point(rank: int, stage: str) -> None:
    """Tests: TOKENLOOM_TEST_RANK_FAULT=RANK:STAGE kills this rank at `stage` (start, load, cache,
    forward3: the third forward), saying so first, as a rank that crashes there would die;
    RANK:stall-STAGE makes it hang there instead."""
    fault = os.environ.get("TOKENLOOM_TEST_RANK_FAULT")
    if fault == f"{rank}:{stage}":
        print(
            f"rank {rank}: killed at {stage} (TOKENLOOM_TEST_RANK_FAULT) at {time.time():.3f}",
            file=sys.stderr,
            flush=True,
        )
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == f"{rank}:stall-{stage}":
        time.sleep(3600)


def worker_main(
    rank: int,
    size: int,
    init_method: str | None,
    config: EngineConfig,
    threads: int | None = None,
    shm_path: str | None = None,
    model_config=None,
    store_addr: tuple[str, int] | None = None,
) -> None:
    """The process of rank `rank` of `size`: started by launch.py (with rank 0's store address, the
    shared-memory file of its all-reduces and the model's config rank 0 read), or by torchrun (which
    reads the config here). Reports its start-up stages (joined, loaded) in the store."""
    torch.set_num_threads(threads or threads_per_rank(size))
    fault_point(rank, "start")
    if model_config is None:
        from tokenloom.loader.load import load_checkpoint

        model_config = load_checkpoint(config.model).config
    config = dataclasses.replace(config, device=rank_device(config.device, rank))
    store = None
    if store_addr is not None:
        store = dist.TCPStore(store_addr[0], store_addr[1], size, is_master=False, timeout=timedelta(seconds=60))
        report_stage(store, "joined", rank)
    group = init_group(rank, size, init_method, config.device, shm_path, ParentWatch(), store=store)
    try:
        fault_point(rank, "load")
        loaded = load_share(config, parallel_plan(config, rank, model_config), group)
        report_stage(group.store, "loaded", rank)
        serve(loaded, group, config)
    except ParallelRankError:
        sys.exit(0)  # rank 0 is gone: so is the engine this rank served
    finally:
        # Left to the interpreter's exit, gloo's threads can outlive it and abort the process
        # ("terminate called without an active exception", pytorch/pytorch#190489).
        dist.destroy_process_group()


@torch.inference_mode()
def serve(loaded, group, config: EngineConfig) -> None:
    """Run rank 0's commands until it says stop."""
    from tokenloom.kv_cache.paged import PagedKVCache
    from tokenloom.worker.model_runner import ModelRunner

    runner, forwards = None, 0
    while True:
        kind, payload = group.receive()
        if kind == "cache":
            fault_point(group.rank, "cache")
            num_blocks, block_size, dtype, kv_dtype = payload
            kv = PagedKVCache(
                loaded.local_config,
                num_blocks,
                block_size,
                parse_dtype(dtype),
                config.device,
                kv_dtype,
                loaded.kv_layers,
            )
            runner = ModelRunner(loaded.model, kv, config.device, pipeline=loaded.pipeline)
        elif kind == "copy":
            assert runner is not None  # rank 0 sends "cache" first
            runner.kv_cache.copy_blocks(payload)
        elif kind == "forward":
            forwards += 1
            fault_point(group.rank, f"forward{forwards}")
            assert runner is not None  # rank 0 sends "cache" first
            runner.forward(payload)
        elif kind == "logits":
            loaded.model.lm_head.serve(*payload)
        elif kind == "stop":
            return
        else:
            raise ValueError(f"unknown command {kind!r} from rank 0")
