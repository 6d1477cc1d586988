"""The FastAPI application: routes, API-key check, body-size limit, OpenAI-shaped errors.

``build_app(engine, model_name)`` is all a caller needs; ``tokenloom serve`` runs
it under uvicorn. Every error a client can cause comes back as OpenAI's error
JSON with a 4xx status; an unexpected server fault is a 500 in the same shape
and never stops the engine.
"""

from __future__ import annotations

import logging
import secrets
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenloom.async_engine import AsyncLLMEngine
from tokenloom.outputs import RequestError
from tokenloom.server.chat import ChatCompletions
from tokenloom.server.completions import Completions
from tokenloom.server.metrics import ServerMetrics
from tokenloom.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from tokenloom.server.serving import OpenAIServing, request_failed
from tokenloom.server.streams import ClientDisconnected, unless_disconnected

log = logging.getLogger("tokenloom.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20


class BodySizeLimit:
    """ASGI middleware: 413 for a request body over `max_bytes` (declared or streamed)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            response = _error_response(APIError(413, f"request body exceeds {self.max_bytes} bytes"))
            return await response(scope, receive, send)
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise APIError(413, f"request body exceeds {self.max_bytes} bytes", None)
            return message
        await self.app(scope, limited, send)


class ApiKeyCheck:
    """ASGI middleware: 401 on /v1/* unless the request carries 'Authorization: Bearer <api_key>'.

    Pure ASGI (not BaseHTTPMiddleware), so the app still sees the client's disconnect.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = _error_response(APIError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                                    type="authentication_error", code="invalid_api_key"))
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(),
                        None)
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param)


def build_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """An OpenAI-compatible app over `engine`, serving it as `model_name`."""
    metrics = ServerMetrics(engine.stats)
    serving = OpenAIServing(engine, model_name, metrics)
    completions, chat = Completions(serving), ChatCompletions(serving)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await engine.shutdown()
        engine.close()

    app = FastAPI(title="tokenloom", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions and chat over tokenloom's engine")
    app.state.serving, app.state.metrics = serving, metrics
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=api_key)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_error(exc))

    @app.exception_handler(RequestError)
    async def on_request_failed(request: Request, exc: RequestError) -> JSONResponse:
        return _error_response(request_failed(exc))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s", request.url.path)
        return _error_response(APIError(500, f"internal error: {exc!r}", type="server_error"))

    playground = (resources.files("tokenloom.server") / "static" / "playground.html").read_text(encoding="utf-8")

    @app.get("/", include_in_schema=False)
    async def playground_page() -> HTMLResponse:
        """The web playground: one static page (no outside resources) over the API below."""
        return HTMLResponse(playground)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "tokenloom", "max_model_len": serving.max_model_len}]}

    async def respond(handler, req, prepared, request: Request):
        if req.stream:
            return StreamingResponse(handler.stream(req, prepared), media_type="text/event-stream")
        try:
            outs = await unless_disconnected(serving.run(prepared), request)
        except ClientDisconnected:
            return Response(status_code=499)
        return JSONResponse(handler.response(req, prepared, outs))

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, request: Request):
        prepared = serving.prepare_completion(req)
        if req.use_beam_search:
            return JSONResponse(await completions.beam_response(req, prepared))
        return await respond(completions, req, prepared, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, request: Request):
        return await respond(chat, req, serving.prepare_chat(req), request)

    return app
