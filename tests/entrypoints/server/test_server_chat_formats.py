"""GLM-4, Command R7B (Cohere 2) and SmolLM3 through the real server in their releases' chat layouts
(tests/helpers/family_chats.py; Command R7B's and SmolLM3's released templates): the prompt is the
template's text with its markers as single special tokens and no second BOS, replies agree whole,
streamed and concurrent with no marker in the text, and each family's end tokens end a reply.
Command R7B's and Qwen3-Coder's tool calls come back whole and streamed, valid against the tools'
schemas."""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.helpers.chat_model import ASK_FORECAST, CHATS, FORECAST_TOOLS, chat_reply, check_forecast_calls
from tests.helpers.family_chats import COMMAND_R7B, GLM4, QWEN3_CODER, SMOLLM3, family_chat_model
from tests.helpers.real_templates import render
from tests.helpers.server_harness import ThreadedServer

# tiny config -> (family layout, how its template renders CHATS[1])
FAMILIES = {
    "glm4": (GLM4, "[gMASK]<sop><|system|>\nBe brief.<|user|>\nOnce upon a time<|assistant|>\n"),
    "cohere2": (
        COMMAND_R7B,
        render("CohereForAI-c4ai-command-r7b-12-2024-tool_use", CHATS[1], bos_token="<BOS_TOKEN>"),
    ),
    "smollm3": (SMOLLM3, render("HuggingFaceTB-SmolLM3-3B", CHATS[1])),
    "qwen3_moe": (QWEN3_CODER, render("Qwen3-Coder", CHATS[1])),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request, tiny_model_dir, tmp_path_factory):
    from tokenloom import LLM
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    family, rendered = FAMILIES[request.param]
    folder = family_chat_model(tiny_model_dir(request.param), tmp_path_factory.mktemp(request.param) / "chat", family)
    engine = LLM(str(folder), kv_cache_memory=16 << 20).engine
    with ThreadedServer(build_app(AsyncLLMEngine(engine), "chat")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), engine, family, rendered


def test_the_prompt_is_the_template_text_with_each_marker_one_token(served):
    _, engine, (markers, *_), rendered = served
    tokenizer = engine.tokenizer
    assert tokenizer.apply_chat_template(CHATS[1]) == rendered
    ids = tokenizer.encode_chat(CHATS[1])
    special = {m: tokenizer.encode(m, add_special_tokens=False) for m in markers}
    assert all(len(i) == 1 for i in special.values())
    for marker, (token,) in special.items():  # each marker once as its token, never spelled out
        assert ids.count(token) == rendered.count(marker)
    assert tokenizer.decode(ids, skip_special_tokens=False) == rendered
    if "<BOS_TOKEN>" in markers:  # the tokenizer adds it to plain text; the chat's prompt holds one
        assert tokenizer.encode("hi")[0] == special["<BOS_TOKEN>"][0]


def test_replies_agree_whole_streamed_and_concurrent_without_markers(served):
    client, _, (markers, *_), _ = served
    ask = dict(model="chat", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = functools.partial(chat_reply, client, **ask)
    alone = [whole(chat) for chat in CHATS]
    with ThreadPoolExecutor(len(CHATS)) as pool:
        assert list(pool.map(whole, CHATS)) == alone
    assert [chat_reply(client, chat, stream=True, **ask) for chat in CHATS] == alone
    assert all(alone) and not any(m in reply for m in markers for reply in alone)


def test_each_end_token_of_the_family_ends_a_reply(served):
    client, engine, (_, _, ends, _), _ = served
    for end in ends:
        (token,) = engine.tokenizer.encode(end, add_special_tokens=False)
        reply = client.chat.completions.create(
            model="chat", messages=CHATS[0], max_tokens=16, temperature=0, logit_bias={str(token): 100}
        ).choices[0]
        assert (reply.finish_reason, reply.message.content) == ("stop", "")


OPENERS = {id(COMMAND_R7B): "<|START_ACTION|>", id(QWEN3_CODER): "<tool_call>"}  # families whose calls are read


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_calls_come_back_valid_whole_and_streamed(served, tool_choice):
    client, engine, family, _ = served
    if id(family) not in OPENERS:
        pytest.skip("a family without tool calls here")
    opener = OPENERS[id(family)]
    # the random model pads its JSON with whitespace (the grammar allows it): room for that
    kwargs = dict(model="chat", messages=ASK_FORECAST, tools=FORECAST_TOOLS, tool_choice=tool_choice)
    kwargs |= dict(max_tokens=400, temperature=0)
    if tool_choice == "auto":  # a random model would rather talk: bias it to open a call (once: the bias
        (token,) = engine.tokenizer.encode(opener, add_special_tokens=False)  # would open another after it)
        kwargs |= dict(logit_bias={str(token): 100}, parallel_tool_calls=False)
    check_forecast_calls(client, kwargs, opener)
