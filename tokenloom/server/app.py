"""The FastAPI application: routes, API-key check, body-size limit, OpenAI-shaped errors.

``build_app(engine, model_name)`` is all a caller needs; ``tokenloom serve`` runs
it under uvicorn. Every error a client can cause comes back as OpenAI's error
JSON with a 4xx status; an unexpected server fault is a 500 in the same shape
and never stops the engine.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import weakref
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenloom.async_engine import AsyncLLMEngine
from tokenloom.outputs import RequestError
from tokenloom.server.admission import AdmissionLimits
from tokenloom.server.chat import ChatCompletions
from tokenloom.server.completions import Completions
from tokenloom.server.metrics import ServerMetrics
from tokenloom.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from tokenloom.server.serving import OpenAIServing, request_failed
from tokenloom.server.streams import ClientDisconnected, unless_disconnected

log = logging.getLogger("tokenloom.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0
_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 408: "timeout_error",
                413: "invalid_request_error", 429: "rate_limit_error"}


class BodyReader:
    """ASGI middleware: reads a request's whole body before the app sees it, so that a body over
    `max_bytes` (declared or sent in chunks) is a 413 and a body that stops arriving for
    `timeout_s` (a slow client, a Content-Length longer than what is sent) is a 408, each in
    OpenAI's error JSON, instead of holding a worker. The app then reads the buffered body; later
    receive() calls (the disconnect) go to the client as before."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _send_error(APIError(413, f"request body exceeds {self.max_bytes} bytes"), scope, send)
        try:
            messages = await self._read(receive)
        except APIError as error:
            return await _send_error(error, scope, send)
        pending = iter(messages)

        async def replay() -> Message:
            return next(pending, None) or await receive()
        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> list[Message]:
        messages, seen = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.timeout_s:g} s") from None
            messages.append(message)
            if message["type"] != "http.request":           # the client left: the app will see it
                return messages
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise APIError(413, f"request body exceeds {self.max_bytes} bytes")
            if not message.get("more_body", False):
                return messages


async def _send_error(error: APIError, scope: Scope, send: Send) -> None:
    """Answer with `error` from an ASGI middleware (no request body is read)."""
    async def nothing() -> Message:
        return {"type": "http.disconnect"}
    await _error_response(error)(scope, nothing, send)


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
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(),
                        None)
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None          # the top-level parameter (deeper parts name union members)
    return APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')} (got {first.get('input')!r:.80})",
                    param)


async def _releasing(events: AsyncIterator[str], ticket) -> AsyncIterator[str]:
    """`events`, then the admission ticket released (also when the client leaves mid-stream)."""
    try:
        async with aclosing(events):
            async for event in events:
                yield event
    finally:
        ticket.release()


def build_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
              limits: AdmissionLimits | None = None) -> FastAPI:
    """An OpenAI-compatible app over `engine`, serving it as `model_name`, admitting work within
    `limits` (server/admission.py; its defaults when None)."""
    metrics = ServerMetrics(engine.stats)
    serving = OpenAIServing(engine, model_name, metrics, limits)
    completions, chat = Completions(serving), ChatCompletions(serving)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await engine.shutdown()
        engine.close()
        serving.workers.shutdown(wait=False, cancel_futures=True)

    # no /docs or /redoc: their pages load scripts from a CDN (the schema is at /openapi.json)
    app = FastAPI(title="tokenloom", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="OpenAI-compatible completions and chat over tokenloom's engine")
    app.state.serving, app.state.metrics = serving, metrics
    app.add_middleware(BodyReader, max_bytes=max_body_bytes, timeout_s=body_timeout_s)
    if api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=api_key)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Routing and body-parsing errors (404, 405, unparsable bodies) in OpenAI's shape."""
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path} (the API: /openapi.json)"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        error = APIError(exc.status_code, message, type=_ERROR_TYPES.get(exc.status_code, "invalid_request_error"))
        response = _error_response(error)
        response.headers.update(exc.headers or {})
        return response

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
                                            "owned_by": "tokenloom", "max_model_len": serving.max_model_len,
                                            "default_max_tokens": serving.admission.limits.default_max_tokens}]}

    async def respond(handler, req, prepared, request: Request):
        """Run an admitted request; its admission ticket is released however it ends."""
        if req.stream:
            events = _releasing(handler.stream(req, prepared), prepared.ticket)
            weakref.finalize(events, prepared.ticket.release)     # a stream cut before its first event
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            outs = await unless_disconnected(serving.run(prepared), request)
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            prepared.ticket.release()
        return JSONResponse(handler.response(req, prepared, outs))

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, request: Request):
        prepared = await serving.off_loop(serving.prepare_completion, req)
        param = "n" if req.n > 1 or len(prepared.prompt_ids) == 1 else "prompt"
        if req.use_beam_search:
            serving.admit(prepared, req.beam_width * len(prepared.prompt_ids), "best_of")
            try:
                return JSONResponse(await unless_disconnected(completions.beam_response(req, prepared), request))
            except ClientDisconnected:
                return Response(status_code=499)
            finally:
                prepared.ticket.release()
        return await respond(completions, req, serving.admit(prepared, param=param), request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, request: Request):
        return await respond(chat, req, serving.admit(await serving.off_loop(serving.prepare_chat, req)), request)

    return app
