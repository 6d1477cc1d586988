"""The sliding-window layers' own blocks: lent to a block of the KV cache while a sequence's window
can still see it, and taken back once no sequence's window does.

A model whose layers mix full attention with a sliding window (Gemma 2 and 3, gpt-oss; Mistral's
are all windowed) would otherwise keep every block of the context in every layer, though a window
layer's query at position p reads positions ``p - window + 1 .. p`` only. Here the window layers
store their keys and values in a second, smaller pool of blocks ("backings", ids ``0 ..
num_blocks - 1``, id ``num_blocks`` the always-zero null block): the block manager's block ``b``
(its table, hashes and prefix index are the same for every layer) keeps the full layers' data at
``b`` and the window layers' data at ``b.window_id`` while it has one.

A sequence *holds* the blocks its window may still read (``hold``), from allocation until its
queries have moved past them (``let_go``); the window layers' block table it attends with names
the null block for the others. A backing no sequence holds goes back to the pool: at once if its
block holds nothing worth keeping, else (a block in the prefix index) it stays with its block, so a
later prefix hit can still read it. A hold takes a backing never written while fewer than
``reserve`` (four windows' worth) are kept, else the kept one let go longest ago: so the backings
ever written (on the CPU, the pages resident) are at most the most held at once plus the reserve,
however long the contexts, while the last windows before recent hit points (a shared system
prompt's end, a conversation's last turn) stay for the next request. A hit is
only as long as the blocks its first query's window reaches still have their backings
(``BlockManager`` checks). This is vLLM v1's sliding-window KV-cache manager in one table.

Pure Python: no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol


class Backed(Protocol):
    """What the pool reads and writes of a block (kv_cache/block_manager.Block)."""

    window_id: int | None
    window_refs: int
    hash: int | None
    partial_keys: list | None


class WindowPool:
    """Backings for the window layers: ``num_blocks`` of them for blocks of ``window`` positions' reach."""

    def __init__(self, num_blocks: int, window: int, block_size: int) -> None:
        if num_blocks <= 0 or window <= 0:
            raise ValueError(f"need positive window-layer blocks and window, got {num_blocks}, {window}")
        self.num_blocks, self.window, self.block_size = num_blocks, window, block_size
        self.reserve = 4 * (-(-window // block_size) + 1)  # kept backings before written ones are reused
        self.null = num_blocks
        self._unowned: list[int] = list(range(num_blocks - 1, -1, -1))  # popped from the end: lowest first
        self._kept: OrderedDict[int, Backed] = OrderedDict()  # backing -> its cached block; front: take first

    @property
    def num_available(self) -> int:
        """Backings a hold may take: unowned ones, and those kept only for the prefix cache."""
        return len(self._unowned) + len(self._kept)

    def first_visible(self, position: int) -> int:
        """The first block a query at `position` reads in a window layer."""
        return max(0, position - self.window + 1) // self.block_size

    @staticmethod
    def cost(blocks: Iterable[Backed]) -> int:
        """Backings holding `blocks` (distinct, each held once) takes from ``num_available``."""
        return sum(1 for b in blocks if b.window_refs == 0)

    def hold(self, block: Backed) -> bool:
        """One more sequence holds `block`; True if its backing is fresh (no earlier contents: its
        first write must come before any read). Call only when ``num_available`` covers it; hold a
        batch's blocks that have backings before those that need one, so none is taken from a
        block held in the same batch."""
        block.window_refs += 1
        if block.window_refs > 1:
            return False
        if block.window_id is not None:
            del self._kept[block.window_id]
            return False
        if self._kept and (len(self._kept) >= self.reserve or not self._unowned):  # module doc
            backing, owner = self._kept.popitem(last=False)
            owner.window_id = None
            block.window_id = backing
        else:
            block.window_id = self._unowned.pop()
        return True

    def let_go(self, block: Backed) -> None:
        """A sequence no longer reads `block` in the window layers."""
        assert block.window_refs > 0, "let go of a block nobody holds in the window layers"
        block.window_refs -= 1
        if block.window_refs == 0:
            self.drop_unless_cached(block)

    def drop_unless_cached(self, block: Backed) -> None:
        """A block no sequence holds: its backing waits for a prefix hit if the block is in the
        prefix index, else goes back to the pool."""
        if block.window_refs or block.window_id is None:
            return
        if block.hash is not None or block.partial_keys:
            self._kept[block.window_id] = block
        else:
            self.forget(block)

    def forget(self, block: Backed) -> None:
        """`block`'s contents are gone (evicted, reused): its backing, if no one holds it, is free."""
        if block.window_refs or block.window_id is None:
            return
        self._kept.pop(block.window_id, None)
        self._unowned.append(block.window_id)
        block.window_id = None

    def check(self, blocks: Iterable[Backed]) -> None:
        """Assert the pool's invariants against every block of the manager."""
        owned = [b for b in blocks if b.window_id is not None]
        ids = [b.window_id for b in owned]
        assert len(set(ids)) == len(ids), "a backing lent to two blocks"
        assert len(ids) + len(self._unowned) == self.num_blocks, "backings lost or doubled"
        kept = {b.window_id for b in owned if b.window_refs == 0}
        assert kept == set(self._kept), "the kept backings disagree with the blocks no one holds"
