"""Which KV cache block belongs to which request. Pure Python: no torch.

Blocks are fixed-size runs of ``block_size`` token slots. A request's block
table lists its blocks in order; token position p lives in slot
``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations


class BlockManager:
    """A free list of block ids and a per-request block table."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # A stack: the most recently freed (cache-warm, already paged-in) block is reused first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request's table can be grown to hold `num_tokens` tokens."""
        have = len(self._tables.get(request_id, ()))
        return self.blocks_needed(num_tokens) - have <= len(self._free)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's block table to hold `num_tokens` tokens; returns the table.

        Raises MemoryError when there are not enough free blocks (call can_allocate first).
        """
        table = self._tables.setdefault(request_id, [])
        extra = self.blocks_needed(num_tokens) - len(table)
        if extra > len(self._free):
            raise MemoryError(f"request {request_id} needs {extra} more KV blocks, {len(self._free)} free")
        table.extend(self._free.pop() for _ in range(max(extra, 0)))
        return table

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks to the free list (no-op if it holds none)."""
        self._free.extend(self._tables.pop(request_id, ()))

    def table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def check_integrity(self) -> None:
        """Assert: no block is both free and owned, none owned twice, free + owned = total."""
        owned = [b for t in self._tables.values() for b in t]
        free = list(self._free)
        assert len(set(owned)) == len(owned), "a block is owned twice"
        assert len(set(free)) == len(free), "a block is free twice"
        assert not set(owned) & set(free), "a block is both free and owned"
        assert len(owned) + len(free) == self.num_blocks, "blocks were lost or invented"
