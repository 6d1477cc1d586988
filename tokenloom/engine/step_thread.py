"""The thread that runs engine steps, and the turns engines sharing it take.

A server with several models has an engine per model, and one thread runs all their steps: one
OpenMP pool (see async_engine's module doc), and one step at a time, so two models' steps never
fight over the cores. Which waiting engine steps next is chosen by the CPU time each has had, as
Linux's fair scheduler chooses between tasks: the one that has used the least goes first. A
model whose steps take 40 ms beside one whose steps take 10 ms so gets about half the thread's
time, not four fifths (as it would taking a step each in turn). An engine that arrives, or
comes back from idle, starts level with the least-served engine still stepping (it is owed
nothing for the time it did not ask for).

An engine that will step again (``run(..., more=...)`` says so once its step is done) and has had
less time than every engine waiting keeps the thread for its next step (``held``), as the
running task stays on the CPU in a fair scheduler; it hands the thread on at that step, or by
``idle`` if it does not take it after all.

With one engine, a turn is taken at once (no wait, no task switch).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from tokenloom.memory.allocator import keep_freed_memory


class StepThread:
    """``await thread.run(key, fn, *args)``: fn(*args) on the thread in `key`'s turn (module doc).
    Touched from one event loop (``run``) and from any thread (``submit``, outside the turns)."""

    def __init__(self) -> None:
        keep_freed_memory()  # before the thread exists, so that it allocates from the kept heap
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenloom-engine")
        self.used: dict[object, float] = {}  # key -> seconds of steps it has had (lifted on arrival)
        self.waiting: dict[object, asyncio.Future] = {}
        self.running: object | None = None
        self.held = False  # the running engine keeps the thread between two of its steps

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """fn(*args) on the thread, outside the turns (start-up work, a benchmark's baseline)."""
        return self.executor.submit(fn, *args)

    def shutdown(self, wait: bool = True) -> None:
        self.executor.shutdown(wait=wait)

    def idle(self, key: object) -> None:
        """`key` will not step now: the thread it held goes on to the next engine."""
        if self.running is key and self.held:
            self._pass_on()

    def forget(self, key: object) -> None:
        """Drop a departed engine's account (and the thread, if it held it)."""
        self.idle(key)
        self.used.pop(key, None)

    async def run(self, key: object, fn: Callable[..., Any], *args: Any, more: Callable[[], bool] | None = None) -> Any:
        """fn(*args) on the thread once it is `key`'s turn; its time is charged to `key`. `more()`,
        asked once it is done: whether `key` will run again at once (it may keep the thread)."""
        await self._turn(key)
        started = time.perf_counter()
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        finally:
            self.used[key] = self.used.get(key, 0.0) + time.perf_counter() - started
            least_waiting = min((self.used[k] for k in self.waiting), default=None)
            if least_waiting is not None and more is not None and self.used[key] < least_waiting and more():
                self.held = True  # its next step comes first
            else:
                self._pass_on()

    async def _turn(self, key: object) -> None:
        if self.running is key and self.held:  # kept since its last step
            self.held = False
            return
        others = [*self.waiting, *([self.running] if self.running is not None else [])]
        floor = min((self.used[k] for k in others), default=0.0)
        self.used[key] = max(self.used.get(key, 0.0), floor)  # level with the least-served still stepping
        if self.running is None and not self.waiting:
            self.running = key
            return
        turn = asyncio.get_running_loop().create_future()
        self.waiting[key] = turn
        try:
            await turn
        except asyncio.CancelledError:
            if self.waiting.get(key) is turn:
                del self.waiting[key]
            elif self.running is key:  # granted as it was cancelled: the next one's turn
                self._pass_on()
            raise

    def _pass_on(self) -> None:
        """The thread to the waiting engine that has had the least of it."""
        self.running, self.held = None, False
        if self.waiting:
            key = min(self.waiting, key=self.used.__getitem__)
            self.running = key
            self.waiting.pop(key).set_result(None)
