"""The ASGI middlewares in front of the API (pure ASGI, not BaseHTTPMiddleware, so the app still
sees a client's disconnect): each answers what it refuses in OpenAI's error JSON.

- ``BodyReader``: whole body read first, with a size limit (413) and a timeout (408);
- ``ApiKeyCheck``: 'Authorization: Bearer <key>' on /v1/* (401);
- ``HostCheck``: the Host header in an allow-list (a server bound to localhost without a key
  would otherwise answer any web page through DNS rebinding) (421);
- ``AccessLog``: one log line per request: id, method, path, status, tokens in/out, time to
  first token, total time (text or JSON).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenloom.entrypoints.server.protocol import APIError

log = logging.getLogger("tokenloom.entrypoints.server")

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_BODY_DEADLINE_S = 120.0  # a whole body, however steadily it trickles in
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _send_error(error: APIError, scope: Scope, send: Send) -> None:
    """Answer with `error` from a middleware (no request body is read)."""

    async def nothing() -> Message:
        return {"type": "http.disconnect"}

    await error_response(error)(scope, nothing, send)


class BodyReader:
    """ASGI middleware: reads a request's whole body before the app sees it, so that a body over
    `max_bytes` (declared or sent in chunks) is a 413 and a body that stops arriving for
    `timeout_s` (a slow client, a Content-Length longer than what is sent), or that is not all
    there `deadline_s` after it began (a byte a second never pauses long enough for the first),
    is a 408, each in OpenAI's error JSON, instead of holding a worker. The app then reads the
    buffered body; later receive() calls (the disconnect) go to the client as before."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        deadline_s: float = DEFAULT_BODY_DEADLINE_S,
    ) -> None:
        self.app, self.max_bytes, self.timeout_s, self.deadline_s = app, max_bytes, timeout_s, deadline_s

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
        deadline = time.monotonic() + self.deadline_s
        while True:
            left = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, min(self.timeout_s, left)))
            except TimeoutError:
                if left <= self.timeout_s:
                    raise APIError(408, f"the request body was not all there within {self.deadline_s:g} s") from None
                raise APIError(408, f"the request body did not arrive within {self.timeout_s:g} s") from None
            messages.append(message)
            if message["type"] != "http.request":  # the client left: the app will see it
                return messages
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise APIError(413, f"request body exceeds {self.max_bytes} bytes")
            if not message.get("more_body", False):
                return messages


class JsonBodies:
    """ASGI middleware: a body sent to a path under `prefix` is JSON whatever its Content-Type says,
    as ollama's server reads it (its documented examples are ``curl URL -d '{...}'``, sent as a
    form)."""

    def __init__(self, app: ASGIApp, prefix: str = "/api/") -> None:
        self.app, self.prefix = app, prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix):
            headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-type"]
            scope = dict(scope, headers=[*headers, (b"content-type", b"application/json")])
        await self.app(scope, receive, send)


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
                return await _send_error(
                    APIError(
                        401,
                        "missing or wrong API key (Authorization: Bearer <key>)",
                        type="authentication_error",
                        code="invalid_api_key",
                    ),
                    scope,
                    send,
                )
        await self.app(scope, receive, send)


class HostCheck:
    """421 unless the request's Host (port aside) is one of `allowed` (lower-case names)."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...]) -> None:
        self.app, self.allowed = app, {h.lower() for h in allowed}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1").lower()
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if name not in self.allowed:
                error = APIError(
                    421,
                    f"Host {host!r} is not served here (allowed: {', '.join(sorted(self.allowed))}"
                    "; start the server with --allowed-hosts or --api-key)",
                    "Host",
                    code="host_not_allowed",
                )
                return await _send_error(error, scope, send)
        await self.app(scope, receive, send)


class AccessLog:
    """One line per HTTP request once its response has ended: the handlers leave the response id,
    tokens and time to first token in ``scope["state"]["log"]`` (a serving.Prepared)."""

    def __init__(self, app: ASGIApp, json_lines: bool = False) -> None:
        self.app, self.json_lines = app, json_lines

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), [0]

        async def recording(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording)
        finally:
            self._log(scope, status[0] or 499, time.perf_counter() - started)

    def _log(self, scope: Scope, status: int, seconds: float) -> None:
        entry = scope.get("state", {}).get("log")
        fields = {
            "id": getattr(entry, "response_id", None),
            "method": scope["method"],
            "path": scope["path"],
            "status": status,
            "prompt_tokens": getattr(entry, "prompt_tokens", None),
            "completion_tokens": getattr(entry, "completion_tokens", None),
            "ttft_s": _rounded(getattr(entry, "ttft_s", None)),
            "total_s": _rounded(seconds),
            "client": scope["client"][0] if scope.get("client") else None,
            "outcome": getattr(entry, "outcome", None),
        }
        if self.json_lines:
            log.info(json.dumps({"event": "request"} | fields))
        else:
            log.info(" ".join(f"{k}={v}" for k, v in fields.items() if v is not None))


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 4)
