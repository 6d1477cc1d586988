"""Context shift (engine/context_shift.py): a sequence that fills its context keeps its first
blocks, drops the oldest ones after them and goes on, its moved keys turned to their new positions.

With one layer, a token's keys and values depend only on the token and its position, so after a
shift the model must see exactly what a fresh prefill of the context's tokens (the kept ones, then
the rest at their new positions) gives: that is the equivalence pinned here, greedy token and
top-5 logprobs to 1e-4 in float32, for sequences that shift beside sequences that do not, and
for sequences sharing prompt blocks (the shared blocks are copied, not turned in place).
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.conftest import _llama_like_kwargs, make_tiny_tokenizer
from tokenloom import LLM, SamplingParams

CONTEXT, BLOCK = 64, 8


def _one_layer(folder, **extra):
    config = transformers.LlamaConfig(**_llama_like_kwargs({"num_hidden_layers": 1, **extra}))
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    make_tiny_tokenizer(folder)
    return str(folder)


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    return _one_layer(tmp_path_factory.mktemp("one_layer"), num_attention_heads=4, num_key_value_heads=2)


def _engine(folder, **kwargs):
    kwargs = {"dtype": "float32", "max_model_len": CONTEXT, "block_size": BLOCK, "kv_cache_memory": 8 << 20} | kwargs
    return LLM(folder, **kwargs)


def _run_recording_shifts(llm, prompts, max_tokens):
    """Step the engine; per request, (context before the token, token, its top logprobs) for every
    token sampled in the step that followed a shift."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    requests = {str(i): engine.add_request(str(i), p, params) for i, p in enumerate(prompts)}
    dropped = {rid: 0 for rid in requests}
    after_shift, outputs = [], {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            req = requests[delta.request_id]
            outputs[delta.request_id] += delta.new_token_ids
            if req.num_dropped != dropped[delta.request_id]:
                dropped[delta.request_id] = req.num_dropped
                (token,) = delta.new_token_ids
                after_shift.append((req.all_token_ids[:-1], token, delta.logprobs[0], req))
    return after_shift, outputs


def _fresh_prefill(folder, contexts):
    """The greedy next token and top logprobs of a fresh prefill of each context, no shift."""
    llm = _engine(folder)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=5)
    return [(o.outputs[0].token_ids[0], o.outputs[0].logprobs[0]) for o in llm.generate(contexts, params)]


def _check_equal_to_fresh_prefill(folder, after_shift):
    fresh = _fresh_prefill(folder, [context for context, *_ in after_shift])
    for (context, token, logprobs, _), (fresh_token, fresh_logprobs) in zip(after_shift, fresh):
        assert len(context) < CONTEXT
        assert token == fresh_token
        assert logprobs.keys() == fresh_logprobs.keys()
        for t, lp in logprobs.items():
            assert lp == pytest.approx(fresh_logprobs[t], abs=1e-4)


def test_after_a_shift_the_next_token_is_a_fresh_prefill_of_the_kept_tokens(one_layer):
    llm = _engine(one_layer, context_shift=True)
    prompts = [list(range(5, 45)), [7, 3, 9] * 4]  # the second shifts later than the first
    after_shift, outputs = _run_recording_shifts(llm, prompts, max_tokens=150)
    assert all(len(out) == 150 for out in outputs.values())  # went on past the context
    assert len(after_shift) >= 4  # each shifted more than once
    _check_equal_to_fresh_prefill(one_layer, after_shift)
    first = [r for *_, r in after_shift if r.request_id == "0"]
    assert first[0].keep_tokens == BLOCK  # keep 4 -> one whole block
    # the first shift, with 63 tokens computed: 7 full blocks, 6 after the kept one, half of them go
    assert llm.engine.core.scheduler.num_context_shifts == len(after_shift)


def test_shifting_sequences_run_beside_ones_that_do_not(one_layer):
    prompts = [list(range(5, 45)), [11, 12, 13], list(range(100, 120))]
    budgets = [120, 10, 20]  # only the first reaches the context
    llm = _engine(one_layer, context_shift=True)
    engine = llm.engine
    got = {}
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    while engine.has_unfinished_requests():
        for delta in engine.step():
            got.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    alone = _engine(one_layer).generate(prompts[1:], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert got["1"] == alone[0].outputs[0].token_ids[:10]
    assert got["2"] == alone[1].outputs[0].token_ids
    assert len(got["0"]) == 120 and engine.core.scheduler.num_context_shifts >= 1


def test_sequences_sharing_prompt_blocks_shift_into_copies(one_layer):
    """Two equal prompts share their full blocks (prefix caching); a shift must not turn a block the
    other sequence still reads: the moved shared blocks are copied first."""
    llm = _engine(one_layer, context_shift=True)
    prompt = list(range(5, 50))  # 5 full blocks shared
    after_shift, outputs = _run_recording_shifts(llm, [prompt, prompt], max_tokens=60)
    assert outputs["0"] == outputs["1"]
    assert {r.request_id for *_, r in after_shift} == {"0", "1"}
    _check_equal_to_fresh_prefill(one_layer, after_shift)
    llm.engine.core.block_manager.check_integrity()


def test_the_first_shift_drops_half_the_blocks_after_the_kept_ones(one_layer):
    llm = _engine(one_layer, context_shift=True)
    after_shift, _ = _run_recording_shifts(llm, [list(range(5, 45))], max_tokens=30)
    (context, _, _, req), *_ = after_shift
    # 63 tokens computed when the context filled: 7 full blocks, 6 after the kept one; 3 go
    assert req.num_dropped == 3 * BLOCK
    everything = req.prompt_token_ids + req.output_token_ids
    assert context == everything[:BLOCK] + everything[4 * BLOCK : len(context) + 3 * BLOCK]


def test_memory_stays_flat_over_many_shifts(one_layer):
    llm = _engine(one_layer, context_shift=True, context_keep=10)
    engine, blocks = llm.engine, llm.engine.core.block_manager
    engine.add_request("long", [1, 2, 3], SamplingParams(temperature=0.8, seed=1, max_tokens=400, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, blocks.num_used_blocks)
    assert most <= CONTEXT // BLOCK
    assert engine.core.scheduler.num_context_shifts >= 8
    req_keep = 2 * BLOCK  # keep 10 -> two whole blocks
    assert blocks.num_used_blocks == 0 and req_keep == 16


def test_an_int8_cache_shifts_close_to_the_float_one(one_layer):
    """A quantized cache is read, turned and quantized again: greedy tokens after the shift match
    the float cache's for a while, logprobs within int8's error."""
    floats, _ = _run_recording_shifts(_engine(one_layer, context_shift=True), [list(range(5, 45))], 30)
    ints, _ = _run_recording_shifts(
        _engine(one_layer, context_shift=True, kv_cache_dtype="int8"), [list(range(5, 45))], 30
    )
    (_, token, logprobs, _), (_, int_token, int_logprobs, _) = floats[0], ints[0]
    assert token == int_token
    assert int_logprobs[token] == pytest.approx(logprobs[token], abs=0.05)


def test_shift_goes_on_where_the_context_would_end_with_length(one_layer):
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    (plain,) = _engine(one_layer).generate([list(range(5, 45))], params)
    (shifted,) = _engine(one_layer, context_shift=True).generate([list(range(5, 45))], params)
    assert plain.outputs[0].finish_reason == "length" and len(plain.outputs[0].token_ids) == CONTEXT - 40
    assert shifted.outputs[0].finish_reason == "length" and len(shifted.outputs[0].token_ids) == 100
    assert shifted.outputs[0].token_ids[: CONTEXT - 40] == plain.outputs[0].token_ids  # the same until the shift


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"context_keep": 60}, "leaves no room to shift"),
        ({"speculative": "ngram,k=2"}, "speculative decoding"),
    ],
)
def test_what_context_shift_cannot_run_with_is_refused(one_layer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _engine(one_layer, context_shift=True, **kwargs)


def test_a_model_without_rotary_positions_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="context shift is not implemented for GPT2"):
        _engine(str(tiny_model_dir("gpt2")), context_shift=True)


def test_a_request_keep_that_leaves_no_room_is_refused(one_layer):
    llm = _engine(one_layer, context_shift=True)
    with pytest.raises(ValueError, match="leaves no room to shift"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, context_keep=50))


def _cached(llm, request_id, layer, count):
    """Layer `layer`'s keys and values of a request's first `count` positions: each (count, heads, dim)."""
    kv, blocks = llm.engine.core.runner.kv_cache, llm.engine.core.block_manager
    table = torch.tensor(blocks.block_ids(request_id), dtype=torch.int64)
    keys, values = (t[table].reshape(-1, *t.shape[2:])[:count] for t in kv.layer(layer))
    return keys, values


def test_each_layer_turns_by_its_own_rope(tiny_model_dir):
    """Gemma 3: the sliding layer 0 turns by the local rope, the full layer 1 by the global one. After
    a shift, layer 0's cache equals a fresh prefill's everywhere; layer 1's where a token's window
    (6 positions) reaches back no further than the moved tokens."""
    folder = str(tiny_model_dir("gemma3"))
    # every layer's blocks in one table, read back here (window layers' own blocks: test_window_blocks.py)
    llm = _engine(folder, context_shift=True, window_blocks=False)
    llm.engine.add_request("g", list(range(5, 45)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    req = llm.engine.requests["g"]
    while not req.num_dropped:
        llm.engine.step()
    context = req.all_token_ids[:-1]  # computed: every context token but the newest
    fresh = _engine(folder, window_blocks=False)
    fresh.engine.add_request("f", context + [1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    fresh.engine.step()  # the prompt: its keys and values are in the cache now
    for layer, start in ((0, 0), (1, req.keep_tokens + 6)):
        for ours, theirs in zip(_cached(llm, "g", layer, len(context)), _cached(fresh, "f", layer, len(context))):
            torch.testing.assert_close(ours[start:], theirs[start:], atol=1e-4, rtol=1e-4)


def test_the_server_lets_max_tokens_run_past_the_context_only_with_context_shift(one_layer):
    import httpx

    from tests.helpers.server_harness import ThreadedServer
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    body = {"model": "m", "prompt": "The quick brown fox", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
    for shift in (False, True):
        engine = _engine(one_layer, context_shift=shift).engine
        with ThreadedServer(build_app(AsyncLLMEngine(engine), "m")) as url:
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        if shift:
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 100
            assert reply.json()["choices"][0]["finish_reason"] == "length"
        else:
            assert reply.status_code == 400 and "max_tokens is 100" in reply.json()["error"]["message"]
