"""ollama's API through the real server and ollama's own Python client, on Qwen2.5-Coder-0.5B: the
same replies as the OpenAI routes (whole and streamed, chat and generate), structured output, tool
calls and their results, thinking, embeddings, the listings, and errors in ollama's shape."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from tests.helpers.server_harness import ThreadedServer
from tokenloom.entrypoints.server.load_policy import ModelEntry
from tokenloom.loader import hub

ollama = pytest.importorskip("ollama")

QWEN = "qwen2.5-coder-0.5b"
SMOL = "smollm2-135m"
pytestmark = pytest.mark.skipif(not hub.is_pulled(QWEN), reason=f"`tokenloom pull {QWEN}` has not run")
GREEDY = {"temperature": 0, "num_predict": 24}
ASK = [{"role": "user", "content": "Name three colors of the rainbow."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def served():
    from tokenloom import LLM
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    def load(path: str):
        return LLM(path, max_model_len=1024, kv_cache_memory=64 << 20).engine

    smol = [ModelEntry("smol", str(hub.gguf_path(SMOL)))] if hub.is_pulled(SMOL) else []
    app = build_app(
        AsyncLLMEngine(load(str(hub.gguf_path(QWEN)))),
        "qwen",
        reasoning_parser="think",
        catalog=lambda: smol,
        load_engine=load,
    )
    with ThreadedServer(app) as url:
        yield url, ollama.Client(host=url), openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_chat_gives_the_openai_routes_reply_whole_and_streamed(served):
    _, client, oa = served
    want = oa.chat.completions.create(model="qwen", messages=ASK, temperature=0, max_tokens=24)
    reply = client.chat(model="qwen", messages=ASK, options=GREEDY)
    assert reply.message.role == "assistant" and reply.message.content == want.choices[0].message.content
    assert reply.done and reply.done_reason == want.choices[0].finish_reason
    assert reply.eval_count == want.usage.completion_tokens and reply.prompt_eval_count == want.usage.prompt_tokens
    assert reply.total_duration > 0
    parts = list(client.chat(model="qwen", messages=ASK, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].eval_count == reply.eval_count
    assert "".join(p.message.content for p in parts) == reply.message.content


def test_generate_is_a_chat_turn_or_with_raw_the_prompt_as_it_is(served):
    _, client, oa = served
    chat = client.chat(model="qwen", messages=ASK, options=GREEDY).message.content
    assert client.generate(model="qwen", prompt=ASK[0]["content"], options=GREEDY).response == chat
    streamed = list(client.generate(model="qwen", prompt=ASK[0]["content"], options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == chat and streamed[-1].done
    raw = client.generate(model="qwen", prompt="The capital of France is", raw=True, options=GREEDY).response
    want = oa.completions.create(model="qwen", prompt="The capital of France is", temperature=0, max_tokens=24)
    assert raw == want.choices[0].text
    loaded = client.generate(model="qwen", prompt="")  # how ollama clients load a model
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_format_json_and_a_schema_constrain_the_reply(served):
    _, client, _ = served
    ask = [{"role": "user", "content": "Describe a cat as JSON with its name and age."}]
    text = client.chat(model="qwen", messages=ask, format="json", options={"temperature": 0}).message.content
    assert isinstance(json.loads(text), dict)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    text = client.chat(model="qwen", messages=ask, format=schema, options={"temperature": 0}).message.content
    jsonschema.validate(json.loads(text), schema)


def test_a_tool_call_and_its_result_round_trip(served):
    _, client, _ = served
    messages = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    reply = client.chat(model="qwen", messages=messages, tools=[WEATHER], options={"temperature": 0})
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    streamed = list(
        client.chat(model="qwen", messages=messages, tools=[WEATHER], options={"temperature": 0}, stream=True)
    )
    calls = [c for p in streamed for c in (p.message.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [{"function": call.function.model_dump()}]},
        {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"},
    ]
    answer = client.chat(model="qwen", messages=messages, options={"temperature": 0})  # no tools: answer
    assert "18" in answer.message.content and not answer.message.tool_calls


def test_thinking_comes_apart_from_content(served):
    _, client, _ = served
    think = [
        {"role": "system", "content": "First think step by step between <think> and </think> tags, then answer."},
        {"role": "user", "content": "What is 17 + 25?"},
    ]
    reply = client.chat(model="qwen", messages=think, options={"temperature": 0, "num_predict": 64})
    assert "42" in reply.message.thinking and "<think>" not in reply.message.content + reply.message.thinking
    parts = list(client.chat(model="qwen", messages=think, options={"temperature": 0, "num_predict": 64}, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == reply.message.thinking
    assert "".join(p.message.content for p in parts) == reply.message.content


def test_embed_and_the_listings(served):
    url, client, oa = served
    out = client.embed(model="qwen", input=["red", "blue"])
    want = oa.embeddings.create(model="qwen", input=["red", "blue"])
    assert len(out.embeddings) == 2
    for ours, theirs in zip(out.embeddings, want.data):
        assert ours == pytest.approx(theirs.embedding, abs=1e-6)
    listed = {m.model: m for m in client.list().models}["qwen"]
    assert listed.model == "qwen" and listed.details.format == "gguf" and listed.details.family == "qwen2"
    assert listed.details.quantization_level == "Q4_K_M" and listed.size > 100e6
    assert listed.details.parameter_size == "630M"  # this file keeps its output projection apart: 630.17M
    assert "qwen" in [m.model for m in client.ps().models]
    shown = client.show("qwen")
    assert "tools" in shown.capabilities and "thinking" in shown.capabilities and "im_start" in shown.template
    assert shown.modelinfo["qwen2.context_length"] == 1024
    # the file's own count, every tensor's elements summed with gguf's reader (norms and biases too)
    assert shown.modelinfo["general.parameter_count"] == pytest.approx(630_167_424, rel=1e-3)
    assert httpx.get(f"{url}/api/version").json()["version"]


def test_errors_come_in_ollamas_shape(served):
    url, client, _ = served
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama9", messages=ASK)
    assert e.value.status_code == 404 and "llama9" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="qwen", messages=[{"role": "user", "content": "hi", "images": ["aGk="]}])
    assert e.value.status_code == 400 and "images" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="qwen", messages=ASK, options={"temprature": 0.5})
    assert e.value.status_code == 400 and "temprature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="qwen", messages=ASK, options={"temperature": 7})
    assert e.value.status_code == 400 and "options.temperature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="qwen", messages=ASK, options={"num_predict": 5000})  # past the context
    assert e.value.status_code == 400 and "options.num_predict is 5000" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="qwen", prompt="x", suffix="y")
    assert e.value.status_code == 400 and "suffix" in e.value.error
    reply = httpx.post(
        f"{url}/api/chat",
        json={"model": "qwen", "messages": ASK, "stream": False, "options": {"num_ctx": 4096, "num_predict": 2}},
    )
    assert reply.status_code == 200 and reply.headers["x-tokenloom-ignored-fields"] == "options.num_ctx"
    bad = httpx.post(f"{url}/api/chat", content=b"{not json")
    assert bad.status_code == 400 and isinstance(bad.json()["error"], str)


@pytest.mark.skipif(not hub.is_pulled(SMOL), reason=f"`tokenloom pull {SMOL}` has not run")
def test_two_models_by_name_in_turn_and_at_once(served):
    """SmolLM2 loads when a request first names it and serves beside Qwen: each model's reply is
    the same in turn as when both run at once, and the two differ."""
    _, client, oa = served
    assert {"qwen", "smol"} <= {m.model for m in client.list().models}
    alone = {m: client.chat(model=m, messages=ASK, options=GREEDY).message.content for m in ("smol", "qwen")}
    assert alone["smol"] != alone["qwen"]
    assert {"qwen", "smol"} <= {m.model for m in client.ps().models}
    with ThreadPoolExecutor(4) as pool:
        asks = [pool.submit(client.chat, model=m, messages=ASK, options=GREEDY) for m in ("smol", "qwen") * 2]
        together = [f.result().message.content for f in asks]
    assert together == [alone["smol"], alone["qwen"]] * 2
    card = {m.id: m for m in oa.models.list().data}["smol"]
    assert card.model_extra["loaded"] is True
    reply = oa.chat.completions.create(model="smol", messages=ASK, temperature=0, max_tokens=24)
    assert reply.model == "smol" and reply.choices[0].message.content == alone["smol"]
