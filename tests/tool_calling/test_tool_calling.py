"""Tool-call and reasoning parsers on recorded replies of each family, whole and streamed, and
the grammars that make calls valid (checked with llguidance on a real tokenizer)."""

from __future__ import annotations

import itertools
import json

import pytest

from tokenloom.tool_calling import (
    FORMATS,
    ReasoningStream,
    ToolCallStream,
    detect_format,
    parse_tool_calls,
    split_reasoning,
    tool_grammar,
)
from tokenloom.tool_calling.formats import GENERIC, HERMES, LLAMA3_JSON, MISTRAL
from tokenloom.tool_calling.grammar import no_call_grammar
from tokenloom.tool_calling.messages import function_of, template_messages

WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'

PRETTY_ARGS = '{\n    "city": "Tokyo",\n    "unit": "celsius"\n  }'
PRETTY = f'{{\n  "name": "get_weather",\n  "arguments": {PRETTY_ARGS}\n}}'

# (format, reply as a model wrote it, expected content, expected [(name, arguments)])
RECORDED = [
    # Qwen2.5-Coder-0.5B under the tools grammar (tool_choice required), and its own bare answer
    (
        HERMES,
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n</tool_call>',
        None,
        [("get_weather", WEATHER_ARGS)],
    ),
    (HERMES, f'{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}', None, [("get_weather", WEATHER_ARGS)]),
    (
        HERMES,
        'I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris", "fmt": "a } in \\" a string"}}\n'
        "</tool_call>",
        "I will check both.",
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "Europe/Paris", "fmt": "a } in \\" a string"}')],
    ),
    # ... and, asked in other words, the same call fenced as a ```json block (recorded)
    (
        HERMES,
        '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (HERMES, "```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    (HERMES, "The capital of France is Paris.", "The capital of France is Paris.", []),
    (HERMES, '{"answer": 42}', '{"answer": 42}', []),  # JSON that is not a call
    # Llama 3.1/3.2 (JSON tool calling, "parameters", calls joined by ;)
    (
        LLAMA3_JSON,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    # Mistral v0.3
    (
        MISTRAL,
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Lyon"}}]',
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Lyon"}')],
    ),
    # a call with no arguments at all takes none
    (HERMES, '<tool_call>\n{"name": "now"}\n</tool_call>', None, [("now", "{}")]),
    # pretty-printed calls, bare and fenced, as Qwen2.5-Coder-0.5B writes them at temperature 1 (recorded)
    (HERMES, PRETTY, None, [("get_weather", PRETTY_ARGS)]),
    (HERMES, f"```json\n{PRETTY}\n```", None, [("get_weather", PRETTY_ARGS)]),
    (HERMES, f"<tool_call>\n{PRETTY}\n</tool_call>", None, [("get_weather", PRETTY_ARGS)]),
    (LLAMA3_JSON, 'Calling it.\n{\n  "name": "get_time",\n  "parameters": {}\n}', "Calling it.", [("get_time", "{}")]),
]

MALFORMED = [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # cut inside a call
    (HERMES, '<tool_call>\n{"name": 5, "arguments": {}}\n</tool_call>'),  # name not a string
    (HERMES, '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>'),  # arguments not an object
    (HERMES, "<tool_call>\nnot json at all\n</tool_call>"),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>'),  # invalid JSON
    (MISTRAL, "[TOOL_CALLS] sorry"),
    (LLAMA3_JSON, '{"name": "f", "parameters": {"a": tru}}'),
]


@pytest.mark.parametrize("fmt,text,content,calls", RECORDED)
def test_recorded_replies_parse_to_their_calls(fmt, text, content, calls):
    got_content, got = parse_tool_calls(text, fmt)
    assert [(c.name, c.arguments) for c in got] == calls
    assert (got_content or None) == (content or None)
    for c in got:
        assert isinstance(json.loads(c.arguments), dict)
        assert c.id.startswith("call_") and len({x.id for x in got}) == len(got)


@pytest.mark.parametrize("fmt,text", MALFORMED)
def test_malformed_calls_come_back_as_text(fmt, text):
    assert parse_tool_calls(text, fmt) == (text, [])


def test_a_reply_cut_inside_a_call_keeps_the_complete_ones():
    text = (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"y": '
    )
    assert parse_tool_calls(text, HERMES) == (text, [])
    content, calls = parse_tool_calls(text, HERMES, cut=True)
    assert [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}')] and content == ""


def _streamed(text: str, fmt, pieces: list[int], cut: bool = False):
    """Feed `text` cut at `pieces`; reassemble content and calls from the deltas as a client does."""
    stream = ToolCallStream(fmt)
    content, calls = "", {}
    bounds = [0, *pieces, len(text)]
    deltas = [stream.feed(text[a:b]) for a, b in itertools.pairwise(bounds)] + [stream.finish(cut)]
    for d in deltas:
        content += d.content
        for tc in d.tool_calls:
            call = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = tc.get("id", call["id"])
            call["name"] = tc.get("function", {}).get("name", call["name"])
            call["arguments"] += tc["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)], stream


@pytest.mark.parametrize("fmt,text,content,calls", RECORDED)
def test_streamed_deltas_reassemble_to_the_whole_reading(fmt, text, content, calls):
    whole_content, whole = parse_tool_calls(text, fmt)
    for step in (1, 2, 3, 7):  # every character boundary, and coarser pieces
        got_content, got, stream = _streamed(text, fmt, list(range(step, len(text), step)))
        assert [(c["name"], c["arguments"]) for c in got] == [(c.name, c.arguments) for c in whole]
        assert got_content == (whole_content if whole else text)
        assert [c["id"] for c in got] == [c.id for c in stream.calls]


def test_streaming_never_shows_a_half_written_trigger_as_content():
    text = 'Sure.<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    stream = ToolCallStream(HERMES)
    said = "".join(stream.feed(ch).content for ch in text)
    assert said == "Sure."  # never "Sure.<tool" and the like


@pytest.mark.parametrize(
    "fmt,text,said",
    [
        (HERMES, PRETTY, ""),
        (HERMES, f"```json\n{PRETTY}\n```", ""),
        (LLAMA3_JSON, 'Sure. {\n "name": "get_time", "parameters": {}}', "Sure."),  # content before calls: rstripped
        (LLAMA3_JSON, 'A set: { "a": 1 }', 'A set: { "a": 1 }'),  # a brace that does not become a call
    ],
)
def test_streaming_holds_back_a_pretty_printed_head_until_it_is_known(fmt, text, said):
    stream = ToolCallStream(fmt)
    assert "".join(stream.feed(ch).content for ch in text) + stream.finish().content == said


@pytest.mark.parametrize("fmt,text", MALFORMED)
def test_streamed_malformed_replies_end_as_the_same_text(fmt, text):
    content, _, _ = _streamed(text, fmt, list(range(1, len(text))))
    assert content == text


# (format, a reply cut by max_tokens, its content, its calls): the partial call, or the partial opening of
# one, is dropped, and the text before it is the content (never a call's markup)
CUT = [
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "", []),
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_wea', "Let me check.", []),
    (HERMES, "Let me check. <tool_ca", "Let me check.", []),
    (HERMES, '```json\n{"name": "get_weather", "arguments": {', "", []),
    (HERMES, '{\n  "name": "get_wea', "", []),
    (HERMES, '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_', "", [("a", "{}")]),
    (MISTRAL, '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name"', "", [("a", '{"x": 1}')]),
    (LLAMA3_JSON, 'Calling it. {"name": "get_ti', "Calling it.", []),
    (HERMES, "The weather in Paris is ", "The weather in Paris is ", []),  # plain text stays whole
]


@pytest.mark.parametrize("fmt,text,content,calls", CUT)
def test_a_cut_reply_never_carries_call_markup_whole_or_streamed(fmt, text, content, calls):
    got_content, got = parse_tool_calls(text, fmt, cut=True)
    assert (got_content, [(c.name, c.arguments) for c in got]) == (content, calls)
    for step in (1, 4):
        streamed_content, streamed, _ = _streamed(text, fmt, list(range(step, len(text), step)), cut=True)
        assert (streamed_content, [(c["name"], c["arguments"]) for c in streamed]) == (content, calls)


@pytest.mark.parametrize(
    "template,expected",
    [
        ("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>", HERMES),
        ("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", MISTRAL),
        (
            '{% if tools %}{"name": function name, "parameters": dictionary of argument name and its value}{% endif %}',
            LLAMA3_JSON,
        ),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", GENERIC),
        (None, GENERIC),
    ],
)
def test_the_format_is_read_from_the_template(template, expected):
    assert detect_format(template) is expected


@pytest.mark.parametrize(
    "text,thinking,reasoning,content",
    [
        ("<think>\nThe user greets me.\n</think>\n\nHello!", False, "The user greets me.", "Hello!"),
        ("The user greets me.\n</think>\n\nHello!", True, "The user greets me.", "Hello!"),  # the prompt opened it
        ("Hello!", False, None, "Hello!"),
        ("<think>\nStill thinking when max_tokens", False, "Still thinking when max_tokens", ""),
        ("a < b, and <thinking> is not a tag", False, None, "a < b, and <thinking> is not a tag"),
    ],
)
def test_reasoning_split_whole_and_streamed(text, thinking, reasoning, content):
    assert split_reasoning(text, thinking) == (reasoning, content)
    for step in (1, 3):
        stream = ReasoningStream(thinking)
        said = [stream.feed(text[i : i + step]) for i in range(0, len(text), step)] + [stream.finish()]
        assert "".join(r for r, _ in said) == (reasoning or "")
        assert "".join(c for _, c in said) == content


def test_tools_and_turns_reach_the_template_as_it_expects():
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    templated = template_messages(history, [function_of(tool, 0)], HERMES)
    assert templated[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # templates apply tojson
    generic = template_messages(history, [function_of(tool, 0)], GENERIC)
    assert generic[0]["role"] == "system" and "get_weather" in generic[0]["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in generic[2]["content"]
    assert generic[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    with pytest.raises(ValueError, match="name"):
        function_of({"type": "function", "function": {"name": "bad name!"}}, 0)


# ---- grammars, on the default model's real tokenizer ----------------------------------------------
TOOLS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
]


@pytest.fixture(scope="module")
def compiler(default_model_dir):
    from tokenloom.structured.grammars import GrammarCompiler
    from tokenloom.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(default_model_dir)
    return GrammarCompiler(tok.backend.to_str, tok.vocab_size, [tok.token_to_id(tok.eos_token)]), tok


def _accepts(compiler, grammar: str, text: str) -> bool:
    from tokenloom.structured import StructuredOutput

    grammars, tok = compiler
    matcher = grammars.matcher(StructuredOutput.grammar(grammar))
    ids = tok.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.mark.parametrize(
    "mode,parallel,text,ok",
    [
        ("required", True, f"<tool_call>\n{CALL}\n</tool_call>", True),
        ("required", True, f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>", True),
        ("required", False, f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALL}\n</tool_call>", False),
        ("required", True, "Paris is sunny.", False),
        ("required", True, '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>', False),
        ("required", True, '<tool_call>\n{"name": "get_wether", "arguments": {"city": "Paris"}}\n</tool_call>', False),
        ("auto", True, "Paris is sunny.", True),
        ("auto", True, f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>", True),
        ("auto", True, CALL, True),  # the bare form
        ("auto", True, '{"answer": 42}', True),  # JSON content is still content
        ("auto", True, f"```json\n{CALL}\n```", True),  # a fenced bare call
        ("auto", True, '```json\n{"name": "get_weather", "arguments": {}}\n```', False),  # ... still checked
        ("auto", True, "```python\nprint(1)\n```", True),
        ("auto", True, "Let me look.\n<tool_call>\nthe weather please", False),  # once opened, only a valid call
        ("auto", True, '{"name": "get_weather", "arguments": {"unit": "kelvin"}}', False),
        # pretty-printed calls are calls too, held to their schemas; free text cannot be one
        ("auto", True, '{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}', True),
        ("auto", True, '\n```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Paris"}\n}\n```', True),
        (
            "auto",
            True,
            'Look:\n<tool_call>\n{\n  "name" : "get_weather", "arguments": {"city": "Paris"}\n}\n</tool_call>',
            True,
        ),
        ("auto", True, '{\n  "name": "get_weather",\n  "arguments": {\n    "town": "Paris"\n  }\n}', False),
        ("required", True, '<tool_call>\n{ "name": "get_time", "arguments": {} }\n</tool_call>', True),
    ],
)
def test_tool_grammars_admit_valid_calls_only(compiler, mode, parallel, text, ok):
    assert _accepts(compiler, tool_grammar(TOOLS, HERMES, mode, parallel), text) == ok


@pytest.mark.parametrize("mode", ["required", "auto"])
@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL])
def test_a_reply_may_end_after_each_complete_call_and_parallel_off_allows_one(compiler, fmt, mode):
    call = fmt.call_open + f'{{"name": "get_weather", "{fmt.args_key}": {{"city": "Paris"}}}}' + fmt.call_close
    one = fmt.section_open + call + fmt.section_close
    two = fmt.section_open + call + fmt.separator + call + fmt.section_close
    for text in (one, one + "\n", one + "\n\n", two, two + "\n"):  # newlines models write before their end
        assert _accepts(compiler, tool_grammar(TOOLS, fmt, mode, True), text), text
    assert not _accepts(compiler, tool_grammar(TOOLS, fmt, mode, True), one + "\n\n\n")
    assert _accepts(compiler, tool_grammar(TOOLS, fmt, mode, False), one + "\n")
    assert not _accepts(compiler, tool_grammar(TOOLS, fmt, mode, False), two)


OPEN_WEATHER = {
    "type": "object",
    "required": ["city"],
    "properties": {  # no additionalProperties anywhere
        "city": {"type": "string"},
        "where": {"type": "object", "properties": {"country": {"type": "string"}}},
    },
}


@pytest.mark.parametrize(
    "parameters,arguments,ok",
    [
        (OPEN_WEATHER, '{"city": "Paris"}', True),
        (OPEN_WEATHER, '{"city": "Paris", "where": {"country": "FR"}}', True),
        (OPEN_WEATHER, '{"city": "Paris", "type": "string"}', False),  # an invented key
        (OPEN_WEATHER, '{"city": "Paris", "where": {"country": "FR", "zip": 1}}', False),  # ... in a nested object
        ({**OPEN_WEATHER, "additionalProperties": True}, '{"city": "Paris", "type": "string"}', True),  # asked for
        ({"type": "object"}, '{"city": "Paris", "type": "string"}', True),  # no properties: any object
    ],
)
def test_a_schema_without_additional_properties_takes_only_its_properties(compiler, parameters, arguments, ok):
    grammar = tool_grammar([{"name": "get_weather", "parameters": parameters}], HERMES, "required", True)
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    assert _accepts(compiler, grammar, text) == ok


@pytest.mark.parametrize("fmt", [LLAMA3_JSON, MISTRAL])
def test_other_formats_grammars_write_what_their_parsers_read(compiler, fmt):
    call = f'{{"name": "get_weather", "{fmt.args_key}": {{"city": "Paris"}}}}'
    text = f"{fmt.section_open}{call}{fmt.separator}{call}{fmt.section_close}"
    assert _accepts(compiler, tool_grammar(TOOLS, fmt, "required", True), text)
    assert [c.name for c in parse_tool_calls(text, fmt)[1]] == ["get_weather", "get_weather"]


def test_tool_choice_none_grammar_cannot_call(compiler):
    grammar = no_call_grammar(HERMES)
    assert _accepts(compiler, grammar, "It is 18 degrees in Paris.")
    assert not _accepts(compiler, grammar, CALL)
    assert not _accepts(compiler, grammar, f"Sure: <tool_call>\n{CALL}\n</tool_call>")


def test_every_format_is_registered_and_self_consistent():
    assert set(FORMATS) == {
        "hermes",
        "llama3_json",
        "mistral",
        "generic",
        "harmony",
        "deepseek_v3",
        "deepseek_v31",
        "command_r7b",
        "mistral_v11",
        "qwen3_coder",
    }
