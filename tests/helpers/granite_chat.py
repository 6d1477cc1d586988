"""The tiny Granite 4.0-H made a chat model the way Granite 4.0's release is one: its role markers
as special tokens, a chat template laid out as IBM's prompt guide lays it out (written here, not
copied: the released file cannot be fetched), and <|end_of_text|> as its end token.

The layout: one system turn (the user's, then the tool listing: each tool's JSON on its own line
inside <tools></tools>, and the instruction to answer with <tool_call> JSON), turns as
<|start_of_role|>ROLE<|end_of_role|>TEXT<|end_of_text|>, an assistant's calls as
<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>, tool results as one user turn of
<tool_response> blocks."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.chat_model import marked_chat_model

MARKERS = (
    "<|start_of_role|>",
    "<|end_of_role|>",
    "<|end_of_text|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
TOOLS_INTRO = "You are a helpful assistant with access to the following tools.\n<tools>"
TOOLS_OUTRO = (
    "\n</tools>\n\nFor each tool call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>."
)
TEMPLATE = (
    "{%- set ns = namespace(system='', tools='') -%}"
    "{%- if tools -%}{%- for t in tools %}{% set ns.tools = ns.tools + '\\n' + (t | tojson) %}{% endfor -%}"
    "{%- set ns.tools = " + repr(TOOLS_INTRO) + " + ns.tools + " + repr(TOOLS_OUTRO) + " -%}{%- endif -%}"
    "{%- if messages[0].role == 'system' -%}{%- set ns.system = messages[0].content -%}"
    "{%- if ns.tools %}{% set ns.system = ns.system + '\\n\\n' + ns.tools %}{% endif -%}"
    "{%- else %}{% set ns.system = ns.tools or 'You are a helpful assistant.' %}{% endif -%}"
    "{{- '<|start_of_role|>system<|end_of_role|>' + ns.system + '<|end_of_text|>\\n' -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}"
    "{{- '<|start_of_role|>' + m.role + '<|end_of_role|>' + m.content + '<|end_of_text|>\\n' -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|start_of_role|>assistant<|end_of_role|>' + (m.content or '') -}}"
    "{%- for c in m.tool_calls or [] -%}"
    "{%- if not loop.first or m.content %}{{ '\\n' }}{% endif -%}"
    "{%- set f = c.function or c -%}"
    '{{- \'<tool_call>\\n{"name": "\' + f.name + \'", "arguments": \' -}}'
    "{{- f.arguments if f.arguments is string else f.arguments | tojson -}}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|end_of_text|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}"
    "{{- '<|start_of_role|>user<|end_of_role|>' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|end_of_text|>\\n' }}{% endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt %}{{ '<|start_of_role|>assistant<|end_of_role|>' }}{% endif -%}"
)


def granite_chat_model(folder: Path, out: Path) -> Path:
    """The tiny Granite 4.0-H at `folder` as a Granite 4.0 chat model at `out`."""
    return marked_chat_model(folder, out, MARKERS, TEMPLATE, ("<|end_of_text|>",))
