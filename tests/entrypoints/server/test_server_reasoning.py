"""Reasoning output through the real server: `<think>...</think>` written by a real model comes back
as `reasoning_content`, apart from `content`, whole and streamed. No reasoning model can be installed
here, so Qwen2.5-Coder-0.5B-Instruct is asked to think in the tags (it does, greedily) and the server
runs with --reasoning-parser think."""

from __future__ import annotations

import openai
import pytest

from tests.helpers.server_harness import ThreadedServer
from tokenloom.loader import hub

QWEN = "qwen2.5-coder-0.5b"
pytestmark = pytest.mark.skipif(not hub.is_pulled(QWEN), reason=f"`tokenloom pull {QWEN}` has not run")
THINK = [
    {
        "role": "system",
        "content": "First think step by step between <think> and </think> tags, "
        "then give the answer after the closing tag.",
    },
    {"role": "user", "content": "What is 17 + 25?"},
]


@pytest.fixture(scope="module")
def served():
    from tokenloom import LLM
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    engine = LLM(str(hub.gguf_path(QWEN)), max_model_len=1024, kv_cache_memory=64 << 20).engine
    with ThreadedServer(build_app(AsyncLLMEngine(engine), "qwen", reasoning_parser="think")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0), engine


def test_reasoning_comes_apart_from_content_whole_and_streamed(served):
    client, engine = served
    message = (
        client.chat.completions.create(model="qwen", messages=THINK, temperature=0, max_tokens=64).choices[0].message
    )
    reasoning, content = message.reasoning_content, message.content or ""
    assert "42" in reasoning and "<think>" not in reasoning + content and "</think>" not in reasoning + content

    # the model's raw text, through plain completions on the same templated prompt, is exactly the two parts
    prompt = engine.tokenizer.apply_chat_template(THINK)
    raw = client.completions.create(model="qwen", prompt=prompt, temperature=0, max_tokens=64).choices[0].text
    assert raw.strip() == f"<think>{reasoning}</think>{content}".strip()

    chunks = list(
        client.chat.completions.create(model="qwen", messages=THINK, temperature=0, max_tokens=64, stream=True)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == content
