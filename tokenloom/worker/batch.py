"""Flatten a ragged batch of sequences into model inputs and paged-attention metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

from tokenloom.attention import AttentionMetadata
from tokenloom.memory.transfer import to_device


@dataclass(slots=True)
class SeqChunk:
    """Tokens of one sequence computed in one forward pass."""

    token_ids: list[int]  # the tokens at positions start .. start + len - 1
    start: int  # position of token_ids[0]
    block_ids: list[int]  # the sequence's block table (covers start + len tokens)
    state_slot: int = -1  # its recurrent-state slot (kv_cache/recurrent.py); -1: the model has none
    window_block_ids: list[int] | None = None  # its window layers' table (kv_cache/window_pool.py), if apart
    lora_slot: int = -1  # the LoRA adapter slot its rows use (lora/manager.py); -1: the base model


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata  # block tables on the host (the attention backends move what they read)
    fresh_blocks: list[int]  # blocks whose first slot this pass writes (zero them first)
    fresh_window_blocks: list[int] | None = None  # the same in the window layers' pool, if apart


def _tables_and_slots(
    chunks: list[SeqChunk], tables_of: list[list[int]], bs: int
) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """Per chunk its block table (covering its context), every token's cache slot, and the blocks
    whose first slot this pass writes, read from `tables_of` (one table per chunk)."""
    tables: list[torch.Tensor] = []
    slots: list[int] = []
    fresh: list[int] = []
    for c, table in zip(chunks, tables_of):
        end = c.start + len(c.token_ids)
        slots.extend(table[p // bs] * bs + p % bs for p in range(c.start, end))
        fresh.extend(table[p // bs] for p in range(-(-c.start // bs) * bs, end, bs))  # first write of a block
        tables.append(torch.tensor(table[: -(-end // bs)], dtype=torch.int64))
    return tables, slots, fresh


def build_batch(
    chunks: list[SeqChunk], block_size: int, device: torch.device, null_block: int, window_null: int = 0
) -> Batch:
    """Token ids, positions, slots and block tables of `chunks`, flattened in order; where the chunks
    carry window tables, ``meta.window`` has those (its null block `window_null`)."""
    ids: list[int] = []
    positions: list[int] = []
    starts, q_lens, ctx_lens = [], [], []
    for c in chunks:
        end = c.start + len(c.token_ids)
        starts.append(len(ids))
        ids.extend(c.token_ids)
        positions.extend(range(c.start, end))
        q_lens.append(len(c.token_ids))
        ctx_lens.append(end)
    tables, slots, fresh = _tables_and_slots(chunks, [c.block_ids for c in chunks], block_size)
    windowed = bool(chunks) and chunks[0].window_block_ids is not None
    if windowed:
        window_tables = [cast("list[int]", c.window_block_ids) for c in chunks]
        w_tables, w_slots, w_fresh = _tables_and_slots(chunks, window_tables, block_size)
        slots = slots + w_slots
    rows = to_device(torch.tensor(ids + positions + slots, dtype=torch.int64), device)  # (T ids | T pos | slots)
    T = len(ids)
    state_slots = [c.state_slot for c in chunks] if any(c.state_slot >= 0 for c in chunks) else None
    meta = AttentionMetadata(
        rows[2 * T : 3 * T], starts, q_lens, ctx_lens, tables, null_block=null_block, state_slots=state_slots
    )
    if not windowed:
        return Batch(rows[:T], rows[T : 2 * T], meta, fresh)
    meta.window = AttentionMetadata(
        rows[3 * T :], starts, q_lens, ctx_lens, w_tables, null_block=window_null, state_slots=state_slots
    )
    return Batch(rows[:T], rows[T : 2 * T], meta, fresh, w_fresh)
