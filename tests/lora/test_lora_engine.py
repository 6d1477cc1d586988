"""Adapters in the engine: the prefix cache keyed by adapter, run-time load and unload, speculative
decoding and structured output with an adapter, and every error a user can cause."""

from __future__ import annotations

import dataclasses
import re

import pytest

pytest.importorskip("peft")

from tests.helpers.peft_adapters import make_peft_adapter
from tokenloom import LLM, SamplingParams
from tokenloom.structured.spec import StructuredOutput

PROMPT = [(7 * i) % 250 + 3 for i in range(40)]  # two full blocks and a partial one
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return tiny_model_dir("llama_gqa")


@pytest.fixture(scope="module")
def two_adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: str(make_peft_adapter(base, root / name, r=8, seed=seed)) for name, seed in (("a", 11), ("b", 12))}


def _hit_tokens(llm) -> int:
    return llm.engine.core.block_manager.stats.hit_tokens


def test_the_same_prompt_under_two_adapters_never_shares_kv(base, two_adapters):
    llm = LLM(str(base), kv_cache_memory=16 << 20, lora=two_adapters)
    fresh = {
        name: LLM(str(base), kv_cache_memory=16 << 20, lora=two_adapters).generate([PROMPT], GREEDY, lora=name)[0]
        for name in ("a", "b")
    }
    first = llm.generate([PROMPT], GREEDY, lora="a")[0]
    assert _hit_tokens(llm) == 0
    other = llm.generate([PROMPT], GREEDY, lora="b")[0]
    assert _hit_tokens(llm) == 0  # b found nothing of a's
    base_run = llm.generate([PROMPT], GREEDY)[0]
    assert _hit_tokens(llm) == 0  # nor did the base model
    again = llm.generate([PROMPT], GREEDY, lora="a")[0]
    assert _hit_tokens(llm) >= 32  # a hits its own blocks
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == fresh["a"].outputs[0].token_ids
    assert other.outputs[0].token_ids == fresh["b"].outputs[0].token_ids
    for hit, miss in zip(again.outputs[0].logprobs, first.outputs[0].logprobs):
        assert list(hit.values()) == pytest.approx(list(miss.values()), abs=1e-5)
    assert len({tuple(r.outputs[0].token_ids) for r in (first, other, base_run)}) == 3


def test_load_and_unload_at_run_time(base, two_adapters):
    llm = LLM(str(base), kv_cache_memory=16 << 20, enable_lora=True, max_loras=1)
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
        llm.generate([PROMPT], GREEDY, lora="a")
    llm.add_lora("a", two_adapters["a"])
    with_a = llm.generate([PROMPT], GREEDY, lora="a")[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="all 1 slots are in use"):
        llm.add_lora("b", two_adapters["b"])
    with pytest.raises(ValueError, match="already loaded"):
        llm.add_lora("a", two_adapters["a"])
    llm.remove_lora("a")
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
        llm.generate([PROMPT], GREEDY, lora="a")
    llm.add_lora("b", two_adapters["b"])  # into the slot a left, which must hold none of a
    with_b = llm.generate([PROMPT], GREEDY, lora="b")[0].outputs[0].token_ids
    alone_b = LLM(str(base), kv_cache_memory=16 << 20, lora={"b": two_adapters["b"]})
    assert with_b == alone_b.generate([PROMPT], GREEDY, lora="b")[0].outputs[0].token_ids
    assert with_b != with_a


def test_reading_an_adapter_does_not_stop_the_engine_stepping(base, two_adapters, monkeypatch):
    """The async engine reads an adapter's files off the engine thread: a generation runs to its end
    while the read is held, and the adapter then serves as if loaded alone."""
    import asyncio
    import threading

    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.lora.manager import LoRAManager

    held, read = threading.Event(), LoRAManager._read

    def slow_read(self, path):
        assert held.wait(30), "the read was never released"
        return read(self, path)

    monkeypatch.setattr(LoRAManager, "_read", slow_read)
    engine = AsyncLLMEngine(LLM(str(base), kv_cache_memory=16 << 20, enable_lora=True).engine)

    async def tokens(params: SamplingParams) -> list[int]:
        return [t async for delta in engine.generate(PROMPT, params) for t in delta.new_token_ids]

    async def scenario() -> list[int]:
        adding = asyncio.ensure_future(engine.add_lora("a", two_adapters["a"]))
        try:
            assert len(await tokens(GREEDY)) == GREEDY.max_tokens
            assert not adding.done()  # the base request ran to its end while the read was held
        finally:
            held.set()
            await adding
        with_a = await tokens(dataclasses.replace(GREEDY, lora="a"))
        await engine.shutdown()
        return with_a

    try:
        with_a = asyncio.run(scenario())
    finally:
        held.set()
        engine.close()
    alone = LLM(str(base), kv_cache_memory=16 << 20, lora={"a": two_adapters["a"]})
    assert with_a == alone.generate([PROMPT], GREEDY, lora="a")[0].outputs[0].token_ids


def test_an_adapter_in_use_is_not_unloaded(base, two_adapters):
    llm = LLM(str(base), kv_cache_memory=16 << 20, lora=two_adapters)
    llm.engine.add_request("r", PROMPT, SamplingParams(max_tokens=4, lora="a"))
    with pytest.raises(ValueError, match="in use by 1 request"):
        llm.remove_lora("a")
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.remove_lora("a")


@pytest.mark.parametrize("proposer", ["ngram,k=4", "draft"])
def test_speculative_decoding_with_an_adapter_keeps_the_greedy_tokens(base, two_adapters, proposer):
    """The target verifies with the request's adapter; the proposer (n-gram, or a draft model: the
    base without adapters, which the adapter's tokens often disagree with) only drafts."""
    prompt = [8, 9, 10, 11] * 8  # repeats: the n-gram proposer drafts
    plain = LLM(str(base), kv_cache_memory=16 << 20, lora=two_adapters)
    spec_text = proposer if proposer != "draft" else f"draft={base},k=3"
    spec = LLM(str(base), kv_cache_memory=16 << 20, lora=two_adapters, speculative=spec_text)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for name in ("a", None, "b"):
        want = plain.generate([prompt], params, lora=name)[0].outputs[0].token_ids
        assert spec.generate([prompt], params, lora=name)[0].outputs[0].token_ids == want
    stats = spec.engine.stats()
    assert stats.spec_draft_tokens > 0
    if proposer == "draft":  # the base drafts the base's own tokens: some accepted, not all (adapters)
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens


def test_structured_output_with_an_adapter(base, two_adapters):
    llm = LLM(str(base), kv_cache_memory=16 << 20, lora=two_adapters)
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=40, structured_output=StructuredOutput("regex", "[0-9]{3}-[a-z]{2}")
    )
    outs = [llm.generate([PROMPT], params, lora=name)[0].outputs[0] for name in ("a", "b")]
    assert all(re.fullmatch("[0-9]{3}-[a-z]{2}", o.text) for o in outs), [o.text for o in outs]


def test_errors_name_what_is_wrong(base, tiny_model_dir, two_adapters, tmp_path):
    with pytest.raises(ValueError, match="start it with --lora"):
        LLM(str(base), kv_cache_memory=16 << 20).generate([PROMPT], GREEDY, lora="a")
    with pytest.raises(ValueError, match="3 LoRA adapters given but max_loras is 2"):
        LLM(str(base), lora={"a": "x", "b": "y", "c": "z"}, max_loras=2)
    with pytest.raises(ValueError, match="--lora takes NAME=PATH"):
        LLM(str(base), lora=["no-equals-sign"])
    # an adapter trained for another shape of model: k_proj has 1 kv head there, 2 here
    other = make_peft_adapter(tiny_model_dir("llama_mqa_tied"), tmp_path / "other", targets=("k_proj",))
    with pytest.raises(ValueError, match=re.escape("k_proj's lora_B has 16 outputs, the model's has 32")):
        LLM(str(base), kv_cache_memory=16 << 20, lora={"o": str(other)})
    big = make_peft_adapter(base, tmp_path / "big", r=32)
    with pytest.raises(ValueError, match="rank 32 .* above --max-lora-rank 16"):
        LLM(str(base), kv_cache_memory=16 << 20, lora={"big": str(big)})
    dora = make_peft_adapter(base, tmp_path / "dora", use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        LLM(str(base), kv_cache_memory=16 << 20, lora={"d": str(dora)})
    head = make_peft_adapter(base, tmp_path / "head", targets=("q_proj", "lm_head"))
    with pytest.raises(ValueError, match="lm_head.*not supported"):
        LLM(str(base), kv_cache_memory=16 << 20, lora={"h": str(head)})
    with pytest.raises(ValueError, match="not a PEFT adapter folder"):
        LLM(str(base), kv_cache_memory=16 << 20, lora={"x": str(tmp_path)})


def test_adapters_are_invariant_to_chunking_and_preemption(base, two_adapters):
    """Chunked prefill == whole, and sequences preempted for lack of blocks (then recomputed through
    their adapter) == uninterrupted, with adapters and the base mixed."""
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0, lora=name)
        for name in ("a", "b", None, "a")
    ]
    prompts = [PROMPT, PROMPT[::-1], [5, 17, 42, 99] * 5, [8] * 21]
    plain = LLM(str(base), kv_cache_memory=16 << 20, lora=two_adapters).generate(prompts, params)
    chunked = LLM(str(base), kv_cache_memory=16 << 20, lora=two_adapters, max_num_batched_tokens=8)
    block_bytes = 16 * 512  # 16 positions x 512 B a token (2 layers x 2 kv heads x 16 dims x 4 B x 2)
    cramped = LLM(str(base), kv_cache_memory=10 * block_bytes, lora=two_adapters, enable_prefix_caching=False)
    for llm in (chunked, cramped):
        outs = llm.generate(prompts, params)
        for got, want in zip(outs, plain):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            got_lp = [lp[t] for lp, t in zip(got.outputs[0].logprobs, got.outputs[0].token_ids)]
            want_lp = [lp[t] for lp, t in zip(want.outputs[0].logprobs, want.outputs[0].token_ids)]
            assert got_lp == pytest.approx(want_lp, abs=1e-5)
    assert cramped.engine.stats().num_preemptions > 0


def test_a_model_split_over_processes_refuses_adapters(base, two_adapters):
    with pytest.raises(ValueError, match="LoRA adapters with a model split over processes"):
        LLM(str(base), kv_cache_memory=16 << 20, lora=two_adapters, tensor_parallel_size=2)


def test_an_adapter_for_the_experts_of_a_moe_model_is_refused(tiny_model_dir, tmp_path):
    moe = tiny_model_dir("qwen2_moe")
    attention_only = make_peft_adapter(moe, tmp_path / "attn", targets=("q_proj", "v_proj"))
    llm = LLM(str(moe), kv_cache_memory=16 << 20, lora={"attn": str(attention_only)})
    assert llm.generate([PROMPT], GREEDY, lora="attn")[0].outputs[0].token_ids  # attention adapters work
    experts = make_peft_adapter(moe, tmp_path / "experts", targets=("gate_proj",))
    with pytest.raises(ValueError, match="takes no LoRA"):
        llm.add_lora("experts", str(experts))


def test_bfloat16_activations_take_the_torch_path_without_tapes(base, two_adapters):
    """The torch fallback reads each step's rows on the host: no decode tape may bake one step's."""
    llm = LLM(str(base), kv_cache_memory=16 << 20, dtype="bfloat16", lora=two_adapters)
    assert llm.engine.core.runner.tapes is None
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first_base = llm.generate([PROMPT], params)[0].outputs[0].token_ids  # decode steps of one shape, no adapter
    through_a = llm.generate([PROMPT], params, lora="a")[0].outputs[0].token_ids  # the same shapes, adapter a
    alone = LLM(str(base), kv_cache_memory=16 << 20, dtype="bfloat16", lora=two_adapters)
    assert through_a == alone.generate([PROMPT], params, lora="a")[0].outputs[0].token_ids
    assert through_a != first_base


def test_projections_wider_than_their_shards_take_no_lora(tiny_model_dir):
    """Qwen3-Next's q projection also holds its gate: it is left unwrapped, the rest still serve."""
    folder = str(tiny_model_dir("qwen3_next"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = LLM(folder, kv_cache_memory=16 << 20).generate([PROMPT], params)[0].outputs[0].token_ids
    with_room = LLM(folder, kv_cache_memory=16 << 20, enable_lora=True)
    assert with_room.generate([PROMPT], params)[0].outputs[0].token_ids == plain


def test_decode_tapes_of_base_steps_never_replay_an_adapters(base, two_adapters):
    """A LoRA engine's steps with no adapter row skip LoRA: their decode tapes are kept apart from
    those of steps through an adapter, shape for shape."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    llm = LLM(str(base), kv_cache_memory=16 << 20, lora=two_adapters)
    tapes = llm.engine.core.runner.tapes
    assert tapes is not None
    first_base = llm.generate([PROMPT], params)[0].outputs[0]  # records the base steps' tapes
    recorded = len(tapes.tapes)
    assert recorded > 0
    through_a = llm.generate([PROMPT], params, lora="a")[0].outputs[0]  # the same shapes through a
    assert len(tapes.tapes) > recorded  # tapes of their own
    fresh = LLM(str(base), kv_cache_memory=16 << 20, lora=two_adapters).generate([PROMPT], params, lora="a")
    assert through_a.token_ids == fresh[0].outputs[0].token_ids != first_base.token_ids
    again = llm.generate([PROMPT], params)[0].outputs[0]
    assert again.token_ids == first_base.token_ids
