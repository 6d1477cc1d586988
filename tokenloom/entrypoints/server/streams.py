"""Async plumbing for the server: merging per-choice streams, and abort on client disconnect.

Cancellation is how requests die: cancelling a consumer cancels the tasks that
pump each choice's engine stream, and AsyncLLMEngine.generate aborts its request
(freeing its KV blocks) when its stream is closed before it finished.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from typing import Any, TypeVar

from starlette.requests import Request

T = TypeVar("T")
_DONE = object()


class ShuttingDown(Exception):
    """The server's graceful shutdown is ending: requests still running are cut."""


async def merge(
    streams: list[AsyncGenerator[T, None]], cut: asyncio.Event | None = None
) -> AsyncGenerator[tuple[int, T], None]:
    """Interleave several async streams as (stream index, item), in arrival order.

    An exception in any stream is re-raised here, and ShuttingDown once `cut` is set; leaving
    early (or being cancelled) cancels and closes every stream.
    """
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream):
                async for item in stream:
                    queue.put_nowait((index, item))
            queue.put_nowait((index, _DONE))
        except Exception as e:  # surfaced to the consumer, which stops everything
            queue.put_nowait((index, e))

    async def watch(event: asyncio.Event) -> None:
        await event.wait()
        queue.put_nowait((-1, ShuttingDown("the server is shutting down; this request was cut")))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    if cut is not None:
        tasks.append(asyncio.create_task(watch(cut)))
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class ClientDisconnected(Exception):
    """The HTTP client went away before its (non-streamed) response was ready."""


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects: the ASGI server's next message after the (already
    read) body is http.disconnect, so this waits on it instead of polling."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(work: Awaitable[T], request: Request) -> T:
    """Await `work`, cancelling it (which aborts its engine requests) if the client disconnects."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
