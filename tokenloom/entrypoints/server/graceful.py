"""uvicorn, run the way tokenloom serves: a graceful shutdown that ends in words, and a deadline
for request headers.

- On SIGTERM/SIGINT uvicorn stops accepting connections and waits up to
  ``timeout_graceful_shutdown`` for those in flight, then cancels them: a stream would end
  mid-response, with no error event and no ``[DONE]``. ``GracefulServer`` first tells the app
  (``OpenAIServing.begin_shutdown``), which ends what still runs just before the deadline with
  an error in OpenAI's shape, so every client learns why its response stopped.
- uvicorn has no timeout for a request's headers: a client sending them a byte at a time holds
  a connection forever. ``HeaderDeadline`` answers 408 and closes a connection whose headers
  have not all arrived `header_timeout_s` after its request began (the body has its own
  timeout: middleware.BodyReader).
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenloom.entrypoints.server.protocol import APIError


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers."""

    header_timeout_s = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first bytes of a kept-alive connection's next request
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete and self._deadline is not None:
            self._deadline.cancel()  # headers complete: the request is the app's now
            self._deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._deadline = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _too_slow(self) -> None:
        error = APIError(
            408, f"the request headers did not arrive within {self.header_timeout_s:g} s", type="timeout_error"
        )
        body = json.dumps(error.body()).encode()
        self.transport.write(
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        self.transport.close()


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, serving) -> None:
        super().__init__(config)
        self.serving = serving
        self.signals: list[int] = []  # the signals that ended it, in order

    def handle_exit(self, sig: int, frame) -> None:
        self.signals.append(sig)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.serving.begin_shutdown(self.config.timeout_graceful_shutdown or 0.0)
        await super().shutdown(sockets)


def serve(app, serving, header_timeout_s: float = 30.0, **config) -> None:
    """Run `app` until a signal ends it (uvicorn.Config's keyword arguments), with request headers
    due within `header_timeout_s`. After the drain the process ends by that signal (status 128 +
    its number, as a supervisor expects), not with status 0."""
    protocol = type("HeaderDeadlineProtocol", (HeaderDeadline,), {"header_timeout_s": header_timeout_s})
    server = GracefulServer(uvicorn.Config(app, http=protocol, **config), serving)
    server.run()
    for sig in reversed(server.signals):  # uvicorn re-raises them itself from 0.29; older ones do not
        signal.signal(sig, signal.SIG_DFL)
        signal.raise_signal(sig)
