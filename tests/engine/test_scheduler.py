"""Scheduler with a fake model: token budgets, chunking, block ids, preemption order, no leaks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers.fake_engine import FakeEngine


def test_prefill_then_decode_with_exact_blocks():
    e = FakeEngine(num_blocks=8, block_size=4)
    a = e.add("a", list(range(6)), max_tokens=3)
    e.step()
    assert e.log[-1] == [("a", 6)] and e.blocks.block_ids("a") == [0, 1]
    e.step()
    e.step()
    assert e.log[1:] == [[("a", 1)], [("a", 1)]]
    assert a.output_token_ids == [1006, 1007, 1008] and a.is_finished
    assert e.blocks.num_free_blocks == 8


def test_long_prompt_is_chunked_and_decodes_share_the_budget():
    e = FakeEngine(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    e.add("a", list(range(3)), max_tokens=5)
    e.step()  # a: 3 prompt tokens
    e.add("b", list(range(100, 120)), max_tokens=2)  # 20-token prompt
    e.step()
    e.step()
    e.step()
    assert e.log == [[("a", 3)], [("a", 1), ("b", 7)], [("a", 1), ("b", 7)], [("a", 1), ("b", 6)]]
    assert e.requests["b"].output_token_ids == [1020]  # sampled only when its prompt was complete


def test_admission_is_fcfs_and_respects_max_num_seqs():
    e = FakeEngine(num_blocks=16, max_num_seqs=2)
    for rid in "abc":
        e.add(rid, [1, 2, 3], max_tokens=2)
    e.step()
    assert [r for r, _ in e.log[-1]] == ["a", "b"]
    e.step()  # a and b finish here
    e.step()
    assert [r for r, _ in e.log[-1]] == ["c"]


def test_prefix_hit_skips_cached_blocks():
    e = FakeEngine(num_blocks=16, block_size=4)
    system = list(range(50, 62))  # 3 full blocks
    e.add("a", system + [1, 2], max_tokens=1)
    e.run()
    b = e.add("b", system + [7, 8, 9], max_tokens=1)
    e.step()
    assert e.log[-1] == [("b", 3)]  # 12 of 15 prompt tokens came from the cache
    assert e.blocks.stats.hit_tokens == 12 and e.blocks.stats.queried_tokens == 14 + 15
    assert b.is_finished


def test_requests_arriving_together_compute_a_shared_prefix_once():
    """b and c share a's 3-block system prompt: they wait one step, then hit it."""
    e = FakeEngine(num_blocks=32, block_size=4)
    system = list(range(50, 62))  # 3 full blocks
    e.add("a", system + [1, 2], max_tokens=3)
    e.add("b", system + [3, 4, 5], max_tokens=3)
    e.add("c", system + [6], max_tokens=3)
    e.add("d", [7, 8, 9], max_tokens=3)  # unrelated, but behind b (FCFS)
    e.step()
    assert e.log[-1] == [("a", 14)]
    e.step()
    assert e.log[-1] == [("a", 1), ("b", 3), ("c", 1), ("d", 3)]  # 12 prompt tokens each from the cache
    assert e.blocks.stats.hit_tokens == 24
    e.run()  # check_integrity() after every step
    assert all(r.is_finished for r in e.requests.values()) and e.blocks.num_free_blocks == 32


def test_a_shared_prefix_in_chunked_prefill_is_waited_for_until_computed():
    e = FakeEngine(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    system = list(range(50, 66))  # 4 full blocks, two 8-token chunks
    e.add("a", system + [1], max_tokens=2)
    e.add("b", system + [2], max_tokens=2)
    e.step()
    e.step()
    assert e.log == [[("a", 8)], [("a", 8)]]  # b waits while a computes blocks it needs
    e.step()
    assert e.log[-1] == [("a", 1), ("b", 1)]  # a's last prompt token; b: 16 from the cache + 1


def test_without_prefix_caching_requests_are_admitted_together():
    e = FakeEngine(num_blocks=32, block_size=4, prefix_caching=False)
    system = list(range(50, 62))
    e.add("a", system + [1, 2], max_tokens=1)
    e.add("b", system + [3], max_tokens=1)
    e.step()
    assert e.log[-1] == [("a", 14), ("b", 13)]


def test_newest_request_is_preempted_and_recomputed():
    # 6 blocks of 4: a and b (prompt 8 each) fill 4 blocks; growing needs more than there are.
    e = FakeEngine(num_blocks=6, block_size=4, prefix_caching=False)
    a = e.add("a", list(range(8)), max_tokens=8)
    b = e.add("b", list(range(100, 108)), max_tokens=8)
    e.step()
    assert e.blocks.block_ids("a") == [0, 1] and e.blocks.block_ids("b") == [2, 3]
    e.step()  # a -> block 4, b -> block 5 (9 tokens each)
    assert e.blocks.block_ids("a") == [0, 1, 4] and e.blocks.block_ids("b") == [2, 3, 5]
    for _ in range(3):
        e.step()  # both reach 12 tokens: blocks full
    assert e.scheduler.num_preemptions == 0
    e.step()  # a needs a 4th block: b (newest) is preempted
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert e.log[-1] == [("a", 1)]
    # b's uncached blocks were freed tail first to the front of the queue: 2 comes back first
    assert e.blocks.block_ids("a") == [0, 1, 4, 2] and e.blocks.block_ids("b") == []
    e.run()
    assert a.output_token_ids == [1000 + n for n in range(8, 16)]
    assert b.output_token_ids == [1000 + n for n in range(108 - 100, 16)]  # same tokens as uninterrupted
    assert e.blocks.num_free_blocks == 6


def test_request_that_can_never_fit_is_rejected():
    e = FakeEngine(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="needs up to 20 tokens of KV cache .* whole cache holds 16"):
        e.add("big", list(range(10)), max_tokens=10)
    assert not e.scheduler.has_unfinished


def test_abort_frees_blocks_at_once():
    e = FakeEngine(num_blocks=8)
    e.add("a", list(range(9)), max_tokens=20)
    e.step()
    assert e.blocks.num_free_blocks == 5
    e.abort("a")
    assert e.blocks.num_free_blocks == 8 and not e.scheduler.has_unfinished
    e.blocks.check_integrity()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 24), st.integers(1, 12), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    max_size=30,
)


@settings(max_examples=1000, deadline=None)
@given(ops)
def test_random_submit_abort_sequences_never_leak(ops):
    e = FakeEngine(num_blocks=12, block_size=4, max_num_batched_tokens=16, max_num_seqs=6)
    shared = list(range(500, 512))
    for op in ops:
        if op[0] == "add":
            _, n, max_tokens, share = op
            prompt = (shared + list(range(n)))[: max(n, 1)] if share else list(range(900, 900 + n))
            try:
                e.add(f"r{len(e.requests)}", prompt, max_tokens)
            except ValueError:
                pass  # could never fit: rejected up front
        elif op[0] == "abort":
            e.abort(f"r{op[1]}")
        else:
            for _ in range(op[1]):
                e.step()
        e.blocks.check_integrity()
    e.run()
    assert e.blocks.num_free_blocks == e.blocks.num_blocks
    assert all(r.is_finished for r in e.requests.values())
    assert not e.blocks._hashes and not e.blocks._registered  # no per-request state outlives its request
