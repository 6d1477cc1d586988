"""What every model class promises the loader and the runner."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from tokenloom.attention import AttentionMetadata
from tokenloom.attention.backend import StepAttention
from tokenloom.kv_cache.paged import PagedKVCache
from tokenloom.models.config import ModelConfig


class CausalLM(nn.Module):
    """A decoder-only LM over a flattened, ragged batch of tokens.

    Weight loading is declared, not coded per model:
    - ``packed_modules_mapping``: checkpoint sub-name -> (our sub-name, shard id or None
      for a plain rename); a shard's rows in the fused parameter come from ``shard_rows``.
    - ``ignored_checkpoint_keys``: regexes of checkpoint tensors that are not weights
      (e.g. cached rotary tables); everything else must map onto a parameter.
    - ``transform_checkpoint_tensor``: layout fix-ups (GPT-2's Conv1D transpose).
    """

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | None]]] = {}
    ignored_checkpoint_keys: tuple[str, ...] = ()
    input_embedding_name: str = ""  # the nn.Embedding a tied output projection shares
    # The layers run the same ops for every step of a given shape, with no data-dependent
    # Python (a MoE router's .tolist() is): decode steps may replay from a tape (op_tape.py).
    # Only for models whose forward is this class's: embed_and_plan, then run_layers.
    replayable_layers: ClassVar[bool] = False
    # The step's attention is planned with the window layers' own metadata where the step has it
    # (AttentionMetadata.window; kv_cache/window_pool.py), so they may keep blocks of their own.
    plans_window_pools: ClassVar[bool] = False
    lm_head: nn.Module  # the output projection, which every model sets

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: PagedKVCache
    ) -> torch.Tensor:
        """input_ids, positions: (T,) -> final hidden states (T, hidden). Writes the KV cache.
        A model either overrides this or defines its two halves below."""
        return self.run_layers(*self.embed_and_plan(input_ids, positions, meta, kv_cache))

    def embed_and_plan(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: PagedKVCache
    ) -> tuple[torch.Tensor, StepAttention]:
        """The step's embeddings (T, hidden) and its attention op, rope tables planned in."""
        raise NotImplementedError

    def run_layers(self, h: torch.Tensor, attend: StepAttention) -> torch.Tensor:
        """Embeddings (T, hidden) -> final hidden states (T, hidden), through every layer."""
        raise NotImplementedError

    def key_turns(self, delta: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per layer, the (cos, sin) (rotary_dim,) float32 that turn a cached key `delta` positions
        back (context shift, engine/context_shift.py); None for a layer without rotary positions.
        A model whose cached keys cannot be moved raises NotImplementedError naming it."""
        raise NotImplementedError(f"context shift is not implemented for {type(self).__name__}")

    @classmethod
    def replays_decode_steps(cls) -> bool:
        """Decode steps of this class may replay from a tape (see replayable_layers)."""
        return cls.replayable_layers and cls.forward is CausalLM.forward

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> float32 logits (N, vocab)."""
        return self.lm_head(hidden).float()

    def prepare_for_inference(self) -> None:
        """Called once after the weights are loaded: CPU-only layout changes.

        Every float32 nn.Linear (the output projection included) gets its weight prepacked
        for this CPU's fastest kernel (layers/prepacked.py says why); on
        AVX-512 VNNI and AVX2 CPUs int8/int4 weights are re-laid in 16-row panels (quant/int8/panels.py).
        Then the weights move into 2 MiB pages (memory/huge_pages.py). Forward signatures do not change.
        """
        from tokenloom.layers.prepacked import prepack_linears
        from tokenloom.memory.huge_pages import move_to_huge_pages
        from tokenloom.quant.int8.modules import use_panels

        prepack_linears(self)
        use_panels(self)
        move_to_huge_pages(self)
        self._build_cpu_kernels()

    def _build_cpu_kernels(self) -> None:
        """Compile (or load from torch's cache) the CPU kernels this model's forward will call,
        so their one-time "compiling" messages come while loading, not inside streamed text."""
        from tokenloom.attention import cpu_decode, cpu_latent, cpu_prefill
        from tokenloom.layers import fused, ssm_scan
        from tokenloom.quant import QuantizedLinear
        from tokenloom.quant.int8 import kernels

        weight = next((p for p in self.parameters() if p.is_floating_point()), None)  # a norm's, at least
        if weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32:
            fused.build()
            cpu_decode.build()
            cpu_prefill.ops()
            if self.config.mla is not None:
                cpu_latent.build()
            if self.config.recurrent is not None:
                ssm_scan.build()
        if any(isinstance(m, QuantizedLinear) for m in self.modules()):
            kernels.available()

    def init_buffers(self, device: torch.device | str) -> None:
        """Recompute the non-persistent buffers (rotary tables) once the model is on `device`."""

    def shard_rows(self, param_name: str, shard_id: str) -> slice:
        """Rows of a fused parameter that hold one packed checkpoint tensor."""
        raise KeyError(f"{param_name} has no shard {shard_id!r}")

    def is_ignored_checkpoint_key(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.ignored_checkpoint_keys)

    def transform_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @classmethod
    def stored_block_types(cls, config: ModelConfig, names: Iterable[str]) -> dict[str, int] | None:
        """For an HF folder (tensor `names`) whose checkpoint_tensors gives some parameters as GGUF
        blocks (an MXFP4 folder's experts): those parameters' HF names -> their GGML type, so they are
        kept as stored; None where the folder holds none."""
        return None

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The checkpoint's (name, tensor) pairs as the parameters take them: as read, unless a
        family stores several parameters in one tensor (gpt-oss's stacked experts) and splits it here."""
        return tensors

    def checkpoint_rows(self, name: str) -> torch.Tensor | None:
        """The order (an index) in which to read the rows of checkpoint tensor `name`, for float
        and GGUF-block tensors alike; None: as stored (GLM-4's interleaved rope pairs)."""
        return None

    def tie_weights(self) -> None:
        """Share the output projection with the input embedding when the config says so."""
