"""Command R7B's tool calls (a pretty-printed list of numbered call objects between
<|START_ACTION|> and <|END_ACTION|>), its plan as reasoning and its <|START_RESPONSE|> answers:
read whole and streamed, and held to the tools' schemas by the grammars."""

from __future__ import annotations

import pytest

from tests.tool_calling.test_tool_calling import TOOLS, _accepts, _streamed, compiler  # noqa: F401 (a fixture)
from tokenloom.entrypoints.server.chat_tools import ChatFeatures, ReplyStream, read_reply
from tokenloom.tool_calling import parse_tool_calls, tool_grammar
from tokenloom.tool_calling.formats import COMMAND_R7B
from tokenloom.tool_calling.stream import MarkerFilter


def action(*calls: tuple[str, str]) -> str:
    """Calls as the release's template writes them."""
    body = ",\n".join(
        f'    {{"tool_call_id": "{i}", "tool_name": "{n}", "parameters": {a}}}' for i, (n, a) in enumerate(calls)
    )
    return f"<|START_ACTION|>[\n{body}\n]<|END_ACTION|>"


REPLIES = [
    (action(("get_weather", '{"city": "Paris"}')), None, [("get_weather", '{"city": "Paris"}')]),
    (
        action(("get_weather", '{"city": "Paris"}'), ("get_time", "{}")),
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    ("<|START_RESPONSE|>Paris is sunny today.<|END_RESPONSE|>", "Paris is sunny today.", []),
    ("Paris is sunny today.", "Paris is sunny today.", []),  # decoded without its special tokens
]


@pytest.mark.parametrize("text,content,calls", REPLIES)
def test_replies_parse_to_their_calls_whole_and_streamed(text, content, calls):
    got_content, got = parse_tool_calls(text, COMMAND_R7B)
    assert [(c.name, c.arguments) for c in got] == calls
    assert (got_content or None) == content
    for pieces in ([], [1, 5, 17, 18, 40], list(range(1, len(text), 2))):
        streamed_content, streamed, _ = _streamed(text, COMMAND_R7B, pieces)
        assert [(c["name"], c["arguments"]) for c in streamed] == calls
        assert (streamed_content or None) == content


@pytest.mark.parametrize(
    "text",
    [
        '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_time", "parameters": {}}<|END_ACTION|>',  # no ]
        '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": X}}]<|END_ACTION|>',
        '<|START_ACTION|>[{"tool_call_id": "0", "parameters": {}}]<|END_ACTION|>',  # no tool named
    ],
)
def test_malformed_calls_come_back_as_text(text):
    assert parse_tool_calls(text, COMMAND_R7B) == (text, [])


def test_the_plan_is_reasoning_and_the_answer_loses_its_markers_whole_and_streamed():
    features = ChatFeatures.for_template("<|START_ACTION|> tools <|END_THINKING|>")
    assert features.tool_format is COMMAND_R7B and features.reasoning
    reply = "<|START_THINKING|>Look it up.<|END_THINKING|>" + action(("get_weather", '{"city": "Paris"}'))
    whole = read_reply(reply, "<|CHATBOT_TOKEN|>", "auto", features)
    assert whole.reasoning == "Look it up." and not whole.content
    assert [c["function"]["name"] for c in whole.tool_calls] == ["get_weather"]
    answer = "<|START_RESPONSE|>Sunny.<|END_RESPONSE|>"
    for mode in ("auto", "none"):  # no calls read under tool_choice none: the markers still go
        assert read_reply(answer, "<|START_THINKING|><|END_THINKING|>", mode, features).content == "Sunny."
        stream = ReplyStream("<|START_THINKING|><|END_THINKING|>", mode, features)
        deltas = [stream.feed(answer[i : i + 3], i + 3 >= len(answer)) for i in range(0, len(answer), 3)]
        assert "".join(d.get("content", "") for d in deltas) == "Sunny."


def test_the_marker_filter_holds_a_marker_cut_between_deltas():
    f = MarkerFilter(("<|START_RESPONSE|>", "<|END_RESPONSE|>"))
    assert f.feed("<|START_RES") == "" and f.feed("PONSE|>Hi <") == "Hi " and f.feed("b> ok<|END_") == "<b> ok"
    assert f.feed("RESPONSE|>") == "" and f.finish() == ""
    assert f.feed("a <|") == "a " and f.finish() == "<|"  # what never became a marker is said at the end


CALL = action(("get_weather", '{"city": "Paris"}'))


@pytest.mark.parametrize(
    "mode,text,ok",
    [
        ("required", CALL, True),
        ("required", action(("get_weather", '{"city": "Paris"}'), ("get_time", "{}")), True),
        ("required", action(("get_weather", '{"town": "Paris"}')), False),  # not its schema
        ("required", '<|START_ACTION|>[{"tool_name": "get_time", "parameters": {}}]<|END_ACTION|>', False),  # no number
        ("required", "<|START_RESPONSE|>Sunny.<|END_RESPONSE|>", False),
        ("auto", "<|START_RESPONSE|>Paris is sunny.<|END_RESPONSE|>", True),
        ("auto", "Paris is sunny.", True),
        ("auto", "<|START_THINKING|>Look it up.<|END_THINKING|>" + CALL, True),
        ("auto", "<|START_THINKING|>Look it up.<|END_THINKING|><|START_RESPONSE|>Sunny.<|END_RESPONSE|>", True),
    ],
)
def test_grammars_admit_valid_calls_only(compiler, mode, text, ok):  # noqa: F811 (the fixture)
    assert _accepts(compiler, tool_grammar(TOOLS, COMMAND_R7B, mode, True), text) == ok
