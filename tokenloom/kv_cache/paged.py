"""The KV cache tensors: per layer, a pool of fixed-size blocks for keys and values."""

from __future__ import annotations

import torch

from tokenloom.kv_cache.quantized import (
    QUANTIZED_CACHES,
    Int4Cache,
    Int8Cache,
    copy_cache_blocks,
    quantized_bytes_per_element_row,
    write_cache,
)
from tokenloom.kv_cache.recurrent import RecurrentStateCache
from tokenloom.memory.zero_pages import zeros_on
from tokenloom.models.config import ModelConfig


def kv_bytes_per_token(
    model: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto", layers: range | None = None
) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element (`layers`: those cached here,
    a pipeline stage's; None: all; a hybrid's recurrent layers keep no KV and are not counted);
    with latent attention (ModelConfig.mla) 1, the values being part of the keys.

    For an int8 cache: 1 byte per element plus a float32 scale per token and head, i.e.
    2 x layers x kv_heads x (head_dim + 4); int4: half a byte per element plus a float16 scale
    per 32 (kv_cache/quantized.py).
    """
    count = len(model.attention_layers(layers))
    tensors = 1 if model.mla is not None else 2
    if kv_cache_dtype in ("int8", "int4"):
        return tensors * count * model.num_kv_heads * quantized_bytes_per_element_row(kv_cache_dtype, model.head_dim)
    elem = torch.empty((), dtype=dtype).element_size()
    return tensors * count * model.num_kv_heads * model.head_dim * elem


class PagedKVCache:
    """Keys and values of every layer: each (num_blocks + 1, block_size, kv_heads, head_dim),
    a tensor of the model's dtype, or an Int8Cache / Int4Cache with ``kv_cache_dtype`` "int8" / "int4"
    (kv_cache/quantized.py).

    The tensors are allocated once; which request owns which block is the
    BlockManager's business, not this class's. Block ``null_block`` (the extra
    last one) is never handed out or written: it stays zero and pads block tables.
    Together with ``zero_blocks`` on a block's first write (done where a reader looks
    past a sequence's end: ``attention.reads_past_context``), every slot a sequence
    can see past its own end is zero, never stale or NaN.

    With latent attention (ModelConfig.mla) only the keys are stored, one (head_dim) latent a
    token: each layer's values are a view of its keys' last value_dim dims, written with them.

    A hybrid model's recurrent layers keep no keys or values (empty tensors here); their
    per-sequence state lives in ``states`` (kv_cache/recurrent.py), `state_slots` sequences' worth.
    """

    def __init__(
        self,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_cache_dtype: str = "auto",
        layers: range | None = None,
        state_slots: int = 0,
    ) -> None:
        """`layers`: the layers whose KV this cache holds (a pipeline stage's; None: all; less a
        hybrid's recurrent layers); the others get empty tensors of the same dtype and never see a
        block. `state_slots`: sequences the recurrent layers' state is kept for (hybrids only)."""
        shape = (num_blocks + 1, block_size, model.num_kv_heads, model.head_dim)
        self.latent = model.mla is not None  # values live in the keys
        if self.latent and kv_cache_dtype != "auto":
            raise ValueError(
                f"an {kv_cache_dtype} KV cache is not implemented for latent attention (DeepSeek); use auto"
            )
        self.layers = model.attention_layers(layers)
        self.states = (
            RecurrentStateCache(model, state_slots, dtype, device, layers) if model.recurrent is not None else None
        )
        self.num_blocks = num_blocks
        self.null_block = num_blocks
        self.block_size = block_size
        self.dtype = dtype  # what attention computes in
        self.kv_cache_dtype = kv_cache_dtype
        self.device = torch.device(device)

        def zeros(size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            # on the CPU, pages that read as zero until written: no memset of a cache sized for
            # the whole context, and only the blocks a run writes become resident
            return zeros_on(size, dtype, self.device)

        def layer_cache(i: int):
            size = shape if i in self.layers else (0, *shape[1:])
            if kv_cache_dtype == "int8":
                return Int8Cache(zeros(size, torch.int8), zeros(size[:3], torch.float32), dtype)
            if kv_cache_dtype == "int4":
                return Int4Cache.allocate(size, dtype, zeros)
            return zeros(size, dtype)

        self.keys = [layer_cache(i) for i in range(model.num_layers)]
        if self.latent:  # (num_blocks + 1, block_size, 1, value_dim) views
            self.values = [k[..., model.head_dim - model.value_dim :] for k in self.keys]
        else:
            self.values = [layer_cache(i) for i in range(model.num_layers)]

    @classmethod
    def from_memory_budget(
        cls,
        model: ModelConfig,
        memory_bytes: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kv_cache_dtype: str = "auto",
        layers: range | None = None,
        state_slots: int = 0,
    ) -> PagedKVCache:
        per_block = kv_bytes_per_token(model, dtype, kv_cache_dtype, layers) * block_size
        num_blocks = memory_bytes // per_block - 1  # one block is the null block
        if num_blocks < 1:
            raise ValueError(
                f"kv cache memory {memory_bytes} B holds no block of {block_size} tokens ({per_block} B per block)"
            )
        return cls(model, num_blocks, block_size, dtype, device, kv_cache_dtype, layers, state_slots)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[i], self.values[i]

    def zero_blocks(self, block_ids: torch.Tensor) -> None:
        """Clear blocks (in place, every layer) before their first slot is written."""
        for cache in [self.keys[i] for i in self.layers] + self._value_layers():
            cache.index_fill_(0, block_ids, 0)

    def _block_ids(self, pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sources, destinations) of (source, destination) block pairs, each (n,) int64 on the device."""
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        return src, torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)

    def _value_layers(self) -> list:
        """The value caches of the layers held here (none with latent attention: they are key views)."""
        return [] if self.latent else [self.values[i] for i in self.layers]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of a shared partial block)."""
        src, dst = self._block_ids(pairs)
        for cache in [self.keys[i] for i in self.layers] + self._value_layers():
            copy_cache_blocks(cache, src, dst)

    def shift_keys(self, pairs: list[tuple[int, int]], turns: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Context shift (engine/context_shift.py): each (source, destination) block's keys, turned
        by layer i's rope `turns[i]` (cos, sin, each (rotary_dim,) float32; None: the layer has no
        rope), written to the destination in every layer; values copied where the destination is
        another block. A quantized cache is read, turned and quantized again."""
        src, dst = self._block_ids(pairs)
        slots = (dst[:, None] * self.block_size + torch.arange(self.block_size, device=self.device)).reshape(-1)
        for i in self.layers:
            k = self.keys[i][src]  # (n, block_size, kv_heads, head_dim)
            turn = turns[i]
            turned = k if turn is None else turn_keys(k, *turn)
            write_cache(self.keys[i], turned.reshape(-1, *k.shape[2:]), slots)  # (n * block_size, kv_heads, head_dim)
        moved = [(a, b) for a, b in pairs if a != b]
        if moved:
            m_src, m_dst = self._block_ids(moved)
            for cache in self._value_layers():
                copy_cache_blocks(cache, m_src, m_dst)

    def _stored(self) -> list[torch.Tensor]:
        """Every tensor a block's contents live in, indexed by block first: per cached layer its keys
        and values (a quantized layer's codes and scales; latent attention: keys only)."""
        caches = [self.keys[i] for i in self.layers] + self._value_layers()
        out: list[torch.Tensor] = []
        for cache in caches:
            out += [cache.data, cache.scales] if isinstance(cache, QUANTIZED_CACHES) else [cache]
        return out

    def block_bytes(self, block_id: int) -> bytes:
        """One block's keys and values in every layer, as bytes (the prefix cache's disk tier)."""
        parts = [t[block_id].contiguous().cpu().view(torch.uint8).reshape(-1) for t in self._stored()]
        return torch.cat(parts).numpy().tobytes()

    def load_block_bytes(self, block_id: int, payload: bytes) -> None:
        """Write `payload` (what block_bytes gave for some block of a cache like this one) into a block."""
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        start = 0
        for t in self._stored():
            row = t[block_id]
            size = row.numel() * row.element_size()
            if start + size > flat.numel():
                raise ValueError(f"a stored block has {flat.numel()} bytes; this cache's blocks need more")
            t[block_id] = flat[start : start + size].clone().view(t.dtype).view(row.shape).to(t.device)
            start += size
        if start != flat.numel():
            raise ValueError(f"a stored block has {flat.numel()} bytes; this cache's blocks have {start}")


def turn_keys(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope applied to roped keys k (..., head_dim) by the angle whose cos and sin
    (rotary_dim,) are given, in float32; dims past rotary_dim pass through. Returns k's dtype."""
    rotary = cos.shape[-1]
    x = k[..., :rotary].float()
    half = rotary // 2
    turned = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    return torch.cat([turned.to(k.dtype), k[..., rotary:]], dim=-1)
