"""A tiny random model made a chat model of some family: its markers added to the tiny tokenizer as
special tokens (the tiny vocabulary leaves room for them), its chat template and end tokens; and a
tool a random model can call validly (short enum and integer arguments)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Tokenizer

# a random model fills a free string or number up to max_tokens: short values only
FORECAST_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
FORECAST_TOOLS = [
    {"type": "function", "function": {"name": "forecast", "description": "Weather", "parameters": FORECAST_SCHEMA}}
]
# conversations for a chat test: a user turn alone, after a system turn, and after an exchange
CHATS = [
    [{"role": "user", "content": "The quick brown fox?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Once upon a time"}],
    [
        {"role": "user", "content": "a cat"},
        {"role": "assistant", "content": "the dog"},
        {"role": "user", "content": "jumps over"},
    ],
]
ASK_FORECAST = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


def marked_chat_model(
    folder: Path,
    out: Path,
    markers: tuple[str, ...],
    template: str,
    ends: tuple[str, ...],
    tokens: dict | None = None,
    positions: int = 1024,
) -> Path:
    """`folder` copied to `out` with `markers` as special tokens, `template` as its chat template,
    the `ends` markers as its end tokens, `tokens` (e.g. bos_token) in tokenizer_config.json, and
    room for a prompt that lists tools (`positions`)."""
    shutil.copytree(folder, out)
    config = json.loads((out / "config.json").read_text()) | {"max_position_embeddings": positions}
    (out / "config.json").write_text(json.dumps(config))
    tk = Tokenizer.from_file(str(out / "tokenizer.json"))
    tk.add_special_tokens([AddedToken(m, special=True) for m in markers])
    tk.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(template)
    if tokens:
        (out / "tokenizer_config.json").write_text(json.dumps(tokens))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [tk.token_to_id(e) for e in ends]}))
    return out


def chat_reply(client, chat: list[dict], stream: bool = False, **ask) -> str:
    """The server's reply (an openai client) to `chat` with `ask`: whole, or the streamed deltas joined."""
    if not stream:
        return client.chat.completions.create(messages=chat, **ask).choices[0].message.content
    chunks = client.chat.completions.create(messages=chat, stream=True, **ask)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def check_forecast_calls(client, kwargs: dict, marker: str) -> list[tuple[str, str]]:
    """Asks the server (an openai client) with `kwargs` whole and streamed: both give the same
    tool calls, each to forecast with arguments valid against FORECAST_SCHEMA, finish reason
    tool_calls, and no `marker` of the call syntax in the content. Returns the calls."""
    import jsonschema

    choice = client.chat.completions.create(**kwargs).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert calls and choice.finish_reason == "tool_calls"
    for name, arguments in calls:
        assert name == "forecast"
        jsonschema.validate(json.loads(arguments), FORECAST_SCHEMA)
    assert marker not in (choice.message.content or "")
    streamed: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        finish = chunk.choices[0].finish_reason or finish
        for tc in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(tc.index, ["", ""])
            entry[0] += (tc.function.name or "") if tc.function else ""
            entry[1] += (tc.function.arguments or "") if tc.function else ""
    assert [tuple(v) for v in streamed.values()] == calls and finish == "tool_calls"
    return calls
