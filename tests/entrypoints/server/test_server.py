"""The OpenAI-compatible server, driven by the real `openai` client over real HTTP."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest

from tests.helpers.server_harness import ThreadedServer, metric, wait_until_idle

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def engine(default_model_dir):
    from tokenloom import LLM

    return LLM(str(default_model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory=128 << 20).engine


@pytest.fixture(scope="module")
def base_url(engine):
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    with ThreadedServer(build_app(AsyncLLMEngine(engine), "smol")) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


GREEDY = {"temperature": 0}


def test_models_health_and_metrics(client, base_url):
    assert [m.id for m in client.models.list().data] == ["smol"]
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{base_url}/metrics").text
    for name in (
        "tokenloom_kv_cache_blocks_free",
        "tokenloom_prefix_cache_hit_rate",
        "tokenloom_time_to_first_token_seconds_bucket",
        "tokenloom_num_requests_waiting",
    ):
        assert name in text


def test_completion_usage_matches_tokens_and_stream_matches_whole(client, engine):
    prompt = "The capital of France is"
    whole = client.completions.create(
        model="smol", prompt=prompt, max_tokens=12, logprobs=0, extra_body={"ignore_eos": True}, **GREEDY
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert whole.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    assert whole.usage.completion_tokens == len(choice.logprobs.tokens) == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    assert whole.id.startswith("cmpl-") and whole.created > 0 and whole.object == "text_completion"
    chunks = list(
        client.completions.create(
            model="smol",
            prompt=prompt,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_completion_prompt_forms_and_echo(client, engine):
    ids = engine.tokenizer.encode("Once upon a time")
    by_text = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=6, **GREEDY)
    by_ids = client.completions.create(model="smol", prompt=ids, max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(model="smol", prompt=["Once upon a time", "Hello"], max_tokens=6, **GREEDY)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == by_text.choices[0].text
    echoed = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=6, echo=True, **GREEDY)
    assert echoed.choices[0].text == "Once upon a time" + by_text.choices[0].text


def test_chat_whole_and_stream_agree(client, engine):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(model="smol", messages=messages, max_completion_tokens=20, **GREEDY)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(engine.tokenizer.encode_chat(messages))
    chunks = list(
        client.chat.completions.create(
            model="smol",
            messages=messages,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_and_seed_reproducible(client):
    kwargs = dict(model="smol", prompt="My favourite animal is", max_tokens=10, n=2, seed=7, temperature=1.0)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.choices[0].text != first.choices[1].text  # distinct seeds per sample
    assert 2 <= first.usage.completion_tokens <= 20  # both choices counted, prompt once
    assert first.usage.prompt_tokens == second.usage.prompt_tokens < 10


def test_stop_string_cuts_output_and_never_streams(client):
    base = (
        client.completions.create(
            model="smol", prompt="1, 2, 3, 4,", max_tokens=16, extra_body={"ignore_eos": True}, **GREEDY
        )
        .choices[0]
        .text
    )
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    assert stop.strip()
    cut = client.completions.create(
        model="smol", prompt="1, 2, 3, 4,", max_tokens=16, stop=[stop], extra_body={"ignore_eos": True}, **GREEDY
    ).choices[0]
    assert cut.finish_reason == "stop" and cut.text == base[: base.index(stop)]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="smol",
            prompt="1, 2, 3, 4,",
            max_tokens=16,
            stop=stop,
            stream=True,
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
    )
    assert streamed == cut.text


def test_logprobs_are_distributions_and_greedy_picks_the_top(client):
    out = client.completions.create(model="smol", prompt="The sky is", max_tokens=5, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and chosen == pytest.approx(max(top.values()))
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-4
    chat = client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert bytes(entry.bytes).decode() == entry.token


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"extra_body": {"logit_bias": {"abc": 1}}}, "logit_bias"),
        ({"extra_body": {"logit_bias": {"1": 500}}}, "logit_bias"),
        ({"extra_body": {"stop_token_ids": [10**9]}}, "stop_token_ids"),
        ({"extra_body": {"logit_bias": {str(10**9): 1}}}, "logit_bias"),
        ({"extra_body": {"stop": ["x"] * 65}}, "stop"),
        ({"extra_body": {"stop": "x" * 1001}}, "stop"),
        ({"seed": 2**64}, "seed"),
        ({"seed": -1}, "seed"),
        ({"extra_body": {"n": "2"}}, "n"),  # strict types: no coercion
        ({"extra_body": {"max_tokens": True}}, "max_tokens"),
        ({"extra_body": {"temperature": "0.5"}}, "temperature"),
        ({"extra_body": {"stop": [True]}}, "stop"),
        ({"extra_body": {"use_beam_search": True, "best_of": 2, "length_penalty": 1e308}}, "length_penalty"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": "word " * (MAX_MODEL_LEN + 10)}, "prompt"),
    ],
)
def test_bad_parameters_are_400_naming_the_parameter(client, base_url, kwargs, param):
    args = {"model": "smol", "prompt": "Hi", "max_tokens": 4} | kwargs
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**args)
    assert err.value.status_code == 400
    assert err.value.body["param"] == param, err.value.body
    assert wait_until_idle(base_url) == 0


def test_unknown_model_malformed_json_and_body_limit(client, base_url):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-9", prompt="Hi", max_tokens=2)
    assert err.value.body["param"] == "model"
    bad = httpx.post(
        f"{base_url}/v1/completions",
        content=b'{"model": "smol", "prompt": ',
        headers={"content-type": "application/json"},
    )
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
    missing = httpx.post(f"{base_url}/v1/chat/completions", json={"model": "smol"})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
    huge = httpx.post(f"{base_url}/v1/completions", json={"model": "smol", "prompt": "x" * (5 << 20)})
    assert huge.status_code == 413 and "error" in huge.json()


def test_api_key_required_when_set(engine):
    from fastapi.testclient import TestClient

    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    app = build_app(AsyncLLMEngine(engine), "smol", api_key="sekret")
    with TestClient(app) as tc:
        assert tc.get("/v1/models").status_code == 401
        wrong = tc.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        assert tc.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert tc.get("/health").status_code == 200


def test_32_concurrent_streams_equal_one_at_a_time(client, base_url):
    prompts = [f"Fact number {i}: the" + " very" * (i % 7) for i in range(32)]
    alone = [client.completions.create(model="smol", prompt=p, max_tokens=8, **GREEDY).choices[0].text for p in prompts]
    aclient = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)

    async def one(p: str) -> str:
        stream = await aclient.completions.create(model="smol", prompt=p, max_tokens=8, stream=True, **GREEDY)
        return "".join([c.choices[0].text async for c in stream])

    async def all_at_once() -> list[str]:
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    assert asyncio.run(all_at_once()) == alone
    assert wait_until_idle(base_url) == 0


def test_client_gone_mid_stream_frees_its_blocks(base_url):
    before = metric(base_url, "tokenloom_requests_total", 'finish_reason="abort"')
    body = {"model": "smol", "prompt": "Tell me a long story.", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        received = [line for _, line in zip(range(6), lines) if line.startswith("data:")]
    assert received and metric(base_url, "tokenloom_kv_cache_blocks_used") >= 0
    assert wait_until_idle(base_url) == 0
    assert metric(base_url, "tokenloom_requests_total", 'finish_reason="abort"') == before + 1


def test_client_gone_before_whole_response_frees_its_blocks(base_url):
    body = {"model": "smol", "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=1.0)
    assert wait_until_idle(base_url) == 0


def test_metrics_count_requests_and_latencies(client, base_url):
    before = metric(base_url, "tokenloom_time_to_first_token_seconds_count")
    generated = metric(base_url, "tokenloom_generation_tokens_total")
    client.completions.create(model="smol", prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True}, **GREEDY)
    assert metric(base_url, "tokenloom_time_to_first_token_seconds_count") == before + 1
    assert metric(base_url, "tokenloom_generation_tokens_total") == generated + 3
    assert metric(base_url, "tokenloom_requests_total", 'finish_reason="length"') >= 1


def test_streamed_error_free_sse_framing(base_url):
    """Raw SSE: every event is one `data:` line with JSON, and the stream ends with [DONE]."""
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert json.loads(e[6:])["object"] == "chat.completion.chunk"
