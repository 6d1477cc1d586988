"""The KV cache tensors: per layer, a pool of fixed-size blocks for keys and values."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenloom.kv_cache.quantized import (
    QUANTIZED_CACHES,
    STORED_DTYPES,
    allocate_stored,
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
    per 32; float16 / bfloat16: 2 bytes per element whatever `dtype` (kv_cache/quantized.py).
    """
    count = len(model.attention_layers(layers))
    tensors = 1 if model.mla is not None else 2
    if kv_cache_dtype in STORED_DTYPES:
        return tensors * count * model.num_kv_heads * quantized_bytes_per_element_row(kv_cache_dtype, model.head_dim)
    elem = torch.empty((), dtype=dtype).element_size()
    return tensors * count * model.num_kv_heads * model.head_dim * elem


class PagedKVCache:
    """Keys and values of every layer: each (num_blocks + 1, block_size, kv_heads, head_dim),
    a tensor of the model's dtype, or an Int8Cache / Int4Cache / HalfCache with ``kv_cache_dtype``
    "int8" / "int4" / "float16" or "bfloat16" (kv_cache/quantized.py).

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

    Sliding-window layers given a pool of their own (``window_layers``, kv_cache/window_pool.py) have
    ``num_window_blocks + 1`` blocks instead (the last, ``window_null``, the zero one), addressed by
    the window tables; the methods moving blocks take those layers' block ids apart.
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
        window_layers: frozenset[int] = frozenset(),
        num_window_blocks: int = 0,
    ) -> None:
        """`layers`: the layers whose KV this cache holds (a pipeline stage's; None: all; less a
        hybrid's recurrent layers); the others get empty tensors of the same dtype and never see a
        block. `state_slots`: sequences the recurrent layers' state is kept for (hybrids only).
        `window_layers`: those of them keeping `num_window_blocks` blocks of their own."""
        shape = (num_blocks + 1, block_size, model.num_kv_heads, model.head_dim)
        self.latent = model.mla is not None  # values live in the keys
        if self.latent and kv_cache_dtype != "auto":
            raise ValueError(
                f"an {kv_cache_dtype} KV cache is not implemented for latent attention (DeepSeek); use auto"
            )
        self.layers = model.attention_layers(layers)
        self.window_layers = window_layers
        if not window_layers <= set(self.layers) or (window_layers and num_window_blocks < 1):
            raise ValueError(f"window layers {sorted(window_layers)} need blocks and must be cached layers")
        self.num_window_blocks = num_window_blocks
        self.window_null = num_window_blocks
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
            blocks = num_window_blocks + 1 if i in window_layers else num_blocks + 1
            size = (blocks, *shape[1:]) if i in self.layers else (0, *shape[1:])
            if kv_cache_dtype in STORED_DTYPES:
                return allocate_stored(kv_cache_dtype, size, dtype, zeros)
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
        window_layers: frozenset[int] = frozenset(),
        window_blocks: int = 0,
    ) -> PagedKVCache:
        """The cache `memory_bytes` holds. With `window_layers` (a pool of their own), those layers get
        `window_blocks` blocks, or as many as the budget gives every layer if fewer, and the other
        layers the rest of the budget."""
        per_block = kv_bytes_per_token(model, dtype, kv_cache_dtype, layers) * block_size
        num_blocks = memory_bytes // per_block - 1  # one block is the null block
        if num_blocks < 1:
            raise ValueError(
                f"kv cache memory {memory_bytes} B holds no block of {block_size} tokens ({per_block} B per block)"
            )
        if not window_layers:
            return cls(model, num_blocks, block_size, dtype, device, kv_cache_dtype, layers, state_slots)
        layer_block = per_block // len(model.attention_layers(layers))  # every layer's block is alike
        num_window = min(window_blocks, num_blocks)
        other_block = per_block - layer_block * len(window_layers)
        if other_block:  # the other layers' blocks: what the window layers leave of the budget
            num_blocks = (memory_bytes - (num_window + 1) * layer_block * len(window_layers)) // other_block - 1
        return cls(
            model, num_blocks, block_size, dtype, device, kv_cache_dtype, layers, state_slots, window_layers, num_window
        )

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[i], self.values[i]

    def zero_blocks(self, block_ids: torch.Tensor, window_ids: torch.Tensor | None = None) -> None:
        """Clear blocks (in place, every layer; `window_ids` in the window layers' pool) before their
        first slot is written."""
        for cache in self._caches(window=False):
            cache.index_fill_(0, block_ids, 0)
        if window_ids is not None:
            for cache in self._caches(window=True):
                cache.index_fill_(0, window_ids, 0)

    def _group(self, window: bool) -> list[int]:
        """The layers held here that keep their blocks in the window layers' pool, or the others."""
        return [i for i in self.layers if (i in self.window_layers) == window]

    def _caches(self, window: bool) -> list:
        """Every key and value cache of the layers held here (values not with latent attention: they
        are key views), of the window layers' pool or of the others."""
        layers = self._group(window)
        return [self.keys[i] for i in layers] + ([] if self.latent else [self.values[i] for i in layers])

    def _block_ids(self, pairs: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sources, destinations) of (source, destination) block pairs, each (n,) int64 on the device."""
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        return src, torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)

    def copy_blocks(self, pairs: list[tuple[int, int]], window_pairs: Sequence[tuple[int, int]] = ()) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of a shared partial block);
        `window_pairs` in the window layers' pool."""
        for window, moves in ((False, pairs), (True, window_pairs)):
            if moves:
                src, dst = self._block_ids(moves)
                for cache in self._caches(window):
                    copy_cache_blocks(cache, src, dst)

    def shift_keys(
        self,
        pairs: list[tuple[int, int]],
        turns: list[tuple[torch.Tensor, torch.Tensor] | None],
        window_pairs: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Context shift (engine/context_shift.py): each (source, destination) block's keys, turned
        by layer i's rope `turns[i]` (cos, sin, each (rotary_dim,) float32; None: the layer has no
        rope), written to the destination in every layer (`window_pairs` in the window layers'
        pool); values copied where the destination is another block. A quantized cache is read,
        turned and quantized again."""
        for window, moves in ((False, pairs), (True, window_pairs)):
            if not moves:
                continue
            src, dst = self._block_ids(moves)
            slots = (dst[:, None] * self.block_size + torch.arange(self.block_size, device=self.device)).reshape(-1)
            for i in self._group(window):
                k = self.keys[i][src]  # (n, block_size, kv_heads, head_dim)
                turn = turns[i]
                turned = k if turn is None else turn_keys(k, *turn)
                write_cache(
                    self.keys[i], turned.reshape(-1, *k.shape[2:]), slots
                )  # (n * block_size, kv_heads, head_dim)
            moved = [(a, b) for a, b in moves if a != b]
            if moved and not self.latent:
                m_src, m_dst = self._block_ids(moved)
                for i in self._group(window):
                    copy_cache_blocks(self.values[i], m_src, m_dst)

    def _stored(self) -> list[torch.Tensor]:
        """Every tensor a block's contents live in, indexed by block first: per cached layer its keys
        and values (a quantized layer's codes and scales; latent attention: keys only)."""
        assert not self.window_layers, "a window layers' pool keeps no block whole in one id"
        caches = self._caches(window=False)
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
