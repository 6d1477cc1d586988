"""`tokenloom chat --tools`: a call is shown, the typed result goes back, the model goes on."""

from __future__ import annotations

import json

import pytest

from tokenloom.entrypoints.cli.chat import ChatSession, chat_loop
from tokenloom.loader import hub
from tokenloom.sampling_params import SamplingParams
from tokenloom.tool_calling.messages import load_tools

QWEN = "qwen2.5-coder-0.5b"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def test_a_bad_tools_file_is_a_clear_error(tmp_path):
    path = tmp_path / "tools.json"
    path.write_text('{"not": "a list"}')
    with pytest.raises(ValueError, match="non-empty JSON list"):
        load_tools(str(path))
    path.write_text('[{"type": "function", "function": {"name": "has space"}}]')
    with pytest.raises(ValueError, match="name"):
        load_tools(str(path))


@pytest.mark.skipif(not hub.is_pulled(QWEN), reason=f"`tokenloom pull {QWEN}` has not run")
def test_chat_shows_the_call_and_sends_the_typed_result_back(tmp_path, capsys):
    from tokenloom import LLM

    path = tmp_path / "tools.json"
    path.write_text(json.dumps(TOOLS))
    llm = LLM(str(hub.gguf_path(QWEN)), max_model_len=2048, kv_cache_memory=64 << 20)
    session = ChatSession(llm, SamplingParams(temperature=0, max_tokens=48), None, load_tools(str(path)))
    lines = iter(["What's the weather like in Paris today?", "18 degrees Celsius and sunny"])
    prompts = []

    def read(prompt: str) -> str:
        prompts.append(prompt)
        line = next(lines, None)
        if line is None:
            raise EOFError  # as Ctrl-D
        return line

    assert chat_loop(session, read) == 0
    assert "-> get_weather(" in capsys.readouterr().out
    assert prompts[1] == "result of get_weather> "
    tool_turn = session.history[2]
    assert session.history[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert tool_turn == {
        "role": "tool",
        "tool_call_id": session.history[1]["tool_calls"][0]["id"],
        "name": "get_weather",
        "content": "18 degrees Celsius and sunny",
    }
