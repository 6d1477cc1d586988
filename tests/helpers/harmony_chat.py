"""A tiny gpt-oss model that speaks harmony: the tiny random gpt_oss folder with harmony's markers
as special tokens, <|return|> and <|call|> as its end tokens, and a chat template in the shape of
gpt-oss's own (system and developer messages, tools as a TypeScript namespace, calls as commentary
messages to functions.NAME, results as messages from the function back to the assistant, and the
generation prompt opening an assistant message)."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.chat_model import marked_chat_model
from tokenloom.tool_calling.harmony import MARKERS

TEMPLATE = """<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06

Reasoning: medium

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.
{%- endif %}<|end|>
{%- set system = messages | selectattr('role', 'equalto', 'system') | map(attribute='content') | first %}
{%- if system or tools %}<|start|>developer<|message|>
{%- if system %}# Instructions

{{ system }}

{% endif %}
{%- if tools %}# Tools

## functions

namespace functions {
{% for t in tools %}// {{ t.function.description }}
type {{ t.function.name }} = (_: {{ t.function.parameters | tojson }}) => any;
{% endfor %}} // namespace functions
{%- endif %}<|end|>
{%- endif %}
{%- set ns = namespace(last_call='') %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' and m.tool_calls %}
{%- for c in m.tool_calls %}{% set ns.last_call = c.function.name %}<|start|>assistant to=functions.
{{- c.function.name }}<|channel|>commentary json<|message|>{{ c.function.arguments | tojson }}<|call|>
{%- endfor %}
{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'tool' %}<|start|>functions.{{ ns.last_call }} to=assistant<|channel|>commentary<|message|>
{{- m.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


def harmony_model(folder: Path, out: Path) -> Path:
    """`folder` (the tiny gpt_oss model) copied to `out` as a harmony chat model."""
    return marked_chat_model(folder, out, MARKERS, TEMPLATE, ("<|return|>", "<|call|>"))
