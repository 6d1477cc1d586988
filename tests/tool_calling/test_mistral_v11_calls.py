"""The tool-call syntax of Mistral's v11+ tokenizers (Mistral Small 3.2, Devstral, Magistral):
``[TOOL_CALLS]NAME[ARGS]{...}`` per call, Mistral Small 3.2's with ``[CALL_ID]ID`` before
``[ARGS]``: read whole and streamed, and held to the tools' schemas by the grammars."""

from __future__ import annotations

import pytest

from tests.tool_calling.test_tool_calling import TOOLS, _accepts, _streamed, compiler  # noqa: F401 (a fixture)
from tokenloom.tool_calling import parse_tool_calls, tool_grammar
from tokenloom.tool_calling.formats import MISTRAL_V11

REPLIES = [
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [("get_weather", '{"city": "Paris"}')]),
    (
        '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}'
        "[TOOL_CALLS]get_time[CALL_ID]x9y8z7w6v[ARGS]{}",
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    ('Checking.[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}', "Checking.", [("get_time", '{"tz": "UTC"}')]),
    ("Paris is sunny today.", "Paris is sunny today.", []),
]


@pytest.mark.parametrize("text,content,calls", REPLIES)
def test_replies_parse_to_their_calls_whole_and_streamed(text, content, calls):
    got_content, got = parse_tool_calls(text, MISTRAL_V11)
    assert [(c.name, c.arguments) for c in got] == calls
    assert (got_content or None) == content
    for pieces in ([], [1, 5, 13, 14, 30], list(range(1, len(text), 2))):
        streamed_content, streamed, _ = _streamed(text, MISTRAL_V11, pieces)
        assert [(c["name"], c["arguments"]) for c in streamed] == calls
        assert (streamed_content or None) == content


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS]get_weather[CALL_ID]not-an-id![ARGS]{"city": "Paris"}',
        '[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}',
        "[TOOL_CALLS]get_weather[ARGS][1, 2]",
    ],
)
def test_malformed_calls_come_back_as_text(text):
    assert parse_tool_calls(text, MISTRAL_V11) == (text, [])


@pytest.mark.parametrize(
    "mode,text,ok",
    [
        ("required", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', True),
        ("required", '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}', True),
        ("required", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', True),
        ("required", '[TOOL_CALLS]get_weather[ARGS]{"town": "Paris"}', False),  # not its schema
        ("required", '[TOOL_CALLS]get_weather[CALL_ID]short[ARGS]{"city": "Paris"}', False),  # ids are 9 long
        ("required", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', False),  # the older syntax
        ("auto", "Paris is sunny.", True),
        ("auto", 'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', True),
    ],
)
def test_grammars_admit_valid_calls_only(compiler, mode, text, ok):  # noqa: F811 (the fixture)
    assert _accepts(compiler, tool_grammar(TOOLS, MISTRAL_V11, mode, True), text) == ok
