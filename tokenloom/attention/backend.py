"""The attention op every model calls: one step's rope, cache write and paged attention,
planned once per forward from the step's shape and called per layer.

A model computes qkv (T, (heads + 2 kv_heads) head_dim) and calls ``attend(layer, qkv,
norms)``; which kernels run is decided here, once per step, so every architecture written
against this op gets the fastest path the step allows:

- ``KernelAttention`` (CPU, float32, kernels built, a plain cache, rope over whole or
  partial heads, scores soft-capped or not, every sequence decoding one token or a prompt
  chunk the prefill kernel takes, decoding ones first): q/k rotated and k/v written in one
  kernel pass, decode attention into the first rows, prompt attention into the rest. One
  kernel call per layer when every sequence decodes. Every kernel also takes a stored-format cache
  (HalfCache, Int8Cache, Int4Cache: keys and values rounded or quantized as they are written,
  the same bits as the layer's ``store``, and read in place).
- ``TritonAttention`` (CUDA, a cache in the compute dtype): rope and the cache write in one
  Triton kernel, then one paged-attention kernel reading the block table in place, for decode,
  prompt chunks and mixed steps alike; what a CUDA graph captures.
- ``TorchAttention`` (everything else: bf16/fp16 on the CPU, head sizes the prefill kernel lacks,
  attention sinks in a prompt chunk, no rope): the same arithmetic from separate ops: q/k norm,
  rope (fused on CPU float32), ``paged_attention`` below: the CPU kernels for the rows they take,
  torch SDPA (torch_sdpa.py) for the rest. Latent attention (DeepSeek's MLA: one shared key a token whose
  tail is its value, ``AttentionShape.value_dim``) always runs here: decoding rows on its CPU
  kernel (cpu_latent.py), the rest on torch_sdpa.latent_attention.

The CPU two give the same bits where both run (tests/attention/test_attention_backends.py); the Triton
path is checked against its torch references (tests/kernels/test_triton_kernels.py) and against
transformers on a GPU (tests/test_gpu.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from tokenloom.attention import cpu_decode, cpu_latent, cpu_prefill, torch_sdpa
from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.kernels import triton as triton_kernels
from tokenloom.kv_cache.quantized import HalfCache, Int8Cache, QuantizedKV
from tokenloom.layers.rope import apply_rope


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """What the attention op needs to know of a model's attention layers."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    windows: tuple[int | None, ...] = ()  # per layer: the positions a query sees (None: all); () for all layers
    softcap: float | None = None  # scores -> tanh(scores / softcap) * softcap before softmax (Gemma 2)
    # each head has a learned sink logit, counted in its softmax's denominator with no value behind
    # it (gpt-oss): the layers pass theirs (heads,) float32 to the op's call
    sinks: bool = False
    # latent attention (DeepSeek's MLA): one kv head whose last value_dim dims are also its value;
    # qkv holds q and k only, the cache holds the keys only, and a call returns (T, heads value_dim)
    value_dim: int | None = None

    def __post_init__(self) -> None:
        if self.sinks and self.softcap is not None:
            raise ValueError("attention sinks with soft-capped scores are not implemented")
        if self.value_dim is not None and (self.num_kv_heads != 1 or self.sinks or self.softcap is not None):
            raise ValueError("latent attention has one kv head, and neither sinks nor soft-capped scores")

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def out_size(self) -> int:
        """Columns of a call's output: heads x (value_dim, or head_dim)."""
        return self.num_heads * (self.value_dim or self.head_dim)


QKNorms = tuple[nn.Module, nn.Module]  # per-head RMSNorms of q and of k (Qwen3), or None


class StepAttention:
    """One step's attention: ``attend(layer, qkv, norms, sinks)`` -> (T, heads head_dim).

    qkv: (T, (heads + 2 kv_heads) head_dim), this layer's projections of the step's tokens;
    norms: per-head q/k RMSNorms or None; sinks: (heads,) the layer's sink logits where the
    shape says the model has them (each head's softmax over [scores, sink], the sink's share
    dropped), else None. Writes the layer's keys/values of those tokens into the cache.
    """

    def __init__(
        self, shape: AttentionShape, meta: AttentionMetadata, kv_cache, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> None:
        self.shape, self.meta, self.kv_cache, self.rope = shape, meta, kv_cache, rope

    def __call__(
        self, layer: int, qkv: torch.Tensor, norms: QKNorms | None = None, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise NotImplementedError

    def step_tensors(self) -> list[torch.Tensor] | None:
        """Every per-step tensor the layers' calls read, for a step whose layers may replay from a
        tape (layers/op_tape.py): the same calls for every step of these tensors' shapes, the
        Python of __call__ deciding nothing from their values. None: this step runs eagerly."""
        return None


class TorchAttention(StepAttention):
    def __call__(
        self, layer: int, qkv: torch.Tensor, norms: QKNorms | None = None, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        sh, T = self.shape, qkv.shape[0]
        if sh.value_dim is not None:
            return self._latent(layer, qkv)
        q_size, kv_size = sh.q_size, sh.kv_size
        if norms is not None:
            _norm_in_place(qkv, norms, sh)
        v = qkv[:, q_size + kv_size :].view(T, sh.num_kv_heads, sh.head_dim)
        qk = qkv[:, : q_size + kv_size].view(T, -1, sh.head_dim)
        if self.rope is not None:  # q and k side by side: one rotation for both (elementwise, same numbers)
            qk = apply_rope(qk, *self.rope)
        q, k = qk[:, : sh.num_heads], qk[:, sh.num_heads :]  # (T, heads|kv_heads, head_dim)
        keys, values = self.kv_cache.layer(layer)
        out = paged_attention(
            q, k, v, keys, values, self.meta, sh.scale, sh.window(layer), sh.softcap, sinks
        )  # (T, heads, head_dim)
        return out.reshape(T, q_size)

    def _latent(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        """Latent attention: qkv (T, (heads + 1) head_dim), rope over the first rotary dims of
        each head -> (T, heads value_dim); the keys written, the values read from them."""
        sh, T = self.shape, qkv.shape[0]
        assert sh.value_dim is not None  # a latent shape
        qk = qkv.view(T, sh.num_heads + 1, sh.head_dim)
        if self.rope is not None:
            qk = apply_rope(qk, *self.rope)
        q, k = qk[:, : sh.num_heads], qk[:, sh.num_heads :]  # (T, heads, D), (T, 1, D)
        keys, meta, window = self.kv_cache.keys[layer], self.meta, sh.window(layer)
        torch_sdpa.write_cache(keys, k, meta.slot_mapping)
        decoding = cpu_decode.decode_rows(meta) if cpu_latent.usable(q, keys, sh.value_dim) else []
        if decoding and len(decoding) == meta.num_seqs:  # one query per sequence: q rows = sequences
            return cpu_latent.attend(q, keys, meta, sh.scale, sh.value_dim, window).view(T, sh.out_size)
        out = q.new_empty(T, sh.num_heads, sh.value_dim)
        if decoding:
            rows = [meta.query_start[i] for i in decoding]
            out[rows] = cpu_latent.attend(q[rows], keys, meta, sh.scale, sh.value_dim, window)
        torch_sdpa.latent_attention(q, k, keys, meta, sh.scale, sh.value_dim, window, frozenset(decoding), out)
        return out.reshape(T, sh.out_size)


class TritonAttention(StepAttention):
    """CUDA: per layer, q/k norms (where the model has them), one rope + cache-write kernel and one
    paged-attention kernel. Nothing in a call depends on the values of the step's tensors (slots,
    paged inputs, rope tables), so a CUDA graph of the layers replays it for new values written
    into the same tensors."""

    def __init__(
        self, shape: AttentionShape, meta: AttentionMetadata, kv_cache, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> None:
        super().__init__(shape, meta, kv_cache, rope)
        from tokenloom.kernels.triton.paged_attention import paged_attention as triton_paged_attention
        from tokenloom.kernels.triton.rope_cache import rope_and_cache

        self.attention, self.rope_and_cache = triton_paged_attention, rope_and_cache
        self.inputs = meta.paged_inputs()

    def __call__(
        self, layer: int, qkv: torch.Tensor, norms: QKNorms | None = None, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        sh, T = self.shape, qkv.shape[0]
        if qkv.stride(-1) != 1:
            qkv = qkv.contiguous()
        if norms is not None:
            _norm_in_place(qkv, norms, sh)
        keys, values = self.kv_cache.layer(layer)
        q = self.rope_and_cache(
            qkv, self.rope, keys, values, self.meta.slot_mapping, sh.num_heads, sh.num_kv_heads, sh.head_dim
        )  # (T, heads, head_dim)
        out = self.attention(q, keys, values, self.inputs, sh.scale, sh.window(layer), sh.softcap, sinks)
        return out.view(T, sh.q_size)


class KernelAttention(StepAttention):
    rope: tuple[torch.Tensor, torch.Tensor]  # always given here (kernels_take)

    def __init__(
        self, shape: AttentionShape, meta: AttentionMetadata, kv_cache, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        super().__init__(shape, meta, kv_cache, rope)
        self.decoding = cpu_decode.decode_rows(meta)
        self.ops = cpu_decode.ops()
        self.tables: torch.Tensor | None
        self.ctx: torch.Tensor | None
        self.tables, self.ctx = cpu_decode.decode_inputs(meta) if self.decoding else (None, None)
        self.all_decode = len(self.decoding) == meta.num_seqs
        self.prompts = [] if self.all_decode else cpu_prefill.prefill_rows(meta)

    def step_tensors(self) -> list[torch.Tensor] | None:
        """All-decode steps: rope tables, cache slots, block tables, context lengths."""
        if not self.all_decode:
            return None
        # all decoding: tables and ctx made
        return cast("list[torch.Tensor]", [*self.rope, self.meta.slot_mapping, self.tables, self.ctx])

    def _decode_op(self, keys, values) -> tuple:
        """The fused all-decode op for this cache's format and the cache arrays it takes (between
        sin and slots): rope, the write (rounded or quantized as the layer's ``store`` does) and
        the attention in one call."""
        if isinstance(keys, torch.Tensor):
            return self.ops.rope_write_decode, (keys, values)
        if isinstance(keys, HalfCache):
            return self.ops.rope_write_decode_half, (keys.data, values.data)
        op = self.ops.rope_write_decode_int8 if isinstance(keys, Int8Cache) else self.ops.rope_write_decode_int4
        return op, (keys.data, keys.scales, values.data, values.scales)

    def __call__(
        self, layer: int, qkv: torch.Tensor, norms: QKNorms | None = None, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        sh, meta = self.shape, self.meta
        if norms is not None:
            _norm_in_place(qkv, norms, sh)
        keys, values = self.kv_cache.keys[layer], self.kv_cache.values[layer]
        cos, sin = self.rope
        slots, window = meta.slot_mapping, sh.window(layer) or 0
        if self.all_decode:
            op, caches = self._decode_op(keys, values)
            step = (slots, self.tables, self.ctx, sh.num_heads, sh.scale, window, sh.softcap or 0.0, sinks)
            return op(qkv, cos, sin, *caches, *step)
        T, n = qkv.shape[0], len(self.decoding)
        out = qkv.new_empty(T, sh.q_size)
        if isinstance(keys, torch.Tensor):
            q = self.ops.rope_write(qkv, cos, sin, keys, values, slots, sh.num_heads)  # (T, heads, head_dim)
            if n:
                decode_args = (self.tables, self.ctx, sh.scale, window, sh.softcap or 0.0, sinks)
                self.ops.paged_decode_out(q[:n], keys, values, *decode_args, out[:n].view(n, sh.num_heads, sh.head_dim))
        else:  # a stored format: each key and value stored as the layer's store() does
            k_data, v_data, k_scales, v_scales = cpu_prefill.cache_arrays(keys, values)
            q = self.ops.rope_write_stored(qkv, cos, sin, k_data, v_data, slots, sh.num_heads, k_scales, v_scales)
            if n:
                decoded = cpu_decode.attend(
                    q[:n], keys, values, meta, self.decoding, sh.scale, window, sh.softcap, sinks
                )  # (n, heads, head_dim)
                out[:n] = decoded.view(n, sh.q_size)
        cpu_prefill.attend_into(
            out.view(T, sh.num_heads, sh.head_dim),
            q,
            keys,
            values,
            meta,
            self.prompts,
            sh.scale,
            sh.window(layer),
            sh.softcap,
        )
        return out


class LayerwiseAttention(StepAttention):
    """One of several planned attention ops per layer: Gemma's sliding-window layers rotate with
    their own rope base, so they get an op planned with those tables."""

    def __init__(self, ops: list[StepAttention], op_of_layer: list[int]) -> None:
        first = ops[0]
        super().__init__(first.shape, first.meta, first.kv_cache, first.rope)
        self.ops, self.op_of_layer = ops, op_of_layer

    def __call__(
        self, layer: int, qkv: torch.Tensor, norms: QKNorms | None = None, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.ops[self.op_of_layer[layer]](layer, qkv, norms, sinks)

    def step_tensors(self) -> list[torch.Tensor] | None:
        """Every op's step tensors, each once (the ops share the step's slots and tables)."""
        parts = [op.step_tensors() for op in self.ops]
        found: dict[int, torch.Tensor] = {}
        for part in parts:
            if part is None:
                return None
            found.update((id(t), t) for t in part)
        return list(found.values())


def _norm_in_place(qkv: torch.Tensor, norms: QKNorms, sh: AttentionShape) -> None:
    """Per-head RMSNorm of qkv's q and k columns, written back (T, (heads + 2 kv_heads) head_dim);
    each head row is one row of a 2-D norm, so both backends normalize with the same op."""
    T = qkv.shape[0]
    q = qkv[:, : sh.q_size].reshape(T * sh.num_heads, sh.head_dim)
    k = qkv[:, sh.q_size : sh.q_size + sh.kv_size].reshape(T * sh.num_kv_heads, sh.head_dim)
    qkv[:, : sh.q_size] = norms[0](q).view(T, sh.q_size)
    qkv[:, sh.q_size : sh.q_size + sh.kv_size] = norms[1](k).view(T, sh.kv_size)


def reads_past_context(kv_cache) -> bool:
    """Whether attention over `kv_cache` (a PagedKVCache) may read the slots past a sequence's
    end: torch_sdpa's padded decode batches do (masked, so they must hold zeros, not NaN; latent
    attention always runs there); where
    the CPU decode kernel takes every decoding sequence, no reader does (the kernels and the
    per-sequence SDPA calls read exactly each context), and fresh blocks need no clearing."""
    probe = torch.empty(0, dtype=kv_cache.dtype, device=kv_cache.device)
    return kv_cache.latent or not cpu_decode.usable(probe, kv_cache.keys[kv_cache.layers[0]])


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write this step's k/v into the caches, then attend (torch_sdpa.paged_attention's contract):
    decoding rows on the CPU decode kernel and prompt chunks on the prefill kernel where they take
    them (CPU, float32; the prefill kernel not with sinks), every other sequence in torch SDPA.
    Returns (T, heads, head_dim)."""
    torch_sdpa.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    decoding = cpu_decode.decode_rows(meta) if cpu_decode.usable(q, k_cache) else []
    if decoding and len(decoding) == meta.num_seqs:  # one query per sequence: q rows = sequences
        return cpu_decode.attend(q, k_cache, v_cache, meta, decoding, scale, window, softcap, sinks)
    if not decoding and meta.num_seqs > 1 and max(meta.query_lens) == 1 and softcap is None and sinks is None:
        return torch_sdpa.paged_attention(q, k, v, k_cache, v_cache, meta, scale, window)  # one padded call
    out = torch.empty_like(q)
    if decoding:
        rows = [meta.query_start[i] for i in decoding]
        out[rows] = cpu_decode.attend(q[rows], k_cache, v_cache, meta, decoding, scale, window, softcap, sinks)
    prompts = cpu_prefill.prefill_rows(meta) if sinks is None and cpu_prefill.usable(q, k_cache) else []
    if prompts:
        cpu_prefill.attend_into(out, q, k_cache, v_cache, meta, prompts, scale, window, softcap)
    return torch_sdpa.paged_attention(
        q, k, v, k_cache, v_cache, meta, scale, window, softcap, out, frozenset(prompts) | frozenset(decoding), sinks
    )


def kernels_take(
    shape: AttentionShape, meta: AttentionMetadata, kv_cache, rope: tuple[torch.Tensor, torch.Tensor] | None
) -> bool:
    """The step's attention can run on the CPU kernels (see the module doc); the rope tables
    have the activations' dtype and device, and usable() requires float32 on the CPU."""
    if rope is None:
        return False
    cos = rope[0]
    keys = kv_cache.keys[kv_cache.layers[0]]
    decoding = cpu_decode.decode_rows(meta)
    all_decode = len(decoding) == meta.num_seqs
    # rope_write(_decode) write float32 slots; rope_write_stored and rope_write_decode_half/_int8/_int4
    # the stored formats
    writable = isinstance(keys, (torch.Tensor, QuantizedKV))
    if not (writable and cpu_decode.usable(cos, keys) and cos.shape[-1] <= shape.head_dim and cos.is_contiguous()):
        return False
    if all_decode:
        return True
    return (
        not shape.sinks  # the prefill kernel has none
        and cpu_prefill.takes(shape.head_dim, kv_cache.keys[kv_cache.layers[0]])
        and (not decoding or decoding[-1] == len(decoding) - 1)
        and len(cpu_prefill.prefill_rows(meta)) == meta.num_seqs - len(decoding)
    )


def plan_attention(
    shape: AttentionShape, meta: AttentionMetadata, kv_cache, rope: tuple[torch.Tensor, torch.Tensor] | None
) -> StepAttention:
    """The attention op for this step's layers; `rope`: (cos, sin) (T, 1, head_dim) in the
    activations' dtype, or None (learned positions). Latent attention runs on TorchAttention (its
    decoding rows on the latent CPU kernel)."""
    if shape.value_dim is not None:
        return TorchAttention(shape, meta, kv_cache, rope)
    if triton_kernels.takes_cache(kv_cache):
        return TritonAttention(shape, meta, kv_cache, rope)
    if kernels_take(shape, meta, kv_cache, rope):
        assert rope is not None  # kernels_take wants the tables
        return KernelAttention(shape, meta, kv_cache, rope)
    return TorchAttention(shape, meta, kv_cache, rope)
