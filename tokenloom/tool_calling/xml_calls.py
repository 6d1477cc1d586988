"""Qwen3-Coder's calls: a function tag holding one tag per parameter, values as plain text::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

``read_xml_call`` reads one call from ``<function=`` on; ``xml_arguments`` turns its parameters into
the call's JSON arguments, each value read by its type in the tool's schema as Qwen3-Coder's
template writes it (``tojson`` for objects and arrays, ``string`` for the rest: a string as is,
``3``, ``True``, ``None``); ``xml_types`` the JSON types a parameter's schema allows (grammar.py
builds the calls' grammar from them).
"""

from __future__ import annotations

import json
import re
from typing import Any

FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_KEY = re.compile(r"[^\s<>]{1,128}")


def read_xml_call(text: str, pos: int) -> tuple[int, bool | None, str | None, dict[str, str]]:
    """The call at `pos` (whitespace first is skipped): (end, True, name, raw parameter values)
    once ``</function>`` closes it; (pos, None, ...) while the text ends inside it; (pos, False, ...)
    when it is not one."""
    params: dict[str, str] = {}
    i = _skip_ws(text, pos)
    name, i, ok = _tag(text, i, FUNCTION_OPEN, _NAME)
    if not ok:
        return pos, ok, None, params
    while True:
        i = _skip_ws(text, i)
        if text.startswith(FUNCTION_CLOSE, i):
            return i + len(FUNCTION_CLOSE), True, name, params
        if not text.startswith(PARAMETER_OPEN, i):
            rest = text[i:]
            growing = FUNCTION_CLOSE.startswith(rest) or PARAMETER_OPEN.startswith(rest)
            return pos, None if growing else False, name, params
        key, i, ok = _tag(text, i, PARAMETER_OPEN, _KEY)
        if not ok:
            return pos, ok, name, params
        close = text.find(PARAMETER_CLOSE, i)
        if close < 0:
            return pos, None, name, params
        value = text[i:close]
        params[key] = value[1 if value.startswith("\n") else 0 : -1 if value.endswith("\n") else None]
        i = close + len(PARAMETER_CLOSE)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\n":
        pos += 1
    return pos


def _tag(text: str, pos: int, opening: str, name: re.Pattern[str]) -> tuple[str, int, bool | None]:
    """`opening NAME>` at `pos`: (NAME, index after it, True); None while the text ends inside it;
    False when it is something else."""
    rest = text[pos : pos + len(opening)]
    if rest != opening:
        return "", pos, None if opening.startswith(rest) and pos + len(rest) == len(text) else False
    end = text.find(">", pos)
    start = pos + len(opening)
    if end < 0:
        return "", pos, None if len(text) - start <= 128 and not re.search(r"\s", text[start:]) else False
    value = text[start:end]
    return (value, end + 1, True) if name.fullmatch(value) else ("", pos, False)


def xml_types(schema: Any) -> list[str]:
    """The JSON types a parameter schema allows (from its type, or its enum's values)."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    if isinstance(schema.get("enum"), list):
        names = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null"}
        return sorted({names.get(type(v), "object") for v in schema["enum"]})
    return []


def xml_value(raw: str, schema: Any) -> Any:
    """A parameter's text as the value its schema's type says (module doc); the text itself where
    the schema allows a string, says nothing, or the text does not read as the type."""
    types = xml_types(schema)
    if not types or "string" in types:
        return raw
    word = raw.strip()
    if "boolean" in types and word in ("true", "false", "True", "False"):
        return word.lower() == "true"
    if "null" in types and word in ("null", "None"):
        return None
    try:
        return json.loads(word)
    except ValueError:
        return raw


def xml_arguments(params: dict[str, str], parameters: dict[str, Any] | None) -> str:
    """The JSON arguments of a call's raw parameter values, read by the tool's `parameters`
    schema (None: every value a string)."""
    properties = (parameters or {}).get("properties") or {}
    return json.dumps({k: xml_value(v, properties.get(k)) for k, v in params.items()}, ensure_ascii=False)
