"""The tiny GLM-4, Command R7B (Cohere 2) and SmolLM3 made chat models the way their releases are:
their markers as special tokens, chat templates laid out as the releases lay theirs out (written
here, not copied: the released files cannot be fetched), and their end tokens. Plain chat only: the
tool-call syntaxes of GLM-4 and Command R7B are not read by tokenloom.

- GLM-4-0414: ``[gMASK]<sop>`` once, then ``<|ROLE|>\\nTEXT`` per turn and ``<|assistant|>\\n`` to
  answer; a reply ends at ``<|endoftext|>``, ``<|user|>`` or ``<|observation|>``.
- Command R7B: ``<BOS_TOKEN>`` written by the template, turns as
  ``<|START_OF_TURN_TOKEN|><|ROLE_TOKEN|>TEXT<|END_OF_TURN_TOKEN|>``, an assistant's text inside
  ``<|START_RESPONSE|>...<|END_RESPONSE|>``; a reply ends at ``<|END_OF_TURN_TOKEN|>``.
- SmolLM3: ChatML turns, the system turn a metadata header then the user's instructions, and with
  reasoning off (``/no_think``) an empty think block after the assistant's opening; a reply ends at
  ``<|im_end|>``."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, processors

from tests.helpers.chat_model import marked_chat_model

GLM4 = (
    ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>"),
    "[gMASK]<sop>{%- for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}",
    ("<|endoftext|>", "<|user|>", "<|observation|>"),
    {},
)
_TURN = "'<|START_OF_TURN_TOKEN|>'"
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
    ),
    "{{ bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{ " + _TURN + " + '<|SYSTEM_TOKEN|>' + m.content + '<|END_OF_TURN_TOKEN|>' }}"
    "{%- elif m.role == 'user' %}{{ " + _TURN + " + '<|USER_TOKEN|>' + m.content + '<|END_OF_TURN_TOKEN|>' }}"
    "{%- else %}{{ " + _TURN + " + '<|CHATBOT_TOKEN|><|START_RESPONSE|>' + m.content + "
    "'<|END_RESPONSE|><|END_OF_TURN_TOKEN|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ " + _TURN + " + '<|CHATBOT_TOKEN|>' }}{% endif %}",
    ("<|END_OF_TURN_TOKEN|>",),
    {"bos_token": "<BOS_TOKEN>"},
)
_SMOL_HEADER = (
    "## Metadata\\n\\nKnowledge Cutoff Date: June 2025\\nReasoning Mode: /no_think\\n\\n## Custom Instructions\\n\\n"
)
SMOLLM3 = (
    ("<|im_start|>", "<|im_end|>", "<think>", "</think>"),
    "{%- set system = messages[0].content if messages[0].role == 'system' else '' %}"
    "{{ '<|im_start|>system\\n" + _SMOL_HEADER + "' + system + '\\n\\n<|im_end|>\\n' }}"
    "{%- for m in messages if m.role != 'system' %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n' }}{% endif %}",
    ("<|im_end|>",),
    {},
)


def family_chat_model(folder: Path, out: Path, family: tuple) -> Path:
    """The tiny model at `folder` as a chat model of `family` (GLM4, COMMAND_R7B, SMOLLM3) at `out`.
    A family with a bos_token gets a tokenizer that adds it to every encoded text, as Command R's
    tokenizer.json does (its template writes it too: the chat's prompt must not hold two)."""
    markers, template, ends, tokens = family
    out = marked_chat_model(folder, out, markers, template, ends, tokens)
    if "bos_token" in tokens:
        tk = Tokenizer.from_file(str(out / "tokenizer.json"))
        bos = tokens["bos_token"]
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tk.token_to_id(bos))]
        )
        tk.save(str(out / "tokenizer.json"))
    return out
