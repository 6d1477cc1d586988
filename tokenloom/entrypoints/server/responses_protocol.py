"""OpenAI's Responses API requests read into the chat completion requests the server already prepares:
``instructions`` the system message, ``input`` (text, or items: messages, function calls and their
outputs, reasoning) the conversation, after the stored turns of ``previous_response_id``; function
``tools``, ``tool_choice``, ``text.format`` and ``max_output_tokens`` their chat counterparts.
Built-in tools (web search, files, ...) and image inputs are refused by name."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenloom.entrypoints.server.protocol import APIError, ChatCompletionRequest

REQUEST = ConfigDict(extra="allow")
STORED_RESPONSES = 1024  # responses kept for previous_response_id (least recently stored go first)


class ResponsesRequest(BaseModel):
    model_config = REQUEST
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    store: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


class ResponseStore:
    """The conversations behind stored responses (OpenAI chat messages, the reply's included), for
    a later request's previous_response_id; the oldest go once STORED_RESPONSES are kept."""

    def __init__(self, capacity: int = STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._turns: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def get(self, response_id: str) -> list[dict[str, Any]]:
        if response_id not in self._turns:
            raise APIError(
                404,
                f"no stored response {response_id!r} (stored ones live as long as the server)",
                "previous_response_id",
            )
        return list(self._turns[response_id])

    def put(self, response_id: str, messages: list[dict[str, Any]]) -> None:
        self._turns[response_id] = messages
        while len(self._turns) > self.capacity:
            self._turns.popitem(last=False)


def _content_text(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind not in ("input_text", "output_text", "text"):
            raise APIError(400, f"{kind!r} content is not supported (text models only)", f"{where}[{i}]")
        parts.append(part.get("text", ""))
    return "".join(parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as OpenAI chat messages: consecutive function calls join one assistant message, a
    reasoning item goes with the assistant turn after it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for i, item in enumerate(items):
        kind, where = item.get("type", "message"), f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(
                    400, f"a message's role must be user, assistant, system or developer, got {role!r}", where
                )
            message = {"role": role, "content": _content_text(item.get("content", ""), f"{where}.content")}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = "".join(reasoning), []
            out.append(message)
        elif kind == "function_call":
            call = {
                "id": item.get("call_id", ""),
                "type": "function",
                "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")},
            }
            if out and out[-1]["role"] == "assistant" and not out[-1].get("content") and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning:
                    out[-1]["reasoning_content"], reasoning = "".join(reasoning), []
        elif kind == "function_call_output":
            output = item.get("output", "")
            text = output if isinstance(output, str) else _content_text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id", ""), "content": text})
        elif kind == "reasoning":
            reasoning += [c.get("text", "") for c in (item.get("content") or item.get("summary") or [])]
        else:
            raise APIError(400, f"{kind!r} input items are not supported", where)
    return out


def _tools(req: ResponsesRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if req.tools:
        tools = []
        for i, tool in enumerate(req.tools):
            if tool.get("type") != "function":
                raise APIError(400, f"{tool.get('type')!r} tools are not supported: function tools only", f"tools[{i}]")
            spec = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
            tools.append({"type": "function", "function": spec})
        fields["tools"] = tools
    choice = req.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise APIError(400, "tool_choice must be none, auto, required or a function", "tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name", "")}}
    if choice is not None:
        fields["tool_choice"] = choice
    fields["parallel_tool_calls"] = req.parallel_tool_calls
    return fields


def _format(text: dict[str, Any] | None) -> dict[str, Any]:
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        spec = {"name": fmt.get("name", "output"), "schema": fmt["schema"]}
        return {"response_format": {"type": "json_schema", "json_schema": spec}}
    raise APIError(400, "text.format must be text, json_object or json_schema with a schema", "text")


def chat_request(
    req: ResponsesRequest, history: list[dict[str, Any]]
) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
    """The chat completion request for `req` after the stored `history`, and the conversation it
    sends (kept with the response for a later previous_response_id)."""
    messages = history + input_messages(req.input)
    if req.instructions:  # instructions are this request's only: not carried to the next
        sent = [{"role": "system", "content": req.instructions}] + [m for m in messages if m["role"] != "system"]
    else:
        sent = messages
    body: dict[str, Any] = {
        "model": req.model,
        "messages": sent,
        "stream": req.stream,
        **_tools(req),
        **_format(req.text),
    }
    for name, value in (("max_tokens", req.max_output_tokens), ("temperature", req.temperature), ("top_p", req.top_p)):
        if value is not None:
            body[name] = value
    try:
        return ChatCompletionRequest.model_validate(body), messages
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        param = {"max_tokens": "max_output_tokens", "messages": "input"}.get(loc[0], loc[0]) if loc else None
        raise APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param) from None


def ignored_fields(req: ResponsesRequest) -> list[str]:
    """What the request asks that this server does not do: unknown fields, and reasoning effort."""
    return sorted(req.model_extra or ()) + (["reasoning.effort"] if (req.reasoning or {}).get("effort") else [])
