"""The tiny GLM-4, Command R7B (Cohere 2) and SmolLM3 made chat models the way their releases are:
their markers as special tokens, their chat templates and their end tokens. Command R7B's and
SmolLM3's templates are the released ones (tests/tool_calling/templates); GLM-4-0414's is written
here from its release's layout (its file is not among them), plain chat only: its tool-call syntax
(a call as ``NAME\\n{arguments}`` after ``<|assistant|>``) is not read by tokenloom.

- GLM-4-0414: ``[gMASK]<sop>`` once, then ``<|ROLE|>\\nTEXT`` per turn and ``<|assistant|>\\n`` to
  answer; a reply ends at ``<|endoftext|>``, ``<|user|>`` or ``<|observation|>``.
- Command R7B: ``<BOS_TOKEN>`` written by the template, turns as
  ``<|START_OF_TURN_TOKEN|><|ROLE_TOKEN|>TEXT<|END_OF_TURN_TOKEN|>``, an answer inside
  ``<|START_RESPONSE|>...<|END_RESPONSE|>``, calls inside ``<|START_ACTION|>...<|END_ACTION|>``
  (tool_calling/formats.py ``command_r7b``); a reply ends at ``<|END_OF_TURN_TOKEN|>``.
- SmolLM3: ChatML turns, the system turn a metadata header then the user's instructions; a reply
  ends at ``<|im_end|>``."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, processors

from tests.helpers.chat_model import marked_chat_model
from tests.helpers.real_templates import real_template

GLM4 = (
    ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>"),
    "[gMASK]<sop>{%- for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
    ("<|endoftext|>", "<|user|>", "<|observation|>"),
    {},
)
COMMAND_R7B = (
    (
        "<BOS_TOKEN>",
        "<|START_OF_TURN_TOKEN|>",
        "<|END_OF_TURN_TOKEN|>",
        "<|SYSTEM_TOKEN|>",
        "<|USER_TOKEN|>",
        "<|CHATBOT_TOKEN|>",
        "<|START_RESPONSE|>",
        "<|END_RESPONSE|>",
        "<|START_THINKING|>",
        "<|END_THINKING|>",
        "<|START_ACTION|>",
        "<|END_ACTION|>",
        "<|START_TOOL_RESULT|>",
        "<|END_TOOL_RESULT|>",
    ),
    real_template("CohereForAI-c4ai-command-r7b-12-2024-tool_use"),
    ("<|END_OF_TURN_TOKEN|>",),
    {"bos_token": "<BOS_TOKEN>"},
)
# Qwen3-Coder: ChatML, calls as function and parameter tags inside <tool_call> (tool_calling/xml_calls.py)
QWEN3_CODER = (
    ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"),
    real_template("Qwen3-Coder"),
    ("<|im_end|>",),
    {},
)
SMOLLM3 = (
    ("<|im_start|>", "<|im_end|>", "<think>", "</think>"),
    real_template("HuggingFaceTB-SmolLM3-3B"),
    ("<|im_end|>",),
    {},
)


def family_chat_model(folder: Path, out: Path, family: tuple) -> Path:
    """The tiny model at `folder` as a chat model of `family` (GLM4, COMMAND_R7B, SMOLLM3) at `out`.
    A family with a bos_token gets a tokenizer that adds it to every encoded text, as Command R's
    tokenizer.json does (its template writes it too: the chat's prompt must not hold two)."""
    markers, template, ends, tokens = family
    # room for the released templates' preambles (Command R7B's is ~2K tokens of this vocabulary, ~5K with tools)
    out = marked_chat_model(folder, out, markers, template, ends, tokens, positions=8192)
    if "bos_token" in tokens:
        tk = Tokenizer.from_file(str(out / "tokenizer.json"))
        bos = tokens["bos_token"]
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tk.token_to_id(bos))]
        )
        tk.save(str(out / "tokenizer.json"))
    return out
