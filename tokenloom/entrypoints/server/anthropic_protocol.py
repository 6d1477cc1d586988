"""Anthropic's Messages API requests (docs.anthropic.com, "Messages") read into the chat completion
requests the server already prepares: the system prompt and content blocks become OpenAI messages
(``tool_use`` blocks the assistant's tool calls, ``tool_result`` blocks tool messages, ``thinking``
blocks its reasoning), ``tools`` and ``tool_choice`` OpenAI's, ``thinking`` the template's
enable_thinking. Image and document blocks are refused by name."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenloom.entrypoints.server.protocol import APIError, ChatCompletionRequest

REQUEST = ConfigDict(extra="allow")  # newer SDK fields are kept aside and named back


class AnthropicMessage(BaseModel):
    model_config = REQUEST
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(BaseModel):
    model_config = REQUEST
    name: str
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class MessagesRequest(BaseModel):
    model_config = REQUEST
    model: str
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema": ...}, "effort": ...}


class CountTokensRequest(BaseModel):
    model_config = REQUEST
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def _text_of(blocks: str | list[dict[str, Any]], param: str) -> str:
    """The text of a string or of text blocks (a tool result's content, the system prompt)."""
    if isinstance(blocks, str):
        return blocks
    parts = []
    for i, block in enumerate(blocks):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise APIError(400, f"only text blocks are supported here, got {block.get('type')!r}", f"{param}[{i}]")
        parts.append(block["text"])
    return "".join(parts)


def _user_turn(content: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """A user message's blocks: tool results become tool messages (first, as they answer the turn
    before), the text one user message."""
    out: list[dict[str, Any]] = []
    text = []
    for j, block in enumerate(content):
        kind, where = block.get("type"), f"messages[{index}].content[{j}]"
        if kind == "text":
            text.append(block.get("text", ""))
        elif kind == "tool_result":
            result = _text_of(block.get("content", ""), f"{where}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id", ""), "content": result})
        else:
            raise APIError(400, f"{kind!r} content blocks are not supported (text models only)", where)
    return out + ([{"role": "user", "content": "".join(text)}] if text else [])


def _assistant_turn(content: list[dict[str, Any]], index: int) -> dict[str, Any]:
    """An assistant message's blocks as one OpenAI message: text, tool calls and reasoning."""
    text, calls, thought = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind == "text":
            text.append(block.get("text", ""))
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input", {}))
            calls.append(
                {
                    "id": block.get("id", ""),
                    "type": "function",
                    "function": {"name": block.get("name", ""), "arguments": arguments},
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            thought.append(block.get("thinking", ""))
        else:
            raise APIError(400, f"{kind!r} content blocks are not supported here", f"messages[{index}].content[{j}]")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        message["tool_calls"] = calls
    if thought:
        message["reasoning_content"] = "".join(thought)
    return message


def openai_messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages."""
    out: list[dict[str, Any]] = []
    if req.system:
        out.append({"role": "system", "content": _text_of(req.system, "system")})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            out += _user_turn(m.content, i)
        else:
            out.append(_assistant_turn(m.content, i))
    return out


def _tool_fields(req: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """tools and tool_choice as OpenAI's."""
    fields: dict[str, Any] = {}
    if req.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in req.tools
        ]
    choice = req.tool_choice or {}
    kind = choice.get("type")
    if kind is not None:
        named = {"type": "function", "function": {"name": choice.get("name", "")}}
        mapping = {"auto": "auto", "any": "required", "none": "none", "tool": named}
        if kind not in mapping:
            raise APIError(400, f"tool_choice type must be auto, any, tool or none, got {kind!r}", "tool_choice")
        fields["tool_choice"] = mapping[kind]
        if choice.get("disable_parallel_tool_use"):
            fields["parallel_tool_calls"] = False
    return fields


def _thinking_fields(thinking: dict[str, Any] | None) -> dict[str, Any]:
    if not thinking:
        return {}
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled"):
        raise APIError(400, f"thinking type must be enabled or disabled, got {kind!r}", "thinking")
    return {"chat_template_kwargs": {"enable_thinking": kind == "enabled"}}


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """/v1/messages as a chat completion request."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": openai_messages(req),
        "max_tokens": req.max_tokens,
        "stream": req.stream,
        **_tool_fields(req),
        **_thinking_fields(req.thinking),
    }
    for name, value in (("stop", req.stop_sequences), ("temperature", req.temperature), ("top_p", req.top_p)):
        if value is not None:
            body[name] = value
    if req.top_k:
        body["top_k"] = req.top_k
    fmt = (req.output_config or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise APIError(400, "output_config.format must be {type: json_schema, schema: {...}}", "output_config")
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        param = {"stop": "stop_sequences"}.get(loc[0], loc[0]) if loc else None
        raise APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param) from None


def ignored_fields(req: MessagesRequest) -> list[str]:
    """What the request asks that this server does not do: unknown fields, and output_config's effort
    (a reasoning budget; the reply's length is max_tokens here)."""
    names = sorted(req.model_extra or ())
    return names + (["output_config.effort"] if "effort" in (req.output_config or {}) else [])


def count_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """/v1/messages/count_tokens as the chat request whose prompt is counted."""
    body = {"model": req.model, "messages": openai_messages(req), **_tool_fields(req), **_thinking_fields(req.thinking)}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise APIError(400, f"messages: {e.errors()[0].get('msg', 'invalid value')}", "messages") from None


def stop_reason(finish_reason: str | None, matched: str | int | None, called: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for an engine finish."""
    if called:
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None
