"""Which layers keep their KV blocks where: whether a model's sliding-window layers get a pool of their
own (kv_cache/window_pool.py), how many blocks it has, and what a sequence then holds."""

from __future__ import annotations

import logging

import torch

from tokenloom.config import EngineConfig
from tokenloom.loader.load import LoadedModel

logger = logging.getLogger(__name__)

HEADROOM_TOKENS = 64  # per sequence past its window: a step's decode-ahead or draft tokens


def window_pool_layers(
    config: EngineConfig, loaded: LoadedModel, max_model_len: int, split: bool
) -> tuple[frozenset[int], int]:
    """(the sliding-window layers that keep their blocks in a pool of their own, their window), or
    (frozenset(), 0) where every layer keeps every block: the window layers must share one window
    shorter than the context, the model must plan them apart (``plans_window_pools``), and the
    engine must run in one process (`split` False) on the CPU (the Triton path and CUDA graphs read
    one table a step) without a disk tier (which saves whole blocks of every layer)."""
    c = loaded.local_config
    assert c is not None  # LoadedModel.__post_init__ fills it
    windows = c.layer_windows()
    layers = frozenset(i for i in c.attention_layers(loaded.kv_layers) if windows[i] is not None)
    sizes = {windows[i] for i in layers}
    runs_apart = (
        config.cache.window_blocks
        and not split
        and loaded.pipeline is None
        and torch.device(config.device).type == "cpu"
        and config.cache.prefix_cache_dir is None
        and getattr(loaded.model, "plans_window_pools", False)
    )
    if not layers or len(sizes) != 1 or not runs_apart:
        return frozenset(), 0
    window = sizes.pop()
    assert window is not None  # layers with a window
    return (layers, window) if window < max_model_len else (frozenset(), 0)


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks the window layers' pool wants: every running sequence's window (and a few tokens past
    it), and one step's worth of prompt tokens on top."""
    per_sequence = -(-(window + HEADROOM_TOKENS) // block_size) + 1
    return max_num_seqs * per_sequence + -(-max_num_batched_tokens // block_size) + 1


def sequence_kv_bytes(
    window_layers: int, window: int, num_layers: int, per_token: int, context: int, block_size: int
) -> tuple[int, int]:
    """(KV bytes one sequence of `context` tokens holds with `window_layers` of the `num_layers`
    keeping only the blocks a window reads, the same with every layer keeping every block);
    `per_token`: KV bytes a token takes in all `num_layers`."""
    per_layer = per_token // num_layers
    reach = min(context, (-(-window // block_size) + 1) * block_size)
    apart = context * per_layer * (num_layers - window_layers) + reach * per_layer * window_layers
    return apart, context * per_token


def report_window_pool(
    window_layers: frozenset[int], window: int, num_layers: int, per_token: int, context: int, block_size: int
) -> None:
    """Log what a sequence at the full context holds with and without the window layers' pool."""
    apart, whole = sequence_kv_bytes(len(window_layers), window, num_layers, per_token, context, block_size)
    logger.info(
        "sliding-window layers: %d of %d keep only the blocks their %d-position window reads: a sequence at "
        "the full %d-token context holds %.1f MiB of KV instead of %.1f MiB (%.1fx less)",
        len(window_layers),
        num_layers,
        window,
        context,
        apart / 2**20,
        whole / 2**20,
        whole / apart,
    )
