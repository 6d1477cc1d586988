"""What one forward pass needs to know to read and write the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class PagedInputs:
    """A step's sequences as the paged-attention kernel reads them (device tensors, int32)."""

    seq_lens: torch.Tensor  # (S,) cached positions of each sequence after this step's writes
    query_start: torch.Tensor  # (S + 1,) sequence i's queries are rows query_start[i] : query_start[i + 1]
    block_offsets: torch.Tensor  # (S,) where sequence i's blocks start in block_ids
    block_ids: torch.Tensor  # (N,) every sequence's block table, one after another
    max_query_len: int  # the most queries any sequence has (sizes the grid)


def build_paged_inputs(
    query_lens: list[int], context_lens: list[int], tables: list[list[int]], device: torch.device
) -> PagedInputs:
    """PagedInputs of a step, built on the host as one int32 buffer and copied in one transfer
    (pinned and asynchronous on a GPU). tables[i]: sequence i's block ids (at least enough for
    context_lens[i] positions)."""
    S = len(query_lens)
    starts, offsets = [0], []
    flat: list[int] = []
    for q_len, table in zip(query_lens, tables):
        starts.append(starts[-1] + q_len)
        offsets.append(len(flat))
        flat.extend(table)
    host = torch.tensor([*context_lens, *starts, *offsets, *flat], dtype=torch.int32)
    if torch.device(device).type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    return PagedInputs(host[:S], host[S : 2 * S + 1], host[2 * S + 1 : 3 * S + 1], host[3 * S + 1 :], max(query_lens))


@dataclass(slots=True)
class AttentionMetadata:
    """Describes a ragged batch of sequences flattened into T tokens.

    Sequence i owns tokens ``query_start[i] : query_start[i] + query_lens[i]`` of the
    flattened batch. Its keys/values live in the cache blocks ``block_tables[i]``;
    after this step's tokens are written, it has ``context_lens[i]`` cached tokens,
    the last ``query_lens[i]`` of which are this step's.
    """

    slot_mapping: torch.Tensor  # (T,) int64: flat cache slot (block * block_size + offset) per token
    query_start: list[int]  # per sequence: first token index in the flattened batch
    query_lens: list[int]  # per sequence: tokens computed this step
    context_lens: list[int]  # per sequence: cached tokens after this step (>= query_lens)
    block_tables: list[torch.Tensor]  # per sequence: (num_blocks_i,) int64 block ids covering context_lens[i] (host)
    null_block: int = 0  # an always-zero block that pads block tables
    # per sequence: its slot in the recurrent layers' state cache (kv_cache/recurrent.py); None
    # for a model without recurrent layers
    state_slots: list[int] | None = None
    # What the attention backends derive from the fields above, built at the first layer that
    # needs it and reused by the rest of this step's layers (None until then).
    decode_rows_: list[int] | None = None  # sequences with one query (cpu_decode.decode_rows)
    prefill_rows_: list[int] | None = None  # sequences the prefill kernel takes (cpu_prefill)
    decode_kernel_inputs: tuple[torch.Tensor, torch.Tensor] | None = None  # padded tables (S, W), ctx (S,)
    prefill_kernel_inputs: tuple[torch.Tensor, ...] | None = None  # tables (S, W), starts, lens, ctx (S,)
    padded_decode_inputs: dict | None = None  # torch path: attention window -> (tables, may-attend mask)
    paged_inputs_: PagedInputs | None = None  # the Triton path's (paged_inputs); a CUDA graph sets its own
    recurrent_batch_: Any = None  # the recurrent layers' view (kv_cache/recurrent.recurrent_batch)
    # the same step as the sliding-window layers with a pool of their own read it (their block
    # tables, slots and null block; kv_cache/window_pool.py); None where every layer reads this one
    window: AttentionMetadata | None = None

    def for_window_layers(self, windowed: bool) -> AttentionMetadata:
        """The metadata a layer attends with: the window layers' where it has a window and they have
        their own pool, else this."""
        return self.window if windowed and self.window is not None else self

    def paged_inputs(self) -> PagedInputs:
        """This step's sequences as the Triton paged-attention kernel reads them (built once a step)."""
        if self.paged_inputs_ is None:
            tables = [t.tolist() if isinstance(t, torch.Tensor) else t for t in self.block_tables]
            self.paged_inputs_ = build_paged_inputs(
                self.query_lens, self.context_lens, tables, self.slot_mapping.device
            )
        return self.paged_inputs_

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    def padded_block_tables(self, seqs: list[int], power_of_two: bool = False) -> torch.Tensor:
        """Block tables of sequences `seqs`, (len(seqs), longest) int64 on the CPU, padded with the
        null block (to a power-of-two width if asked)."""
        width = max(len(self.block_tables[i]) for i in seqs)
        if power_of_two:
            width = 1 << (width - 1).bit_length()
        tables = torch.full((len(seqs), width), self.null_block, dtype=torch.int64)
        for row, i in enumerate(seqs):
            tables[row, : len(self.block_tables[i])] = self.block_tables[i]
        return tables
