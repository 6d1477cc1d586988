"""Per-sequence state of a hybrid model's recurrent layers, beside the paged KV cache.

An attention layer keeps every token's key and value (paged.py); a recurrent layer (Granite
4.0-H's Mamba-2 mixers, ModelConfig.recurrent) folds the tokens it has read into a state of fixed
size: its conv's last inputs and its SSM state. Each sequence holds one *slot* of that state in
every recurrent layer, from the step its first KV blocks are allocated until they are released
(BlockManager.state_slot): when it finishes, is aborted or is preempted.

What a slot holds is the state after its sequence's computed tokens and nothing else:
- a chunk that starts at position 0 (a new prompt, a preempted sequence recomputed, a borrowed
  table) starts from zero state whatever the slot held, so slots are never cleared on hand-out;
- a chunk that starts later continues from the slot (chunked prefill, decoding);
- so nothing may skip computing a token or compute one that is later taken back: the engine
  turns prefix caching off for these models (a cached prefix's blocks hold its keys and values,
  not the state after it), refuses speculative decoding (rejected drafts would have advanced the
  state), and recomputes a failed step's sequences from position 0 (worker/model_runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.memory.zero_pages import zeros_on
from tokenloom.models.config import ModelConfig


class RecurrentStateCache:
    """Every recurrent layer's state for `num_slots` sequences: per layer i, ``conv[i]``
    (slots, conv_dim, conv_kernel - 1) in the model's dtype and ``state[i]`` (slots, *state shape)
    float32 (ModelConfig.recurrent.state_shapes). Allocated once; which sequence holds which slot
    is the BlockManager's business."""

    def __init__(
        self,
        model: ModelConfig,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        layers: range | None = None,
    ) -> None:
        rec = model.recurrent
        assert rec is not None  # only hybrids have recurrent layers
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.layers = [i for i in rec.layers if layers is None or i in layers]
        shapes = rec.state_shapes()  # on the CPU resident only where a sequence has written
        self.conv = {i: zeros_on((num_slots, *shapes["conv"]), dtype, self.device) for i in self.layers}
        self.state = {i: zeros_on((num_slots, *shapes["state"]), torch.float32, self.device) for i in self.layers}

    @property
    def bytes_per_sequence(self) -> int:
        """One slot's bytes over every recurrent layer held here."""
        tensors = [*self.conv.values(), *self.state.values()]
        return sum(t[0].numel() * t.element_size() for t in tensors)


@dataclass(slots=True)
class RecurrentBatch:
    """A step's sequences as the recurrent layers read them (built once a step, from the metadata).

    Decoding sequences (one token this step) are handled together: rows ``decode_rows`` of the
    step's tokens, their slots ``decode_slots`` (D,) and ``decode_keep`` (D, 1) 1.0, or 0.0 for a
    sequence whose state starts from zero (a one-token prompt). The others (``prompts``) each run
    alone: (first row, tokens, slot, starts from zero)."""

    decode_rows: list[int]
    decode_slots: torch.Tensor  # (D,) int64
    decode_keep: torch.Tensor  # (D, 1) float32
    prompts: list[tuple[int, int, int, bool]]
    all_decode: bool  # every sequence decodes: the step's rows are decode_rows, in order


def recurrent_batch(meta: AttentionMetadata, device: torch.device) -> RecurrentBatch:
    """The step's RecurrentBatch (cached on `meta`: the first recurrent layer builds it)."""
    if meta.recurrent_batch_ is not None:
        return meta.recurrent_batch_
    slots = meta.state_slots
    if slots is None or any(s < 0 for s in slots):
        raise RuntimeError("a recurrent layer ran without a state slot for each sequence")
    rows, decode_slots, keep, prompts = [], [], [], []
    for slot, start, q, ctx in zip(slots, meta.query_start, meta.query_lens, meta.context_lens):
        if q == 1:  # decoding, or a one-token prompt (its state starts from zero)
            rows.append(start)
            decode_slots.append(slot)
            keep.append(float(ctx > 1))
        else:
            prompts.append((start, q, slot, ctx == q))
    batch = RecurrentBatch(
        rows,
        torch.tensor(decode_slots, dtype=torch.int64, device=device),
        torch.tensor(keep, device=device).view(-1, 1),
        prompts,
        len(rows) == meta.num_seqs,
    )
    meta.recurrent_batch_ = batch
    return batch
