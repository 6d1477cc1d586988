"""uvicorn's server, told to let the app cut its own requests at the end of a graceful shutdown.

On SIGTERM/SIGINT uvicorn stops accepting connections and waits up to
``timeout_graceful_shutdown`` for those in flight, then cancels them: a stream would end
mid-response, with no error event and no ``[DONE]``. This server first tells the app
(``OpenAIServing.begin_shutdown``), which ends what is still running just before the deadline
with an error in OpenAI's shape, so every client learns why its response stopped.
"""

from __future__ import annotations

import socket

import uvicorn


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, serving) -> None:
        super().__init__(config)
        self.serving = serving

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.serving.begin_shutdown(self.config.timeout_graceful_shutdown or 0.0)
        await super().shutdown(sockets)


def serve(app, serving, **config) -> None:
    """Run `app` until a signal ends it (uvicorn.Config's keyword arguments)."""
    GracefulServer(uvicorn.Config(app, **config), serving).run()
