"""Which KV cache block belongs to which request, and which blocks hold a known prefix.

Pure Python: no torch. Blocks are fixed-size runs of ``block_size`` token
slots; token position p of a request lives in slot
``table[p // block_size] * block_size + p % block_size``.

Prefix caching (as in vLLM v1):
- a block that is full gets a chained hash: hash((hash of the block before,
  its token ids)), so equal hashes mean equal whole prefixes;
- a request's blocks are reference-counted and may be shared by several
  requests; a block whose count drops to 0 goes to the free queue but keeps its
  hash, so a later request with the same prefix can take it back (a hit);
- the free queue is the eviction order: blocks without a hash first, then
  cached blocks least recently freed first; a request's blocks are freed tail
  first, so its later blocks are evicted before the prefix others may share.

Partial last blocks (copy-on-write): a finished request's last, partly filled
block is remembered under (hash of the block before, each prefix of its computed
token ids).
A later request whose tokens continue that prefix (a beam, a chat's next turn)
starts after it: it takes the block over if nobody holds it, or else gets a
fresh block plus a pending copy of the shared one (run by the runner before
the step's forward, see ``pending_copies``), so no one ever writes into a block
another request still reads.

With a disk tier (``attach_disk``, kv_cache/disk_tier.py), full blocks also have a chained digest
key; a cached block evicted for reuse is saved to disk right then (its contents are intact until the
next forward), and a lookup goes on past the blocks in memory through those on disk, which
``allocate`` reads back into fresh blocks. The bytes move through the two functions the engine
attaches with the tier (the cache's block_bytes / load_block_bytes): no torch here.

With sliding-window layers (``window``, kv_cache/window_pool.py), those layers keep a block's data
in a backing of their own pool only while some sequence's window can read it: a sequence holds
its blocks there from allocation until its queries pass them (``commit``), a prefix hit is cut to
where the blocks its first query's window reads still have their backings, and ``window_block_ids``
is the table those layers attend with (the pool's null block for the blocks let go).

The scheduler's interface is narrow (``SCHEDULER_INTERFACE``, held by tests/kv_cache): ``lookup``
a sequence's cached prefix, ``allocate`` room (starting from that prefix), ``commit`` computed
tokens to the prefix index, ``trim`` and ``release``, the ``pending_copies`` the runner must run,
and ``borrow`` (a block table outside any request, for embeddings and full-logit scoring). Which
prompt blocks are still being computed by running sequences (so that a request with the same
prompt waits a step and hits them instead of computing them twice) is tracked here too.
"""

from __future__ import annotations

import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import cast

from tokenloom.kv_cache.disk_tier import DiskTier, chain_key
from tokenloom.kv_cache.window_pool import WindowPool

# What the scheduler may call (tests/kv_cache/test_block_manager.py checks that it calls nothing else).
SCHEDULER_INTERFACE = frozenset(
    {
        "lookup",
        "allocate",
        "grow_all",
        "block_ids",
        "commit",
        "trim",
        "release",
        "pending_copies",
        "copies_done",
        "fits",
        "capacity_tokens",
        "state_slot",
        "shift",
        "block_size",
        "window_block_ids",
        "pending_window_copies",
    }
)


def _unattached(*args):
    raise AssertionError("no disk tier is attached")


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and cached
    key: tuple | None = None  # (parent hash, token ids): guards against hash collisions
    partial_keys: list | None = None  # (parent hash, token ids) of computed prefixes of this block
    disk_key: str | None = None  # its key in the disk tier (kv_cache/disk_tier.py), with a disk tier
    window_id: int | None = None  # its backing in the window layers' pool (kv_cache/window_pool.py)
    window_refs: int = 0  # sequences (and pending copies) whose window layers read it


@dataclass(slots=True)
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    hit_tokens: int = 0  # of those, found cached
    partial_hits: int = 0  # requests that continued a remembered partial block
    copied_blocks: int = 0  # of those, the ones that had to copy it (someone else held it)
    disk_hit_tokens: int = 0  # of hit_tokens, those read back from the disk tier

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(slots=True)
class ShiftMoves:
    """What a context shift asks of the KV cache: (source, destination) blocks whose keys turn, and
    the same moves in the window layers' pool (kv_cache/window_pool.py) for the blocks held there."""

    pairs: list[tuple[int, int]]
    window_pairs: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class PrefixHit:
    """What ``lookup`` found for a sequence: the cached full blocks it starts from, then a remembered
    partial block and how many of its slots match. ``num_tokens`` of its tokens need no computing;
    ``waits`` says its next prompt block is being computed by another sequence right now."""

    blocks: list[Block] = field(default_factory=list)
    partial: tuple[Block, int] | None = None
    num_tokens: int = 0
    num_queried: int = 0  # tokens looked up (the prefix-cache hit rate's denominator)
    prompt_hashes: list[int] = field(default_factory=list)  # the full prompt blocks' hashes (caching on)
    waits: bool = False
    # after the blocks in memory, those on disk: (disk key, hash, (parent hash, token ids)) each
    on_disk: list[tuple[str, int, tuple]] = field(default_factory=list)


class BlockManager:
    """Block tables, reference counts, the prefix-cache index and the LRU free queue."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        state_slots: int = 0,
        window: WindowPool | None = None,
    ) -> None:
        """`window`: the sliding-window layers' pool, for a model whose window layers keep only the
        blocks their window reads (None: every layer keeps every block)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # front: evict first
        self._cached: dict[int, Block] = {}  # hash -> block
        self._tables: dict[str, list[Block]] = {}
        # per request: the chained hashes of its full blocks (the scheduler's prompt look-ahead may
        # run past what is cached), and how many of its table's blocks are in the prefix index
        self._hashes: dict[str, list[int]] = {}
        # per request whose blocks must not meet others' (a LoRA adapter's): the root its hash chain
        # starts from instead of None
        self._roots: dict[str, int] = {}
        self._registered: dict[str, int] = {}
        self._cacheable: dict[str, int] = {}  # after a context shift: blocks of the sequence that may be indexed
        self._partial: dict[tuple, Block] = {}  # (parent hash, token ids) -> block starting so
        self._copies: list[tuple[Block, Block]] = []  # (shared source, private copy) not yet run
        # prompt blocks that running sequences have yet to compute: per sequence its prompt hashes and
        # how many are computed; every uncomputed hash counted once per sequence computing it
        self._computing: dict[str, tuple[list[int], int]] = {}
        self._in_flight: Counter[int] = Counter()
        self.stats = PrefixCacheStats()
        self.state_slots = state_slots
        self._free_slots = list(range(state_slots - 1, -1, -1))  # popped from the end: lowest first
        self._slot_of: dict[str, int] = {}
        self.disk: DiskTier | None = None
        self._disk_keys: dict[str, list[str]] = {}  # per request: its full blocks' disk keys
        self._block_bytes: Callable[[int], bytes] = _unattached
        self._load_block: Callable[[int, bytes], None] = _unattached
        self.window = window
        self._window_held: dict[str, list[bool]] = {}  # per request, per table entry: held in the window pool
        self._window_lo: dict[str, int] = {}  # per request: its entries before this one are let go (sinks aside)

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def window_block_ids(self, request_id: str) -> list[int] | None:
        """The block table the window layers attend with: each block's backing where the sequence
        holds it, else the pool's null block (its window no longer reads it); None without a pool."""
        if self.window is None:
            return None
        null, table = self.window.null, self._tables.get(request_id, ())
        held = self._window_held.get(request_id, ())
        return [cast("int", b.window_id) if h else null for b, h in zip(table, held)]

    def _pool(self) -> WindowPool:
        assert self.window is not None, "a table entry held in the window pool without a pool"
        return self.window

    def state_slot(self, request_id: str) -> int:
        """The sequence's recurrent-state slot; -1 without one (no state slots, or no blocks yet)."""
        return self._slot_of.get(request_id, -1)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole cache holds."""
        return self.num_blocks * self.block_size

    def fits(self, num_tokens: int) -> bool:
        """Whether one sequence of `num_tokens` fits in the whole cache (when nothing else holds it)."""
        return self.blocks_needed(num_tokens) <= self.num_blocks

    # ---- the scheduler's interface -------------------------------------------------------
    def lookup(
        self,
        seq_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        use_cache: bool = True,
        root: int | None = None,
    ) -> PrefixHit:
        """Where `seq_id` (not yet allocated) may start: its longest cached prefix of `token_ids`
        (none when `use_cache` is False: a scoring request needs logits at every position), and
        whether its next prompt block is in flight. `root` (a LoRA adapter's) starts the sequence's
        hash chain, so it shares blocks only with sequences of the same root. Changes nothing but
        hashing memos."""
        if root is not None:
            self._roots[seq_id] = root
        if not self.enable_prefix_caching:
            return PrefixHit(num_queried=len(token_ids))
        hits = self.find_cached_prefix(token_ids, root) if use_cache else []
        on_disk = self.find_on_disk(seq_id, token_ids, hits) if use_cache and root is None else []
        partial = self.find_cached_partial(token_ids, hits, root) if use_cache and not on_disk else None
        if self.window is not None:
            hits, partial = self._window_cut(hits, partial)
        prompt = self.request_hashes(seq_id, token_ids)[: num_prompt_tokens // self.block_size]
        first = len(hits) + len(on_disk)  # the first block to compute
        waits = use_cache and first < len(prompt) and self._in_flight[prompt[first]] > 0
        computed = first * self.block_size + (partial[1] if partial else 0)
        return PrefixHit(hits, partial, computed, len(token_ids), prompt, waits, on_disk)

    def allocate(self, seq_id: str, num_tokens: int, hit: PrefixHit | None = None) -> list[int] | None:
        """Grow `seq_id`'s block table to hold `num_tokens` tokens (a new sequence starting from
        `hit`, its lookup): the table's block ids, or None (nothing changed) if blocks are short.
        A new sequence with a lookup counts toward the hit rate, and its uncomputed prompt blocks
        are in flight until ``commit`` passes them or ``release``."""
        hit = hit or PrefixHit()
        new = not self._tables.get(seq_id)
        if not self._allocate(seq_id, num_tokens, hit.blocks, hit.partial, hit.on_disk):
            return None
        if hit.on_disk:  # what was read back (a damaged or vanished file ends it): the hit
            hit.num_tokens = self._registered[seq_id] * self.block_size
        if new and hit.num_queried:
            self.record_lookup(hit.num_queried, hit.num_tokens)
            first = self._registered.get(seq_id, 0)  # cached in memory, then read back from disk
            if first < len(hit.prompt_hashes):
                self._computing[seq_id] = (hit.prompt_hashes, first)
                self._in_flight.update(hit.prompt_hashes[first:])
        return self.block_ids(seq_id)

    def attach_disk(
        self, disk: DiskTier, block_bytes: Callable[[int], bytes], load_block: Callable[[int, bytes], None]
    ) -> None:
        """Give the prefix cache a disk tier; `block_bytes(block)` reads a block's keys and values from
        the KV cache as bytes, `load_block(block, payload)` writes them back (PagedKVCache's)."""
        if not self.enable_prefix_caching:
            raise ValueError(
                "the prefix cache's disk tier needs prefix caching, which is off here (a hybrid model keeps none)"
            )
        if self.window is not None:
            raise ValueError("the prefix cache's disk tier is not implemented for window layers with their own pool")
        self.disk, self._block_bytes, self._load_block = disk, block_bytes, load_block

    def save_to_disk(self) -> int:
        """Save every cached block the disk tier does not hold yet (at shutdown); how many."""
        if self.disk is None:
            return 0
        saved = 0
        for b in self.blocks:
            if b.hash is not None and b.disk_key is not None and not self.disk.contains(b.disk_key):
                self.disk.put(b.disk_key, self._block_bytes(b.block_id))
                saved += 1
        return saved

    def grow_all(self, wants: dict[str, int]) -> dict[str, list[int]] | None:
        """Grow several sequences at once, each to its token count, or none of them (None) if the
        free blocks cannot hold all: their new block tables."""
        more = sum(self.blocks_needed(n) - len(self._tables.get(seq_id, ())) for seq_id, n in wants.items())
        if more > self.num_free_blocks or (self.window is not None and more > self.window.num_available):
            return None
        # counted above: each allocation fits
        return {seq_id: cast("list[int]", self.allocate(seq_id, n)) for seq_id, n in wants.items()}

    def commit(self, seq_id: str, token_ids: list[int], num_computed_tokens: int, keep_tokens: int = 0) -> None:
        """`num_computed_tokens` of the sequence's `token_ids` have KV now: index its newly full blocks
        for prefix hits, and mark its prompt blocks up to there computed. With a window pool, let go
        of the blocks its next query's window no longer reads, but for the blocks of its first
        `keep_tokens` (what a context shift keeps, and so may read again)."""
        self.cache_full_blocks(seq_id, token_ids, num_computed_tokens)
        self._advance_computing(seq_id, num_computed_tokens // self.block_size)
        if self.window is not None:
            self._slide(seq_id, num_computed_tokens, self.blocks_needed(keep_tokens))

    def _slide(self, seq_id: str, position: int, keep_blocks: int) -> None:
        """Let go in the window pool of the sequence's blocks after its first `keep_blocks` that a
        query at `position` does not read."""
        assert self.window is not None
        held, table = self._window_held.get(seq_id, []), self._tables.get(seq_id, [])
        lo, first = self._window_lo.get(seq_id, 0), min(self.window.first_visible(position), len(held))
        for i in range(max(lo, keep_blocks), first):
            if held[i]:
                held[i] = False
                self.window.let_go(table[i])
        self._window_lo[seq_id] = max(lo, first)

    def release(self, seq_id: str, token_ids: list[int] | None = None, num_computed_tokens: int = 0) -> None:
        """Drop the sequence's blocks. Given its `token_ids` (a request that ended normally), first
        index the full blocks of its computed tokens and remember its last partial block, so a
        later request may start from them."""
        if token_ids is not None and self._tables.get(seq_id):
            self.cache_full_blocks(seq_id, token_ids, num_computed_tokens)
            self.remember_partial(seq_id, token_ids, num_computed_tokens)
        self._advance_computing(seq_id, None)
        self.free(seq_id)

    def _advance_computing(self, seq_id: str, num_full_computed: int | None) -> None:
        """The sequence's prompt blocks below `num_full_computed` are computed (None: it left)."""
        if seq_id not in self._computing:
            return
        hashes, first = self._computing[seq_id]
        upto = len(hashes) if num_full_computed is None else min(num_full_computed, len(hashes))
        if upto <= first:
            return
        for h in hashes[first:upto]:
            self._in_flight[h] -= 1
            if not self._in_flight[h]:
                del self._in_flight[h]
        if upto == len(hashes):
            del self._computing[seq_id]
        else:
            self._computing[seq_id] = (hashes, upto)

    @contextmanager
    def borrow(self, num_tokens: int) -> Iterator[tuple[list[int], int, list[int] | None]]:
        """(block table, recurrent-state slot or -1, the window layers' table or None) for one
        sequence of `num_tokens` outside any request (embeddings, full-logit scoring), freed when the
        block ends; RuntimeError if the free blocks (or state slots, or window-layer blocks) cannot
        hold it now."""
        seq_id = f"borrowed-{uuid.uuid4().hex}"
        block_ids = self.allocate(seq_id, num_tokens)
        if block_ids is None:
            slots = " (or no recurrent-state slot is free)" if self.state_slots else ""
            raise RuntimeError(
                f"the KV cache has no room for {num_tokens} tokens now{slots}; retry when fewer requests run"
            )
        try:
            yield block_ids, self.state_slot(seq_id), self.window_block_ids(seq_id)
        finally:
            self.free(seq_id)

    def shift(self, seq_id: str, keep_blocks: int, drop_blocks: int) -> ShiftMoves | None:
        """Context shift (engine/context_shift.py): drop the sequence's `drop_blocks` blocks after
        its first `keep_blocks`; the blocks after them move up in its table. Returns one (source,
        destination) pair per moved block, whose keys the runner turns back
        (``PagedKVCache.shift_keys``): in place where the sequence alone holds the block, into a
        fresh block where another sequence holds it too; with a window pool, the same for the moved
        blocks the sequence holds there. None (nothing changed) if the free blocks (or backings)
        cannot hold those copies.

        The moved blocks' keys and values belong to a history no prompt has: they leave the prefix
        index, and none of the sequence's blocks past the kept ones enter it until it is freed.
        """
        table, end = self._tables[seq_id], keep_blocks + drop_blocks
        held = self._window_held.get(seq_id, [False] * len(table))
        dropped, moved = table[keep_blocks:end], table[end:]
        shared = [b for b in moved if b.ref_count > 1]
        if len(shared) > len(self._free) + sum(1 for b in dropped if b.ref_count == 1):
            return None
        if self.window is not None and sum(held[end:][i] for i, b in enumerate(moved) if b.ref_count > 1) > (
            self.window.num_available
        ):
            return None
        for i in reversed(range(keep_blocks, end)):
            if held[i]:
                self._pool().let_go(table[i])
            self._release(table[i])
        moves, kept = ShiftMoves([]), table[:keep_blocks]
        for block, h in zip(moved, held[end:]):
            target, source_backing = block, block.window_id
            if block.ref_count > 1:
                target = self._take_free()
                if h:
                    self._pool().hold(target)
                    self._pool().let_go(block)  # read by the runner before any write
                self._release(block)  # the runner reads it before this step writes any block
            else:
                self._evict(block)  # its contents change: not a cached prefix any more
            moves.pairs.append((block.block_id, target.block_id))
            if h:
                moves.window_pairs.append((cast("int", source_backing), cast("int", target.window_id)))
            kept.append(target)
        self._tables[seq_id] = kept
        if self.window is not None:
            self._window_held[seq_id] = held[:keep_blocks] + held[end:]
            self._window_lo[seq_id] = max(keep_blocks, self._window_lo.get(seq_id, 0) - drop_blocks)
        self._hashes[seq_id] = self._hashes.get(seq_id, [])[:keep_blocks]
        self._disk_keys[seq_id] = self._disk_keys.get(seq_id, [])[:keep_blocks]
        self._registered[seq_id] = min(self._registered.get(seq_id, 0), keep_blocks)
        self._cacheable[seq_id] = keep_blocks
        self._advance_computing(seq_id, None)
        return moves

    # ---- the parts (the interface above, and unit tests, use them) ------------------------

    # ---- prefix cache --------------------------------------------------------------------
    def _chain(self, token_ids: list[int], start_hashes: list[int], num_full: int, root: int | None) -> list[int]:
        """Hashes of the first `num_full` blocks, extending `start_hashes` (the first block's parent: `root`)."""
        hashes = list(start_hashes)
        bs = self.block_size
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else root
            hashes.append(hash((parent, tuple(token_ids[i * bs : (i + 1) * bs]))))
        return hashes

    def request_hashes(self, request_id: str, token_ids: list[int]) -> list[int]:
        """The chained hashes of every full block of `token_ids`, a request's tokens, kept with the
        request's other block state (computed once, extended as blocks fill; dropped by free)."""
        known = self._hashes.get(request_id, [])
        if len(known) < len(token_ids) // self.block_size:
            root = self._roots.get(request_id)
            known = self._hashes[request_id] = self._chain(token_ids, known, len(token_ids) // self.block_size, root)
        return known

    def find_cached_prefix(self, token_ids: list[int], root: int | None = None) -> list[Block]:
        """The cached blocks holding the longest prefix of `token_ids` (not yet referenced).

        At most ``len(token_ids) - 1`` tokens are matched: the last token must be
        computed to produce the next token's logits.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[Block] = []
        parent = root
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            block = self._cached.get(hash((parent, tokens)))
            if block is None or block.key != (parent, tokens):
                break
            hits.append(block)
            parent = block.hash
        return hits

    def find_cached_partial(
        self, token_ids: list[int], hits: list[Block], root: int | None = None
    ) -> tuple[Block, int] | None:
        """A remembered partial block continuing `hits` with the most of `token_ids`' next tokens,
        and how many (< block_size, leaving the last token to compute); None if there is none."""
        if not self.enable_prefix_caching:
            return None
        start = len(hits) * self.block_size
        parent = hits[-1].hash if hits else root
        for j in range(min(self.block_size - 1, len(token_ids) - 1 - start), 0, -1):
            block = self._partial.get((parent, tuple(token_ids[start : start + j])))
            if block is not None:
                return block, j
        return None

    def _window_cut(
        self, hits: list[Block], partial: tuple[Block, int] | None
    ) -> tuple[list[Block], tuple[Block, int] | None]:
        """The longest start of a prefix hit (its full blocks, then the partial one) whose blocks the
        window of its first query to compute still has backings for (the window layers' keys and
        values of the rest are gone)."""
        assert self.window is not None
        while hits or partial:
            start = len(hits) * self.block_size + (partial[1] if partial else 0)
            read = hits + [partial[0]] if partial else hits
            if all(b.window_id is not None for b in read[self.window.first_visible(start) :]):
                break
            if partial is not None:
                partial = None
            else:
                hits = hits[:-1]
        return hits, partial

    def find_on_disk(self, request_id: str, token_ids: list[int], hits: list[Block]) -> list[tuple[str, int, tuple]]:
        """The blocks after the memory `hits` whose keys the disk tier holds, in order: (key, hash,
        (parent hash, token ids)) each. At most ``len(token_ids) - 1`` tokens, as in memory."""
        parent = (hits[-1].disk_key if hits else self.disk.space) if self.disk is not None else None
        if self.disk is None or parent is None:
            return []
        bs, found = self.block_size, []
        hashes = self.request_hashes(request_id, token_ids)
        for i in range(len(hits), (len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = chain_key(parent, tokens)
            if not self.disk.contains(key):
                break
            found.append((key, hashes[i], (hashes[i - 1] if i else None, tokens)))
            parent = key
        return found

    def _disk_chain(self, request_id: str, token_ids: list[int], num_full: int) -> list[str]:
        """The disk keys of the request's first `num_full` blocks (memoized like its hashes)."""
        assert self.disk is not None
        keys = self._disk_keys.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(keys), num_full):
            keys.append(chain_key(keys[-1] if keys else self.disk.space, token_ids[i * bs : (i + 1) * bs]))
        return keys

    def remember_partial(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Index the request's partly filled last block by every prefix of its computed tokens
        (call once its full blocks are cached, before freeing it)."""
        table, hashes = self._tables.get(request_id, []), self._hashes.get(request_id, [])
        full, j = divmod(num_computed_tokens, self.block_size)
        if not self.enable_prefix_caching or not j or full >= len(table) or full != self._registered.get(request_id, 0):
            return
        root = self._roots.get(request_id)
        block, parent, start = table[full], hashes[full - 1] if full else root, full * self.block_size
        if block.hash is not None:
            return
        for length in range(1, j + 1):
            key = (parent, tuple(token_ids[start : start + length]))
            if key not in self._partial:
                self._partial[key] = block
                block.partial_keys = (block.partial_keys or []) + [key]

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.stats.queried_tokens += num_prompt_tokens
        self.stats.hit_tokens += num_hit_tokens

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register the request's blocks that are now full of computed tokens in the prefix index."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(table), self._cacheable.get(request_id, len(table)))
        root = self._roots.get(request_id)
        hashes = self._hashes[request_id] = self._chain(token_ids, self._hashes.get(request_id, []), num_full, root)
        bs = self.block_size
        on_disk = self.disk is not None and root is None  # an adapter's blocks stay in memory
        disk_keys = self._disk_chain(request_id, token_ids, num_full) if on_disk else None
        for i in range(self._registered.get(request_id, 0), num_full):
            block = table[i]
            if block.hash is None:
                block.hash = hashes[i]
                block.key = (hashes[i - 1] if i else root, tuple(token_ids[i * bs : (i + 1) * bs]))
                block.disk_key = disk_keys[i] if disk_keys is not None else None
                self._cached.setdefault(block.hash, block)  # an equal block already cached stays the index entry
        self._registered[request_id] = max(num_full, self._registered.get(request_id, 0))

    # ---- allocation ----------------------------------------------------------------------
    def can_allocate(
        self,
        request_id: str,
        num_tokens: int,
        cached_prefix: Sequence[Block] = (),
        partial: tuple[Block, int] | None = None,
    ) -> bool:
        have = len(self._tables.get(request_id, ())) or len(cached_prefix)
        if self.state_slots and request_id not in self._slot_of and not self._free_slots:
            return False  # a new sequence of a hybrid model needs a state slot too
        reclaimable = sum(1 for b in cached_prefix if b.ref_count == 0)  # hits sitting in the free queue
        if partial is not None and self._must_copy(partial[0]) and partial[0].ref_count == 0:
            reclaimable += 1  # the copy's source, pinned
        if self.window is not None and self._window_cost(request_id, num_tokens, cached_prefix, partial) > (
            self.window.num_available
        ):
            return False
        return self.blocks_needed(num_tokens) - have <= len(self._free) - reclaimable

    def _window_cost(
        self, request_id: str, num_tokens: int, cached_prefix: Sequence[Block], partial: tuple[Block, int] | None
    ) -> int:
        """The backings growing the request's table to `num_tokens` tokens takes from the window pool."""
        assert self.window is not None
        table = self._tables.get(request_id)
        if table:
            return max(0, self.blocks_needed(num_tokens) - len(table))
        start = len(cached_prefix) * self.block_size + (partial[1] if partial else 0)
        prefix = list(cached_prefix)[self.window.first_visible(start) :]
        cost = WindowPool.cost(prefix) + self.blocks_needed(num_tokens) - len(cached_prefix)
        if partial is not None and self._must_copy(partial[0]):
            cost += partial[0].window_refs == 0  # the copy's source, held until copied
        return cost

    def _allocate(
        self,
        request_id: str,
        num_tokens: int,
        cached_prefix: Sequence[Block] = (),
        partial: tuple[Block, int] | None = None,
        on_disk: Sequence[tuple[str, int, tuple]] = (),
    ) -> bool:
        """Grow the request's table to hold `num_tokens` tokens, starting from `cached_prefix`
        and then the `partial` block (from find_cached_partial) if it has no table yet.
        Returns False (and changes nothing) if blocks are short."""
        if not self.can_allocate(request_id, num_tokens, cached_prefix, partial):
            return False
        table = self._tables.setdefault(request_id, [])
        if self.state_slots and request_id not in self._slot_of:
            self._slot_of[request_id] = self._free_slots.pop()
        start = len(cached_prefix) * self.block_size + (partial[1] if partial else 0)  # a new table's first
        if not table:
            for block in cached_prefix:
                self._take(block)
                table.append(block)
            if len(self._hashes.get(request_id, ())) < len(cached_prefix):
                self._hashes[request_id] = cast("list[int]", [b.hash for b in cached_prefix])  # cached: all hashed
            self._registered[request_id] = len(cached_prefix)
            if partial is not None:
                table.append(self._continue_partial(*partial))
            elif on_disk:
                self._read_back(request_id, table, on_disk)
        while len(table) < self.blocks_needed(num_tokens):
            table.append(self._take_free())
        if self.window is not None:
            self._hold_window(request_id, table, start)
        return True

    def _hold_window(self, request_id: str, table: list[Block], start: int) -> None:
        """Hold the table's new entries in the window pool: of a new table, those the window of its
        first query (at position `start`) reads and every block after; of a grown one, the new
        blocks. Blocks with backings are held before those needing one (module window_pool)."""
        assert self.window is not None
        held = self._window_held.setdefault(request_id, [])
        grown = bool(held)
        first = len(held) if grown else self.window.first_visible(start)
        if not grown:
            self._window_lo[request_id] = first
        held.extend(i >= first for i in range(len(held), len(table)))
        new = [table[i] for i in range(first, len(table)) if held[i]]
        for block in sorted(new, key=lambda b: b.window_id is None):  # stable: backed ones first
            self.window.hold(block)

    def _read_back(self, request_id: str, table: list[Block], on_disk: Sequence[tuple[str, int, tuple]]) -> None:
        """Fresh blocks for the disk hits, in order, each written into the KV cache now and indexed as
        a cached block; a file that cannot be read (gone, damaged) ends the run there."""
        assert self.disk is not None
        for key, block_hash, block_key in on_disk:
            payload = self.disk.get(key)
            if payload is None:
                break
            block = self._take_free()
            block.hash, block.key, block.disk_key = block_hash, block_key, key
            self._cached.setdefault(block_hash, block)
            self._load_block(block.block_id, payload)
            table.append(block)
            self.stats.disk_hit_tokens += self.block_size
        self._registered[request_id] = len(table)
        self._disk_keys[request_id] = [cast("str", b.disk_key) for b in table]

    def _take_free(self) -> Block:
        block = self.blocks[next(iter(self._free))]
        key = block.disk_key if block.hash is not None else None
        if self.disk is not None and key is not None and not self.disk.contains(key):
            self.disk.put(key, self._block_bytes(block.block_id))  # before the next forward overwrites it
        self._evict(block)
        self._take(block)
        return block

    @staticmethod
    def _must_copy(block: Block) -> bool:
        """Someone else reads this block (or it is a full cached one): write into a copy."""
        return block.ref_count > 0 or block.hash is not None

    def _continue_partial(self, block: Block, num_tokens: int) -> Block:
        """The block a request continuing `block`'s first `num_tokens` slots writes into:
        `block` itself if nobody holds it (its longer prefixes are forgotten, since their
        slots will be overwritten), else a fresh block with a copy pending (source pinned)."""
        self.stats.partial_hits += 1
        if not self._must_copy(block):
            self._take(block)
            assert block.partial_keys is not None  # a partial hit is indexed by its keys
            for key in [k for k in block.partial_keys if len(k[1]) > num_tokens]:
                block.partial_keys.remove(key)
                del self._partial[key]
            return block
        self._take(block)  # pinned until the copy has run
        if self.window is not None:
            self.window.hold(block)  # its window layers' data too
        copy = self._take_free()
        self._copies.append((block, copy))
        self.stats.copied_blocks += 1
        return copy

    def pending_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies the runner must run before the next forward."""
        return [(src.block_id, dst.block_id) for src, dst in self._copies]

    def pending_window_copies(self) -> list[tuple[int, int]]:
        """The same copies in the window layers' pool (backing ids); [] without a pool."""
        if self.window is None:
            return []
        return [(cast("int", src.window_id), cast("int", dst.window_id)) for src, dst in self._copies]

    def copies_done(self) -> None:
        """The runner has copied: unpin the sources."""
        for src, _ in self._copies:
            if self.window is not None:
                self.window.let_go(src)
            self._release(src)
        self._copies.clear()

    def _take(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def _evict(self, block: Block) -> None:
        """Forget a free block's cached contents before reusing it."""
        if block.hash is not None and self._cached.get(block.hash) is block:
            del self._cached[block.hash]
        for key in block.partial_keys or ():
            del self._partial[key]
        block.hash = block.key = block.partial_keys = block.disk_key = None
        if self.window is not None:
            self.window.forget(block)  # unless a sequence holds it there

    def free(self, request_id: str) -> None:
        """Drop the request's references (tail first); blocks no one holds become free."""
        table, held = self._tables.pop(request_id, []), self._window_held.pop(request_id, [])
        for block, h in zip(table, held):
            if h:
                self._pool().let_go(block)
        for block in reversed(table):
            self._release(block)
        self._window_lo.pop(request_id, None)
        if request_id in self._slot_of:
            self._free_slots.append(self._slot_of.pop(request_id))
        self._hashes.pop(request_id, None)
        self._roots.pop(request_id, None)
        self._registered.pop(request_id, None)
        self._cacheable.pop(request_id, None)
        self._disk_keys.pop(request_id, None)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the request's tail blocks beyond what `num_tokens` tokens need
        (e.g. the room taken for speculative tokens that were rejected)."""
        table = self._tables.get(request_id)
        if not table:
            return
        keep = max(self.blocks_needed(num_tokens), self._registered.get(request_id, 0))
        held = self._window_held.get(request_id)
        while len(table) > keep:
            block = table.pop()
            if held and held.pop():
                self._pool().let_go(block)
            self._release(block)

    def _release(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block.block_id] = None
            if block.hash is None and not block.partial_keys:  # nothing worth keeping: reuse it first
                self._free.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents)."""
        for block in self.blocks:
            if block.ref_count == 0:
                self._evict(block)

    # ---- invariants ----------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert every invariant: ref counts match the tables, free + used = total,
        free blocks are exactly those nobody holds, and the index points at matching blocks."""
        holders: dict[int, int] = {}
        for src, _ in self._copies:  # pinned copy sources
            holders[src.block_id] = holders.get(src.block_id, 0) + 1
        for rid, table in self._tables.items():
            ids = [b.block_id for b in table]
            assert len(set(ids)) == len(ids), f"request {rid} holds a block twice: {ids}"
            for i in ids:
                holders[i] = holders.get(i, 0) + 1
        for block in self.blocks:
            assert block.ref_count == holders.get(block.block_id, 0), (
                f"block {block.block_id}: ref_count {block.ref_count} != {holders.get(block.block_id, 0)} holders"
            )
            assert (block.ref_count == 0) == (block.block_id in self._free), (
                f"block {block.block_id}: free-queue membership disagrees with ref_count {block.ref_count}"
            )
        assert len(self._free) + len(holders) == self.num_blocks, "free + used != total"
        assert set(self._slot_of) <= set(self._tables), "a state slot is held by a sequence without blocks"
        held = list(self._slot_of.values())
        assert sorted(held + self._free_slots) == list(range(self.state_slots)), "state slots lost or doubled"
        expected: Counter[int] = Counter()
        for seq_id, (hashes, first) in self._computing.items():
            assert seq_id in self._tables, f"sequence {seq_id} computes prompt blocks without a table"
            expected.update(hashes[first:])
        assert +self._in_flight == expected, "the in-flight prompt blocks disagree with the sequences computing them"
        for h, block in self._cached.items():
            assert block.hash == h and block.key is not None, f"index entry {h} points at a block without it"
        for key, block in self._partial.items():
            assert key in (block.partial_keys or ()), f"partial entry {key} points at a block without it"
        if self.window is not None:
            self._check_window()

    def _check_window(self) -> None:
        """The window pool's holds match the tables' held entries and pinned copy sources."""
        assert self.window is not None
        holds: Counter[int] = Counter(src.block_id for src, _ in self._copies)
        for rid, held in self._window_held.items():
            table = self._tables.get(rid, [])
            assert len(held) == len(table), f"request {rid}: {len(held)} window flags for {len(table)} blocks"
            holds.update(b.block_id for b, h in zip(table, held) if h)
        for block in self.blocks:
            assert block.window_refs == holds[block.block_id], f"block {block.block_id}: window holds disagree"
            assert not block.window_refs or block.window_id is not None, f"block {block.block_id}: held, no backing"
        self.window.check(self.blocks)
