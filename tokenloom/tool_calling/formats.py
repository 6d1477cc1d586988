"""How each model family writes tool calls, and which one a chat template uses.

A format is text around JSON call objects ``{"name": ..., "<args_key>": {...}}``:

    <section_open> <call_open> OBJECT <call_close> [<separator>] <call_open> OBJECT <call_close> ... <section_close>

- ``hermes`` (Qwen2.5/Qwen3, SmolLM3, Hermes): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
  per call. Small models trained on it (Qwen2.5-Coder-0.5B) often answer a call as the bare object,
  without the tags, or fence them as a ```json block; a reply that is nothing but call objects
  (fenced or not) counts as calls (``bare``).
- ``llama3_json`` (Llama 3.1/3.2/3.3): ``{"name": ..., "parameters": {...}}``, calls separated by ``;``.
- ``mistral`` (Mistral v0.3, Nemo): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.
- ``mistral_v11`` (the v11+ tokenizers: Mistral Small 3.2, Devstral, Magistral, Ministral 3): one
  ``[TOOL_CALLS]NAME[ARGS]{...}`` per call, Mistral Small 3.2's with ``[CALL_ID]ID`` before ``[ARGS]``.
- ``generic``: the hermes syntax for a template that does not render tools itself: the tools and the
  syntax go into a system message tokenloom writes (tool_calling/prompt.py).
- ``harmony`` (gpt-oss): calls are messages to ``functions.NAME`` in harmony's commentary channel,
  read by tool_calling/harmony.py rather than by this module's call syntax (its fields are unused).
- ``deepseek_v3`` (DeepSeek-V3, V3-0324, R1): the name outside the arguments (``name_close``)::

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
      ```json
      {...}
      ```<｜tool▁call▁end｜>
      <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

  Its template renders the calls and results of a conversation (arguments as their JSON text) but
  not the tools: tokenloom lists them in a system message, in this syntax (messages.py).
- ``deepseek_v31`` (DeepSeek-V3.1): the same markers, the name then the arguments as bare JSON::

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

  Its template, like V3's, renders calls and results but not the tools; it applies ``tojson`` to a
  call's arguments itself, so they go in as an object.
- ``qwen3_coder`` (Qwen3-Coder, Qwen3-Coder-Next, Qwen3.5): ``<tool_call>`` around a function tag with
  one tag per parameter, values as plain text (xml_calls.py), not a call object.
- ``command_r7b`` (Command R7B, Cohere 2): a pretty-printed JSON list of calls whose objects number
  the call and name the tool (``name_key``, ``id_key``)::

      <|START_ACTION|>[
          {"tool_call_id": "0", "tool_name": NAME, "parameters": {...}},
          ...
      ]<|END_ACTION|>

  preceded by an optional plan (``<|START_THINKING|>...<|END_THINKING|>``, reasoning.py reads it);
  a plain answer is wrapped in ``<|START_RESPONSE|>...<|END_RESPONSE|>`` (``content_markers``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenloom.tool_calling.xml_calls import FUNCTION_OPEN

CALL_HEAD = '{"name": "'  # how every format's call object starts, written compactly
CALL_WS = r"[ \t\n]{0,24}"  # whitespace a call object may hold between its parts (bounded for the grammar)
# The head as a regex (Python's and llguidance's syntax alike): models pretty-print calls too, as
# '{\n  "name": "', and the grammars and the parser both take any such head.
CALL_HEAD_PATTERN = rf'\{{{CALL_WS}"name"{CALL_WS}:{CALL_WS}"'
FENCE_OPEN, FENCE_CLOSE = "```json\n", "\n```"  # around bare calls, as small models often write them


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call syntax (module doc)."""

    name: str
    trigger: str  # text whose appearance opens the calls in free text
    section_open: str = ""
    section_close: str = ""
    call_open: str = ""
    call_close: str = ""
    separator: str = ""  # between calls, besides whitespace
    args_key: str = "arguments"
    bare: bool = False  # a reply made only of call objects (no markers) is calls too
    renders_tools: bool = True  # False: tokenloom writes the tool prompt (the template does not)
    # a call is `call_open NAME name_close {arguments} call_close`, not a call object (DeepSeek)
    name_close: str = ""
    lists_tools: bool = True  # False: the template renders calls and results, tokenloom lists the tools
    arguments_text: bool = False  # templates concatenate a call's arguments as JSON text (messages.JSONText)
    specials: tuple[str, ...] = ()  # the special tokens within the format's texts, where several make one
    id_marker: str = ""  # between NAME and name_close: the call's id after this marker (Mistral v11)
    nine_char_ids: bool = False  # the template takes only 9-letter-or-digit call ids (messages.py)
    null_call_content: bool = False  # the template renders a turn's calls only when its content is none
    xml_params: bool = False  # a call is Qwen3-Coder's function tag with parameter tags (xml_calls.py)
    name_key: str = "name"  # the call object's key for the tool's name
    id_key: str = ""  # a key that comes first in each call object, holding the call's number (Command R7B)
    spaced: bool = False  # whitespace may come before each call and before the section's close
    content_markers: tuple[str, str] = ("", "")  # what wraps a plain answer (dropped from the content)
    plan_markers: tuple[str, str] = ("", "")  # what wraps the reasoning a reply may open with (grammar.py)

    @property
    def head(self) -> str:
        """How a call object starts, written compactly, up to the name's opening quote."""
        if self.xml_params:
            return FUNCTION_OPEN
        numbered = f'"{self.id_key}": "0", ' if self.id_key else ""
        return f'{{{numbered}"{self.name_key}": "'

    @property
    def head_pattern(self) -> str:
        """The head as a regex in any spacing (Python's and llguidance's syntax alike)."""
        numbered = rf'"{self.id_key}"{CALL_WS}:{CALL_WS}"[0-9]{{1,4}}"{CALL_WS},{CALL_WS}' if self.id_key else ""
        return rf'{CALL_WS if self.spaced else ""}\{{{CALL_WS}{numbered}"{self.name_key}"{CALL_WS}:{CALL_WS}"'

    @property
    def markers(self) -> tuple[str, ...]:
        """The format's fixed texts that a vocabulary may hold as special tokens."""
        if self.specials:
            return tuple(sorted(self.specials))
        texts = (self.trigger, self.section_open, self.section_close, self.call_open, self.call_close)
        return tuple(sorted({t.strip() for t in texts if t.strip() and t.strip() != CALL_HEAD.strip()}))

    def __post_init__(self) -> None:
        opening = self.section_open + self.call_open + ("" if self.name_close else self.head)
        if not opening.startswith(self.trigger):
            raise ValueError(f"{self.name}: the trigger {self.trigger!r} must begin the calls {opening!r}")


HERMES = ToolFormat(
    "hermes", trigger="<tool_call>", call_open="<tool_call>\n", call_close="\n</tool_call>", separator="\n", bare=True
)
LLAMA3_JSON = ToolFormat("llama3_json", trigger=CALL_HEAD, separator="; ", args_key="parameters")
MISTRAL = ToolFormat(
    "mistral",
    trigger="[TOOL_CALLS]",
    section_open="[TOOL_CALLS][",
    section_close="]",
    separator=", ",
    nine_char_ids=True,
)
MISTRAL_V11 = ToolFormat(
    "mistral_v11",
    trigger="[TOOL_CALLS]",
    call_open="[TOOL_CALLS]",
    id_marker="[CALL_ID]",
    name_close="[ARGS]",
    nine_char_ids=True,
    specials=("[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"),
)
GENERIC = ToolFormat(
    "generic",
    trigger="<tool_call>",
    call_open="<tool_call>\n",
    call_close="\n</tool_call>",
    separator="\n",
    bare=True,
    renders_tools=False,
)

QWEN3_CODER = ToolFormat(
    "qwen3_coder",
    trigger="<tool_call>",
    call_open="<tool_call>\n",
    call_close="\n</tool_call>",
    separator="\n",
    xml_params=True,
)
HARMONY = ToolFormat("harmony", trigger="")  # tool_calling/harmony.py reads its calls

_DS_CALLS, _DS_CALL, _DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"
_DS_CALL_END, _DS_CALLS_END = "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_V3 = ToolFormat(
    "deepseek_v3",
    trigger=_DS_CALLS,
    section_open=_DS_CALLS,
    section_close=_DS_CALLS_END,
    call_open=f"{_DS_CALL}function{_DS_SEP}",
    name_close="\n```json\n",
    call_close=f"\n```{_DS_CALL_END}",
    separator="\n",
    lists_tools=False,
    arguments_text=True,
    null_call_content=True,
    specials=(_DS_CALLS, _DS_CALL, _DS_SEP, _DS_CALL_END, _DS_CALLS_END),
)

DEEPSEEK_V31 = ToolFormat(
    "deepseek_v31",
    trigger=_DS_CALLS,
    section_open=_DS_CALLS,
    section_close=_DS_CALLS_END,
    call_open=_DS_CALL,
    name_close=_DS_SEP,
    call_close=_DS_CALL_END,
    lists_tools=False,
    specials=(_DS_CALLS, _DS_CALL, _DS_SEP, _DS_CALL_END, _DS_CALLS_END),
)

_CR_ACTION, _CR_ACTION_END = "<|START_ACTION|>", "<|END_ACTION|>"
_CR_RESPONSE, _CR_RESPONSE_END = "<|START_RESPONSE|>", "<|END_RESPONSE|>"
_CR_PLAN = ("<|START_THINKING|>", "<|END_THINKING|>")  # reasoning.PLAN_TAGS
COMMAND_R7B = ToolFormat(
    "command_r7b",
    trigger=_CR_ACTION,
    section_open=f"{_CR_ACTION}[",
    section_close=f"]{_CR_ACTION_END}",
    separator=",",
    args_key="parameters",
    name_key="tool_name",
    id_key="tool_call_id",
    spaced=True,
    content_markers=(_CR_RESPONSE, _CR_RESPONSE_END),
    plan_markers=_CR_PLAN,
    specials=(_CR_ACTION, _CR_ACTION_END, _CR_RESPONSE, _CR_RESPONSE_END, *_CR_PLAN),
)

FORMATS = {
    f.name: f
    for f in (
        HERMES,
        QWEN3_CODER,
        LLAMA3_JSON,
        MISTRAL,
        MISTRAL_V11,
        GENERIC,
        HARMONY,
        DEEPSEEK_V3,
        DEEPSEEK_V31,
        COMMAND_R7B,
    )
}


def detect_format(chat_template: str | None) -> ToolFormat:
    """The format a chat template teaches its model, from the markers it writes; GENERIC when the
    template does not render tools at all (or there is no template)."""
    source = chat_template or ""
    if "<|channel|>" in source:
        return HARMONY
    if _DS_CALLS in source:  # renders calls, not tools; V3 fences the arguments, V3.1 does not
        return DEEPSEEK_V3 if "```json" in source else DEEPSEEK_V31
    if _CR_ACTION in source:
        return COMMAND_R7B
    if "tools" not in source:
        return GENERIC
    if "<tool_call>" in source:
        return QWEN3_CODER if FUNCTION_OPEN in source else HERMES
    if "[TOOL_CALLS]" in source:
        return MISTRAL_V11 if "[ARGS]" in source else MISTRAL
    if '"parameters"' in source or "<|python_tag|>" in source:
        return LLAMA3_JSON
    return GENERIC


def tool_format(name: str | None, chat_template: str | None) -> ToolFormat:
    """`name` (a --tool-call-parser value; "auto" or None: from the template). ValueError if unknown."""
    if name in (None, "auto"):
        return detect_format(chat_template)
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose auto or one of {', '.join(FORMATS)}")
    return FORMATS[name]
