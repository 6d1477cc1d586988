"""The FastAPI application: routes and OpenAI-shaped errors (the ASGI middlewares in front of
it, body limits, API key, Host check, request log: middleware.py).

``build_app(engine, model_name)`` is all a caller needs; ``tokenloom serve`` runs
it under uvicorn. Every error a client can cause comes back as OpenAI's error
JSON with a 4xx status; an unexpected server fault is a 500 in the same shape
and never stops the engine.
"""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenloom.engine import LLMEngine
from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.entrypoints.server.admission import AdmissionLimits
from tokenloom.entrypoints.server.anthropic import add_anthropic_routes
from tokenloom.entrypoints.server.anthropic import error_body as anthropic_error
from tokenloom.entrypoints.server.chat import ChatCompletions
from tokenloom.entrypoints.server.chat_tools import ChatFeatures
from tokenloom.entrypoints.server.completions import Completions
from tokenloom.entrypoints.server.load_policy import weights_size
from tokenloom.entrypoints.server.lora_routes import add_lora_routes
from tokenloom.entrypoints.server.metrics import ServerMetrics
from tokenloom.entrypoints.server.middleware import (
    DEFAULT_BODY_DEADLINE_S,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    AccessLog,
    ApiKeyCheck,
    BodyReader,
    HostCheck,
    JsonBodies,
    error_response,
)
from tokenloom.entrypoints.server.ollama import add_ollama_routes
from tokenloom.entrypoints.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, unknown_fields
from tokenloom.entrypoints.server.responses_api import add_responses_routes
from tokenloom.entrypoints.server.served_models import LoadedModel, LoadPolicy, ModelEntry, ServedModels
from tokenloom.entrypoints.server.serving import (
    OpenAIServing,
    client_of,
    ignored_fields_header,
    prepare_workers,
    request_failed,
    shutting_down,
    size_param,
)
from tokenloom.entrypoints.server.streams import ClientDisconnected, ShuttingDown, unless_disconnected
from tokenloom.entrypoints.server.utility_routes import add_utility_routes
from tokenloom.outputs import RequestError

log = logging.getLogger("tokenloom.entrypoints.server")

_ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return APIError(
            400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".strip(), None
        )
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None  # the top-level parameter (deeper parts name union members)
    return APIError(
        400, f"{param or 'body'}: {first.get('msg', 'invalid value')} (got {first.get('input')!r:.80})", param
    )


async def _releasing(events: AsyncGenerator[str, None], ticket) -> AsyncGenerator[str, None]:
    """`events`, then the admission ticket released (also when the client leaves mid-stream)."""
    try:
        async with aclosing(events):
            async for event in events:
                yield event
    finally:
        ticket.release()


def _ignored_fields_header(req, request: Request) -> dict[str, str]:
    """A request's unknown fields, named in a warning and in a response header."""
    return ignored_fields_header(unknown_fields(req), request.url.path)


def build_app(
    engine: AsyncLLMEngine,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    body_deadline_s: float = DEFAULT_BODY_DEADLINE_S,
    limits: AdmissionLimits | None = None,
    allowed_hosts: tuple[str, ...] | None = None,
    log_json: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    playground_tools: list[dict] | None = None,
    model_aliases: tuple[str, ...] = (),
    catalog: Callable[[], list[ModelEntry]] | None = None,
    load_engine: Callable[[str], LLMEngine] | None = None,
    load_policy: LoadPolicy | None = None,
) -> FastAPI:
    """An OpenAI-compatible app over `engine`, serving it as `model_name` (requests may also name
    it by one of `model_aliases`), and, given `load_engine` (``load(source) -> LLMEngine``), every
    model `catalog()` lists too (read again as models are pulled), each loaded when a request
    first names it and unloaded as `load_policy` says (served_models.py); admitting work within
    `limits` (server/admission.py; its defaults when None), answering only requests whose Host is
    in `allowed_hosts` (None: any), logging a line per request (JSON lines if `log_json`), reading
    tool calls and reasoning from replies as `tool_call_parser` and `reasoning_parser` say (None or
    "auto": from the chat template; tool_calling/formats.py and reasoning.py), and offering
    `playground_tools` (functions, as tool_calling.messages.function_of gives) in the playground."""
    metrics = ServerMetrics(lambda: models.stats())  # `models` is made below, before any scrape
    workers = prepare_workers()  # every model's requests are prepared on the same threads

    def serving_for(engine: AsyncLLMEngine, entry: ModelEntry, tool_parser, reasoning) -> OpenAIServing:
        features = ChatFeatures.for_template(engine.tokenizer.chat_template, tool_parser, reasoning)
        return OpenAIServing(engine, entry.name, metrics, limits, features, workers)

    step_thread = engine.step_thread  # not the engine: an unloaded first model must be freed

    def make_serving(entry: ModelEntry) -> OpenAIServing:
        """Another model's serving (or the first one's again), its steps taking turns with the
        others' on one thread; tool calls and reasoning read as the flags say for the first model,
        as its chat template says for the others."""
        assert load_engine is not None
        loaded = AsyncLLMEngine(load_engine(entry.source), step_thread)
        loaded.prepare_for_serving()
        parsers = (tool_call_parser, reasoning_parser) if entry.name == model_name else (None, None)
        return serving_for(loaded, entry, *parsers)

    primary = ModelEntry(model_name, engine.model_path, model_aliases, weights_size(engine.model_path))
    serving = serving_for(engine, primary, tool_call_parser, reasoning_parser)
    first = LoadedModel(primary, serving, keep_alive_s=-1)
    models = ServedModels(first, step_thread, catalog, make_serving if load_engine is not None else None, load_policy)

    # no /docs or /redoc: their pages load scripts from a CDN (the schema is at /openapi.json)
    app = FastAPI(
        title="tokenloom",
        version="0.1.0",
        lifespan=_lifespan(models, workers),
        docs_url=None,
        redoc_url=None,
        description="OpenAI-compatible completions and chat over tokenloom's engine",
    )
    app.state.models, app.state.metrics = models, metrics
    app.add_middleware(JsonBodies)  # ollama's routes read any body as JSON, as ollama does
    app.add_middleware(BodyReader, max_bytes=max_body_bytes, timeout_s=body_timeout_s, deadline_s=body_deadline_s)
    if api_key is not None:
        app.add_middleware(ApiKeyCheck, api_key=api_key)
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=allowed_hosts)
    app.add_middleware(AccessLog, json_lines=log_json)  # added last: outermost, sees every answer
    _add_error_handlers(app)
    _add_info_routes(app, models, metrics, playground_tools or [])
    add_utility_routes(app, models)
    add_lora_routes(app, models)
    _add_generation_routes(app, models)
    add_ollama_routes(app, models)
    add_anthropic_routes(app, models)
    add_responses_routes(app, models)
    return app


def _lifespan(models: ServedModels, workers: ThreadPoolExecutor):
    """The app's lifespan: the heap frozen at start, the engines and the server's workers closed at the end."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Everything alive at start (model, tokenizer, libraries) out of the cyclic GC's scans: a
        # full collection over them pauses the event loop for a noticeable time under a large request.
        gc.freeze()
        yield
        await models.close()
        workers.shutdown(wait=False, cancel_futures=True)

    return lifespan


def _error(request: Request, error: APIError) -> JSONResponse:
    """`error` in the shape of the API the request spoke: ollama's {"error": message} under /api/,
    Anthropic's error object under /v1/messages, OpenAI's elsewhere."""
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": error.message}, status_code=error.status, headers=error.headers)
    if request.url.path.startswith("/v1/messages"):
        return JSONResponse(anthropic_error(error), status_code=error.status, headers=error.headers)
    return error_response(error)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error a client can cause as OpenAI's error JSON with its 4xx status; anything else a 500
    in the same shape (logged, the engine untouched)."""

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Routing and body-parsing errors (404, 405, unparsable bodies) in OpenAI's shape."""
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path} (the API: /openapi.json)"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        error = APIError(exc.status_code, message, type=_ERROR_TYPES.get(exc.status_code, "invalid_request_error"))
        response = _error(request, error)
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(request, _validation_error(exc))

    @app.exception_handler(ShuttingDown)
    async def on_shutting_down(request: Request, exc: ShuttingDown) -> JSONResponse:
        return _error(request, shutting_down(exc))

    @app.exception_handler(RequestError)
    async def on_request_failed(request: Request, exc: RequestError) -> JSONResponse:
        return _error(request, request_failed(exc))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s", request.url.path)
        return _error(request, APIError(500, f"internal error: {exc!r}", type="server_error"))


def _add_info_routes(app: FastAPI, models: ServedModels, metrics: ServerMetrics, tools: list[dict]) -> None:
    """The playground page and its settings, /health, /metrics and /v1/models."""
    playground_file = resources.files("tokenloom.entrypoints.server") / "static" / "playground.html"
    playground = playground_file.read_text(encoding="utf-8")
    offered = [{"type": "function", "function": f} for f in tools]

    @app.get("/", include_in_schema=False)
    async def playground_page() -> HTMLResponse:
        """The web playground: one static page (no outside resources) over the API below."""
        return HTMLResponse(playground)

    @app.get("/playground/settings", include_in_schema=False)
    async def playground_settings() -> dict[str, Any]:
        """What the playground starts from: the sampling settings a request that leaves them out
        gets (sampling/defaults.py), and the tools `serve --tools FILE.json` gave ([] if none)."""
        async with models.use(None) as serving:
            defaults = serving.engine.sampling_defaults
        return {"sampling": defaults.values, "sampling_source": defaults.source, "tools": offered}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        """Every model this server serves by name, loaded or not (`loaded` says), then the LoRA
        adapters it serves, each with the model it runs on (`parent`) and its folder (`root`)."""
        names = [*models.entries, *models.adapters]
        return {"object": "list", "data": [models.card(name) for name in names]}


async def _whole(work, prepared, request: Request, shape, headers: dict[str, str] | None = None) -> Response:
    """Await an admitted request's `work` unless its client leaves (499); ``shape(result)`` is the
    body. Its admission ticket is released however it ends."""
    try:
        return JSONResponse(shape(await unless_disconnected(work, request)), headers=headers)
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        prepared.ticket.release()


async def _respond(serving: OpenAIServing, handler, req, prepared, request: Request) -> Response:
    """Run an admitted request, streamed or whole."""
    headers = _ignored_fields_header(req, request)
    if req.stream:
        events = _releasing(handler.stream(req, prepared), prepared.ticket)
        weakref.finalize(events, prepared.ticket.release)  # a stream cut before its first event
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    return await _whole(
        serving.run(prepared), prepared, request, lambda outs: handler.response(req, prepared, outs), headers
    )


def _add_generation_routes(app: FastAPI, models: ServedModels) -> None:
    """POST /v1/completions (beam search included) and /v1/chat/completions, whole or streamed."""

    @app.post("/v1/completions")
    async def create_completion(req: CompletionRequest, request: Request):
        client = client_of(req.user, request)
        async with models.use(req.model) as serving:
            completions = Completions(serving)
            prepared = request.state.log = await serving.off_loop(serving.prepare_completion, req, client)
            if req.use_beam_search:
                serving.admit(prepared, client, req.beam_width * len(prepared.prompt_ids), "best_of")
                headers = _ignored_fields_header(req, request)
                beams = completions.beam_response(req, prepared)
                return await _whole(beams, prepared, request, lambda body: body, headers)
            param = size_param(req.n, len(prepared.prompt_ids))
            return await _respond(serving, completions, req, serving.admit(prepared, client, param=param), request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(req: ChatCompletionRequest, request: Request):
        client = client_of(req.user, request)
        async with models.use(req.model) as serving:
            prepared = request.state.log = await serving.off_loop(serving.prepare_chat, req, client)
            return await _respond(serving, ChatCompletions(serving), req, serving.admit(prepared, client), request)
