"""Anthropic's Messages API on the OpenAI routes' serving (requests read by anthropic_protocol.py):
POST /v1/messages, whole or streamed as Anthropic's server-sent events (message_start, content
blocks opened, filled and closed in order, message_delta with the stop reason, message_stop), and
POST /v1/messages/count_tokens. Replies are read into thinking, text and tool_use blocks by the chat
route's readers. Errors are Anthropic's ``{"type": "error", "error": {...}}`` (app.py renders them
so under /v1/messages)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenloom.entrypoints.server.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_request,
    count_request,
    ignored_fields,
    stop_reason,
)
from tokenloom.entrypoints.server.chat import ChatCompletions
from tokenloom.entrypoints.server.chat_tools import ReplyStream
from tokenloom.entrypoints.server.protocol import APIError, ChatCompletionRequest
from tokenloom.entrypoints.server.served_models import ServedModels
from tokenloom.entrypoints.server.serving import (
    OpenAIServing,
    Prepared,
    client_of,
    ignored_fields_header,
    request_failed,
    shutting_down,
)
from tokenloom.entrypoints.server.streams import ShuttingDown
from tokenloom.outputs import RequestError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(error: APIError) -> dict[str, Any]:
    """`error` as Anthropic's error object."""
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def sse(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An OpenAI message's reasoning, text and tool calls as Anthropic content blocks."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        try:
            arguments = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            arguments = {}
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments})
    return blocks


class _Blocks:
    """The stream's content blocks: each opened once (content_block_start), filled by deltas and
    closed (content_block_stop) before the next opens."""

    def __init__(self) -> None:
        self.index, self.kind = -1, None

    def open(self, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index, self.kind = self.index + 1, block["type"]
        return events + [
            sse("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        ]

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def delta(self, delta: dict[str, Any]) -> str:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def text(self, kind: str, text: str) -> list[str]:
        """`text` into the open block of `kind` (thinking or text), opening one if need be."""
        events = (
            []
            if self.kind == kind
            else self.open({"type": kind, kind: ""} | ({"signature": ""} if kind == "thinking" else {}))
        )
        key = "thinking_delta" if kind == "thinking" else "text_delta"
        return events + [self.delta({"type": key, kind: text})]

    def calls(self, deltas: list[dict[str, Any]]) -> list[str]:
        """OpenAI tool-call stream deltas as tool_use blocks: a header opens one, argument text fills it."""
        events = []
        for d in deltas:
            if "id" in d:
                events += self.open({"type": "tool_use", "id": d["id"], "name": d["function"]["name"], "input": {}})
            piece = (d.get("function") or {}).get("arguments") or ""
            if piece:
                events.append(self.delta({"type": "input_json_delta", "partial_json": piece}))
        return events


class AnthropicRoutes:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.chat = ChatCompletions(serving)

    def message(self, body: MessagesRequest, req: ChatCompletionRequest, prepared: Prepared, out) -> dict[str, Any]:
        """The whole reply as Anthropic's message object."""
        choice = self.chat.response(req, prepared, [out])["choices"][0]
        blocks = content_blocks(choice["message"])
        reason, sequence = stop_reason(out.finish_reason, out.stop_reason, any(b["type"] == "tool_use" for b in blocks))
        return {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "model": body.model,
            "content": blocks,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": prepared.prompt_tokens, "output_tokens": len(out.token_ids)},
        }

    async def stream(self, body: MessagesRequest, prepared: Prepared) -> AsyncGenerator[str, None]:
        """Anthropic's event stream for one reply; an engine failure or the shutdown ends it with an
        error event. The admission ticket is released however it ends."""
        start: dict[str, Any] = {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "model": body.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prepared.prompt_tokens, "output_tokens": 0},
        }
        yield sse("message_start", {"type": "message_start", "message": start})
        reader = ReplyStream(
            prepared.prompt_texts[0], prepared.tool_mode, self.serving.chat_features, prepared.tool_functions
        )
        blocks = _Blocks()
        try:
            async with aclosing(self.serving.deltas(prepared)) as deltas:
                async for _, delta in deltas:
                    cut = delta.finished and delta.finish_reason == "length"
                    fields = reader.feed(delta.text_delta, delta.finished, cut)
                    for event in self._events(blocks, fields):
                        yield event
                    if delta.finished:
                        for event in blocks.close():
                            yield event
                        matched = delta.completion.stop_reason if delta.completion is not None else None
                        reason, sequence = stop_reason(delta.finish_reason, matched, reader.has_calls)
                        end = {"stop_reason": reason, "stop_sequence": sequence}
                        usage = {"output_tokens": prepared.completion_tokens}
                        yield sse("message_delta", {"type": "message_delta", "delta": end, "usage": usage})
                        yield sse("message_stop", {"type": "message_stop"})
        except (RequestError, ShuttingDown) as e:
            error = shutting_down(e) if isinstance(e, ShuttingDown) else request_failed(e)
            yield sse("error", error_body(error))
        finally:
            assert prepared.ticket is not None
            prepared.ticket.release()

    @staticmethod
    def _events(blocks: _Blocks, fields: dict[str, Any]) -> list[str]:
        events = []
        if fields.get("reasoning_content"):
            events += blocks.text("thinking", fields["reasoning_content"])
        if fields.get("content"):
            events += blocks.text("text", fields["content"])
        return events + blocks.calls(fields.get("tool_calls") or [])

    async def respond(self, body: MessagesRequest, request: Request) -> Response:
        req = chat_request(body)
        client = client_of(None, request)
        prepared = request.state.log = await self.serving.off_loop(self.serving.prepare_chat, req, client)
        self.serving.admit(prepared, client)
        headers = ignored_fields_header(ignored_fields(body), request.url.path)
        if body.stream:
            return StreamingResponse(self.stream(body, prepared), media_type="text/event-stream", headers=headers)
        outs = await self.serving.run_admitted(prepared, request)
        if outs is None:  # the client left
            return Response(status_code=499)
        return JSONResponse(self.message(body, req, prepared, outs[0]), headers=headers)


def add_anthropic_routes(app: FastAPI, models: ServedModels) -> None:
    """Register /v1/messages and /v1/messages/count_tokens on `app`."""

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        async with models.use(body.model) as serving:
            return await AnthropicRoutes(serving).respond(body, request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        req = count_request(body)
        async with models.use(req.model) as serving:

            def count(_) -> int:
                prompt = serving.chat_prompt(req)
                return len(serving.encode(prompt, "messages", add_special_tokens=False))

            return {"input_tokens": await serving.off_loop(count, req)}
