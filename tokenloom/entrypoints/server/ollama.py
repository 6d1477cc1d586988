"""ollama's API on the OpenAI routes' serving (requests read by ollama_protocol.py): /api/chat and
/api/generate, streamed as NDJSON (ollama's default) or whole with ``"stream": false``; /api/embed;
/api/tags, /api/ps, /api/show and /api/version describe the model. Replies are read into content,
thinking and tool calls by the same readers as /v1/chat/completions. Errors are ollama's
``{"error": message}`` with the status the OpenAI routes would give (app.py renders them so for
every /api/ path)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenloom.entrypoints.server.admission import server_busy
from tokenloom.entrypoints.server.chat import ChatCompletions
from tokenloom.entrypoints.server.chat_tools import ReplyStream
from tokenloom.entrypoints.server.completions import Completions
from tokenloom.entrypoints.server.ollama_protocol import (
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    chat_request,
    generate_request,
    unknown,
)
from tokenloom.entrypoints.server.protocol import APIError, ChatCompletionRequest
from tokenloom.entrypoints.server.serving import (
    OpenAIServing,
    Prepared,
    client_of,
    ignored_fields_header,
    request_failed,
    shutting_down,
)
from tokenloom.entrypoints.server.streams import ShuttingDown
from tokenloom.outputs import CompletionOutput, RequestError

API_VERSION = "0.12.0"  # the ollama API release whose shapes these routes follow
NDJSON = "application/x-ndjson"


def now_iso() -> str:
    """ollama's created_at: UTC, RFC 3339 with a Z."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


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
    if ollama_req.keep_alive is not None:  # one model, loaded for the server's life
        names.append("keep_alive")
    return ignored_fields_header(names, request.url.path)


def add_ollama_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """Register ollama's routes on `app`."""
    routes = OllamaRoutes(serving)

    @app.post("/api/chat")
    async def ollama_chat(body: OllamaChatRequest, request: Request):
        req, request.state.ignored_options = chat_request(body)

        def shape(message: dict[str, Any], done: bool) -> dict[str, Any]:
            return {"model": body.model, "created_at": now_iso(), "message": message, "done": done}

        return await routes.respond(req, body, request, shape)

    @app.post("/api/generate")
    async def ollama_generate(body: OllamaGenerateRequest, request: Request):
        serving.check_model(body.model)
        if not body.prompt:  # ollama's way to load a model: nothing to generate
            return {"model": body.model, "created_at": now_iso(), "response": "", "done": True, "done_reason": "load"}
        req, request.state.ignored_options = generate_request(body)

        def shape(message: dict[str, Any], done: bool) -> dict[str, Any]:
            out = {"model": body.model, "created_at": now_iso(), "response": message["content"], "done": done}
            return out | ({"thinking": message["thinking"]} if "thinking" in message else {})

        return await routes.respond(req, body, request, shape)

    @app.post("/api/embed")
    async def ollama_embed(body: OllamaEmbedRequest, request: Request) -> dict[str, Any]:
        serving.check_model(body.model)
        if body.dimensions is not None:
            raise APIError(400, "dimensions is not supported: the embedding has the model's hidden size", "dimensions")
        started = time.perf_counter()
        texts = [body.input] if isinstance(body.input, str) else body.input
        limit = serving.max_model_len

        def encode(_) -> list[list[int]]:
            ids = [serving.tokenizer.encode(t) for t in texts]
            if any(len(i) > limit for i in ids) and not body.truncate:
                raise APIError(
                    400, f"an input is longer than the context ({limit} tokens) and truncate is false", "input"
                )
            return [i[:limit] for i in ids]

        token_lists = await serving.off_loop(encode, body)
        vectors = []
        for ids in token_lists:
            try:
                vectors.append(await serving.engine.embed(ids, "mean"))
            except ValueError as e:
                raise APIError(400, str(e), "input") from None
            except RuntimeError as e:  # no KV room now
                raise server_busy(str(e), serving.admission.limits.retry_after_s) from None
        return {
            "model": body.model,
            "embeddings": vectors,
            "total_duration": _ns(time.perf_counter() - started),
            "load_duration": 0,
            "prompt_eval_count": sum(len(i) for i in token_lists),
        }

    _add_info_routes(app, serving)


def model_facts(serving: OpenAIServing) -> dict[str, Any]:
    """What ollama's listings say of the served model: family, file format, parameter count (from
    the config's shapes), quantization (a GGUF file's type from its name, else the dtype or
    --quantization) and size on disk."""
    engine = serving.engine
    c = engine.model_config
    path = Path(serving.engine.model_path)
    attention = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    experts = c.moe.num_experts if c.moe is not None else 1
    per_layer = attention + 3 * c.hidden_size * c.intermediate_size * experts
    count = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + c.num_layers * per_layer
    quant = re.search(r"(?i)(i?q\d+_[a-z0-9_]+|f16|bf16|f32)", path.name) if path.suffix == ".gguf" else None
    size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return {
        "family": re.sub(r"For(Causal|Conditional)LM$", "", c.architecture).lower(),
        "format": "gguf" if path.suffix == ".gguf" else "safetensors",
        "parameter_count": count,
        "parameter_size": f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M",
        "quantization": quant.group(1).upper() if quant else engine.weight_format.upper(),
        "size_bytes": size,
    }


def _details(facts: dict[str, Any]) -> dict[str, Any]:
    """ollama's details of the served model."""
    return {
        "parent_model": "",
        "format": facts["format"],
        "family": facts["family"],
        "families": [facts["family"]],
        "parameter_size": facts["parameter_size"],
        "quantization_level": facts["quantization"],
    }


def _listing(serving: OpenAIServing, facts: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": serving.model_name,
        "model": serving.model_name,
        "modified_at": now_iso(),
        "size": facts["size_bytes"],
        "digest": "",
        "details": _details(facts),
    }


def _add_info_routes(app: FastAPI, serving: OpenAIServing) -> None:
    """/api/version, /api/tags, /api/ps and /api/show."""
    facts = model_facts(serving)

    @app.get("/api/version")
    async def ollama_version() -> dict[str, str]:
        return {"version": API_VERSION}

    @app.get("/api/tags")
    async def ollama_tags() -> dict[str, Any]:
        return {"models": [_listing(serving, facts)]}

    @app.get("/api/ps")
    async def ollama_ps() -> dict[str, Any]:
        loaded = _listing(serving, facts) | {"expires_at": "9999-12-31T23:59:59Z", "size_vram": 0}
        loaded.pop("modified_at")
        return {"models": [loaded]}

    @app.post("/api/show")
    async def ollama_show(body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("model", body.get("name"))
        if not isinstance(name, str):
            raise APIError(400, "model is required", "model")
        serving.check_model(name)
        # every template takes tools: a model's own format, or the generic one (tool_calling/formats.py)
        capabilities = ["completion", "tools"] + (["thinking"] if serving.chat_features.reasoning else [])
        return {
            "modelfile": "",
            "parameters": "",
            "template": serving.tokenizer.chat_template or "",
            "details": _details(facts),
            "model_info": {
                "general.architecture": facts["family"],
                "general.parameter_count": facts["parameter_count"],
                f"{facts['family']}.context_length": serving.max_model_len,
            },
            "capabilities": capabilities,
            "modified_at": now_iso(),
        }
