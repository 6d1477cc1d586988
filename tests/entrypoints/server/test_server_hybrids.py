"""The hybrids through the real server: the tiny random Granite 4.0-H and Qwen3-Next given their
releases' chat layouts (tests/helpers/granite_chat.py, tests/helpers/qwen3_next_chat.py) answer
chats whole, streamed and several at once with the same replies (each sequence's recurrent state
its own), and call tools in their <tool_call> syntax, read back as tool_calls with schema-valid
arguments, whole and streamed alike."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.helpers.chat_model import ASK_FORECAST, CHATS, FORECAST_TOOLS, chat_reply, check_forecast_calls
from tests.helpers.granite_chat import granite_chat_model
from tests.helpers.qwen3_next_chat import qwen3_next_chat_model
from tests.helpers.server_harness import ThreadedServer

# tiny config -> (how it is made a chat model, how its template renders CHATS[1], and the assistant's
# call and the tool's result in the history of test_the_template_lists_tools_and_renders_calls_and_results)
LAYOUTS = {
    "granite_hybrid": (
        granite_chat_model,
        "<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n",
        '<|start_of_role|>assistant<|end_of_role|><tool_call>\n{"name": "forecast", "arguments": {"city": "Paris"}}'
        "\n</tool_call><|end_of_text|>\n<|start_of_role|>user<|end_of_role|>\n<tool_response>\nsunny\n"
        "</tool_response><|end_of_text|>\n",
    ),
    "qwen3_next": (
        qwen3_next_chat_model,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nOnce upon a time<|im_end|>\n",
        '<|im_start|>assistant\n<tool_call>\n{"name": "forecast", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n",
    ),
}


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def served(request, tiny_model_dir, tmp_path_factory):
    from tokenloom import LLM
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    folder = LAYOUTS[request.param][0](tiny_model_dir(request.param), tmp_path_factory.mktemp(request.param) / "chat")
    engine = LLM(str(folder), kv_cache_memory=16 << 20).engine
    with ThreadedServer(build_app(AsyncLLMEngine(engine), "hybrid")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), engine, LAYOUTS[request.param]


def test_chat_replies_whole_streamed_and_concurrent_agree(served):
    client, engine, layout = served
    ask = dict(model="hybrid", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = functools.partial(chat_reply, client, **ask)
    streamed = functools.partial(chat_reply, client, stream=True, **ask)

    alone = [whole(chat) for chat in CHATS]
    with ThreadPoolExecutor(len(CHATS)) as pool:  # batched in the engine: each its own state
        assert list(pool.map(whole, CHATS)) == alone
    assert [streamed(chat) for chat in CHATS] == alone
    assert all(alone) and "<|" not in "".join(alone)
    prompt = engine.tokenizer.apply_chat_template(CHATS[1])
    assert prompt.startswith(layout[1])


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_calls_in_tool_call_tags_come_back_as_tool_calls_whole_and_streamed(served, tool_choice):
    client, engine, _ = served
    opener = engine.tokenizer.encode("<tool_call>", add_special_tokens=False)
    assert len(opener) == 1
    # the random model pads its JSON with whitespace (the grammar allows it): room for that
    kwargs = dict(model="hybrid", messages=ASK_FORECAST, tools=FORECAST_TOOLS, tool_choice=tool_choice)
    kwargs |= dict(max_tokens=400, temperature=0)
    if tool_choice == "auto":  # a random model would rather talk: bias it to open a call
        kwargs["logit_bias"] = {str(opener[0]): 100}
    check_forecast_calls(client, kwargs, "<tool_call>")


def test_the_template_lists_tools_and_renders_calls_and_results(served):
    from tokenloom.entrypoints.server.chat_tools import ChatFeatures, make_turn
    from tokenloom.tool_calling.formats import HERMES

    _, engine, layout = served
    history = ASK_FORECAST + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "forecast", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    features = ChatFeatures.for_template(engine.tokenizer.chat_template)
    assert features.tool_format is HERMES
    turn = make_turn(history, "auto", [FORECAST_TOOLS[0]["function"]], features)
    prompt = engine.tokenizer.apply_chat_template(turn.messages, tools=turn.template_tools)
    assert '<tools>\n{"type": "function", "function": {"name": "forecast"' in prompt
    assert layout[2] in prompt
