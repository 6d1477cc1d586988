"""OpenAI's Responses API through the real server and the openai SDK (responses.create and
responses.stream), on Qwen2.5-Coder-0.5B: the chat route's reply as a message item, instructions,
previous_response_id, function calls and their outputs, reasoning items, text.format, and errors."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.helpers.server_harness import ThreadedServer
from tokenloom.loader import hub

QWEN = "qwen2.5-coder-0.5b"
pytestmark = pytest.mark.skipif(not hub.is_pulled(QWEN), reason=f"`tokenloom pull {QWEN}` has not run")
ASK = "Name three colors of the rainbow."
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def client():
    from tokenloom import LLM
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    engine = LLM(str(hub.gguf_path(QWEN)), max_model_len=1024, kv_cache_memory=64 << 20).engine
    with ThreadedServer(build_app(AsyncLLMEngine(engine), "qwen", reasoning_parser="think")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_a_response_is_the_chat_routes_reply_whole_and_streamed(client):
    want = client.chat.completions.create(
        model="qwen",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}],
        temperature=0,
        max_tokens=24,
    )
    reply = client.responses.create(
        model="qwen", instructions="Be brief.", input=ASK, temperature=0, max_output_tokens=24
    )
    assert reply.output_text == want.choices[0].message.content
    assert (
        reply.usage.input_tokens == want.usage.prompt_tokens
        and reply.usage.output_tokens == want.usage.completion_tokens
    )
    assert reply.status == ("incomplete" if want.choices[0].finish_reason == "length" else "completed")
    with client.responses.stream(
        model="qwen", instructions="Be brief.", input=ASK, temperature=0, max_output_tokens=24
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output_text == reply.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{reply.status}"
    assert kinds.index("response.output_item.added") < kinds.index("response.output_text.delta")
    assert kinds.index("response.output_text.done") < kinds.index("response.output_item.done")
    assert client.responses.retrieve(final.id).output_text == reply.output_text


def test_previous_response_id_carries_the_conversation(client):
    first = client.responses.create(
        model="qwen", input="My name is Ada. Reply with OK.", temperature=0, max_output_tokens=8
    )
    second = client.responses.create(
        model="qwen", input="What is my name?", previous_response_id=first.id, temperature=0, max_output_tokens=16
    )
    assert "Ada" in second.output_text
    alone = client.responses.create(model="qwen", input="What is my name?", temperature=0, max_output_tokens=16)
    assert "Ada" not in alone.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="qwen", input="hi", previous_response_id="resp_nope", max_output_tokens=4)


def test_function_calls_and_their_outputs(client):
    ask = "What is the weather in Paris? Use the tool."
    reply = client.responses.create(model="qwen", input=ask, tools=[WEATHER], temperature=0)
    (call,) = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    with client.responses.stream(model="qwen", input=ask, tools=[WEATHER], temperature=0) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    (streamed_call,) = [item for item in streamed.output if item.type == "function_call"]
    assert json.loads(streamed_call.arguments) == {"city": "Paris"}
    assert "response.function_call_arguments.delta" in kinds
    answer = client.responses.create(
        model="qwen",
        input=[
            {"role": "user", "content": ask},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"},
        ],
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
    )
    assert "18" in answer.output_text


def test_reasoning_items(client):
    instructions = "First think step by step between <think> and </think> tags, then answer."
    reply = client.responses.create(
        model="qwen", instructions=instructions, input="What is 17 + 25?", temperature=0, max_output_tokens=64
    )
    reasoning = [item for item in reply.output if item.type == "reasoning"]
    assert reasoning and "42" in reasoning[0].content[0].text
    with client.responses.stream(
        model="qwen", instructions=instructions, input="What is 17 + 25?", temperature=0, max_output_tokens=64
    ) as stream:
        streamed = stream.get_final_response()
    assert next(i for i in streamed.output if i.type == "reasoning").content[0].text == reasoning[0].content[0].text


def test_text_format_json_schema(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = client.responses.create(
        model="qwen",
        input="Describe a cat as JSON with its name and age.",
        text={"format": {"type": "json_schema", "name": "cat", "schema": schema}},
        temperature=0,
        max_output_tokens=64,
    )
    jsonschema.validate(json.loads(reply.output_text), schema)


def test_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-9", input="hi")
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="qwen", input="hi", tools=[{"type": "web_search"}])
    assert "web_search" in str(e.value)
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,aGk="}]}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="qwen", input=[image])
    assert "input_image" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="qwen", input="hi", max_output_tokens=5000)
    assert "max_output_tokens" in str(e.value)
