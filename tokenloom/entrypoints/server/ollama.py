"""ollama's API on the OpenAI routes' serving (requests read by ollama_protocol.py): /api/chat and
/api/generate, streamed as NDJSON (ollama's default) or whole with ``"stream": false``; /api/embed;
/api/tags, /api/ps, /api/show and /api/version describe the model. Replies are read into content,
thinking and tool calls by the same readers as /v1/chat/completions. Errors are ollama's
``{"error": message}`` with the status the OpenAI routes would give (app.py renders them so for
every /api/ path)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenloom.entrypoints.server.chat import ChatCompletions
from tokenloom.entrypoints.server.chat_tools import ReplyStream
from tokenloom.entrypoints.server.completions import Completions
from tokenloom.entrypoints.server.ollama_models import NDJSON, add_model_routes, now_iso
from tokenloom.entrypoints.server.ollama_protocol import (
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    chat_request,
    generate_request,
    keep_alive_seconds,
    unknown,
)
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
from tokenloom.entrypoints.server.utility_routes import embed_all
from tokenloom.outputs import CompletionOutput, RequestError


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def stats(prepared: Prepared) -> dict[str, int]:
    """ollama's counts and durations (nanoseconds) of a finished request."""
    end = time.perf_counter()
    first = prepared.first_token_at or end
    return {
        "total_duration": _ns(end - prepared.started),
        "load_duration": 0,
        "prompt_eval_count": prepared.prompt_tokens,
        "prompt_eval_duration": _ns(first - prepared.started),
        "eval_count": prepared.completion_tokens,
        "eval_duration": _ns(end - first),
    }


def _message(fields: dict[str, Any]) -> dict[str, Any]:
    """OpenAI message (or delta) fields as ollama's message: thinking, and tool calls whose
    arguments are objects."""
    out: dict[str, Any] = {"role": "assistant", "content": fields.get("content") or ""}
    if fields.get("reasoning_content"):
        out["thinking"] = fields["reasoning_content"]
    calls = fields.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {"function": {"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}}
            for c in calls
        ]
    return out


def _arguments(text: str | None) -> Any:
    try:
        return json.loads(text or "{}")
    except json.JSONDecodeError:
        return text


def _join_calls(calls: dict[int, dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    """Add OpenAI tool-call stream deltas (by index: the name once, the arguments in pieces) to `calls`."""
    for d in deltas:
        call = calls.setdefault(d.get("index", len(calls)), {"function": {"name": "", "arguments": ""}})
        fn = d.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""


def _done_reason(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


class OllamaRoutes:
    """The generation routes' logic: prepare through the OpenAI serving, shape ollama's replies."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.chat = ChatCompletions(serving)
        self.completions = Completions(serving)

    def prepare(self, req) -> Prepared:
        """A translated request prepared (tokenized, templated, validated) as the OpenAI route would."""
        if isinstance(req, ChatCompletionRequest):
            return self.serving.prepare_chat(req)
        return self.serving.prepare_completion(req)

    def reply_fields(self, req, prepared: Prepared, out: CompletionOutput) -> dict[str, Any]:
        """The whole reply read into ollama's message fields (chat) or response text (generate)."""
        if isinstance(req, ChatCompletionRequest):
            choice = self.chat.response(req, prepared, [out])["choices"][0]
            return _message(choice["message"])
        return {"role": "assistant", "content": out.text}

    async def stream(self, req, prepared: Prepared, shape) -> AsyncGenerator[str, None]:
        """NDJSON lines: one per delta with text, thinking or calls, then the done line with the
        counts; an engine failure or the shutdown ends it with an error line. The admission ticket
        is released however it ends."""
        chat = isinstance(req, ChatCompletionRequest)
        reader = ReplyStream(
            prepared.prompt_texts[0], prepared.tool_mode, self.serving.chat_features, prepared.tool_functions
        )
        calls: dict[int, dict[str, Any]] = {}  # OpenAI's call deltas, joined: ollama sends whole calls
        try:
            async with aclosing(self.serving.deltas(prepared)) as deltas:
                async for _, delta in deltas:
                    cut = delta.finished and delta.finish_reason == "length"
                    fields: dict[str, Any] = (
                        reader.feed(delta.text_delta, delta.finished, cut) if chat else {"content": delta.text_delta}
                    )
                    _join_calls(calls, fields.pop("tool_calls", None) or [])
                    if delta.finished and calls:
                        fields["tool_calls"] = [calls[i] for i in sorted(calls)]
                    message = _message(fields)
                    if message["content"] or len(message) > 2:
                        yield json.dumps(shape(message, False)) + "\n"
                    if delta.finished:
                        done = shape({"role": "assistant", "content": ""}, True)
                        done |= {"done_reason": _done_reason(delta.finish_reason)} | stats(prepared)
                        yield json.dumps(done) + "\n"
        except (RequestError, ShuttingDown) as e:
            error = shutting_down(e) if isinstance(e, ShuttingDown) else request_failed(e)
            yield json.dumps({"error": error.message}) + "\n"
        finally:
            assert prepared.ticket is not None
            prepared.ticket.release()

    async def respond(self, req, ollama_req, request: Request, shape) -> Response:
        """Prepare, admit and run a translated request; whole or NDJSON-streamed as asked.
        ``shape(message, done)`` is one ollama object around a message."""
        client = client_of(req.user, request)
        try:
            prepared = request.state.log = await self.serving.off_loop(self.prepare, req, client)
        except APIError as e:
            raise e.renamed({"max_tokens": "options.num_predict", "response_format": "format"}) from None
        if len(prepared.choices) != 1:
            raise APIError(400, "one reply a request", "options")
        self.serving.admit(prepared, client)
        headers = _ignored_header(ollama_req, request)
        if ollama_req.stream:
            return StreamingResponse(self.stream(req, prepared, shape), media_type=NDJSON, headers=headers)
        outs = await self.serving.run_admitted(prepared, request)
        if outs is None:  # the client left
            return Response(status_code=499)
        body = shape(self.reply_fields(req, prepared, outs[0]), True)
        body |= {"done_reason": _done_reason(outs[0].finish_reason)} | stats(prepared)
        return JSONResponse(body, headers=headers)


def _ignored_header(ollama_req, request: Request) -> dict[str, str]:
    """Fields and options of the request this server does not use, in a warning and a header."""
    names = unknown(ollama_req) + getattr(request.state, "ignored_options", [])
    return ignored_fields_header(names, request.url.path)


async def load_or_unload(models: ServedModels, name: str, keep_alive_s: float | None) -> str:
    """ollama's request with nothing to generate: load the model (keep_alive 0: unload it);
    the done_reason to answer with."""
    if keep_alive_s == 0:
        await models.unload_named(name)
        return "unload"
    async with models.use(name, keep_alive_s):
        return "load"


def add_ollama_routes(app: FastAPI, models: ServedModels) -> None:
    """Register ollama's routes on `app`."""

    @app.post("/api/chat")
    async def ollama_chat(body: OllamaChatRequest, request: Request):
        keep = keep_alive_seconds(body.keep_alive)

        def shape(message: dict[str, Any], done: bool) -> dict[str, Any]:
            return {"model": body.model, "created_at": now_iso(), "message": message, "done": done}

        if not body.messages:  # ollama's way to load (or unload) a model
            reason = await load_or_unload(models, body.model, keep)
            return shape({"role": "assistant", "content": ""}, True) | {"done_reason": reason}
        models.resolve(body.model)
        req, request.state.ignored_options = chat_request(body)
        async with models.use(body.model, keep) as serving:
            return await OllamaRoutes(serving).respond(req, body, request, shape)

    @app.post("/api/generate")
    async def ollama_generate(body: OllamaGenerateRequest, request: Request):
        keep = keep_alive_seconds(body.keep_alive)
        if not body.prompt:  # ollama's way to load (or unload) a model: nothing to generate
            reason = await load_or_unload(models, body.model, keep)
            return {"model": body.model, "created_at": now_iso(), "response": "", "done": True, "done_reason": reason}
        models.resolve(body.model)
        req, request.state.ignored_options = generate_request(body)

        def shape(message: dict[str, Any], done: bool) -> dict[str, Any]:
            out = {"model": body.model, "created_at": now_iso(), "response": message["content"], "done": done}
            return out | ({"thinking": message["thinking"]} if "thinking" in message else {})

        async with models.use(body.model, keep) as serving:
            return await OllamaRoutes(serving).respond(req, body, request, shape)

    @app.post("/api/embed")
    async def ollama_embed(body: OllamaEmbedRequest, request: Request) -> dict[str, Any]:
        keep = keep_alive_seconds(body.keep_alive)
        models.resolve(body.model)
        models.adapters.refuse(body.model, "embeddings")
        if body.dimensions is not None:
            raise APIError(400, "dimensions is not supported: the embedding has the model's hidden size", "dimensions")
        started = time.perf_counter()
        texts = [body.input] if isinstance(body.input, str) else body.input
        async with models.use(body.model, keep) as serving:
            limit = serving.max_model_len

            def encode(_) -> list[list[int]]:
                ids = [serving.tokenizer.encode(t) for t in texts]
                if any(len(i) > limit for i in ids) and not body.truncate:
                    raise APIError(
                        400, f"an input is longer than the context ({limit} tokens) and truncate is false", "input"
                    )
                return [i[:limit] for i in ids]

            token_lists = await serving.off_loop(encode, body)
            vectors = await embed_all(serving, token_lists, "mean")
        return {
            "model": body.model,
            "embeddings": vectors,
            "total_duration": _ns(time.perf_counter() - started),
            "load_duration": 0,
            "prompt_eval_count": sum(len(i) for i in token_lists),
        }

    add_model_routes(app, models)
