"""The KV cache tensors: per layer, a pool of fixed-size blocks for keys and values."""

from __future__ import annotations

import torch

from tokenloom.config import ModelConfig


def kv_bytes_per_token(model: ModelConfig, dtype: torch.dtype) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * elem


class PagedKVCache:
    """Keys and values of every layer: each (num_blocks + 1, block_size, kv_heads, head_dim).

    The tensors are allocated once; which request owns which block is the
    BlockManager's business, not this class's. Block ``null_block`` (the extra
    last one) is never handed out or written: it stays zero and pads block tables.
    Together with ``zero_blocks`` on a block's first write, every slot a
    sequence can see past its own end is zero, never stale or NaN.
    """

    def __init__(self, model: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_blocks + 1, block_size, model.num_kv_heads, model.head_dim)
        self.num_blocks = num_blocks
        self.null_block = num_blocks
        self.block_size = block_size
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]

    @classmethod
    def from_memory_budget(cls, model: ModelConfig, memory_bytes: int, block_size: int,
                           dtype: torch.dtype, device: torch.device | str) -> "PagedKVCache":
        per_block = kv_bytes_per_token(model, dtype) * block_size
        num_blocks = memory_bytes // per_block - 1        # one block is the null block
        if num_blocks < 1:
            raise ValueError(f"kv cache memory {memory_bytes} B holds no block of {block_size} tokens "
                             f"({per_block} B per block)")
        return cls(model, num_blocks, block_size, dtype, device)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[i], self.values[i]

    def zero_blocks(self, block_ids: torch.Tensor) -> None:
        """Clear blocks (in place, every layer) before their first slot is written."""
        for k, v in zip(self.keys, self.values):
            k.index_fill_(0, block_ids, 0)
            v.index_fill_(0, block_ids, 0)
