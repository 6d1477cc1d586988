"""Separating a reasoning model's thinking (``<think>...</think>``) from its answer.

Qwen3, DeepSeek-R1 and others write their reasoning between think tags before the answer; some
templates open the tag in the prompt, so the reply starts inside it and only closes it. The
reasoning goes to ``reasoning_content``, the rest to ``content``, whole or streamed. Command R7B
writes its plan between ``<|START_THINKING|>`` and ``<|END_THINKING|>`` (``PLAN_TAGS``): the tags
a template uses are read from it (``reasoning_tags``).
"""

from __future__ import annotations

from tokenloom.tool_calling.parse import partial_tail

OPEN, CLOSE = "<think>", "</think>"
THINK_TAGS = (OPEN, CLOSE)
PLAN_TAGS = ("<|START_THINKING|>", "<|END_THINKING|>")
# think, qwen3, deepseek_r1: the same think tags; harmony: gpt-oss's analysis channel (harmony.py)
PARSERS = ("auto", "none", "think", "qwen3", "deepseek_r1", "harmony")


def reasoning_enabled(name: str | None, chat_template: str | None) -> bool:
    """Whether replies are split (--reasoning-parser `name`; auto: the template knows think tags)."""
    if name not in (None, *PARSERS):
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(PARSERS)}")
    if name in (None, "auto"):
        return reasoning_tags(chat_template)[1] in (chat_template or "")
    return name != "none"


def reasoning_tags(chat_template: str | None) -> tuple[str, str]:
    """The (open, close) tags a template's model thinks between: Command R7B's plan tags where the
    template writes them, else the think tags."""
    return PLAN_TAGS if PLAN_TAGS[1] in (chat_template or "") else THINK_TAGS


def starts_thinking(prompt: str, tags: tuple[str, str] = THINK_TAGS) -> bool:
    """The prompt opened a think tag the reply is to close (the template's generation prompt)."""
    tail = prompt.rstrip()
    return tail.endswith(tags[0])


def split_reasoning(text: str, thinking: bool = False, tags: tuple[str, str] = THINK_TAGS) -> tuple[str | None, str]:
    """(reasoning, content) of a whole reply; `thinking`: the reply starts inside the tag.
    No tag: (None, text). An unclosed tag: everything after it is reasoning."""
    opening, closing = tags
    if not thinking:
        stripped = text.lstrip()
        if not stripped.startswith(opening):
            return None, text
        text, thinking = stripped[len(opening) :], True
    end = text.find(closing)
    if end < 0:
        return text.strip(), ""
    return text[:end].strip(), text[end + len(closing) :].lstrip()


class ReasoningStream:
    """split_reasoning over a stream: feed() returns (reasoning delta, content delta), holding
    back a tail that could be part of a tag."""

    def __init__(self, thinking: bool = False, tags: tuple[str, str] = THINK_TAGS) -> None:
        self.text = ""
        self.thinking = thinking
        self.tags = tags
        self.sent = (0, 0)  # characters of (reasoning, content) said

    def feed(self, text_delta: str) -> tuple[str, str]:
        self.text += text_delta
        reasoning, content = split_reasoning(self.text, self.thinking, self.tags)
        undecided = self._undecided(reasoning)
        if undecided:
            return "", ""
        closing = self.tags[1]
        if reasoning is not None and closing not in self.text:  # still thinking: hold a partial close tag
            reasoning = reasoning[: len(reasoning) - partial_tail(reasoning, (closing,))].rstrip()
        return self._diff(reasoning or "", content if reasoning is None or closing in self.text else "")

    def finish(self) -> tuple[str, str]:
        reasoning, content = split_reasoning(self.text, self.thinking, self.tags)
        return self._diff(reasoning or "", content)

    @property
    def reasoning(self) -> str | None:
        return split_reasoning(self.text, self.thinking, self.tags)[0]

    def _undecided(self, reasoning: str | None) -> bool:
        """The reply so far could still be opening a think tag (or whitespace before one)."""
        opening = self.tags[0]
        return (
            reasoning is None
            and not self.thinking
            and opening.startswith(self.text.lstrip()[: len(opening)])
            and len(self.text.lstrip()) < len(opening)
        )

    def _diff(self, reasoning: str, content: str) -> tuple[str, str]:
        r_sent, c_sent = self.sent
        # reasoning is stripped at both ends when whole: hold trailing whitespace until more comes
        r_new = reasoning[r_sent:] if len(reasoning) > r_sent else ""
        c_new = content[c_sent:] if len(content) > c_sent else ""
        self.sent = (max(r_sent, len(reasoning)), max(c_sent, len(content)))
        return r_new, c_new
