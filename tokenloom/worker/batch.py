"""Flatten a ragged batch of sequences into model inputs and paged-attention metadata."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata  # block tables on the host (the attention backends move what they read)
    fresh_blocks: list[int]  # blocks whose first slot this pass writes (zero them first)


def build_batch(chunks: list[SeqChunk], block_size: int, device: torch.device, null_block: int) -> Batch:
    """Token ids, positions, slots and block tables of `chunks`, flattened in order."""
    bs = block_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    starts, q_lens, ctx_lens, tables = [], [], [], []
    fresh: list[int] = []
    for c in chunks:
        end = c.start + len(c.token_ids)
        starts.append(len(ids))
        ids.extend(c.token_ids)
        positions.extend(range(c.start, end))
        table = c.block_ids
        slots.extend(table[p // bs] * bs + p % bs for p in range(c.start, end))
        fresh.extend(table[p // bs] for p in range(-(-c.start // bs) * bs, end, bs))  # first write of a block
        q_lens.append(len(c.token_ids))
        ctx_lens.append(end)
        tables.append(torch.tensor(table[: -(-end // bs)], dtype=torch.int64))
    ids_positions_slots = to_device(torch.tensor([ids, positions, slots], dtype=torch.int64), device)  # (3, T)
    state_slots = [c.state_slot for c in chunks] if any(c.state_slot >= 0 for c in chunks) else None
    meta = AttentionMetadata(
        ids_positions_slots[2], starts, q_lens, ctx_lens, tables, null_block=null_block, state_slots=state_slots
    )
    return Batch(ids_positions_slots[0], ids_positions_slots[1], meta, fresh)
