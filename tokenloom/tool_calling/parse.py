"""Reading tool calls out of a model's text, whole or as it grows.

``scan(text, fmt)`` reads as far as `text` goes: the content before the calls, and each call
seen so far with its name (once complete) and its arguments' JSON text (as much as there is).
It never raises: text that stops following the format marks the scan ``malformed`` there.
``parse_tool_calls`` is the final reading: the calls if every one is complete and well-formed,
otherwise the whole text as content (a malformed call comes back as text, never an error); of a
reply cut short (max_tokens), the complete calls and the text before the calls, never a partial
call's markup.
A call's ``arguments`` is the model's own JSON text of the object, so a stream's argument
deltas concatenate to exactly what a whole response carries.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

from tokenloom.tool_calling.formats import CALL_HEAD, CALL_HEAD_PATTERN, FENCE_CLOSE, FENCE_OPEN, ToolFormat
from tokenloom.tool_calling.xml_calls import read_xml_call, xml_arguments

_WS = re.compile(r"\s*")
_SCALAR = re.compile(r"[^\s,}\]]*")  # a number, true, false or null
_HEAD = re.compile(CALL_HEAD_PATTERN)  # a call object's head, in any spacing
_BARE_HEAD = re.compile(f"({re.escape(FENCE_OPEN)})?{CALL_HEAD_PATTERN}")
_SQUEEZED_HEAD = CALL_HEAD.replace(" ", "")
_ARGS_KEYS = ("arguments", "parameters")


@dataclass
class PartialCall:
    """A call as far as the text goes."""

    name: str | None = None  # once its string is complete
    arguments: str = ""  # the arguments object's JSON text so far
    complete: bool = False  # the whole call (object and closing marker) has been read


@dataclass
class Scan:
    content: str  # text before the calls (all of it when there are none)
    calls: list[PartialCall] = field(default_factory=list)
    calls_start: int | None = None  # where the calls begin in the text
    malformed: bool = False  # the text stopped following the format
    trailing: str = ""  # non-space text after the last complete call (kept as content)


@dataclass(frozen=True)
class ToolCall:
    """A finished call in OpenAI's terms."""

    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: new_call_id())

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- JSON pieces at a position: end index, or None while the text ends inside them ---------------
def _string_end(text: str, pos: int) -> int | None:
    """text[pos] is '"': the index after the closing quote (None: not closed yet)."""
    i = pos + 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def _value_end(text: str, pos: int) -> int | None:
    """The index after the JSON value starting at `pos` (None: it has not ended yet). Brackets are
    only counted, not checked: json.loads of the slice decides whether it is valid."""
    if text[pos] == '"':
        return _string_end(text, pos)
    if text[pos] not in "[{":
        m = _SCALAR.match(text, pos)
        assert m is not None  # it matches the empty string too
        return m.end() if m.end() < len(text) else None  # a number may still be growing
    depth, i = 0, pos
    while i < len(text):
        c = text[i]
        if c == '"':
            end = _string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if c in "[{":
            depth += 1
        elif c in "]}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _skip_ws(text: str, pos: int) -> int:
    m = _WS.match(text, pos)
    assert m is not None  # it matches the empty string too
    return m.end()


def _expect(text: str, pos: int, literal: str) -> tuple[int, bool | None]:
    """Match `literal` at `pos` (whitespace around it is free): (position after it, True);
    (pos, None) when the text ends partway through it; (pos, False) when something else is there."""
    if not literal.strip():
        return _skip_ws(text, pos), True
    start = _skip_ws(text, pos)
    want = literal.strip()
    got = text[start : start + len(want)]
    if got == want:
        return start + len(want), True
    return pos, None if want.startswith(got) and start + len(got) == len(text) else False


def _scan_object(text: str, pos: int, call: PartialCall, name_key: str = "name") -> tuple[int, bool | None]:
    """Read a call object at `pos` into `call` (name under `name_key`, arguments so far). Returns
    (end, True) when it closed as a valid call, (pos, None) while it is incomplete, (pos, False)
    when it is not one. Other keys (a call's id or number) are read past."""
    i = _skip_ws(text, pos)
    if i == len(text):
        return pos, None
    if text[i] != "{":
        return pos, False
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i == len(text):
            return pos, None
        if text[i] == "}":
            call.arguments = call.arguments or "{}"  # a call without arguments takes none
            if call.name is None or not _valid_arguments(call.arguments):
                return pos, False
            return i + 1, True
        key_end = _string_end(text, i) if text[i] == '"' else -1
        if key_end == -1:
            return pos, False
        if key_end is None:
            return pos, None
        key = json.loads(text[i:key_end])
        i, ok = _expect(text, key_end, ":")
        if not ok:
            return pos, ok
        i = _skip_ws(text, i)
        if i == len(text):
            return pos, None
        end = _value_end(text, i)
        if key in _ARGS_KEYS and text[i] == "{":
            call.arguments = text[i : len(text) if end is None else end]  # grows while it streams
        if end is None:
            return pos, None
        if key == name_key:
            name = json.loads(text[i:end]) if text[i] == '"' else None
            if not isinstance(name, str) or not name:
                return pos, False
            call.name = name
        elif key in _ARGS_KEYS and text[i] != "{":
            return pos, False
        i = _skip_ws(text, end)
        if i < len(text) and text[i] == ",":
            i += 1


_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


_CALL_ID = re.compile(r"[A-Za-z0-9]{1,64}")


def _scan_named(
    text: str, pos: int, call: PartialCall, name_close: str, id_marker: str = ""
) -> tuple[int, bool | None]:
    """Read `NAME [id_marker ID] name_close {arguments}` at `pos` into `call` (DeepSeek's and
    Mistral v11's calls): (end, True) when the arguments closed as an object, (pos, None) while
    incomplete, (pos, False) when not a call."""
    marker = name_close.strip()
    end = text.find(marker, pos)
    if end < 0:  # the name (or the marker after it) is still being written
        rest = text[pos:].strip()
        return pos, None if len(rest) <= 256 and not re.search(r"\s\S*\s", rest) else False
    name = text[pos:end].strip()
    if id_marker and id_marker in name:  # the call's id is not kept: the server gives its own
        name, call_id = name.split(id_marker, 1)
        if not _CALL_ID.fullmatch(call_id.strip()):
            return pos, False
    if not _NAME.fullmatch(name):
        return pos, False
    call.name = name
    i = _skip_ws(text, end + len(marker))
    if i == len(text):
        return pos, None
    if text[i] != "{":
        return pos, False
    args_end = _value_end(text, i)
    call.arguments = text[i : len(text) if args_end is None else args_end]  # grows while it streams
    if args_end is None:
        return pos, None
    return (args_end, True) if _valid_arguments(call.arguments) else (pos, False)


def _scan_xml(text: str, pos: int, call: PartialCall, schemas: dict[str, Any] | None) -> tuple[int, bool | None]:
    """Read Qwen3-Coder's function tag at `pos` into `call` (xml_calls.py); its arguments, once it
    closed, read by the tool's schema in `schemas` ({name: parameters})."""
    end, ok, name, params = read_xml_call(text, pos)
    call.name = name or None
    if ok:
        call.arguments = xml_arguments(params, (schemas or {}).get(cast("str", name)))
    return end, ok


def _valid_arguments(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except ValueError:
        return False


def _calls_start(text: str, fmt: ToolFormat) -> tuple[int | None, tuple[str, str, str, str, str]]:
    """Where the calls begin, and the texts around them there: (section open, section close, call
    open, call close, separator). None if they have not begun."""
    if fmt.trigger == CALL_HEAD:  # the head itself opens the calls (llama3_json), in any spacing
        head = _HEAD.search(text)
        found = head.start() if head else -1
    else:
        found = text.find(fmt.trigger)
    if found >= 0:
        return found, (fmt.section_open, fmt.section_close, fmt.call_open, fmt.call_close, fmt.separator)
    if fmt.bare:  # a reply that is call objects, or one fenced as ```json
        first = _skip_ws(text, 0)
        bare = _BARE_HEAD.match(text, first)
        if bare:
            return first, (FENCE_OPEN, FENCE_CLOSE, "", "", "") if bare.group(1) else ("", "", "", "", "")
    return None, ("", "", "", "", "")


def _may_grow_into_head(text: str) -> bool:
    """`text` could still become a call's head (in any spacing) as more text comes."""
    return _SQUEEZED_HEAD.startswith(re.sub(r"[ \t\n]", "", text))


def _held_back(text: str, fmt: ToolFormat) -> int:
    """How many characters at the end of `text` could be the start of the calls' opening."""
    if fmt.bare:
        rest = text.lstrip()
        if (
            FENCE_OPEN.startswith(rest)
            or _may_grow_into_head(rest)
            or (rest.startswith(FENCE_OPEN) and _may_grow_into_head(rest[len(FENCE_OPEN) :]))
        ):
            return len(text)
    if fmt.trigger == CALL_HEAD:
        brace = text.rfind("{")
        return len(text) - brace if brace >= 0 and _may_grow_into_head(text[brace:]) else 0
    return partial_tail(text, (fmt.trigger,))


def partial_tail(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could be the start of one of `markers` (the
    longest such tail shorter than the longest marker; 0: none)."""
    for n in range(min(len(text), max(map(len, markers), default=1) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


def scan(text: str, fmt: ToolFormat, schemas: dict[str, Any] | None = None) -> Scan:
    """Read `text` as far as it goes (module doc); `schemas` ({tool name: parameters}) read the
    values of formats whose calls hold text, not JSON (Qwen3-Coder's)."""
    start, (section_open, section_close, opening, closing, separator) = _calls_start(text, fmt)
    if start is None:
        return Scan(text[: len(text) - _held_back(text, fmt)])
    result = Scan(text[:start], calls_start=start)
    i, ok = _expect(text, start, section_open)
    if not ok:
        result.malformed = ok is False
        return result
    while True:
        if result.calls:  # after a call: another, or the end of the section
            after_sep, sep_ok = _expect(text, i, separator)
            _, open_ok = _expect(text, after_sep if sep_ok else i, opening or "{")
            if sep_ok is None or (sep_ok and open_ok is None):  # the text ends inside what comes next
                return result
            if not (sep_ok and open_ok):
                return _section_end(text, i, section_close, result)
            i = after_sep
        call = PartialCall()
        result.calls.append(call)
        i, ok = _expect(text, i, opening)
        if ok:
            if fmt.name_close:
                i, ok = _scan_named(text, i, call, fmt.name_close, fmt.id_marker)
            elif fmt.xml_params:
                i, ok = _scan_xml(text, i, call, schemas)
            else:
                i, ok = _scan_object(text, i, call, fmt.name_key)
        if ok:
            i, ok = _expect(text, i, closing)
        if not ok:
            result.malformed = ok is False
            return result
        call.complete = True


def _section_end(text: str, i: int, section_close: str, result: Scan) -> Scan:
    """After the last call: the section's closing (which the text may not have reached yet), then
    anything left is trailing text."""
    if section_close:
        after, ok = _expect(text, i, section_close)
        if ok is False:
            result.malformed = True
            return result
        i = after
    result.trailing = text[i:].strip()
    return result


def parse_tool_calls(
    text: str, fmt: ToolFormat, cut: bool = False, schemas: dict[str, Any] | None = None
) -> tuple[str, list[ToolCall]]:
    """The final reading of a reply: (content, calls). No calls unless every call is complete and
    well-formed; otherwise the whole text is content. Before calls, content loses its trailing
    whitespace; text after them is kept as content, on a line of its own. `cut`: the reply was cut
    short (max_tokens): a call it ended inside, or a tail that could have opened one, is dropped
    (content is the text before it), the complete calls before it are kept. The format's content
    markers (what wraps a plain answer) are not content. `schemas`: as scan's."""
    content, calls = read_calls(text, fmt, cut, schemas)
    return unwrap_content(content, fmt), calls


def unwrap_content(text: str, fmt: ToolFormat) -> str:
    """`text` without the format's content markers."""
    return without_markers(text, fmt.content_markers)


def without_markers(text: str, markers: tuple[str, ...]) -> str:
    """`text` with each of `markers` taken out."""
    for marker in markers:
        if marker:
            text = text.replace(marker, "")
    return text


def read_calls(
    text: str, fmt: ToolFormat, cut: bool = False, schemas: dict[str, Any] | None = None
) -> tuple[str, list[ToolCall]]:
    """parse_tool_calls, content markers and all."""
    result = scan(text, fmt, schemas)
    if cut and not result.malformed:
        return _cut_reading(text, result)
    if result.calls_start is None or result.malformed or not result.calls or not all(c.complete for c in result.calls):
        return text, []
    return _content_around(result), [ToolCall(cast("str", c.name), c.arguments) for c in result.calls]


def _cut_reading(text: str, result: Scan) -> tuple[str, list[ToolCall]]:
    """parse_tool_calls of a reply cut short that is not malformed (`result`: its scan)."""
    calls = [ToolCall(cast("str", c.name), c.arguments) for c in result.calls if c.complete]  # complete: named
    if result.calls_start is None and len(result.content) == len(text):  # plain text, nothing held back
        return text, []
    return _content_around(result), calls


def _content_around(result: Scan) -> str:
    """The content around a reply's calls (or where they would have begun): the text before them
    without its trailing whitespace, and any text after them on a line of its own."""
    content = result.content.rstrip()
    if result.trailing:
        content = f"{content}\n{result.trailing}" if content else result.trailing
    return content
