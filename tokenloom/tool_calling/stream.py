"""Splitting a streamed reply into content deltas and OpenAI tool-call deltas as the text grows.

``ToolCallStream.feed(text_delta)`` returns what can be said for sure so far: content that
cannot be the start of a call (a tail that might open one, and trailing whitespace, wait), and
each call once it is complete: its header (index, id, name) and its arguments. A call is not
streamed while it is being written, so a reply cut short inside one (max_tokens) never streams
half a call, and every streamed call is valid. ``finish()`` says the rest: what the final reading
(parse_tool_calls) says, so the deltas concatenate to the whole response's content and calls (the
content said before is always the start of the final reading's: only a tail that could open a
call, and whitespace before calls, wait, and those are what a final reading may drop). The
format's content markers are taken out of the content as it streams (``MarkerFilter``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from tokenloom.tool_calling.formats import ToolFormat
from tokenloom.tool_calling.parse import ToolCall, new_call_id, partial_tail, read_calls, scan


@dataclass
class Delta:
    """What one feed() adds: content text and tool-call deltas in OpenAI's streaming shape."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class ToolCallStream:
    """One choice's reply, fed delta by delta (module doc)."""

    def __init__(self, fmt: ToolFormat, schemas: dict[str, Any] | None = None) -> None:
        self.fmt = fmt
        self.schemas = schemas  # {tool name: parameters}, for formats whose values are text (parse.scan)
        self.text = ""
        self.content_sent = 0  # characters of content said
        self.ids: list[str] = []  # the id of each call whose header was said
        self.arguments_sent: list[int] = []  # characters of each call's arguments said
        self.calls: list[ToolCall] = []  # the final calls (after finish)
        self.unwrap = MarkerFilter(fmt.content_markers)

    def feed(self, text_delta: str) -> Delta:
        self.text += text_delta
        result = scan(self.text, self.fmt, self.schemas)
        if result.malformed:  # not a call after all: it is all content
            return self._content_upto(len(self.text))
        delta = self._content_upto(len(result.content.rstrip()))
        for index, call in enumerate(result.calls):
            if not call.complete:
                break
            delta.tool_calls += self._call_deltas(index, cast("str", call.name), call.arguments)  # complete: named
        return delta

    def finish(self, cut: bool = False) -> Delta:
        """The rest of the reply, as the final reading has it (`cut`: parse_tool_calls); self.calls
        holds the calls."""
        content, calls = read_calls(self.text, self.fmt, cut, self.schemas)
        delta = Delta(self.unwrap.feed(content[self.content_sent :]) + self.unwrap.finish())
        self.content_sent = max(self.content_sent, len(content))
        self.calls = []
        for index, call in enumerate(calls):
            delta.tool_calls += self._call_deltas(index, call.name, call.arguments)
            self.calls.append(ToolCall(call.name, call.arguments, self.ids[index]))
        return delta

    def _content_upto(self, end: int) -> Delta:
        """Content up to text[:end] that has not been said yet."""
        delta = Delta(self.unwrap.feed(self.text[self.content_sent : end]) if end > self.content_sent else "")
        self.content_sent = max(self.content_sent, end)
        return delta

    def _call_deltas(self, index: int, name: str, arguments: str) -> list[dict]:
        """The header of call `index` if not said yet, and its arguments' new text."""
        deltas = []
        if index == len(self.ids):
            self.ids.append(new_call_id())
            self.arguments_sent.append(0)
            deltas.append(
                {"index": index, "id": self.ids[index], "type": "function", "function": {"name": name, "arguments": ""}}
            )
        new = arguments[self.arguments_sent[index] :]
        if new:
            self.arguments_sent[index] = len(arguments)
            deltas.append({"index": index, "function": {"arguments": new}})
        return deltas


class MarkerFilter:
    """Streamed text without the given markers: feed() returns the text so far less the markers,
    holding back a tail that could be the start of one; finish() returns what was held."""

    def __init__(self, markers: tuple[str, ...]) -> None:
        self.markers = tuple(m for m in markers if m)
        self.held = ""

    def feed(self, text: str) -> str:
        if not self.markers:
            return text
        text = self.held + text
        for marker in self.markers:
            text = text.replace(marker, "")
        keep = partial_tail(text, self.markers)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def finish(self) -> str:
        held, self.held = self.held, ""
        return held
