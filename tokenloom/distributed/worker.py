"""A rank other than 0: load this rank's share of the model, then do what rank 0 says.

Commands (rank 0 sends them from ModelRunner and the LM head, group.py's ``send``):
  ("cache", (num_blocks, block_size, dtype, kv_cache_dtype))   allocate the KV cache, as rank 0's
  ("copy", [(src, dst), ...])                                   copy KV blocks (copy-on-write)
  ("forward", [SeqChunk, ...])                                  run the model over the step's chunks
  ("logits", (shape, dtype))                                    take part in the LM head
  ("stop", None)                                                leave
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from tokenloom.config import EngineConfig, parse_dtype
from tokenloom.distributed.group import ParallelRankError, init_group
from tokenloom.distributed.layers import parallelize
from tokenloom.distributed.shard import TensorShard

log = logging.getLogger("tokenloom")


def threads_per_rank(size: int) -> int:
    """Each of `size` ranks on one machine gets an equal share of its cores."""
    return max(1, (os.cpu_count() or 1) // size)


def load_share(config: EngineConfig, shard: TensorShard, group):
    """This rank's share of the model, wrapped to compute the whole model's results (a LoadedModel)."""
    from tokenloom.loader import load_model
    loaded = load_model(config.model, config.dtype, config.device, config.max_model_len,
                        quantization=config.quantization, shard=shard)
    parallelize(loaded.model, shard, group, loaded.config)
    return loaded


def worker_main(rank: int, size: int, init_method: str, config: EngineConfig, threads: int | None = None) -> None:
    """The process of rank `rank` of `size` (started by launch.py, or by torchrun)."""
    torch.set_num_threads(threads or threads_per_rank(size))
    group = init_group(rank, size, init_method)
    try:
        serve(load_share(config, TensorShard(rank, size), group), group, config)
    except ParallelRankError:
        sys.exit(0)                               # rank 0 is gone: so is the engine this rank served


@torch.inference_mode()
def serve(loaded, group, config: EngineConfig) -> None:
    """Run rank 0's commands until it says stop."""
    from tokenloom.kv_cache.paged import PagedKVCache
    from tokenloom.runner import ModelRunner
    runner = None
    while True:
        kind, payload = group.receive()
        if kind == "cache":
            num_blocks, block_size, dtype, kv_dtype = payload
            kv = PagedKVCache(loaded.local_config, num_blocks, block_size, parse_dtype(dtype), config.device, kv_dtype)
            runner = ModelRunner(loaded.model, kv, config.device)
        elif kind == "copy":
            runner.kv_cache.copy_blocks(payload)
        elif kind == "forward":
            runner.forward(payload)
        elif kind == "logits":
            loaded.model.lm_head.serve(*payload)
        elif kind == "stop":
            return
        else:
            raise ValueError(f"unknown command {kind!r} from rank 0")
