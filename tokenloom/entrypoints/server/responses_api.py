"""OpenAI's Responses API on the chat route's serving (requests read by responses_protocol.py):
POST /v1/responses, whole or streamed as the Responses events (response.created, each output item
added, its deltas, done, then response.completed or response.incomplete), with reasoning, message
and function_call output items; GET /v1/responses/{id} for a stored one. Stored conversations serve
``previous_response_id`` for the server's lifetime."""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenloom.entrypoints.server.chat import ChatCompletions
from tokenloom.entrypoints.server.chat_tools import ReplyStream
from tokenloom.entrypoints.server.protocol import APIError, ChatCompletionRequest
from tokenloom.entrypoints.server.responses_protocol import (
    STORED_RESPONSES,
    ResponsesRequest,
    ResponseStore,
    chat_request,
    ignored_fields,
)
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


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": item_id or _id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def message_item(text: str, item_id: str | None = None, status: str = "completed") -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "type": "message",
        "id": item_id or _id("msg"),
        "status": status,
        "role": "assistant",
        "content": [part] if text or status == "completed" else [],
    }


def call_item(
    call_id: str, name: str, arguments: str, item_id: str | None = None, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id or _id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """An OpenAI chat message as Responses output items: reasoning, the text, each function call."""
    items = [reasoning_item(message["reasoning_content"])] if message.get("reasoning_content") else []
    if message.get("content"):
        items.append(message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def reply_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant's turn as a chat message (kept for previous_response_id)."""
    message: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "message":
            message["content"] += "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            message.setdefault("tool_calls", []).append(call)
        elif item["type"] == "reasoning":
            message["reasoning_content"] = "".join(c["text"] for c in item["content"])
    return message


class ResponsesRoutes:
    """One request's model, and the server's stored conversations and responses."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore, stored: OrderedDict[str, dict[str, Any]]) -> None:
        self.serving = serving
        self.chat = ChatCompletions(serving)
        self.store = store
        self.stored = stored  # id -> the response object

    def envelope(self, body: ResponsesRequest, response_id: str, created: float, status: str) -> dict[str, Any]:
        """The response object's fields around its output."""
        return {
            "id": response_id,
            "object": "response",
            "created_at": created,
            "status": status,
            "model": body.model,
            "output": [],
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": [t for t in body.tools or []],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "store": body.store,
            "text": body.text or {"format": {"type": "text"}},
            "metadata": body.metadata or {},
            "error": None,
            "incomplete_details": None,
        }

    def finish(
        self,
        response: dict[str, Any],
        body: ResponsesRequest,
        sent: list[dict[str, Any]],
        prepared: Prepared,
        reason: str | None,
    ) -> dict[str, Any]:
        """Status, usage and the store, once the output is complete."""
        cut = reason == "length"
        response["status"] = "incomplete" if cut else "completed"
        response["incomplete_details"] = {"reason": "max_output_tokens"} if cut else None
        response["usage"] = {
            "input_tokens": prepared.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": prepared.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prepared.prompt_tokens + prepared.completion_tokens,
        }
        if body.store:
            self.store.put(response["id"], sent + [reply_message(response["output"])])
            self.stored[response["id"]] = response
            while len(self.stored) > STORED_RESPONSES:
                self.stored.popitem(last=False)
        return response

    async def respond(self, body: ResponsesRequest, request: Request) -> Response:
        history = self.store.get(body.previous_response_id) if body.previous_response_id else []
        req, sent = chat_request(body, history)
        client = client_of(body.user, request)
        try:
            prepared = request.state.log = await self.serving.off_loop(self.serving.prepare_chat, req, client)
        except APIError as e:
            raise e.renamed({"max_tokens": "max_output_tokens", "messages": "input"}) from None
        self.serving.admit(prepared, client)
        headers = ignored_fields_header(ignored_fields(body), request.url.path)
        response = self.envelope(body, _id("resp"), time.time(), "in_progress")
        if body.stream:
            events = self.stream(body, req, sent, prepared, response)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        outs = await self.serving.run_admitted(prepared, request)
        if outs is None:  # the client left
            return Response(status_code=499)
        choice = self.chat.response(req, prepared, outs)["choices"][0]
        response["output"] = output_items(choice["message"])
        return JSONResponse(self.finish(response, body, sent, prepared, outs[0].finish_reason), headers=headers)

    async def stream(
        self,
        body: ResponsesRequest,
        req: ChatCompletionRequest,
        sent: list,
        prepared: Prepared,
        response: dict[str, Any],
    ) -> AsyncGenerator[str, None]:
        """The Responses event stream of one reply; an engine failure or the shutdown ends it with an
        error event. The admission ticket is released however it ends."""
        events = _Events()
        yield events.emit("response.created", response=dict(response))
        yield events.emit("response.in_progress", response=dict(response))
        reader = ReplyStream(
            prepared.prompt_texts[0], prepared.tool_mode, self.serving.chat_features, prepared.tool_functions
        )
        try:
            async with aclosing(self.serving.deltas(prepared)) as deltas:
                async for _, delta in deltas:
                    cut = delta.finished and delta.finish_reason == "length"
                    fields = reader.feed(delta.text_delta, delta.finished, cut)
                    for event in events.fields(fields):
                        yield event
                    if delta.finished:
                        for event in events.close():
                            yield event
                        response["output"] = events.items
                        done = self.finish(response, body, sent, prepared, delta.finish_reason)
                        kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
                        yield events.emit(kind, response=done)
        except (RequestError, ShuttingDown) as e:
            error = shutting_down(e) if isinstance(e, ShuttingDown) else request_failed(e)
            yield events.emit("error", code=error.code, message=error.message, param=None)
        finally:
            assert prepared.ticket is not None
            prepared.ticket.release()


class _Events:
    """The stream's events, numbered, and the output items they build: one open item at a time."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None

    def emit(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"

    def _start(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.open = item
        out.append(self.emit("response.output_item.added", output_index=len(self.items), item=item))
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            out.append(
                self.emit(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=len(self.items),
                    content_index=0,
                    part=part,
                )
            )
        return out

    def close(self) -> list[str]:
        """Finish the open item: its done events, then it joins the output."""
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.items)}
        out = []
        if item["type"] == "message":
            text = item["text"]
            out.append(self.emit("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            part = {"type": "output_text", "text": text, "annotations": []}
            out.append(self.emit("response.content_part.done", **where, content_index=0, part=part))
            done = message_item(text, item["id"])
        elif item["type"] == "reasoning":
            out.append(self.emit("response.reasoning_text.done", **where, content_index=0, text=item["text"]))
            done = reasoning_item(item["text"], item["id"])
        else:
            out.append(
                self.emit(
                    "response.function_call_arguments.done", **where, arguments=item["arguments"], name=item["name"]
                )
            )
            done = call_item(item["call_id"], item["name"], item["arguments"], item["id"])
        out.append(self.emit("response.output_item.done", output_index=len(self.items), item=done))
        self.items.append(done)
        return out

    def _text(self, kind: str, text: str) -> list[str]:
        out = []
        if self.open is None or self.open["type"] != kind:
            item = (
                message_item("", status="in_progress") if kind == "message" else {**reasoning_item(""), "content": []}
            )
            out += self._start(item)
            assert self.open is not None
            self.open["text"] = ""
        self.open["text"] += text
        where = {"item_id": self.open["id"], "output_index": len(self.items), "content_index": 0}
        if kind == "message":
            return out + [self.emit("response.output_text.delta", **where, delta=text, logprobs=[])]
        return out + [self.emit("response.reasoning_text.delta", **where, delta=text)]

    def fields(self, fields: dict[str, Any]) -> list[str]:
        """Events for one chat delta's reasoning, content and tool-call pieces."""
        out = []
        if fields.get("reasoning_content"):
            out += self._text("reasoning", fields["reasoning_content"])
        if fields.get("content"):
            out += self._text("message", fields["content"])
        for d in fields.get("tool_calls") or []:
            if "id" in d:
                item = call_item(d["id"], d["function"]["name"], "", status="in_progress")
                out += self._start(item)
            piece = (d.get("function") or {}).get("arguments") or ""
            if piece and self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += piece
                where = {"item_id": self.open["id"], "output_index": len(self.items)}
                out.append(self.emit("response.function_call_arguments.delta", **where, delta=piece))
        return out


def add_responses_routes(app: FastAPI, models: ServedModels) -> None:
    """Register /v1/responses on `app`; the stored responses are the server's, whichever model
    wrote them (a follow-up may name another model)."""
    store, stored = ResponseStore(), OrderedDict[str, dict[str, Any]]()

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        async with models.use(body.model) as serving:
            return await ResponsesRoutes(serving, store, stored).respond(body, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> dict[str, Any]:
        if response_id not in stored:
            raise APIError(404, f"no stored response {response_id!r}", "response_id", type="not_found_error")
        return stored[response_id]
