"""A request whose data breaks a stage of a step fails alone: the step and every other request go on.

The failure is injected into one request of a batch of 8 at each stage a step passes
through (the batched forward, sampling, the core's update, the output processor); the
other 7 must finish with exactly the tokens they get without the failing request, and
every KV block must come back. Prompt logprobs work with any max_tokens.
"""

from __future__ import annotations

import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.engine.scheduler import Scheduler
from tokenloom.sampling import sampler as sampler_module

PROMPTS = [
    "Once upon a time, there was a little",
    "def fibonacci(n):",
    "Paris is",
    "1, 2, 3, 4,",
    "Q: What is 2+2?\nA:",
    "In 1492,",
    "Dear Sir or Madam, I am writing to",
    "Roses are red,",
]
VICTIM = 3  # index among the 8 prompts
MARK = 7  # a logit_bias of 0.0 on this token marks the victim (it changes no logit)
BOOM = "injected failure"
POISON = 48123  # " fallopian": ends the victim's prompt; no other request holds it


def params(victim: bool = False) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, logit_bias={MARK: 0.0} if victim else None
    )


def is_victim(p: SamplingParams) -> bool:
    return bool(p.logit_bias) and MARK in p.logit_bias


def inject(stage: str, monkeypatch, llm: LLM, victim_tokens: list[int]) -> None:
    """Make the victim's part of `stage` raise."""
    if stage == "forward":  # the victim's prompt is the only one holding its last token
        model, real = llm.engine.core.runner.model, llm.engine.core.runner.model.forward
        poison = victim_tokens[-1]

        def forward(input_ids, *args):
            if (input_ids == poison).any():
                raise RuntimeError(BOOM)
            return real(input_ids, *args)

        monkeypatch.setattr(model, "forward", forward)
    elif stage == "sample":
        real = sampler_module.apply_processors

        def processors(logits, meta):
            if any(is_victim(p) for p in meta.params):
                raise RuntimeError(BOOM)
            return real(logits, meta)

        monkeypatch.setattr(sampler_module, "apply_processors", processors)
    elif stage == "update":
        real = Scheduler._token_stop

        def token_stop(self, req):
            if is_victim(req.params):
                raise RuntimeError(BOOM)
            return real(self, req)

        monkeypatch.setattr(Scheduler, "_token_stop", token_stop)
    else:
        real = OutputProcessor._detokenize

        def detokenize(self, state, out):
            if is_victim(out.request.params) and out.new_token_ids:
                raise RuntimeError(BOOM)
            return real(self, state, out)

        monkeypatch.setattr(OutputProcessor, "_detokenize", detokenize)


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def uncontested(llm):
    """The 7 others' tokens and logprobs, run together without the victim."""
    others = [p for i, p in enumerate(PROMPTS) if i != VICTIM]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(others, params())]


def encoded(llm: LLM, i: int) -> list[int]:
    """The prompt's ids; the victim's ends in a token no other prompt holds (the forward poison)."""
    ids = llm.tokenizer.encode(PROMPTS[i])
    return ids + [POISON] if i == VICTIM else ids


@pytest.mark.parametrize("stage", ["forward", "sample", "update", "output"])
def test_a_failing_request_fails_alone(llm, uncontested, monkeypatch, stage):
    prompts = [encoded(llm, i) for i in range(len(PROMPTS))]
    assert all(POISON not in p for i, p in enumerate(prompts) if i != VICTIM)
    inject(stage, monkeypatch, llm, prompts[VICTIM])
    outs = llm.generate(prompts, [params(i == VICTIM) for i in range(len(PROMPTS))])
    failed = outs[VICTIM].outputs[0]
    assert failed.finish_reason == "error" and BOOM in failed.error
    others = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for i, o in enumerate(outs) if i != VICTIM]
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(others, uncontested):
        assert tokens == want_tokens
        assert [lp[t] for lp, t in zip(logprobs, tokens)] == pytest.approx(
            [lp[t] for lp, t in zip(want_logprobs, want_tokens)], abs=1e-4
        )
    bm = llm.engine.core.block_manager
    assert bm.num_used_blocks == 0 and not llm.engine.has_unfinished_requests()
    bm.check_integrity()
    monkeypatch.undo()
    again = llm.generate([prompts[VICTIM]], params())[0].outputs[0]  # the engine still serves it
    assert again.finish_reason == "length" and len(again.token_ids) == 12


def test_a_failing_stream_raises_for_its_caller_only(llm, monkeypatch):
    from tokenloom.outputs import RequestError

    inject("sample", monkeypatch, llm, [])
    other = llm.engine.add_request("bystander", llm.tokenizer.encode(PROMPTS[0]), params())
    with pytest.raises(RequestError, match=BOOM):
        list(llm.stream(PROMPTS[1], params(victim=True)))
    assert not other.is_finished  # still running, untouched
    llm.engine.abort("bystander")
    assert llm.engine.core.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("max_tokens", [0, 1, 2])
def test_prompt_logprobs_with_any_max_tokens(llm, max_tokens):
    prompt = llm.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    scored = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))[0].outputs[0].prompt_logprobs
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=1, ignore_eos=True)
    )[0]
    got = out.outputs[0].prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    for entry, want, token in zip(got[1:], scored[1:], prompt[1:]):
        assert token in entry and len(entry) <= 2
        assert entry[token] == pytest.approx(want[token], abs=1e-4)
    assert len(out.outputs[0].token_ids) == max_tokens
    assert llm.engine.core.block_manager.num_used_blocks == 0


# ---- the server ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_url(llm):
    from tests.helpers.server_harness import ThreadedServer
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    with ThreadedServer(build_app(AsyncLLMEngine(llm.engine), "smol")) as url:
        yield url


def completion_body(i: int, stream: bool) -> dict:
    body = {
        "model": "smol",
        "prompt": PROMPTS[i],
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if i == VICTIM:
        body["logit_bias"] = {str(MARK): 0.0}
    return body


def test_server_a_failing_request_fails_alone(base_url, monkeypatch):
    """8 concurrent requests (4 streamed, 4 whole), one failing in sampling: the other 7 answer
    200 with their uncontested text, the failure is a clear error (500 JSON, or an error event
    and [DONE] that end its stream cleanly), and every KV block comes back."""
    import asyncio
    import json

    import httpx

    from tests.helpers.server_harness import wait_until_idle

    alone = {
        i: httpx.post(f"{base_url}/v1/completions", json=completion_body(i, False), timeout=60).json()["choices"][0][
            "text"
        ]
        for i in range(len(PROMPTS))
        if i != VICTIM
    }
    inject("sample", monkeypatch, None, [])

    async def one(client: httpx.AsyncClient, i: int, stream: bool):
        body = completion_body(i, stream)
        if not stream:
            r = await client.post(f"{base_url}/v1/completions", json=body)
            return r.status_code, r.json()
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
            events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        return r.status_code, events

    async def all_at_once(victim_streams: bool):
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(one(client, i, (i % 2 == 0) == victim_streams) for i in range(len(PROMPTS))))

    for victim_streams in (True, False):
        results = asyncio.run(all_at_once(victim_streams))
        for i, (status, got) in enumerate(results):
            streamed = (i % 2 == 0) == victim_streams
            assert status == 200 or (i == VICTIM and not streamed)
            if i == VICTIM and streamed:
                assert got[-1] == "[DONE]"
                error = json.loads(got[-2])["error"]
                assert BOOM in error["message"] and error["code"] == "request_failed"
            elif i == VICTIM:
                assert status == 500 and BOOM in got["error"]["message"]
            elif streamed:
                assert got[-1] == "[DONE]"
                assert "".join(json.loads(e)["choices"][0]["text"] for e in got[:-1]) == alone[i]
            else:
                assert got["choices"][0]["text"] == alone[i]
        assert wait_until_idle(base_url) == 0


def test_server_echo_logprobs_with_max_tokens_1(base_url):
    """The scoring request evaluation harnesses send answers 200 with the prompt's logprobs."""
    import httpx

    body = {
        "model": "smol",
        "prompt": "The capital of France is",
        "max_tokens": 1,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
    }
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    logprobs = r.json()["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"][0] is None and all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) >= 6  # 5 prompt tokens + 1 generated
    assert r.json()["choices"][0]["text"].startswith("The capital of France is")
