"""Tool calling and reasoning output: the families' formats, grammars that make calls valid,
and parsers that read calls and thinking out of replies, whole or streamed.

Engine-independent: the server (server/chat.py) and ``tokenloom chat`` use these over the
text the engine generates, and the grammars go to the engine as structured output.
"""

from tokenloom.tool_calling.formats import FORMATS, ToolFormat, detect_format, tool_format
from tokenloom.tool_calling.grammar import tool_grammar
from tokenloom.tool_calling.parse import ToolCall, parse_tool_calls
from tokenloom.tool_calling.reasoning import ReasoningStream, reasoning_enabled, split_reasoning, starts_thinking
from tokenloom.tool_calling.stream import ToolCallStream

__all__ = [
    "FORMATS",
    "ReasoningStream",
    "ToolCall",
    "ToolCallStream",
    "ToolFormat",
    "detect_format",
    "parse_tool_calls",
    "reasoning_enabled",
    "split_reasoning",
    "starts_thinking",
    "tool_format",
    "tool_grammar",
]
