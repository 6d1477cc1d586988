"""gpt-oss's harmony replies read back as OpenAI's fields, whole and streamed, on the examples of
OpenAI's harmony documentation (the reply after the prompt's `<|start|>assistant`)."""

from __future__ import annotations

import json

import pytest

from tokenloom.entrypoints.server.chat_tools import ChatFeatures, ReplyStream, read_reply
from tokenloom.tool_calling.formats import detect_format
from tokenloom.tool_calling.harmony import HarmonyStream, read_harmony

# "Receiving the model's output": reasoning, then the answer
ANSWER = (
    '<|channel|>analysis<|message|>User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.<|end|>'
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>"
)
# "Function calling": reasoning, then a call in the commentary channel (recipient in the header)
CALL = (
    "<|channel|>analysis<|message|>Need to use function get_current_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_current_weather <|constrain|>json"
    '<|message|>{"location":"San Francisco"}<|call|>'
)
# the recipient may also come before the channel, and <|call|> (a stop token) may be cut from the text
CALL_ROLE_FIRST = (
    "<|channel|>analysis<|message|>Two cities.<|end|>"
    '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"city": "Tokyo"}<|call|>'
    '<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{"city": "Paris"}'
)


def test_an_answer_is_reasoning_then_content():
    reply = read_harmony(ANSWER)
    assert reply.reasoning == 'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.'
    assert reply.content == "2 + 2 = 4."
    assert reply.calls == []


def test_a_call_in_the_commentary_channel_is_a_tool_call():
    reply = read_harmony(CALL)
    assert reply.reasoning == "Need to use function get_current_weather."
    assert reply.content is None
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [
        ("get_current_weather", {"location": "San Francisco"})
    ]


def test_calls_with_the_recipient_first_and_the_last_stop_token_dropped():
    reply = read_harmony(CALL_ROLE_FIRST)
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [
        ("lookup", {"city": "Tokyo"}),
        ("lookup", {"city": "Paris"}),
    ]
    cut = read_harmony(CALL_ROLE_FIRST[:-4], cut=True)  # max_tokens inside the second call
    assert [c.name for c in cut.calls] == ["lookup"]


def test_a_reply_without_markers_is_content():
    assert read_harmony("plain text").content == "plain text"


@pytest.mark.parametrize("text", [ANSWER, CALL, CALL_ROLE_FIRST])
@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_deltas_join_to_the_whole_reading(text, step):
    stream = HarmonyStream()
    reasoning, content, calls = "", "", []
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for piece in pieces:
        r, c, k = stream.feed(piece)
        assert "<|" not in r + c and not (r + c).endswith("<")  # no marker (or part of one) is said
        reasoning, content, calls = reasoning + r, content + c, calls + k
    r, c, k = stream.finish()
    reasoning, content, calls = reasoning + r, content + c, calls + k
    whole = read_harmony(text)
    assert reasoning == (whole.reasoning or "") and content == (whole.content or "")
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in calls] == [
        (c.name, c.arguments) for c in whole.calls
    ]
    assert [d["index"] for d in calls] == list(range(len(calls)))


def test_the_server_reads_a_harmony_template_as_harmony():
    template = (
        "{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}<|end|>{% endfor %}"
    )
    features = ChatFeatures.for_template(template)
    assert features.harmony and features.reasoning and detect_format(template).name == "harmony"
    reply = read_reply(CALL, "", "auto", features)
    message = reply.message()
    assert message["reasoning_content"] == "Need to use function get_current_weather."
    assert message["content"] is None
    assert message["tool_calls"][0]["function"] == {
        "name": "get_current_weather",
        "arguments": '{"location":"San Francisco"}',
    }
    stream = ReplyStream("", "auto", features)
    deltas = [stream.feed(ch, i == len(ANSWER) - 1) for i, ch in enumerate(ANSWER)]
    assert "".join(d.get("content", "") for d in deltas) == "2 + 2 = 4."
    assert "".join(d.get("reasoning_content", "") for d in deltas).startswith("User asks")
    assert not stream.has_calls
    assert not ChatFeatures.for_template(template, reasoning_parser="none").reasoning


def test_a_cut_reply_says_its_last_characters_and_never_a_raw_header():
    """Cut by max_tokens: a trailing "<" (which could have begun a marker) is text after all, in the
    stream as in the whole reading; a reply cut inside its first header says nothing."""
    text = "<|channel|>analysis<|message|>is a < b? x <"
    stream = HarmonyStream()
    said = stream.feed(text)[0] + stream.finish(cut=True)[0]
    assert said == read_harmony(text, cut=True).reasoning == "is a < b? x <"
    header_only = read_harmony("<|channel|>analy", cut=True)
    assert header_only.content is None and header_only.reasoning is None
    stream = HarmonyStream()
    assert stream.feed("<|channel|>analy") == ("", "", []) and stream.finish(cut=True) == ("", "", [])


def test_a_harmony_grammar_that_must_call_needs_a_tool():
    from tokenloom.tool_calling.grammar import harmony_grammar

    with pytest.raises(ValueError, match="at least one tool"):
        harmony_grammar([], "required")
    assert "start: analysis? (final)" in harmony_grammar([], "none")
