"""OpenAI's harmony format (gpt-oss): a reply is a run of messages, each

    <|start|>assistant<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY<|end|>

(the recipient may stand before the channel: ``assistant to=functions.f<|channel|>commentary json``).
The generation prompt opens the first message (``<|start|>assistant``), so a reply starts at its
header; the last message ends with ``<|return|>`` (an answer) or ``<|call|>`` (a tool call), both
stop tokens that the text may not hold. Read back as OpenAI's fields:

- the ``analysis`` channel is the model's reasoning: ``reasoning_content``;
- a message to ``functions.NAME`` (in the ``commentary`` channel) is a tool call, its body the
  arguments' JSON text;
- ``final`` (and commentary to no one, a preamble the user sees) is the ``content``.

``read_harmony`` reads a whole reply; ``HarmonyStream`` the same as it grows, saying reasoning and
content as they come and each call once its message has ended, so the deltas join to the whole
reading. The markers are special tokens: the reply must be decoded with them (``MARKERS``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tokenloom.tool_calling.parse import ToolCall, new_call_id, partial_tail

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
CALL, RETURN, CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
MARKERS = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
_ENDS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


@dataclass
class Message:
    """One message of a reply as far as the text goes."""

    channel: str | None
    recipient: str | None
    body: str
    ended: bool  # its end marker (or the next message's start) has been read

    @property
    def call_name(self) -> str | None:
        """The function a message to ``functions.NAME`` calls."""
        if self.recipient and self.recipient.startswith("functions."):
            return self.recipient[len("functions.") :]
        return None

    @property
    def kind(self) -> str:
        """reasoning | call | content."""
        if self.call_name is not None:
            return "call"
        return "reasoning" if self.channel == "analysis" else "content"


def messages(text: str) -> list[Message]:
    """The reply's messages in order; the last may be unfinished, its header too (then it is left
    out until its <|message|> comes)."""
    found = []
    for part in text.split(START):
        if MESSAGE not in part:
            continue  # a header still being written (or stray text between messages)
        header, body = part.split(MESSAGE, 1)
        ended = any(m in body for m in _ENDS)
        for marker in _ENDS:
            body = body.split(marker, 1)[0]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header.replace(CONSTRAIN, " "))
        found.append(Message(channel and channel.group(1), recipient and recipient.group(1), body, ended))
    for m in found[:-1]:
        m.ended = True  # a later message began
    return found


@dataclass
class HarmonyReply:
    reasoning: str | None
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


def read_harmony(text: str, cut: bool = False) -> HarmonyReply:
    """A whole reply's reasoning, content and tool calls. A call whose message was cut short
    (`cut`: max_tokens) is left out; a call that ran to the end of an uncut reply ended by <|call|>
    (a stop token the text does not hold), so it counts."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[ToolCall] = []
    found = messages(text)
    for i, m in enumerate(found):
        if m.kind == "call":
            if m.ended or (i == len(found) - 1 and not cut):
                calls.append(ToolCall(m.call_name or "", m.body.strip()))
        else:
            (reasoning if m.kind == "reasoning" else content).append(m.body)
    if not _has_markers(text) and text.strip():  # no markers at all: the text is the answer
        content.append(text)
    return HarmonyReply("".join(reasoning) if reasoning else None, "".join(content) if content else None, calls)


class HarmonyStream:
    """read_harmony over a stream: feed(delta) -> (reasoning delta, content delta, tool-call deltas in
    OpenAI's streaming shape); finish(cut) says the rest."""

    def __init__(self) -> None:
        self.text = ""
        self.said = {"reasoning": 0, "content": 0}  # characters said of each
        self.calls_said = 0
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, str, list[dict]]:
        self.text += delta
        return self._say(messages(self.text), last_call_done=False, whole=False)

    def finish(self, cut: bool = False) -> tuple[str, str, list[dict]]:
        found = messages(self.text)
        if not _has_markers(self.text) and self.text.strip():  # no markers at all: the text is the answer
            found = [Message("final", None, self.text, True)]
        return self._say(found, last_call_done=not cut, whole=True)

    def _say(self, found: list[Message], last_call_done: bool, whole: bool) -> tuple[str, str, list[dict]]:
        """What `found` adds to what was said; `last_call_done`: a last, unended call message is
        whole (its <|call|> was the stop token); `whole`: the text is all there is, nothing held."""
        texts = {"reasoning": "", "content": ""}
        calls: list[ToolCall] = []
        for i, m in enumerate(found):
            if m.kind != "call":
                texts[m.kind] += m.body
            elif m.ended or (last_call_done and i == len(found) - 1):
                calls.append(ToolCall(m.call_name or "", m.body.strip(), ""))
        out = []
        for kind in ("reasoning", "content"):
            new = texts[kind][self.said[kind] :]
            held = 0 if whole else partial_tail(new, MARKERS)  # a marker may be arriving in pieces
            new = new[: len(new) - held]
            self.said[kind] += len(new)
            out.append(new)
        deltas = []
        for index in range(self.calls_said, len(calls)):
            call = ToolCall(calls[index].name, calls[index].arguments, new_call_id())
            self.calls.append(call)
            deltas.append({"index": index, **call.to_openai()})
        self.calls_said = len(calls)
        return out[0], out[1], deltas


def _has_markers(text: str) -> bool:
    return any(m in text for m in MARKERS)
