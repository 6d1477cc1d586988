"""Qwen3-Coder's tool calls (a function tag holding one tag per parameter, values as plain text):
read whole and streamed with each value read by its schema's type, told apart from hermes by the
template, and held to the tools' schemas by the grammars."""

from __future__ import annotations

import json

import pytest

from tests.helpers.real_templates import real_template
from tests.tool_calling.test_tool_calling import _accepts, _streamed, compiler  # noqa: F401 (a fixture)
from tokenloom.tool_calling import detect_format, parse_tool_calls, tool_grammar
from tokenloom.tool_calling.formats import HERMES, QWEN3_CODER
from tokenloom.tool_calling.stream import ToolCallStream

TOOLS = [
    {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer"},
                "exact": {"type": "boolean"},
                "filters": {"type": "object", "properties": {"lang": {"type": "string"}}},
                "tags": {"type": ["array", "null"], "items": {"type": "string"}},
                "sort": {"enum": ["new", "old"]},
            },
            "required": ["query"],
        },
    },
    {"name": "now", "parameters": {"type": "object", "properties": {}}},
]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}


def call(name: str, **params: str) -> str:
    """A call as Qwen3-Coder's template writes it."""
    tags = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{tags}</function>\n</tool_call>"


REPLIES = [
    # a string that reads as a number stays a string; the integer, the boolean (as Python writes it)
    # and the object become theirs; a null as Python writes it
    (
        call("search", query="42", limit="3", exact="True", filters='{"lang": "en"}', tags="None"),
        None,
        [("search", {"query": "42", "limit": 3, "exact": True, "filters": {"lang": "en"}, "tags": None})],
    ),
    (
        "Let me look.\n" + call("search", query="line one\nline two <b>") + "\n" + call("now"),
        "Let me look.",
        [("search", {"query": "line one\nline two <b>"}), ("now", {})],
    ),
    ("Here is the answer.", "Here is the answer.", []),
]


@pytest.mark.parametrize("text,content,calls", REPLIES)
def test_replies_parse_to_their_calls_by_the_schemas_whole_and_streamed(text, content, calls):
    got_content, got = parse_tool_calls(text, QWEN3_CODER, schemas=SCHEMAS)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert (got_content or None) == content
    for step in (1, 3, 7):
        stream, said, names, arguments = ToolCallStream(QWEN3_CODER, SCHEMAS), "", {}, {}
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        for delta in [stream.feed(p) for p in pieces] + [stream.finish()]:
            said += delta.content
            for d in delta.tool_calls:
                names[d["index"]] = d["function"].get("name", names.get(d["index"]))
                arguments[d["index"]] = arguments.get(d["index"], "") + d["function"].get("arguments", "")
        assert [(names[i], json.loads(arguments[i])) for i in sorted(names)] == calls
        assert (said or None) == content


def test_without_schemas_every_value_is_text():
    _, (got,) = parse_tool_calls(call("search", query="q", limit="3"), QWEN3_CODER)
    assert json.loads(got.arguments) == {"query": "q", "limit": "3"}
    _, streamed, _ = _streamed(call("now"), QWEN3_CODER, [5, 20])
    assert [(c["name"], c["arguments"]) for c in streamed] == [("now", "{}")]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>\n<function=search>\n<parameter=query>\nq\n</function>\n</tool_call>",  # a tag left open
        "<tool_call>\n<function=bad name>\n</function>\n</tool_call>",
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',  # hermes's object is not this format
    ],
)
def test_malformed_calls_come_back_as_text(text):
    assert parse_tool_calls(text, QWEN3_CODER, schemas=SCHEMAS) == (text, [])


def test_the_format_is_told_apart_from_hermes_by_its_template():
    assert detect_format(real_template("Qwen3-Coder")) is QWEN3_CODER
    assert detect_format(real_template("Qwen-Qwen3-0.6B")) is HERMES


@pytest.mark.parametrize(
    "mode,text,ok",
    [
        ("required", call("search", query="cats"), True),
        ("required", call("search", query="two\nlines", limit="5", exact="false"), True),
        ("required", call("search", query="cats", tags='["a", "b"]'), True),  # optional ones may be left out
        ("required", call("search", query="cats") + "\n" + call("now"), True),
        ("required", call("search", query="cats", sort="old"), True),
        ("required", call("search", query="cats", sort="older"), False),  # not one of the enum's
        ("required", call("search", limit="5"), False),  # the required query missing
        ("required", call("search", query="cats", limit="five"), False),  # not an integer
        ("required", call("search", limit="5", query="cats"), False),  # the schema's order
        ("required", call("search", query="cats", color="red"), False),  # not a parameter of the tool
        ("required", call("lookup", query="cats"), False),  # not a tool
        ("auto", "Sure.", True),
        ("auto", "Let me look.\n" + call("now"), True),
    ],
)
def test_grammars_admit_valid_calls_only(compiler, mode, text, ok):  # noqa: F811 (the fixture)
    assert _accepts(compiler, tool_grammar(TOOLS, QWEN3_CODER, mode, True), text) == ok
