"""DeepSeek-V3.1's tool-call syntax (the name, then the arguments as bare JSON, between V3's special
markers): read whole and streamed, held to the tools' schemas by the grammars, told apart from V3's
by its template, and fed back to the released template (which applies tojson to the arguments)."""

from __future__ import annotations

import pytest

from tests.helpers.real_templates import real_template, render
from tests.tool_calling.test_deepseek_calls import called_history
from tests.tool_calling.test_tool_calling import TOOLS, _accepts, _streamed, compiler  # noqa: F401 (a fixture)
from tokenloom.tool_calling import detect_format, parse_tool_calls, tool_grammar
from tokenloom.tool_calling.formats import DEEPSEEK_V31, FORMATS
from tokenloom.tool_calling.messages import template_messages

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"

TEMPLATE = real_template("deepseek-ai-DeepSeek-V3.1")  # as the release ships it


def call(name: str, arguments: str) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>"


REPLIES = [
    (BEGIN + call("get_weather", '{"city": "Paris"}') + END, None, [("get_weather", '{"city": "Paris"}')]),
    (
        "Both." + BEGIN + call("get_weather", '{"city": "Paris"}') + call("get_time", "{}") + END,
        "Both.",
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    ("Paris is sunny today.", "Paris is sunny today.", []),
]


@pytest.mark.parametrize("text,content,calls", REPLIES)
def test_replies_parse_to_their_calls_whole_and_streamed(text, content, calls):
    got_content, got = parse_tool_calls(text, DEEPSEEK_V31)
    assert [(c.name, c.arguments) for c in got] == calls
    assert (got_content or None) == (content or None)
    for pieces in ([], [1, 7, 30, 31, 60], list(range(1, len(text), 3))):
        streamed_content, streamed, _ = _streamed(text, DEEPSEEK_V31, pieces)
        assert [(c["name"], c["arguments"]) for c in streamed] == calls
        assert (streamed_content or None) == (content or None)


@pytest.mark.parametrize(
    "text",
    [BEGIN + call("get weather", "{}") + END, BEGIN + call("get_weather", '{"city": Paris}') + END],
)
def test_malformed_calls_come_back_as_text(text):
    assert parse_tool_calls(text, DEEPSEEK_V31) == (text, [])


def test_the_format_is_told_apart_from_v3s_by_its_template():
    from tests.helpers.deepseek_chat import TEMPLATE as V3_TEMPLATE
    from tokenloom.tool_calling.formats import DEEPSEEK_V3

    assert detect_format(TEMPLATE) is DEEPSEEK_V31 and detect_format(V3_TEMPLATE) is DEEPSEEK_V3
    assert FORMATS["deepseek_v31"] is DEEPSEEK_V31  # --tool-call-parser deepseek_v31


@pytest.mark.parametrize(
    "mode,text,ok",
    [
        ("required", BEGIN + call("get_weather", '{"city": "Paris"}') + END, True),
        ("required", BEGIN + call("get_weather", '{"town": "Paris"}') + END, False),  # not its schema
        ("required", BEGIN + "get_weather\n```json\n{}\n```" + END, False),  # V3's fences
        ("auto", "Paris is sunny.", True),
        ("auto", "Let me look." + BEGIN + call("get_weather", '{"city": "Paris"}') + END, True),
    ],
)
def test_grammars_admit_valid_calls_only(compiler, mode, text, ok):  # noqa: F811 (the fixture)
    assert _accepts(compiler, tool_grammar(TOOLS, DEEPSEEK_V31, mode, True), text) == ok


def test_the_template_gets_calls_as_objects_and_the_tools_listed_in_its_syntax():
    functions, history = called_history()
    messages = template_messages(history, functions, DEEPSEEK_V31)
    assert (
        messages[0]["role"] == "system" and BEGIN + call("tool_name", '{"argument": "value"}') in messages[0]["content"]
    )
    text = render("deepseek-ai-DeepSeek-V3.1", messages, bos_token="")
    # the template applies tojson to the arguments: JSON text would come out quoted a second time
    assert BEGIN + call("get_weather", '{"city": "Paris"}') + END in text
    assert text.endswith("<｜tool▁output▁begin｜>18 C<｜tool▁output▁end｜>")  # the model goes on after a result
