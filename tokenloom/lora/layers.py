"""A projection with LoRA slots: the base layer's output plus each row's own adapter's product.

``LoRALinear`` wraps whatever layer loading left (float, prepacked panels, int8/int4, GGUF blocks
as stored: the base stays as it is) and holds ``slots`` adapters' factors in reserved buffers,
written in place when an adapter loads (``load_slot``) so that recorded decode tapes
(layers/op_tape.py) keep reading them. Which slot each row of a step uses is ``StepRows.index``,
set once per forward by the model runner.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenloom.lora.kernel import lora_add
from tokenloom.lora.peft import LoRAFactors


class StepRows:
    """Every row's adapter slot for the step being run (-1: the base model alone), in a buffer the
    model owns (``lora_rows``), so tapes read the step's values in place."""

    def __init__(self, model: nn.Module, capacity: int, device: torch.device) -> None:
        self.index = torch.full((capacity,), -1, dtype=torch.int32, device=device)
        model.register_buffer("lora_rows", self.index, persistent=False)
        self.active = False  # some row of the step has an adapter (else the projections skip LoRA)

    def set(self, runs: list[tuple[int, int]]) -> None:
        """`runs`: (slot, rows) per sequence of the step, in batch order."""
        self.active = any(slot >= 0 for slot, _ in runs)
        if not self.active:  # the projections skip LoRA: nothing to write
            return
        rows = [slot for slot, count in runs for _ in range(count)]
        if len(rows) > self.index.numel():
            raise RuntimeError(f"a step of {len(rows)} tokens exceeds the LoRA row buffer ({self.index.numel()})")
        self.index[: len(rows)].copy_(torch.tensor(rows, dtype=torch.int32))


class LoRALinear(nn.Module):
    """base(x) + B_s (A_s x) for each row's slot s: x (T, in) -> (T, out). A fused projection's
    shards (q/k/v, gate/up) are output groups with factors of their own (``group_names``)."""

    lora_a: torch.Tensor  # (slots, groups * max_rank, in): each group's A in its first `rank` rows
    lora_b: torch.Tensor  # (slots, max_rank, out): B^T times the scaling, in its first `rank` rows
    lora_ranks: torch.Tensor  # (slots, groups) int32; 0: the slot leaves that group alone

    def __init__(
        self,
        base: nn.Module,
        group_bounds: list[int],
        group_names: tuple[str | None, ...],
        slots: int,
        max_rank: int,
        rows: StepRows,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = features(base)
        self.bounds, self.group_names, self.max_rank, self.rows = group_bounds, group_names, max_rank, rows
        groups = len(group_names)
        a_shape, b_shape = (slots, groups * max_rank, self.in_features), (slots, max_rank, self.out_features)
        self.register_buffer("lora_a", torch.zeros(a_shape, dtype=dtype, device=device))
        self.register_buffer("lora_b", torch.zeros(b_shape, dtype=dtype, device=device))
        self.register_buffer("lora_ranks", torch.zeros(slots, groups, dtype=torch.int32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Two op calls for a (T, in) input (decode tapes replay every one): the base's, then the
        batched LoRA op reading the step's row buffer in place; the base's alone in a step where no
        row has an adapter (decode tapes are kept apart for the two: StepTapes.variant)."""
        y = self.base.forward(x)
        if not self.rows.active:
            return y
        if x.dim() == 2:
            return lora_add(y, x, self.lora_a, self.lora_b, self.lora_ranks, self.rows.index, self.bounds)
        flat = lora_add(
            y.reshape(-1, self.out_features),
            x.reshape(-1, self.in_features),
            self.lora_a,
            self.lora_b,
            self.lora_ranks,
            self.rows.index,
            self.bounds,
        )
        return flat.view(y.shape)

    def group_rows(self, group: int) -> int:
        return self.bounds[group + 1] - self.bounds[group]

    def load_slot(self, slot: int, factors: dict[int, LoRAFactors]) -> None:
        """Write an adapter's factors (by output group) into `slot`; groups it leaves out get rank 0."""
        R = self.max_rank
        self.clear_slot(slot)
        for g, f in factors.items():
            r = f.rank
            self.lora_a[slot, g * R : g * R + r].copy_(f.A)
            self.lora_b[slot, :r, self.bounds[g] : self.bounds[g + 1]].copy_(f.B.T)
            self.lora_ranks[slot, g] = r

    def clear_slot(self, slot: int) -> None:
        self.lora_ranks[slot].zero_()
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def extra_repr(self) -> str:
        groups = ",".join(g or "all" for g in self.group_names)
        return f"groups={groups}, slots={self.lora_a.shape[0]}, max_rank={self.max_rank}"


def features(base: Any) -> tuple[int, int]:
    """(in_features, out_features) of a linear layer in any format loading leaves."""
    if hasattr(base, "in_features") and hasattr(base, "out_features"):
        return int(base.in_features), int(base.out_features)
    weight = base.weight
    return int(weight.shape[1]), int(weight.shape[0])
