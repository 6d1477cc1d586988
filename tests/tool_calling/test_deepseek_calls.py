"""DeepSeek-V3's tool-call syntax (the name outside the arguments, between its special markers): read
whole and streamed, held to the tools' schemas by the grammars, and its template fed calls and
results as it concatenates them, the tools listed in a system message in its syntax."""

from __future__ import annotations

import json

import jinja2
import pytest

from tests.helpers.deepseek_chat import TEMPLATE
from tests.tool_calling.test_tool_calling import TOOLS, _accepts, _streamed, compiler  # noqa: F401 (a fixture)
from tokenloom.tool_calling import detect_format, parse_tool_calls, tool_grammar
from tokenloom.tool_calling.formats import DEEPSEEK_V3
from tokenloom.tool_calling.messages import function_of, template_messages

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def call(name: str, arguments: str) -> str:
    return f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```<｜tool▁call▁end｜>"


# (reply as DeepSeek-V3's template writes an assistant's calls, content, [(name, arguments)])
REPLIES = [
    (BEGIN + call("get_weather", '{"city": "Paris"}') + END, None, [("get_weather", '{"city": "Paris"}')]),
    (
        "Both, then." + BEGIN + call("get_weather", '{"city": "Paris"}') + "\n" + call("get_time", "{}") + END,
        "Both, then.",
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    (
        BEGIN + call("get_time", '{\n  "tz": "Europe/Paris",\n  "fmt": "a } in \\" a string"\n}') + END,
        None,
        [("get_time", '{\n  "tz": "Europe/Paris",\n  "fmt": "a } in \\" a string"\n}')],
    ),
    ("Paris is sunny today.", "Paris is sunny today.", []),
]
MALFORMED = [
    BEGIN + call("get weather", '{"city": "Paris"}') + END,  # a name with a space
    BEGIN + call("get_weather", "[1, 2]") + END,  # arguments not an object
    BEGIN + call("get_weather", '{"city": Paris}') + END,  # invalid JSON
    BEGIN + "I will not call anything after all.",
]


def called_history() -> tuple[list, list[dict]]:
    """(the test tools as the server hands them over, a conversation whose assistant called one
    with its arguments as an object, and the tool's result)."""
    functions = [function_of(t, i) for i, t in enumerate([{"type": "function", "function": t} for t in TOOLS])]
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]
    return functions, history


@pytest.mark.parametrize("text,content,calls", REPLIES)
def test_replies_parse_to_their_calls_whole_and_streamed(text, content, calls):
    got_content, got = parse_tool_calls(text, DEEPSEEK_V3)
    assert [(c.name, c.arguments) for c in got] == calls
    assert (got_content or None) == (content or None)
    for pieces in ([], [1, 7, 30, 31, 60], list(range(1, len(text), 3))):
        streamed_content, streamed, _ = _streamed(text, DEEPSEEK_V3, pieces)
        assert [(c["name"], c["arguments"]) for c in streamed] == calls
        assert (streamed_content or None) == (content or None)


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_calls_come_back_as_text(text):
    assert parse_tool_calls(text, DEEPSEEK_V3) == (text, [])


def test_a_reply_cut_inside_a_call_keeps_the_complete_ones():
    text = BEGIN + call("get_weather", '{"city": "Paris"}') + "\n" + call("get_time", '{"tz": "Eur')[:-20]
    content, calls = parse_tool_calls(text, DEEPSEEK_V3, cut=True)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')] and content == ""


def test_the_format_is_read_from_deepseeks_template():
    assert detect_format(TEMPLATE) is DEEPSEEK_V3


@pytest.mark.parametrize(
    "mode,text,ok",
    [
        ("required", BEGIN + call("get_weather", '{"city": "Paris"}') + END, True),
        ("required", BEGIN + call("get_weather", '{"city": "Paris"}') + "\n" + call("get_time", "{}") + END, True),
        ("required", BEGIN + call("get_weather", '{"town": "Paris"}') + END, False),  # not its schema
        ("required", BEGIN + call("get_wether", '{"city": "Paris"}') + END, False),  # no such tool
        ("required", "Paris is sunny.", False),
        ("auto", "Paris is sunny.", True),
        ("auto", "Let me look." + BEGIN + call("get_weather", '{"city": "Paris"}') + END, True),
        ("auto", "Let me look." + BEGIN + "the weather please", False),  # once opened, only a valid call
    ],
)
def test_grammars_admit_valid_calls_only(compiler, mode, text, ok):  # noqa: F811 (the fixture)
    assert _accepts(compiler, tool_grammar(TOOLS, DEEPSEEK_V3, mode, True), text) == ok


def test_the_template_gets_calls_as_text_and_the_tools_in_a_system_message():
    """DeepSeek's template concatenates a call's arguments (an object would not join a string) and
    renders no tools: they come first, listed in its syntax."""
    functions, history = called_history()
    messages = template_messages(history, functions, DEEPSEEK_V3)
    assert messages[0]["role"] == "system" and "### get_weather" in messages[0]["content"]
    assert BEGIN + call("tool_name", '{"argument": "value"}') in messages[0]["content"]
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == json.dumps({"city": "Paris"})
    text = (
        jinja2.Environment().from_string(TEMPLATE).render(messages=messages, bos_token="", add_generation_prompt=True)
    )
    assert BEGIN + call("get_weather", '{"city": "Paris"}') + END in text
    assert text.endswith("<｜tool▁output▁begin｜>18 C<｜tool▁output▁end｜><｜tool▁outputs▁end｜>")
