"""DeepSeek through the real server: the tiny random DeepSeek-V2 (latent attention, grouped routing)
given DeepSeek-V2-Chat's chat template answers a chat, whole and streamed, with the tokens the
engine gives the rendered prompt, several conversations at once as each alone; the tiny DeepSeek-V3
given V3's template and markers (tests/helpers/deepseek_chat.py) calls tools in V3's syntax, read
back as tool_calls with schema-valid arguments, whole and streamed alike."""

from __future__ import annotations

import functools
import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.helpers.chat_model import (
    ASK_FORECAST,
    CHATS,
    FORECAST_SCHEMA,
    FORECAST_TOOLS,
    chat_reply,
    check_forecast_calls,
)
from tests.helpers.server_harness import ThreadedServer
from tokenloom import SamplingParams

# DeepSeek-V2-Chat's template (tokenizer_config.json), with the tiny tokenizer's end token
TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    from tokenloom import LLM
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    folder = shutil.copytree(tiny_model_dir("deepseek_v2"), tmp_path_factory.mktemp("deepseek") / "chat")
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    llm = LLM(str(folder), kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)  # before the server owns the engine
    expected = [r.outputs[0].text for r in llm.generate([rendered(chat) for chat in CHATS], params)]
    with ThreadedServer(build_app(AsyncLLMEngine(llm.engine), "deepseek")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), expected


def rendered(chat: list[dict]) -> str:
    """The template's text for `chat`, written out by hand."""
    text = ""
    for m in chat:
        text += {"user": f"User: {m['content']}\n\n", "system": f"{m['content']}\n\n"}.get(
            m["role"], f"Assistant: {m['content']}<|end|>"
        )
    return text + "Assistant:"


def test_a_chat_reply_is_the_engines_on_the_rendered_prompt_whole_streamed_and_concurrent(served):
    client, expected = served
    ask = dict(model="deepseek", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = functools.partial(chat_reply, client, **ask)
    streamed = functools.partial(chat_reply, client, stream=True, **ask)

    with ThreadPoolExecutor(len(CHATS)) as pool:  # batched in the engine, each its own reply
        assert list(pool.map(whole, CHATS)) == expected
    assert [streamed(chat) for chat in CHATS] == expected
    assert all(expected)  # each reply says something


SCHEMA, TOOLS, ASK = FORECAST_SCHEMA, FORECAST_TOOLS, ASK_FORECAST


@pytest.fixture(scope="module")
def tool_served(tiny_model_dir, tmp_path_factory):
    from tests.helpers.deepseek_chat import deepseek_chat_model
    from tokenloom import LLM
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    folder = deepseek_chat_model(tiny_model_dir("deepseek_v3"), tmp_path_factory.mktemp("deepseek") / "v3")
    engine = LLM(str(folder), kv_cache_memory=16 << 20).engine
    with ThreadedServer(build_app(AsyncLLMEngine(engine), "deepseek-v3")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), engine


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_calls_in_deepseeks_syntax_come_back_as_tool_calls_whole_and_streamed(tool_served, tool_choice):
    client, engine = tool_served
    begin = engine.tokenizer.encode("<｜tool▁calls▁begin｜>", add_special_tokens=False)
    assert len(begin) == 1  # a special token, matched by the grammar as one
    # under auto a random model would rather talk: bias it to open the calls
    kwargs = dict(
        model="deepseek-v3", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=120, temperature=0
    )
    if tool_choice == "auto":
        kwargs["logit_bias"] = {str(begin[0]): 100}
    check_forecast_calls(client, kwargs, "<｜")


def test_the_template_renders_calls_results_and_the_listed_tools(tool_served):
    from tokenloom.entrypoints.server.chat_tools import ChatFeatures, make_turn
    from tokenloom.tool_calling.formats import DEEPSEEK_V3

    _, engine = tool_served
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "forecast", "arguments": '{"city": "Paris", "days": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    features = ChatFeatures.for_template(engine.tokenizer.chat_template)
    assert features.tool_format is DEEPSEEK_V3
    turn = make_turn(history, "auto", [TOOLS[0]["function"]], features)  # as the server hands them over
    prompt = engine.tokenizer.apply_chat_template(turn.messages, tools=turn.template_tools)
    assert prompt.startswith("<｜begin▁of▁sentence｜>## Tools\nYou have access to the following tools:\n\n### forecast")
    assert (
        "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>forecast\n```json\n"
        '{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>' in prompt
    )
    assert prompt.endswith(
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    )
