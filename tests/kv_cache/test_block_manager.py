"""Block manager: exact block ids, ref counts, prefix hits and eviction order."""

from __future__ import annotations

import pytest

from tokenloom.kv_cache.block_manager import BlockManager, PrefixHit

BS = 4


@pytest.fixture
def bm():
    m = BlockManager(num_blocks=8, block_size=BS)
    yield m
    m.check_integrity()


def toks(n, start=0):
    return list(range(start, start + n))


def test_allocate_takes_blocks_in_order_and_grows(bm):
    assert bm.allocate("a", 5)  # 5 tokens -> 2 blocks
    assert bm.block_ids("a") == [0, 1]
    assert bm.allocate("a", 8)  # still 2 blocks
    assert bm.block_ids("a") == [0, 1]
    assert bm.allocate("a", 9)
    assert bm.block_ids("a") == [0, 1, 2]
    assert [bm.ref_count(i) for i in range(4)] == [1, 1, 1, 0]
    assert bm.num_free_blocks == 5
    bm.check_integrity()


def test_allocation_fails_without_side_effects(bm):
    assert bm.allocate("a", 28)  # 7 blocks
    assert not bm.allocate("b", 8)  # needs 2, 1 free
    assert bm.block_ids("b") == [] and bm.num_free_blocks == 1
    bm.check_integrity()


def test_prefix_hit_shares_full_blocks_and_counts_refs(bm):
    prompt = toks(10)  # blocks [0..3] [4..7] full, [8, 9] partial
    bm.allocate("a", 10)
    bm.cache_full_blocks("a", prompt, 10)
    hits = bm.find_cached_prefix(prompt + [99])
    assert [b.block_id for b in hits] == [0, 1]
    assert bm.allocate("b", 11, PrefixHit(hits))
    assert bm.block_ids("b") == [0, 1, 3]
    assert [bm.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    bm.check_integrity()


def test_hit_leaves_the_last_token_to_compute(bm):
    prompt = toks(8)  # exactly two full blocks
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", prompt, 8)
    assert [b.block_id for b in bm.find_cached_prefix(prompt)] == [0]  # not both: one token must run


def test_a_different_earlier_block_breaks_the_chain(bm):
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", toks(8), 8)
    other = [100, 101, 102, 103] + toks(4, 4)  # same second block, different first block
    assert bm.find_cached_prefix(other + [7]) == []


def test_freed_cached_blocks_are_hits_until_evicted_lru(bm):
    a, b = toks(8), toks(8, 50)
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", a, 8)  # blocks 0, 1
    bm.allocate("b", 8)
    bm.cache_full_blocks("b", b, 8)  # blocks 2, 3
    bm.free("a")  # freed tail first: 1 then 0
    bm.free("b")  # 3 then 2
    bm.check_integrity()
    assert [x.block_id for x in bm.find_cached_prefix(a + [1])] == [0, 1]
    # 4 never-cached blocks are reused before any cached one; then LRU: 1, 0, 3, 2.
    assert bm.allocate("c", 4 * BS)
    assert bm.block_ids("c") == [4, 5, 6, 7]
    assert bm.allocate("c", 5 * BS)
    assert bm.block_ids("c")[-1] == 1  # a's tail block evicted first
    assert [x.block_id for x in bm.find_cached_prefix(a + [1])] == [0]
    assert bm.allocate("c", 7 * BS)
    assert bm.block_ids("c")[-2:] == [0, 3]
    assert bm.find_cached_prefix(a + [1]) == []
    assert [x.block_id for x in bm.find_cached_prefix(b + [1])] == [2]  # b's first block is the last one left
    assert bm.num_free_blocks == 1
    bm.check_integrity()


def test_hit_on_a_free_block_takes_it_out_of_the_free_queue(bm):
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", toks(8), 8)
    bm.free("a")
    assert bm.num_free_blocks == 8
    hits = bm.find_cached_prefix(toks(9))
    assert bm.allocate("b", 9, PrefixHit(hits))
    assert bm.block_ids("b")[:2] == [0, 1] and bm.num_free_blocks == 5
    bm.check_integrity()


def test_can_allocate_does_not_count_reclaimed_hits_as_free():
    bm = BlockManager(num_blocks=3, block_size=BS)
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", toks(8), 8)
    bm.free("a")  # 3 free, 2 of them the cached prefix
    hits = bm.find_cached_prefix(toks(13))
    assert len(hits) == 2
    assert bm.can_allocate("b", 12, hits)  # 3 blocks: 2 hits + 1 fresh
    assert not bm.can_allocate("b", 13, hits)  # 4 blocks: only 1 fresh left
    bm.check_integrity()


def test_duplicate_content_keeps_one_index_entry(bm):
    bm.allocate("a", 5)
    bm.allocate("b", 5)
    bm.cache_full_blocks("a", toks(5), 5)
    bm.cache_full_blocks("b", toks(5), 5)  # same first block computed twice (no hit at admission)
    assert [x.block_id for x in bm.find_cached_prefix(toks(6))] == [0]
    bm.free("a")
    bm.free("b")
    bm.check_integrity()


def test_check_integrity_catches_a_corrupted_ref_count(bm):
    bm.allocate("a", 4)
    bm.blocks[0].ref_count = 2
    with pytest.raises(AssertionError, match="ref_count 2 != 1 holders"):
        bm.check_integrity()
    bm.blocks[0].ref_count = 1


def test_prefix_caching_can_be_disabled():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", toks(8), 8)
    assert bm.find_cached_prefix(toks(9)) == []


def finished(bm, rid, tokens):
    """A request that computed all of `tokens` and ended (as the scheduler's finish does)."""
    assert bm.allocate(rid, len(tokens))
    bm.cache_full_blocks(rid, tokens, len(tokens))
    bm.remember_partial(rid, tokens, len(tokens))
    bm.free(rid)


def test_a_finished_requests_partial_block_is_taken_over_without_a_copy(bm):
    finished(bm, "a", toks(6))  # blocks 0 (full) + 1 (2 of 4 slots)
    want = toks(6) + [99]
    hits = bm.find_cached_prefix(want)
    partial = bm.find_cached_partial(want, hits)
    assert [b.block_id for b in hits] == [0] and partial[0].block_id == 1 and partial[1] == 2
    assert bm.allocate("b", 7, PrefixHit(hits, partial))
    assert bm.block_ids("b") == [0, 1] and bm.pending_copies() == []
    assert bm.stats.partial_hits == 1 and bm.stats.copied_blocks == 0


def test_a_partial_block_someone_holds_is_copied_before_anyone_writes(bm):
    finished(bm, "a", toks(6))
    first, second = toks(6) + [99], toks(6) + [77]
    for rid, tokens in (("b", first), ("c", second)):
        hits = bm.find_cached_prefix(tokens)
        assert bm.allocate(rid, 7, PrefixHit(hits, bm.find_cached_partial(tokens, hits)))
    assert bm.block_ids("b") == [0, 1]
    copy = bm.block_ids("c")[1]
    assert bm.block_ids("c")[0] == 0 and copy not in (0, 1)
    assert bm.pending_copies() == [(1, copy)]
    assert bm.ref_count(1) == 2  # b, and the pending copy's pin
    bm.check_integrity()
    bm.copies_done()
    assert bm.ref_count(1) == 1 and bm.pending_copies() == []
    assert bm.stats.copied_blocks == 1


def test_taking_a_partial_block_over_forgets_its_longer_prefixes(bm):
    finished(bm, "a", toks(7))  # block 1 remembers 3 tokens: 4, 5, 6
    diverging = toks(5) + [50, 51]  # shares only token 4 of block 1
    hits = bm.find_cached_prefix(diverging)
    partial = bm.find_cached_partial(diverging, hits)
    assert partial[1] == 1
    assert bm.allocate("b", 7, PrefixHit(hits, partial))  # b overwrites slots 1, 2 of block 1
    again = toks(7) + [9]
    assert bm.find_cached_partial(again, bm.find_cached_prefix(again))[1] == 1  # not 3 any more


def test_evicting_a_partial_block_forgets_it(bm):
    finished(bm, "a", toks(6))
    assert bm.allocate("z", 8 * BS)  # takes every block, block 1 included
    want = toks(6) + [99]
    assert bm.find_cached_partial(want, []) is None
    bm.free("z")


def test_a_partial_block_with_the_next_token_only_is_not_a_hit(bm):
    finished(bm, "a", toks(6))
    assert bm.find_cached_partial(toks(6), bm.find_cached_prefix(toks(6)))[1] == 1  # last token left to compute


def test_the_scheduler_calls_only_the_narrow_interface():
    """Everything the scheduler does with the KV cache goes through SCHEDULER_INTERFACE."""
    import ast
    from pathlib import Path

    from tokenloom.engine import scheduler
    from tokenloom.kv_cache.block_manager import SCHEDULER_INTERFACE

    tree = ast.parse(Path(scheduler.__file__).read_text())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "blocks"
    }
    assert used and used <= SCHEDULER_INTERFACE, used - SCHEDULER_INTERFACE


def test_a_prompt_block_is_in_flight_until_committed_or_released():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(10))  # two full prompt blocks, then 2 tokens
    first = bm.lookup("a", prompt, len(prompt))
    assert not first.waits and first.num_tokens == 0 and first.num_queried == 10
    assert bm.allocate("a", 4, first) == [0]  # a computes its first chunk
    second = bm.lookup("b", prompt, len(prompt))
    assert second.waits  # a is computing b's first block
    bm.check_integrity()
    bm.commit("a", prompt, 4)  # the first block is computed and cached
    third = bm.lookup("b", prompt, len(prompt))
    assert [b.block_id for b in third.blocks] == [0] and third.num_tokens == 4
    assert third.waits  # ... and a computes the second next
    assert not bm.lookup("c", prompt, len(prompt), use_cache=False).waits  # scoring never waits
    bm.release("a")
    assert not bm.lookup("b", prompt, len(prompt)).waits  # a left: nobody computes it now
    bm.check_integrity()
    assert bm.stats.queried_tokens == 10 and bm.stats.hit_tokens == 0  # one allocation counted


def test_borrowed_blocks_come_back_and_a_full_cache_refuses_a_borrow():
    bm = BlockManager(num_blocks=4, block_size=4)
    with bm.borrow(8) as (table, _, _):
        assert len(table) == 2 and bm.num_free_blocks == 2
        with pytest.raises(RuntimeError, match="no room for 12 tokens"), bm.borrow(12):
            pass
    assert bm.num_free_blocks == 4
    bm.check_integrity()


def test_grow_all_grows_every_sequence_or_none():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 4)
    bm.allocate("b", 4)
    assert bm.grow_all({"a": 12, "b": 8}) is None and bm.num_free_blocks == 2  # needs 3
    assert bm.grow_all({"a": 8, "b": 8}) == {"a": [0, 2], "b": [1, 3]}
    bm.check_integrity()


def test_state_slots_come_with_a_sequences_first_blocks_and_go_with_its_release():
    """A hybrid model's sequences each hold one recurrent-state slot: taken at the first
    allocation (lowest free first), kept while the table grows, given back at release; a new
    sequence is not allocated (nothing changes) while no slot is free."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False, state_slots=2)
    assert bm.allocate("a", 4) is not None and bm.allocate("b", 4) is not None
    assert (bm.state_slot("a"), bm.state_slot("b")) == (0, 1)
    assert bm.allocate("a", 12) is not None and bm.state_slot("a") == 0  # growing keeps the slot
    free = bm.num_free_blocks
    assert bm.allocate("c", 4) is None  # blocks to spare, no slot
    assert bm.num_free_blocks == free and bm.state_slot("c") == -1
    bm.release("a")
    assert bm.state_slot("a") == -1
    assert bm.allocate("c", 4) is not None and bm.state_slot("c") == 0
    with pytest.raises(RuntimeError, match="no room"), bm.borrow(4):
        pass  # both slots held
    bm.release("b")
    with bm.borrow(4) as (_, slot, _):
        assert slot == 1
    bm.check_integrity()
    assert BlockManager(num_blocks=4, block_size=4).state_slot("x") == -1  # a model without recurrent layers


def test_a_shift_drops_blocks_moves_the_rest_up_and_forgets_their_hashes(bm):
    seq = toks(22)  # 5 full blocks and 2 tokens
    bm.allocate("a", 22)
    bm.commit("a", seq, 22)  # the 5 full blocks are in the prefix index
    pairs = bm.shift("a", keep_blocks=1, drop_blocks=2).pairs
    assert pairs == [(3, 3), (4, 4), (5, 5)]  # held by a alone: turned in place
    assert bm.block_ids("a") == [0, 3, 4, 5]
    assert [bm.ref_count(i) for i in range(6)] == [1, 0, 0, 1, 1, 1]
    # the dropped blocks keep their hashes (their contents are the prompt's); the moved ones do not
    assert [b.block_id for b in bm.find_cached_prefix(toks(13))] == [0, 1, 2]
    bm.commit("a", seq[:4] + seq[12:] + toks(4, 50), 18)  # full again: none past the kept block is indexed
    assert [b.block_id for b in bm.find_cached_prefix(seq[:4] + seq[12:] + [0])] == [0]
    bm.release("a", seq[:4] + seq[12:], 14)  # nor when it ends
    assert [b.block_id for b in bm.find_cached_prefix(seq[:4] + seq[12:] + [0])] == [0]


def test_a_shift_copies_the_blocks_another_sequence_holds(bm):
    seq = toks(12)
    bm.allocate("a", 12)
    bm.commit("a", seq, 12)
    hit = bm.lookup("b", seq + [99], 13)
    bm.allocate("b", 13, hit)  # b shares a's 3 blocks, then block 3
    pairs = bm.shift("a", keep_blocks=1, drop_blocks=1).pairs
    assert pairs == [(2, 4)]  # block 2 is b's too: a's keys go to a fresh block
    assert bm.block_ids("a") == [0, 4] and bm.block_ids("b") == [0, 1, 2, 3]
    assert [bm.ref_count(i) for i in range(5)] == [2, 1, 1, 1, 1]
    bm.free("b")
    bm.free("a")


def test_a_shift_that_needs_more_copies_than_free_blocks_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=BS)
    bm.allocate("a", 16)
    bm.commit("a", toks(16), 16)
    bm.allocate("b", 16, bm.lookup("b", toks(16) + [1], 17))  # b holds all 4 blocks too
    assert bm.shift("a", keep_blocks=1, drop_blocks=1) is None  # 2 moved blocks to copy, none free
    assert bm.block_ids("a") == [0, 1, 2, 3]
    bm.check_integrity()
