"""What a chat request's tools and the model's reasoning change: the prompt, the grammar, and how
the reply is read back (whole or streamed) into content, reasoning_content and tool_calls."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from tokenloom.structured import StructuredOutput
from tokenloom.tokenizer import template_takes_system
from tokenloom.tool_calling import (
    ReasoningStream,
    ToolCallStream,
    ToolFormat,
    parse_tool_calls,
    reasoning_enabled,
    split_reasoning,
    starts_thinking,
    tool_format,
    tool_grammar,
)
from tokenloom.tool_calling.formats import HARMONY
from tokenloom.tool_calling.grammar import harmony_grammar, no_call_grammar
from tokenloom.tool_calling.harmony import MARKERS as HARMONY_MARKERS
from tokenloom.tool_calling.harmony import HarmonyStream, read_harmony
from tokenloom.tool_calling.messages import merged_system, template_messages
from tokenloom.tool_calling.parse import unwrap_content, without_markers
from tokenloom.tool_calling.reasoning import THINK_TAGS, reasoning_tags
from tokenloom.tool_calling.stream import MarkerFilter


@dataclass
class ChatFeatures:
    """Server-wide: the model's tool-call format and whether replies carry think tags; harmony
    (gpt-oss): replies are harmony messages, read by tool_calling/harmony.py."""

    tool_format: ToolFormat
    reasoning: bool
    think_tags: tuple[str, str] = THINK_TAGS  # what the model's reasoning is written between
    system_role: bool = True  # the template renders system messages (False: merged into the first user turn)
    # the model's special tokens other than the markers, taken out of replies decoded with special tokens
    other_specials: tuple[str, ...] = ()
    _special: frozenset[str] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def for_template(
        cls, chat_template: str | None, tool_parser: str | None = None, reasoning_parser: str | None = None
    ) -> ChatFeatures:
        """From the --tool-call-parser / --reasoning-parser values (None or "auto": from the
        template); ValueError for an unknown name."""
        fmt = tool_format(tool_parser, chat_template)
        reasoning = reasoning_enabled(reasoning_parser, chat_template)
        if fmt is HARMONY or reasoning_parser == "harmony":
            return cls(HARMONY, reasoning_parser != "none")
        return cls(fmt, reasoning, reasoning_tags(chat_template), template_takes_system(chat_template))

    @property
    def harmony(self) -> bool:
        return self.tool_format is HARMONY

    def _marker_texts(self) -> tuple[str, ...]:
        return (
            HARMONY_MARKERS if self.harmony else self.tool_format.markers + (self.think_tags if self.reasoning else ())
        )

    def markers_dropped(self, tokenizer) -> bool:
        """Whether decoding with skip_special_tokens would drop the format's markers or the think
        tags from the text (then the reply is decoded with them, or it could not be read back)."""
        return any(tokenizer.decode(tokenizer.encode(t, add_special_tokens=False)) != t for t in self._marker_texts())

    def decode_with_markers(self, tokenizer) -> bool:
        """markers_dropped; when so, the model's other special tokens are noted (`other_specials`)
        for the reading to drop, so a reply decoded with special tokens holds only the markers."""
        if not self.markers_dropped(tokenizer):
            return False
        markers = set(self._marker_texts())
        added = tokenizer.backend.get_added_tokens_decoder().values()
        self.other_specials = tuple(sorted(t.content for t in added if t.special and t.content not in markers))
        return True

    def special_markers(self, engine) -> frozenset[str]:
        """The format's markers that are special tokens of the model (asked once)."""
        with self._lock:
            if self._special is None:
                markers = HARMONY_MARKERS if self.harmony else self.tool_format.markers
                self._special = engine.grammar_special_tokens(markers)
            return self._special


@dataclass
class ChatTurn:
    """One request's tools as the serving side needs them."""

    mode: str  # none | auto | required
    functions: list[dict[str, Any]]  # the tools the reply may call
    template_tools: list[dict[str, Any]] | None  # what the template receives as `tools`
    messages: list[dict[str, Any]]  # the template's input


def chat_turn(req, features: ChatFeatures) -> ChatTurn:
    """A chat request's turn (make_turn)."""
    mode, functions = req.tool_mode()
    return make_turn([m.as_template_input() for m in req.messages], mode, functions, features)


def make_turn(
    messages: list[dict[str, Any]], mode: str, functions: list[dict[str, Any]], features: ChatFeatures
) -> ChatTurn:
    """OpenAI-shaped `messages` and the `functions` offered under `mode`, as the template takes them
    (tool_choice none: the tools are not offered; calls and results already in the history are
    rendered all the same)."""
    offered = functions if mode != "none" else None
    messages = template_messages(messages, offered, features.tool_format)
    if not features.system_role:  # (a system message of the client's, or the tools' prompt)
        messages = merged_system(messages)
    template_tools = None
    if offered and features.tool_format.renders_tools:
        template_tools = [{"type": "function", "function": f} for f in offered]
    return ChatTurn(mode, functions, template_tools, messages)


def tool_constraint(
    mode: str, functions: list[dict[str, Any]], features: ChatFeatures, engine, parallel: bool
) -> StructuredOutput | None:
    """The grammar that keeps the reply's calls to `functions` valid (tool_calling/grammar.py), or
    under tool_choice none one that keeps it from calling; None without tools."""
    if not functions:
        return None
    if features.harmony:
        special = features.special_markers(engine)
        return StructuredOutput.grammar(harmony_grammar(functions, mode, special))
    if mode == "none":
        return StructuredOutput.grammar(no_call_grammar(features.tool_format))
    special = features.special_markers(engine)
    return StructuredOutput.grammar(tool_grammar(functions, features.tool_format, mode, parallel, special))


@dataclass
class Reply:
    """A finished reply read back: the message fields and the finish reason."""

    content: str | None
    reasoning: str | None
    tool_calls: list[dict]

    def message(self) -> dict[str, Any]:
        body: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            body["reasoning_content"] = self.reasoning
        if self.tool_calls:
            body["tool_calls"] = self.tool_calls
        return body


def read_reply(
    text: str,
    prompt: str,
    turn_mode: str,
    features: ChatFeatures,
    cut: bool = False,
    functions: list[dict[str, Any]] | None = None,
) -> Reply:
    """Split a whole reply into reasoning, content and tool calls (`cut`: it ran out of max_tokens;
    `functions`: the tools offered, whose schemas read the values of calls written as text)."""
    text = without_markers(text, features.other_specials)
    if features.harmony:
        read = read_harmony(text, cut)
        said = [c.to_openai() for c in read.calls] if turn_mode != "none" else []
        return Reply(
            read.content if read.content or not said else None, read.reasoning if features.reasoning else None, said
        )
    reasoning = None
    if features.reasoning:
        tags = features.think_tags
        reasoning, text = split_reasoning(text, starts_thinking(prompt, tags), tags)
    calls = []
    if turn_mode != "none":
        text, found = parse_tool_calls(text, features.tool_format, cut, schemas_of(functions))
        calls = [c.to_openai() for c in found]
    else:
        text = unwrap_content(text, features.tool_format)
    return Reply(text if text or not calls else None, reasoning, calls)


def schemas_of(functions: list[dict[str, Any]] | None) -> dict[str, Any]:
    """{name: parameters} of the tools offered."""
    return {f["name"]: f["parameters"] for f in functions or []}


def finish_reason(reason: str | None, has_calls: bool) -> str | None:
    """OpenAI's: a reply that ended by itself with calls finished for "tool_calls"."""
    return "tool_calls" if has_calls and reason == "stop" else reason


class ReplyStream:
    """read_reply over a stream: feed(text_delta, finished) -> the OpenAI delta fields to send."""

    def __init__(
        self, prompt: str, turn_mode: str, features: ChatFeatures, functions: list[dict[str, Any]] | None = None
    ) -> None:
        self.harmony = HarmonyStream() if features.harmony else None
        self.says_reasoning, self.says_calls = features.reasoning, turn_mode != "none"
        think_tags = features.reasoning and not features.harmony
        tags = features.think_tags
        self.reasoning = ReasoningStream(starts_thinking(prompt, tags), tags) if think_tags else None
        reads_calls = self.says_calls and not features.harmony
        self.tools = ToolCallStream(features.tool_format, schemas_of(functions)) if reads_calls else None
        self.unwrap = MarkerFilter(features.tool_format.content_markers)  # when no calls are read
        self.others = MarkerFilter(features.other_specials)
        self.has_calls = False

    def feed(self, text_delta: str, finished: bool, cut: bool = False) -> dict[str, Any]:
        """The delta fields for `text_delta`; `finished`: the last one (`cut`: by max_tokens)."""
        text_delta = self.others.feed(text_delta) + (self.others.finish() if finished else "")
        if self.harmony is not None:
            return self._feed_harmony(self.harmony, text_delta, finished, cut)
        delta: dict[str, Any] = {}
        thought, text = "", text_delta
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text_delta)
            if finished:
                thought, text = _joined((thought, text), self.reasoning.finish())
        if thought:
            delta["reasoning_content"] = thought
        if self.tools is not None:
            said = self.tools.feed(text)
            if finished:
                rest = self.tools.finish(cut)
                said.content += rest.content
                said.tool_calls += rest.tool_calls
                self.has_calls = bool(self.tools.calls)
            text = said.content
            if said.tool_calls:
                delta["tool_calls"] = said.tool_calls
        else:
            text = self.unwrap.feed(text) + (self.unwrap.finish() if finished else "")
        if text:
            delta["content"] = text
        return delta

    def _feed_harmony(self, stream: HarmonyStream, text_delta: str, finished: bool, cut: bool) -> dict[str, Any]:
        thought, text, calls = stream.feed(text_delta)
        if finished:
            more = stream.finish(cut)
            thought, text, calls = thought + more[0], text + more[1], calls + more[2]
            self.has_calls = self.says_calls and bool(stream.calls)
        delta: dict[str, Any] = {}
        if thought and self.says_reasoning:
            delta["reasoning_content"] = thought
        if calls and self.says_calls:
            delta["tool_calls"] = calls
        if text:
            delta["content"] = text
        return delta


def _joined(first: tuple[str, str], second: tuple[str, str]) -> tuple[str, str]:
    return first[0] + second[0], first[1] + second[1]
