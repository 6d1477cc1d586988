"""The tiny Qwen3-Next made a chat model the way Qwen3-Next-80B-A3B-Instruct is one: its ChatML
markers and tool tags as special tokens, a chat template laid out as the Qwen3 instruct releases lay
theirs out (written here, not copied: the released file cannot be fetched), and <|im_end|> as its
end token.

The layout: turns as <|im_start|>ROLE\\nTEXT<|im_end|>\\n; with tools, one system turn (the
user's system text, then "# Tools" and each tool's JSON on its own line inside <tools></tools>, then
the instruction to answer with <tool_call> JSON); an assistant's calls as
<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>; tool results as one user turn of
<tool_response> blocks; no default system prompt."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.chat_model import marked_chat_model

MARKERS = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call><|im_end|>\n"
)
TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' -}}{% endif -%}"
    "{{- " + repr(TOOLS_INTRO) + " -}}"
    "{%- for t in tools %}{{- '\\n' + (t | tojson) -}}{% endfor -%}"
    "{{- " + repr(TOOLS_OUTRO) + " -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- set content = m.content if m.content is string else '' -%}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + content -}}"
    "{%- for c in m.tool_calls or [] -%}"
    "{%- if not loop.first or content %}{{ '\\n' }}{% endif -%}"
    "{%- set f = c.function or c -%}"
    '{{- \'<tool_call>\\n{"name": "\' + f.name + \'", "arguments": \' -}}'
    "{{- f.arguments if f.arguments is string else f.arguments | tojson -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif -%}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif -%}"
)


def qwen3_next_chat_model(folder: Path, out: Path) -> Path:
    """The tiny Qwen3-Next at `folder` as a Qwen3-Next instruct chat model at `out`."""
    return marked_chat_model(folder, out, MARKERS, TEMPLATE, ("<|im_end|>",))
