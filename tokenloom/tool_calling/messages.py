"""Tools and tool turns on their way into a chat template.

OpenAI clients send tools as ``{"type": "function", "function": {name, description, parameters}}``,
an assistant's calls with ``arguments`` as JSON text, and results as ``role: "tool"`` messages.
Templates that render tools (Qwen's, Llama's, Mistral's) take the tools as they are and a call's
arguments as an object (they apply ``tojson`` themselves). For a template that does not (the
``generic`` format), the tools and the call syntax go into the system message, calls become the
assistant's text and results a user turn, in the hermes syntax the parser reads back. DeepSeek-V3's
template renders calls (their arguments as JSON text, which it concatenates) and results but not
the tools: those are listed in a system message, with its call syntax (``listed_tools_prompt``).
Mistral's templates (Nemo and later) refuse call ids that are not 9 letters or digits, so in the
``mistral`` formats every other id (OpenAI's ``call_...``) is replaced by one derived from it, the
same in the call and in its result (``mistral_call_id``).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from tokenloom.tool_calling.formats import ToolFormat

_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def function_of(tool: dict[str, Any], index: int) -> dict[str, Any]:
    """{"name", "description", "parameters"} of an OpenAI tool; ValueError naming what is wrong."""
    if tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
        raise ValueError(f"tools[{index}] must be {{'type': 'function', 'function': {{...}}}}")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"tools[{index}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    parameters = function.get("parameters") or EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise ValueError(f"tools[{index}].function.parameters must be a JSON schema object")
    return {"name": name, "description": function.get("description") or "", "parameters": parameters}


def load_tools(path: str) -> list[dict[str, Any]]:
    """The functions (function_of) of an OpenAI-style tools file, a JSON list, as given with --tools;
    ValueError naming what is wrong."""
    try:
        tools = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--tools {path}: {e}") from None
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"--tools {path}: expected a non-empty JSON list of tools")
    return [function_of(t, i) for i, t in enumerate(tools)]


def _arguments_object(arguments: Any) -> Any:
    """A call's arguments as the templates expect them: an object (JSON text is parsed)."""
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def template_messages(
    messages: list[dict[str, Any]], functions: list[dict[str, Any]] | None, fmt: ToolFormat
) -> list[dict[str, Any]]:
    """OpenAI-shaped messages (content as text) as the template takes them (module doc);
    `functions`: the tools offered this turn (function_of), or None."""
    if not fmt.renders_tools:
        return _generic_messages(messages, functions)
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": _template_arguments(c["function"]["arguments"], fmt)}}
                for c in m["tool_calls"]
            ]
        if fmt.nine_char_ids:
            _mistral_ids(m)
        if fmt.null_call_content and m.get("tool_calls") and not m.get("content"):
            m["content"] = None  # DeepSeek-V3's and R1's templates: the calls of a turn without text
        out.append(m)
    if functions and not fmt.lists_tools:
        out = _with_system_text(out, listed_tools_prompt(functions, fmt))
    return out


_MISTRAL_ID = re.compile(r"^[a-zA-Z0-9]{9}$")


def mistral_call_id(call_id: Any) -> Any:
    """`call_id` as Mistral's templates take it: 9 letters or digits (an id already so is kept, any
    other string becomes the first 9 hex digits of its SHA-256, so a call and its result agree)."""
    if not isinstance(call_id, str) or _MISTRAL_ID.match(call_id):
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _mistral_ids(message: dict[str, Any]) -> None:
    """`message`'s call ids (a copy's) in Mistral's form."""
    if message.get("tool_calls"):
        message["tool_calls"] = [{**c, "id": mistral_call_id(c.get("id"))} for c in message["tool_calls"]]
    if "tool_call_id" in message:
        message["tool_call_id"] = mistral_call_id(message["tool_call_id"])


class JSONText(str):
    """A call's arguments as JSON text that the chat template's ``tojson`` writes as the value it holds
    (tokenizer.compile_chat_template): DeepSeek-V3's template concatenates the arguments as text,
    R1-Distill-Qwen's applies ``tojson`` to them, and both come out as the JSON object."""

    def json_value(self) -> Any:
        return json.loads(self)


def merged_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` for a template that takes no system message (Gemma 2's): a leading system
    message's text goes at the head of the first user message, as llama.cpp and ollama render them."""
    if not messages or messages[0]["role"] != "system":
        return messages
    system, rest = messages[0].get("content") or "", list(messages[1:])
    at = next((i for i, m in enumerate(rest) if m["role"] == "user"), None)
    if at is None:
        return [{"role": "user", "content": system}, *rest]
    rest[at] = {**rest[at], "content": f"{system}\n\n{rest[at].get('content') or ''}"}
    return rest


def _template_arguments(arguments: Any, fmt: ToolFormat) -> Any:
    """A call's arguments as `fmt`'s template takes them: JSONText where templates concatenate them
    (DeepSeek's), otherwise an object."""
    if fmt.arguments_text:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments)
        return JSONText(text) if _is_json(text) else text
    return _arguments_object(arguments)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _with_system_text(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """`messages` with `text` after the system message's (a new first system message if none)."""
    out = list(messages)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{text}"}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def listed_tools_prompt(functions: list[dict[str, Any]], fmt: ToolFormat) -> str:
    """The system text that lists `functions` for a template that renders calls but not tools
    (DeepSeek-V3's), with the format's own call syntax as the example."""
    listed = "\n\n".join(
        f"### {f['name']}\nDescription: {f.get('description') or ''}\n\nParameters: {json.dumps(f['parameters'])}"
        for f in functions
    )
    example = fmt.call_open + "tool_name" + fmt.name_close + '{"argument": "value"}' + fmt.call_close
    return (
        f"## Tools\nYou have access to the following tools:\n\n{listed}\n\n"
        "IMPORTANT: ALWAYS adhere to this exact format for tool use, one call a line:\n"
        f"{fmt.section_open}{example}{fmt.separator}...{fmt.section_close}"
    )


def _call_text(call: dict[str, Any]) -> str:
    function = call["function"]
    body = json.dumps({"name": function["name"], "arguments": _arguments_object(function["arguments"])})
    return f"<tool_call>\n{body}\n</tool_call>"


def _generic_messages(messages: list[dict[str, Any]], functions: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":  # results: a user turn the model reads them in
            text = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            parts = [m.get("content") or ""] + [_call_text(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(p for p in parts if p)})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    for m in out:
        m.pop("tool_results", None)
    if functions:
        out = _with_system_text(out, generic_tool_prompt(functions))
    return out


def generic_tool_prompt(functions: list[dict[str, Any]]) -> str:
    """The system text that offers `functions` to a model whose template has no tool support."""
    listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in functions)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n"
        "</tools>\n\nFor each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )
