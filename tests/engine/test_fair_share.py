"""Turns between clients (engine/fair_share.py): a busy client's sequences take turns, nobody starves,
one client is never held back, and no token changes."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.helpers.fake_engine import FakeEngine
from tokenloom.entrypoints.llm import LLM
from tokenloom.sampling_params import SamplingParams


def _busy_and_quiet(fair_share_seqs: int | None) -> FakeEngine:
    """Client 'busy' runs 8 decoding requests, client 'quiet' one; all prefilled in the first step."""
    e = FakeEngine(num_blocks=64, max_num_seqs=16, fair_share_seqs=fair_share_seqs)
    for i in range(8):
        e.add(f"busy{i}", [1, 2, 3], max_tokens=40, client="busy")
    e.add("quiet", [4, 5, 6], max_tokens=40, client="quiet")
    e.step()
    return e


def test_a_busy_owner_steps_its_share_and_every_sequence_in_turn():
    e = _busy_and_quiet(fair_share_seqs=4)  # two clients: ceil(4 / 2) = 2 turns each
    assert len(e.log[0]) == 9  # the first step admitted everyone (no one ran yet)
    for _ in range(8):
        e.step()
    stepped = Counter(rid for step in e.log[1:] for rid, _ in step)
    for step in e.log[1:]:
        ids = [rid for rid, _ in step]
        assert "quiet" in ids and len(ids) == 3  # the quiet client every step, 2 of the busy one's
    assert stepped["quiet"] == 8
    assert all(stepped[f"busy{i}"] == 2 for i in range(8))  # in turn: 8 steps x 2 turns over 8 sequences


def test_one_owner_alone_is_never_held_back():
    e = FakeEngine(num_blocks=64, max_num_seqs=16, fair_share_seqs=2)
    for i in range(6):
        e.add(f"r{i}", [1, 2, 3], max_tokens=5, client="only")
    e.run()
    assert all(len(step) == 6 for step in e.log)


def test_without_fair_share_every_running_sequence_steps():
    e = _busy_and_quiet(fair_share_seqs=None)
    e.step()
    assert len(e.log[-1]) == 9


def test_a_busy_owner_admits_one_request_a_step_past_its_share_and_later_owners_pass_the_rest():
    e = _busy_and_quiet(fair_share_seqs=4)
    for i in range(3):  # arrive first; their client's turns are spent
        e.add(f"busy-late{i}", [7, 8], max_tokens=4, client="busy")
    e.add("newcomer", [9, 9], max_tokens=4, client="new")
    e.step()
    ids = [rid for rid, _ in e.log[-1]]
    assert "newcomer" in ids and "busy-late0" in ids and "busy-late1" not in ids
    e.step()
    assert "busy-late1" in [rid for rid, _ in e.log[-1]]  # a new request is never stuck behind running ones


def test_every_request_finishes_with_the_same_tokens_as_without_turns():
    runs = []
    for share in (None, 3):
        e = _busy_and_quiet(fair_share_seqs=share)
        e.run()
        runs.append({rid: r.output_token_ids for rid, r in e.requests.items()})
        assert e.blocks.num_free_blocks == 64
    assert runs[0] == runs[1]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir("llama_gqa")), kv_cache_memory=16 << 20, fair_share_seqs=2)


def test_real_model_tokens_and_logprobs_do_not_depend_on_turns(llm):
    """Greedy tokens and logprobs of requests that sat steps out equal those of a run without clients."""
    prompts = [[1, 5, 9, 13], [2, 6, 10], [3, 7, 11, 15, 19], [4, 8]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    alone = [o.outputs[0] for o in llm.generate(prompts, params)]
    engine = llm.engine
    for i, ids in enumerate(prompts):
        engine.enqueue(f"turns-{i}", ids, params, client="busy" if i < 3 else "quiet")
    done, widths = {}, []
    while engine.has_unfinished_requests():
        deltas = engine.step()
        widths.append(len(deltas))
        done.update({d.request_id: d.completion for d in deltas if d.finished})
    assert max(widths[1:]) < 4  # turns were taken: never all four in one step
    for i, ref in enumerate(alone):
        got = done[f"turns-{i}"]
        assert got.token_ids == ref.token_ids
        assert [lp[t] for lp, t in zip(got.logprobs, got.token_ids)] == pytest.approx(
            [lp[t] for lp, t in zip(ref.logprobs, ref.token_ids)], abs=1e-5
        )
