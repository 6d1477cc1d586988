"""gpt-oss's harmony chat format through the real server, on the tiny random gpt-oss model given
harmony's special tokens and a chat template in gpt-oss's shape (tests/helpers/harmony_chat.py): the
template renders tools, calls and their results as harmony messages; under tool_choice required or
auto the grammar keeps the reply to harmony messages with schema-valid call arguments, read back as
tool_calls (whole and streamed alike); with no tools the reply is content."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.helpers.chat_model import ASK_FORECAST, FORECAST_SCHEMA, FORECAST_TOOLS
from tests.helpers.harmony_chat import harmony_model
from tests.helpers.server_harness import ThreadedServer
from tokenloom.entrypoints.server.chat_tools import ChatFeatures, make_turn

SCHEMA, TOOLS, ASK = FORECAST_SCHEMA, FORECAST_TOOLS, ASK_FORECAST


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    from tokenloom import LLM
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    folder = harmony_model(tiny_model_dir("gpt_oss"), tmp_path_factory.mktemp("harmony") / "model")
    engine = LLM(str(folder), kv_cache_memory=16 << 20).engine
    with ThreadedServer(build_app(AsyncLLMEngine(engine), "gpt-oss")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), engine


def reassembled(stream) -> tuple[str, str, list[tuple[str, str]], str | None]:
    """(reasoning, content, [(name, arguments)], finish_reason) as a client joins the chunks."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            call["name"] += (tc.function.name or "") if tc.function else ""
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return reasoning, content, [(c["name"], c["arguments"]) for c in calls.values()], finish


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_calls_come_back_as_tool_calls_with_valid_arguments_whole_and_streamed(served, tool_choice):
    client, engine = served
    # a random model's reasoning never ends by itself: bias it to close the analysis message at once
    end = engine.tokenizer.encode("<|end|>", add_special_tokens=False)[0]
    kwargs = dict(
        model="gpt-oss",
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=160,
        temperature=0,
        logit_bias={str(end): 100},
    )
    message = client.chat.completions.create(**kwargs).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in message.message.tool_calls or []]
    if tool_choice == "required":
        assert len(calls) == 1 and message.finish_reason == "tool_calls"
    for name, arguments in calls:
        assert name == "forecast"
        jsonschema.validate(json.loads(arguments), SCHEMA)
    text = (message.message.content or "") + (getattr(message.message, "reasoning_content", None) or "")
    assert "<|" not in text  # no harmony marker leaks into the fields
    reasoning, content, streamed_calls, finish = reassembled(client.chat.completions.create(stream=True, **kwargs))
    assert streamed_calls == calls and finish == message.finish_reason
    assert content == (message.message.content or "")
    assert reasoning == (getattr(message.message, "reasoning_content", None) or "")


def test_the_template_renders_calls_and_results_as_harmony_messages(served):
    _, engine = served
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "forecast", "arguments": '{"city": "Paris", "days": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    features = ChatFeatures.for_template(engine.tokenizer.chat_template)
    turn = make_turn(history, "auto", [TOOLS[0]["function"]], features)  # as the server hands them over
    prompt = engine.tokenizer.apply_chat_template(turn.messages, tools=turn.template_tools)
    assert (
        "<|start|>assistant to=functions.forecast<|channel|>commentary json<|message|>"
        '{"city": "Paris", "days": 3}<|call|>' in prompt
    )
    assert "<|start|>functions.forecast to=assistant<|channel|>commentary<|message|>sunny<|end|>" in prompt
    assert prompt.endswith("<|start|>assistant")
    markers = engine.tokenizer.encode("<|channel|><|message|>", add_special_tokens=False)
    assert len(markers) == 2  # each marker one special token


def test_without_tools_the_reply_is_content(served):
    client, _ = served
    choice = client.chat.completions.create(model="gpt-oss", messages=ASK, max_tokens=8, temperature=0).choices[0]
    assert choice.message.content and choice.message.tool_calls is None
