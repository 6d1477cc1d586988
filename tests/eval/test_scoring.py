"""Sequence scoring: prompt logprobs in prefill, LLM.score, and echo + logprobs on the server,
each checked against HF transformers' own per-token log-probabilities on the same weights."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.helpers.hf_reference import load_hf_reference
from tests.helpers.server_harness import ThreadedServer, wait_until_idle
from tokenloom import LLM, SamplingParams

PROMPT, CONTINUATION = "The capital of France is", " Paris, a city on the Seine."


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    return load_hf_reference(default_model_dir)


def hf_token_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1 from one HF forward: (len - 1,) and the full (len - 1, vocab)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()
    full = torch.log_softmax(logits, -1)
    return full.gather(1, torch.tensor(ids[1:])[:, None])[:, 0], full


def test_score_equals_the_sum_of_hf_token_logprobs(smol_llm, hf_model):
    result = smol_llm.score(PROMPT, CONTINUATION)
    prompt_ids = smol_llm.tokenizer.encode(PROMPT)
    assert result.token_ids == smol_llm.tokenizer.encode(CONTINUATION, add_special_tokens=False)
    want, _ = hf_token_logprobs(hf_model, prompt_ids + result.token_ids)
    want = want[len(prompt_ids) - 1 :]
    assert result.logprobs == pytest.approx(want.tolist(), abs=1e-4)
    assert result.total == pytest.approx(float(want.sum()), abs=1e-3)
    assert result.total == pytest.approx(sum(result.logprobs))


@pytest.mark.parametrize("chunk", [None, 5])
def test_prompt_logprobs_match_hf_whole_or_chunked(default_model_dir, hf_model, chunk):
    kwargs = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = LLM(str(default_model_dir), kv_cache_memory=64 << 20, **kwargs)
    ids = llm.tokenizer.encode("Four score and seven years ago our fathers brought forth on this continent")
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=3))[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    entries = out.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    want, full = hf_token_logprobs(hf_model, ids)
    for i, entry in enumerate(entries[1:]):
        assert entry[ids[i + 1]] == pytest.approx(float(want[i]), abs=1e-4)
        top = set(full[i].topk(3).indices.tolist())
        assert top <= set(entry) <= top | {ids[i + 1]}


def test_scoring_ignores_the_prefix_cache_and_leaves_batch_companions_alone(smol_llm):
    ids = smol_llm.tokenizer.encode("Once upon a time there was a little fox who lived in the woods")
    scored = SamplingParams(max_tokens=0, prompt_logprobs=0)
    first = smol_llm.generate([ids], scored)[0].prompt_logprobs
    gen = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = smol_llm.generate([ids[:6]], gen)[0].outputs[0].token_ids
    mixed = smol_llm.generate([ids, ids[:6]], [scored, gen])  # second scoring: the prefix is cached
    assert mixed[0].prompt_logprobs is not None and len(mixed[0].prompt_logprobs) == len(ids)
    assert [e[t] for e, t in zip(mixed[0].prompt_logprobs[1:], ids[1:])] == pytest.approx(
        [e[t] for e, t in zip(first[1:], ids[1:])], abs=1e-5
    )
    assert mixed[1].outputs[0].token_ids == alone
    assert smol_llm.engine.core.block_manager.num_used_blocks == 0


def test_prompt_logprobs_with_generation_and_bad_values(smol_llm):
    out = smol_llm.generate(["Hello there"], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1))[0]
    assert len(out.outputs[0].token_ids) == 3 and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="at least one prompt token"):
        smol_llm.score("Hi", "")


def test_server_echo_logprobs_max_tokens_0_scores_the_prompt(smol_llm):
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    expected = smol_llm.score(PROMPT, CONTINUATION)
    prompt_ids = smol_llm.tokenizer.encode(PROMPT) + expected.token_ids
    with ThreadedServer(build_app(AsyncLLMEngine(smol_llm.engine), "smol")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        resp = client.completions.create(model="smol", prompt=prompt_ids, max_tokens=0, echo=True, logprobs=2)
        choice = resp.choices[0]
        assert choice.finish_reason == "length" and resp.usage.completion_tokens == 0
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt_ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        cont = lp.token_logprobs[len(prompt_ids) - len(expected.token_ids) :]
        assert cont == pytest.approx(expected.logprobs, abs=1e-5)
        assert all(len(t) >= 2 for t in lp.top_logprobs[1:])
        more = client.completions.create(
            model="smol", prompt=PROMPT, max_tokens=3, echo=True, logprobs=0, temperature=0
        )
        n_prompt = len(smol_llm.tokenizer.encode(PROMPT))
        assert len(more.choices[0].logprobs.tokens) == n_prompt + 3
        assert more.choices[0].text.startswith(PROMPT)
        for bad, param in [
            ({"max_tokens": 0}, "max_tokens"),
            ({"max_tokens": 0, "echo": True}, "max_tokens"),
            ({"echo": True, "logprobs": 1, "stream": True}, "stream"),
        ]:
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model="smol", prompt="Hi", **({"max_tokens": 4} | bad))
            assert err.value.body["param"] == param
        assert wait_until_idle(url) == 0
