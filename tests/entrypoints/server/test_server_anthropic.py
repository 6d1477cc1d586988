"""Anthropic's Messages API through the real server and Anthropic's Python SDK, on Qwen2.5-Coder-0.5B:
the OpenAI route's reply as text blocks (whole and streamed, events in order), stop reasons, tool_use
blocks and tool_result turns, thinking blocks, token counting, and errors in Anthropic's shape."""

from __future__ import annotations

import openai
import pytest

from tests.helpers.server_harness import ThreadedServer
from tokenloom.loader import hub

anthropic = pytest.importorskip("anthropic")

QWEN = "qwen2.5-coder-0.5b"
pytestmark = pytest.mark.skipif(not hub.is_pulled(QWEN), reason=f"`tokenloom pull {QWEN}` has not run")
GREEDY = {"temperature": 0}  # this SDK leaves sampling settings to extra_body
ASK = [{"role": "user", "content": "Name three colors of the rainbow."}]
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def served():
    from tokenloom import LLM
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    engine = LLM(str(hub.gguf_path(QWEN)), max_model_len=1024, kv_cache_memory=64 << 20).engine
    with ThreadedServer(build_app(AsyncLLMEngine(engine), "qwen", reasoning_parser="think")) as url:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        yield client, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_a_message_is_the_chat_routes_reply_whole_and_streamed(served):
    client, oa = served
    want = oa.chat.completions.create(
        model="qwen", messages=[{"role": "system", "content": "Be brief."}, *ASK], extra_body=GREEDY, max_tokens=24
    )
    reply = client.messages.create(model="qwen", system="Be brief.", messages=ASK, max_tokens=24, extra_body=GREEDY)
    (block,) = reply.content
    assert block.type == "text" and block.text == want.choices[0].message.content
    assert reply.role == "assistant" and reply.model == "qwen"
    assert reply.stop_reason == ("max_tokens" if want.choices[0].finish_reason == "length" else "end_turn")
    assert reply.usage.input_tokens == want.usage.prompt_tokens
    assert reply.usage.output_tokens == want.usage.completion_tokens
    with client.messages.stream(model="qwen", system="Be brief.", messages=ASK, max_tokens=24, extra_body=GREEDY) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == block.text and final.stop_reason == reply.stop_reason
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert events.index("content_block_start") < events.index("content_block_stop") < events.index("message_delta")


def test_stop_sequences_say_which_one_matched(served):
    client, _ = served
    reply = client.messages.create(
        model="qwen",
        messages=[{"role": "user", "content": "Count from 1 to 10, comma separated."}],
        max_tokens=40,
        extra_body=GREEDY,
        stop_sequences=["5"],
    )
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "5"
    assert "5" not in reply.content[0].text and "4" in reply.content[0].text


def test_tool_use_and_its_result(served):
    client, _ = served
    messages = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    reply = client.messages.create(model="qwen", messages=messages, tools=[WEATHER], max_tokens=64, extra_body=GREEDY)
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and [(u.name, u.input) for u in uses] == [("get_weather", {"city": "Paris"})]
    with client.messages.stream(
        model="qwen", messages=messages, tools=[WEATHER], max_tokens=64, extra_body=GREEDY
    ) as s:
        streamed = s.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [("get_weather", {"city": "Paris"})]
    messages += [
        {"role": "assistant", "content": [u.model_dump() for u in uses]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "18 degrees and sunny"}],
        },
    ]
    answer = client.messages.create(
        model="qwen", messages=messages, tools=[WEATHER], tool_choice={"type": "none"}, max_tokens=64, extra_body=GREEDY
    )
    assert answer.stop_reason == "end_turn" and "18" in answer.content[0].text
    forced = client.messages.create(
        model="qwen",
        messages=[{"role": "user", "content": "Hello"}],
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=64,
        extra_body=GREEDY,
    )
    assert [b.name for b in forced.content if b.type == "tool_use"] == ["get_weather"]


def test_thinking_blocks(served):
    client, _ = served
    system = "First think step by step between <think> and </think> tags, then answer."
    ask = [{"role": "user", "content": "What is 17 + 25?"}]
    reply = client.messages.create(model="qwen", system=system, messages=ask, max_tokens=64, extra_body=GREEDY)
    kinds = [b.type for b in reply.content]
    assert kinds[0] == "thinking" and "42" in reply.content[0].thinking
    assert all("<think>" not in (getattr(b, "text", "") + getattr(b, "thinking", "")) for b in reply.content)
    with client.messages.stream(model="qwen", system=system, messages=ask, max_tokens=64, extra_body=GREEDY) as s:
        streamed = s.get_final_message()
    assert streamed.content[0].thinking == reply.content[0].thinking


def test_output_config_format_constrains_the_reply(served):
    import json

    import jsonschema

    client, _ = served
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = client.messages.create(
        model="qwen",
        messages=[{"role": "user", "content": "Describe a cat as JSON with its name and age."}],
        max_tokens=64,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    jsonschema.validate(json.loads(reply.content[0].text), schema)


def test_count_tokens_is_the_prompts_length(served):
    client, oa = served
    counted = client.messages.count_tokens(model="qwen", system="Be brief.", messages=ASK)
    want = oa.chat.completions.create(
        model="qwen", messages=[{"role": "system", "content": "Be brief."}, *ASK], max_tokens=1
    )
    assert counted.input_tokens == want.usage.prompt_tokens
    with_tools = client.messages.count_tokens(model="qwen", messages=ASK, tools=[WEATHER])
    assert with_tools.input_tokens > client.messages.count_tokens(model="qwen", messages=ASK).input_tokens


def test_errors_come_in_anthropics_shape(served):
    client, _ = served
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-9", messages=ASK, max_tokens=8)
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-9" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="qwen", messages=ASK, max_tokens=8, extra_body={"temperature": 1.5})
    assert e.value.body["type"] == "error" and "temperature" in e.value.body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="qwen", messages=[{"role": "user", "content": [image]}], max_tokens=8)
    assert "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="qwen", messages=ASK, max_tokens=5000)  # past the context
