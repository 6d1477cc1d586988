"""Sliding-window layers' own pool: a sequence holds only the blocks its window reads, prefix hits
are cut where the window's backings are gone, and copies and shifts move the window layers' data."""

from __future__ import annotations

import random

import pytest

from tokenloom.kv_cache.block_manager import BlockManager
from tokenloom.kv_cache.window_pool import WindowPool

BS = 4


def toks(n, start=0):
    return list(range(start, start + n))


def manager(num_blocks=32, window_blocks=6, window=8) -> BlockManager:
    return BlockManager(num_blocks, BS, window=WindowPool(window_blocks, window, BS))


def held(bm: BlockManager, rid: str) -> list[int]:
    """Indices of the request's table entries it holds in the window pool."""
    ids = bm.window_block_ids(rid)
    assert ids is not None and bm.window is not None
    return [i for i, w in enumerate(ids) if w != bm.window.null]


def test_decoding_past_the_window_lets_go_of_what_slid_out():
    bm = manager(num_blocks=64, window_blocks=4)
    bm.allocate("a", 1)
    tokens = toks(1)
    for n in range(1, 200):  # decode one token a step: needs far more blocks than the pool's 4
        tokens.append(n)
        assert bm.allocate("a", n + 1) is not None, f"no room at {n + 1} tokens"
        bm.commit("a", tokens, n)
        # a query at position n reads n - 7 .. n: blocks (n - 7) // 4 .. n // 4
        assert held(bm, "a") == list(range(max(0, n - 7) // BS, n // BS + 1))
        bm.check_integrity()
    assert len(bm.block_ids("a")) == 50  # the full layers keep every block
    bm.release("a", tokens, 199)
    bm.check_integrity()


def test_a_prompt_chunk_holds_its_blocks_and_those_its_first_query_reads():
    bm = manager(window_blocks=8)
    bm.allocate("a", 16)
    bm.commit("a", toks(16), 16)
    assert held(bm, "a") == [2, 3]  # position 16 reads 9 .. 16: blocks 2, 3 (and 4 when allocated)
    bm.allocate("a", 32)  # the next chunk: 16 more tokens
    assert held(bm, "a") == [2, 3, 4, 5, 6, 7]
    assert not bm.allocate("b", 12)  # 3 backings wanted, 2 left
    assert bm.block_ids("b") == [] and bm.window_block_ids("b") == []
    bm.check_integrity()


def test_a_prefix_hit_is_cut_where_its_windows_backings_are_gone():
    bm = manager(window_blocks=6)
    prompt = toks(24)  # 6 blocks
    bm.allocate("a", 24)
    bm.commit("a", prompt, 24)  # lets go of blocks 0-3 (position 24 reads 17 ..): cached, so kept
    bm.release("a", prompt, 24)  # then of 4 and 5
    bm.allocate("x", 4)  # takes the backing kept longest: block 0's
    assert bm.lookup("b", prompt + [99], 25).num_tokens == 24  # position 24 reads blocks 4, 5: kept
    assert bm.lookup("c", prompt[:14] + [99, 98], 16).num_tokens == 12  # position 12 reads blocks 1, 2
    # position 8 would read blocks 0 and 1, position 4 block 0: gone, so nothing is a hit
    assert bm.lookup("d", prompt[:8] + [99], 9).num_tokens == 0
    bm.check_integrity()


def test_kept_backings_serve_a_later_hit_until_the_pool_needs_them():
    bm = manager(window_blocks=4)
    prompt = toks(16)
    bm.allocate("a", 16)
    bm.commit("a", prompt, 16)
    bm.release("a", prompt, 16)  # blocks 2, 3 keep their backings (cached)
    hit = bm.lookup("b", prompt + [7], 17)
    assert hit.num_tokens == 16
    bm.allocate("x", 16)  # takes all 4 backings: the kept ones go
    hit = bm.lookup("b", prompt + [7], 17)
    assert hit.num_tokens < 16
    bm.free("x")
    bm.check_integrity()


def test_a_partial_hit_that_copies_copies_the_window_layers_too():
    bm = manager()
    seq = toks(10)
    bm.allocate("a", 10)
    bm.commit("a", seq, 10)
    bm.release("a", seq, 10)  # the partial block 2 is remembered (2 slots)
    bm.allocate("b", 11, bm.lookup("b", seq + [1], 11))  # b takes block 2 over in place
    hit = bm.lookup("c", seq + [2], 11)
    assert hit.partial is not None and hit.num_tokens == 10
    bm.allocate("c", 11, hit)  # block 2 is b's: c copies it
    copies, window_copies = bm.pending_copies(), bm.pending_window_copies()
    assert len(copies) == 1 and len(window_copies) == 1
    w_b, w_c = bm.window_block_ids("b"), bm.window_block_ids("c")
    assert w_b is not None and w_c is not None
    assert window_copies == [(w_b[2], w_c[2])] and w_b[2] != w_c[2]
    bm.check_integrity()
    bm.copies_done()
    bm.check_integrity()


def test_a_context_shift_moves_the_window_layers_blocks_and_keeps_the_sinks():
    bm = manager(num_blocks=16, window_blocks=8, window=8)
    seq = toks(30)
    bm.allocate("a", 30)
    bm.commit("a", seq, 30, keep_tokens=4)  # block 0 (the kept head) stays held
    assert held(bm, "a") == [0, 5, 6, 7]
    w_before = bm.window_block_ids("a")
    moves = bm.shift("a", keep_blocks=1, drop_blocks=3)
    assert moves is not None and w_before is not None
    assert moves.pairs == [(4, 4), (5, 5), (6, 6), (7, 7)]
    assert moves.window_pairs == [(w_before[i], w_before[i]) for i in (5, 6, 7)]  # held: turned in place
    assert held(bm, "a") == [0, 2, 3, 4]
    bm.check_integrity()


@pytest.mark.parametrize("seed", range(4))
def test_random_traffic_keeps_every_invariant(seed):
    rng = random.Random(seed)
    bm = manager(num_blocks=24, window_blocks=10, window=6)
    live: dict[str, list[int]] = {}
    for step in range(400):
        op = rng.random()
        if op < 0.3 and len(live) < 4:
            rid = f"r{step}"
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]  # few ids: many shared prefixes
            hit = bm.lookup(rid, prompt, len(prompt))
            if bm.allocate(rid, len(prompt), hit) is not None:
                bm.copies_done()
                bm.commit(rid, prompt, len(prompt))
                live[rid] = prompt + [rng.randrange(3)]  # the sampled token: no KV yet
        elif op < 0.85 and live:
            rid = rng.choice(list(live))
            tokens = live[rid]
            if bm.allocate(rid, len(tokens)) is not None:  # the newest token's KV
                bm.commit(rid, tokens, len(tokens))
                tokens.append(rng.randrange(3))
        elif live:
            rid = rng.choice(list(live))
            tokens = live.pop(rid)
            bm.release(rid, tokens, len(tokens) - 1)
        bm.check_integrity()
        for rid, tokens in live.items():  # what a query at the next position reads is held
            assert bm.window is not None
            first = bm.window.first_visible(len(tokens) - 1)
            assert set(range(first, len(bm.block_ids(rid)))) <= set(held(bm, rid))
