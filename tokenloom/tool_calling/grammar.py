"""Grammars (llguidance's Lark) that make tool calls valid by construction.

- ``required`` / a named function: the reply is calls only, in the format, each to a given tool
  with arguments valid against that tool's JSON schema (one call, or several when parallel).
- ``auto``: the reply is free text, or, once it opens a call (the format's trigger, or for a
  ``bare`` format a reply that starts as a call object), schema-valid calls only. The free text
  may not contain the trigger anywhere, so no branch of the grammar lets an invalid call through.

In both, the reply may end after each complete call (and its section's close), or after one or two
newlines there: models write them before their end of turn (Qwen2.5-Coder-0.5B one after
``</tool_call>``, SmolLM2 two), and a grammar that took a newline there only as the separator
before another call made them call again and again until max_tokens. An object schema that lists
``properties`` without ``additionalProperties`` takes no other keys (llama.cpp's reading; JSON
Schema's own lets a small model invent keys until max_tokens).
"""

from __future__ import annotations

import json
import re
from typing import Any

from tokenloom.structured.grammars import JSON_DEFAULTS
from tokenloom.tool_calling.formats import CALL_HEAD, CALL_HEAD_PATTERN, CALL_WS, FENCE_CLOSE, FENCE_OPEN, ToolFormat
from tokenloom.tool_calling.xml_calls import xml_types

ENDING_RULE = "ENDING: /\\n{1,2}/"  # what a reply may write after its calls, before it ends (module doc)


def _lit(text: str, special: frozenset[str] = frozenset()) -> str:
    """`text` in Lark: string literals, and the `special` markers in it (texts that are one special
    token of the vocabulary, which llguidance matches by token, not by bytes) as <token>.
    "" for no text (_rule leaves it out)."""
    parts, rest = [], text
    while rest:
        at = min(((rest.find(m), m) for m in special if m in rest), default=(len(rest), ""))
        if at[0]:
            parts.append(json.dumps(rest[: at[0]]))
        if at[1]:
            parts.append(at[1])
        rest = rest[at[0] + len(at[1]) :]
    return " ".join(parts)


def _seq(*parts: str) -> str:
    """`part part ...`, without the empty parts."""
    return " ".join(p for p in parts if p)


def _rule(name: str, *parts: str) -> str:
    return f"{name}: {_seq(*parts)}"


def _regex_escape(text: str) -> str:
    """`text` as a literal inside a /regex/ (Rust regex syntax; / closes the Lark literal)."""
    return re.sub(r"([\\^$.|?*+()\[\]{}/])", r"\\\1", text).replace("\n", "\\n").replace("\t", "\\t")


def _schema(parameters: dict[str, Any]) -> str:
    """A tool's parameters as the %json argument: objects closed (closed_objects), with the server's
    whitespace rule unless set."""
    schema = closed_objects(parameters)
    schema.setdefault("x-guidance", JSON_DEFAULTS)
    return json.dumps(schema)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # {name: schema}
_SCHEMA_PLACES = ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf")  # a schema or [schema]


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` in which every object schema that lists ``properties`` and does not say
    ``additionalProperties`` has it false, as llama.cpp's json-schema-to-grammar reads such a schema
    (no keys beyond the declared ones), at any depth. Schemas under allOf are left as they are
    (closing each would leave only the keys they all declare). Anything not a schema comes back as is."""
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(sub) for name, sub in closed[key].items()}
    for key in _SCHEMA_PLACES:
        value = closed.get(key)
        if isinstance(value, list):
            closed[key] = [closed_objects(sub) for sub in value]
        elif isinstance(value, dict):
            closed[key] = closed_objects(value)
    if isinstance(closed.get("properties"), dict) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _not_containing(pattern: str) -> str:
    """A regex (llguidance's syntax) for any text that contains no match of `pattern`."""
    return f"~/(?s:.*{pattern}.*)/"


def _trigger_pattern(fmt: ToolFormat) -> str:
    """The trigger as a regex: a call's head in any spacing when the head is the trigger (llama3_json)."""
    return CALL_HEAD_PATTERN if fmt.trigger == CALL_HEAD else _regex_escape(fmt.trigger)


def tool_grammar(
    tools: list[dict[str, Any]], fmt: ToolFormat, mode: str, parallel: bool, special: frozenset[str] = frozenset()
) -> str:
    """The Lark grammar for `tools` ([{"name", "parameters"}] with parameters a JSON schema)
    written in `fmt`; `mode`: "auto" or "required" (a named choice: pass only that tool);
    `special`: the format's markers that are special tokens of the model (formats.markers)."""
    if mode not in ("auto", "required"):
        raise ValueError(f"tool grammar mode must be auto or required, got {mode!r}")
    rules = ["%llguidance {}", ENDING_RULE, *_call_rules(tools, fmt, parallel, special)]
    if mode == "required":
        rules.append("start: calls ENDING?")
    else:
        rules += _auto_rules(fmt, parallel, special)
    return "\n".join(rules) + "\n"


def _call_rules(tools: list[dict[str, Any]], fmt: ToolFormat, parallel: bool, special: frozenset[str]) -> list[str]:
    """HEAD, ARGS, CLOSE: a call object's fixed parts, in any spacing (models pretty-print calls);
    named: what follows HEAD in a call to one of the tools; call, one (with its markers), more (the
    calls after the first), calls (the whole section)."""
    if fmt.name_close:  # NAME [id_marker ID] name_close <schema> (DeepSeek, Mistral v11): no call object, no HEAD
        rules = [_rule("call_id", _lit(fmt.id_marker, special), "/[a-zA-Z0-9]{9}/")] if fmt.id_marker else []
        for i, tool in enumerate(tools):
            named = [_lit(tool["name"], special), "call_id?" if fmt.id_marker else "", _lit(fmt.name_close, special)]
            rules.append(_rule(f"named_{i}", *named, "%json", _schema(tool["parameters"])))
    elif fmt.xml_params:  # <function=NAME> with parameter tags (Qwen3-Coder)
        rules = [f"HEAD: {json.dumps(fmt.head)}"]
        for i, tool in enumerate(tools):
            rules += _xml_named(i, tool, special)
    else:
        rules = [
            f"HEAD: /{fmt.head_pattern}/",
            f'ARGS: /"{CALL_WS},{CALL_WS}"{fmt.args_key}"{CALL_WS}:{CALL_WS}/',
            f"CLOSE: /{CALL_WS}\\}}/",
        ]
        for i, tool in enumerate(tools):  # {"name": "NAME", "<args_key>": <schema>}
            rules.append(_rule(f"named_{i}", _lit(tool["name"]), "ARGS", "%json", _schema(tool["parameters"]), "CLOSE"))
    rules.append(_rule("named", " | ".join(f"named_{i}" for i in range(len(tools)))))
    rules.append(_rule("call", "" if fmt.name_close else "HEAD", "named"))
    rules.append(_rule("one", _lit(fmt.call_open, special), "call", _lit(fmt.call_close, special)))
    rules.append(_rule("more", f"({_seq(_lit(fmt.separator), 'one')})*") if parallel else 'more: ""')
    rules.append(_rule("calls", _lit(fmt.section_open, special), "one more", _section_close(fmt, special)))
    return rules


def _xml_named(i: int, tool: dict[str, Any], special: frozenset[str]) -> list[str]:
    """named_i for Qwen3-Coder's calls (xml_calls.py): the tool's name, then its schema's parameters
    in order (the required ones present), each a tag around its value: one of a string enum's
    values, any other string as any text up to the closing tag (a lazy rule: the first closing tag
    ends it; its other keywords, such as pattern or maxLength, are not held), a boolean as JSON or
    as Python writes it, anything else JSON valid against its schema."""
    parameters = tool["parameters"]
    required = set(parameters.get("required") or [])
    rules, parts = [], []
    for k, (key, schema) in enumerate((parameters.get("properties") or {}).items()):
        name, opening, closing = f"p_{i}_{k}", _lit(f"<parameter={key}>\n", special), _lit("\n</parameter>", special)
        types = xml_types(schema)
        choices = _string_choices(schema)
        if choices:
            rules.append(_rule(name, opening, f"({' | '.join(_lit(c, special) for c in choices)})", closing))
        elif not types or "string" in types:
            rules.append(f"{name}[lazy]: {opening} /(?s:.*)/ {closing}")
        elif types == ["boolean"]:
            rules.append(_rule(name, opening, "/(true|false|True|False)/", closing))
        else:
            rules.append(_rule(name, opening, "%json", _schema(schema), closing))
        parts.append(f'{name} "\\n"' if key in required else f'({name} "\\n")?')
    rules.append(_rule(f"named_{i}", _lit(tool["name"] + ">\n", special), *parts, _lit("</function>", special)))
    return rules


def _string_choices(schema: Any) -> list[str]:
    """The strings a parameter schema allows when it lists them (enum or const of strings only)."""
    if not isinstance(schema, dict):
        return []
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values and all(isinstance(v, str) and v for v in values):
        return values
    return []


def _section_close(fmt: ToolFormat, special: frozenset[str]) -> str:
    """The section's close; for a `spaced` format whitespace may come before it (one lexeme with
    the text up to its first special marker)."""
    if not fmt.spaced or not fmt.section_close:
        return _lit(fmt.section_close, special)
    text = fmt.section_close
    at = min((text.find(m) for m in special if m in text), default=len(text))
    return _seq(f"/[ \\t\\n]{{0,24}}{_regex_escape(text[:at])}/", _lit(text[at:], special))


def _free_text(fmt: ToolFormat) -> str:
    """TEXT: what a reply may say outside calls: anything without the trigger, and for a bare
    format nothing that begins as a call object."""
    text = f"/(?s:.*)/ & {_not_containing(_trigger_pattern(fmt))}"
    if fmt.bare:
        text += f" & ~/(?s:[ \\t\\n]*({_regex_escape(FENCE_OPEN)})?{CALL_HEAD_PATTERN}.*)/"
    return f"TEXT: {text}"


def no_call_grammar(fmt: ToolFormat) -> str:
    """tool_choice none with tools offered before: a reply that cannot be (or begin) a call."""
    return f"%llguidance {{}}\nstart: TEXT\n{_free_text(fmt)}\n"


def _auto_rules(fmt: ToolFormat, parallel: bool, special: frozenset[str]) -> list[str]:
    """auto: free text that never contains the trigger, or such text, the trigger (matched lazily:
    the first occurrence opens the calls) and the calls; for a bare format also bare call objects."""
    rules = []
    if fmt.bare:  # call objects, or the same in a ```json fence
        # Leading space, the fence and the call's head are one lexeme: TEXT (which may not begin with them)
        # must die on the very character that completes it, as the lexer does not go back to an earlier,
        # shorter match.
        rules += [
            f"BARE_HEAD: /[ \\t\\n]{{0,24}}{CALL_HEAD_PATTERN}/",
            f"FENCED_HEAD: /[ \\t\\n]{{0,24}}{_regex_escape(FENCE_OPEN)}{CALL_HEAD_PATTERN}/",
        ]
        others = f"({_lit(fmt.separator or chr(10))} call)*" if parallel else ""
        rules.append(_rule("bare", "BARE_HEAD named", others, "| FENCED_HEAD named", others, _lit(FENCE_CLOSE)))
    if fmt.trigger == CALL_HEAD:  # the head itself opens the calls
        trigger, rest = "HEAD", ""
    else:
        trigger, rest = (
            _lit(fmt.trigger, special),
            _seq(
                _lit((fmt.section_open + fmt.call_open)[len(fmt.trigger) :], special), "" if fmt.name_close else "HEAD"
            ),
        )
    opened = "opened" if fmt.trigger in special else "opened[lazy]"  # a special token ends TEXT by itself
    rules += [
        _free_text(fmt),
        _rule(opened, "TEXT", trigger),
        _rule("after_trigger", rest, "named", _lit(fmt.call_close, special), "more", _section_close(fmt, special)),
        *_answer_rules(fmt, special),
        f"start: {'plan? ' if fmt.plan_markers[0] else ''}(answer | opened after_trigger ENDING?"
        + (" | bare ENDING?" if fmt.bare else "")
        + ")",
    ]
    return rules


def _answer_rules(fmt: ToolFormat, special: frozenset[str]) -> list[str]:
    """answer: the free text, or it in the format's content markers; plan: the reasoning a reply may
    open with in the format's plan markers (nothing for formats without them)."""
    opening, closing = fmt.content_markers
    answer = f"TEXT | {_seq(_lit(opening, special), 'TEXT', _lit(closing, special))}" if opening else "TEXT"
    rules = [_rule("answer", answer)]
    opening, closing = fmt.plan_markers
    if opening:
        rules.append(_rule("plan", _lit(opening, special), "TEXT", _lit(closing, special)))
    return rules


def harmony_grammar(tools: list[dict[str, Any]], mode: str, special: frozenset[str] = frozenset()) -> str:
    """gpt-oss's reply as harmony messages (tool_calling/harmony.py): optionally its reasoning in the
    analysis channel, then under "auto" an answer in the final channel or one call, under "required"
    one call, under "none" an answer: a call is a commentary message to ``functions.NAME`` whose body
    is valid against that tool's schema. One call a reply: harmony ends a call with <|call|>, a stop
    token, and the caller answers with its result."""
    if mode not in ("auto", "required", "none"):
        raise ValueError(f"harmony grammar mode must be auto, required or none, got {mode!r}")
    if not tools and mode != "none":
        raise ValueError(f"a harmony grammar for tool_choice {mode} needs at least one tool")

    def lit(text: str) -> str:
        return _lit(text, special)

    rules = [
        "%llguidance {}",
        "TEXT: /(?s:.*)/",
        _rule("analysis", lit("<|channel|>analysis<|message|>"), "TEXT", lit("<|end|><|start|>assistant")),
        _rule("final", lit("<|channel|>final<|message|>"), "TEXT"),
    ]
    for i, tool in enumerate(tools):
        header = f"<|channel|>commentary to=functions.{tool['name']} <|constrain|>json<|message|>"
        rules.append(_rule(f"call_{i}", lit(header), "%json", _schema(tool["parameters"])))
    ending = {"auto": "final | call", "required": "call", "none": "final"}[mode]
    if tools and mode != "none":
        rules.append(_rule("call", " | ".join(f"call_{i}" for i in range(len(tools)))))
    rules.append(f"start: analysis? ({ending})")
    return "\n".join(rules) + "\n"
