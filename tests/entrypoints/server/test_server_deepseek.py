"""DeepSeek through the real server: the tiny random DeepSeek-V2 (latent attention, grouped routing)
given DeepSeek-V2-Chat's chat template answers a chat, whole and streamed, with the tokens the
engine gives the rendered prompt, several conversations at once as each alone."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

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
CHATS = [
    [{"role": "user", "content": "The quick brown fox?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon a time"}],
    [
        {"role": "user", "content": "a cat"},
        {"role": "assistant", "content": "the dog"},
        {"role": "user", "content": "jumps over"},
    ],
]


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

    def whole(chat):
        return client.chat.completions.create(messages=chat, **ask).choices[0].message.content

    def streamed(chat):
        stream = client.chat.completions.create(messages=chat, stream=True, **ask)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(len(CHATS)) as pool:  # batched in the engine, each its own reply
        assert list(pool.map(whole, CHATS)) == expected
    assert [streamed(chat) for chat in CHATS] == expected
    assert all(expected)  # each reply says something
