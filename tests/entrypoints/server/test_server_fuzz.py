"""Fuzz the request schema: whatever JSON a client sends, never a 5xx and never a leaked block."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.server_harness import ThreadedServer, wait_until_idle

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.lists(st.integers(-5, 60000), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(-200, 200), max_size=2),
)
small = st.one_of(st.integers(-2, 6), junk)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "bot"]), "content": st.one_of(st.text(max_size=20), junk)}
)
common = {
    "model": st.one_of(st.just("smol"), junk),
    "max_tokens": small,
    "max_completion_tokens": small,
    "n": st.one_of(st.integers(-1, 3), junk),
    "temperature": st.one_of(st.floats(-1, 3), junk),
    "top_p": st.one_of(st.floats(-0.5, 1.5), junk),
    "top_k": small,
    "min_p": st.one_of(st.floats(-0.5, 1.5), junk),
    "seed": st.one_of(st.integers(-(2**70), 2**70), junk),
    "user": st.one_of(st.text(max_size=5), junk),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=70), junk),
    "presence_penalty": st.one_of(st.floats(-3, 3), junk),
    "frequency_penalty": st.one_of(st.floats(-3, 3), junk),
    "repetition_penalty": st.one_of(st.floats(-1, 3), junk),
    "logit_bias": junk,
    "ignore_eos": junk,
    "stream": st.booleans(),
    "stream_options": junk,
    "min_tokens": small,
    "stop_token_ids": junk,
}
completion_body = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-3, 60000), max_size=6), junk)},
    optional=common | {"logprobs": small, "echo": junk, "suffix": junk},
)
chat_body = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, max_size=3), junk)},
    optional=common | {"logprobs": junk, "top_logprobs": small, "response_format": junk, "tools": junk},
)


@pytest.fixture(scope="module")
def base_url(default_model_dir):
    from tokenloom import LLM
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app
    from tokenloom.entrypoints.server.admission import AdmissionLimits

    engine = LLM(str(default_model_dir), max_model_len=128, kv_cache_memory=64 << 20).engine
    limits = AdmissionLimits(default_max_tokens=16)  # a body without max_tokens: 16 tokens, not the context's rest
    with ThreadedServer(build_app(AsyncLLMEngine(engine), "smol", limits=limits)) as url:
        yield url


@pytest.fixture(scope="module")
def client():
    with httpx.Client() as shared:  # one for every example: building a client costs more than a request
        yield shared


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(endpoint=st.sampled_from(["completions", "chat/completions"]), data=st.data())
def test_no_input_gets_a_5xx_or_leaks_blocks(base_url, client, endpoint, data):
    body = data.draw(completion_body if endpoint == "completions" else chat_body)
    response = client.post(f"{base_url}/v1/{endpoint}", json=body, timeout=60)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"]
    elif not body.get("stream"):
        assert response.json()["choices"]
    else:
        assert response.text.rstrip().endswith("data: [DONE]")
    assert wait_until_idle(base_url) == 0


ollama_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "bot"]),
        "content": st.one_of(st.text(max_size=20), junk),
    },
    optional={"images": junk, "tool_calls": junk, "thinking": junk},
)
ollama_options = st.one_of(
    junk,
    st.dictionaries(
        st.sampled_from(["temperature", "num_predict", "top_k", "top_p", "seed", "stop", "num_ctx", "mirostat"]),
        small,
        max_size=4,
    ),
)
ollama_common = {
    "model": st.one_of(st.just("smol"), junk),
    "stream": st.one_of(st.booleans(), junk),
    "format": st.one_of(st.just("json"), junk),
    "options": ollama_options,
    "keep_alive": st.one_of(st.sampled_from(["5m", "-1", "0", "1h30m"]), junk),
    "think": junk,
}
other_bodies = {
    "/api/chat": st.fixed_dictionaries(
        {"messages": st.one_of(st.lists(ollama_message, max_size=3), junk)}, optional=ollama_common | {"tools": junk}
    ),
    "/api/generate": st.fixed_dictionaries(
        {"prompt": st.one_of(st.text(max_size=20), junk)},
        optional=ollama_common | {"system": junk, "raw": junk, "suffix": junk, "images": junk, "context": junk},
    ),
    "/api/embed": st.fixed_dictionaries(
        {"input": st.one_of(st.text(max_size=20), st.lists(st.text(max_size=8), max_size=3), junk)},
        optional={"model": ollama_common["model"], "truncate": junk, "keep_alive": ollama_common["keep_alive"]},
    ),
    "/api/show": st.fixed_dictionaries({}, optional={"model": ollama_common["model"], "name": junk}),
    "/api/pull": st.fixed_dictionaries({}, optional={"model": junk, "stream": junk}),
    "/v1/messages": st.fixed_dictionaries(
        {"messages": st.one_of(st.lists(message, max_size=3), junk), "max_tokens": small},
        optional={
            "model": common["model"],
            "system": junk,
            "stop_sequences": junk,
            "temperature": common["temperature"],
            "top_k": small,
            "stream": st.booleans(),
            "tools": junk,
            "tool_choice": junk,
            "thinking": junk,
        },
    ),
    "/v1/messages/count_tokens": st.fixed_dictionaries(
        {"messages": st.one_of(st.lists(message, max_size=3), junk)},
        optional={"model": common["model"], "system": junk},
    ),
    "/v1/responses": st.fixed_dictionaries(
        {"input": st.one_of(st.text(max_size=20), st.lists(message, max_size=3), junk)},
        optional={
            "model": common["model"],
            "instructions": junk,
            "max_output_tokens": small,
            "stream": st.booleans(),
            "tools": junk,
            "previous_response_id": junk,
            "temperature": common["temperature"],
        },
    ),
}


def _error_message(path: str, body: dict) -> str:
    """The message of an error body in the shape of the API at `path`."""
    if path.startswith("/api/"):
        return body["error"]
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"]
    return body["error"]["message"]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(sorted(other_bodies)), data=st.data())
def test_no_input_to_the_ollama_anthropic_or_responses_routes_gets_a_5xx(base_url, client, path, data):
    body = data.draw(other_bodies[path])
    response = client.post(f"{base_url}{path}", json=body, timeout=60)
    assert response.status_code < 500, (path, body, response.text)
    if response.status_code >= 400:
        assert _error_message(path, response.json()), (path, body, response.text)
    assert wait_until_idle(base_url) == 0
