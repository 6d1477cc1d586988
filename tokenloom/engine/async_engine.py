"""Many concurrent callers over one LLMEngine, for servers and async code.

The engine is only ever touched between steps, by code on the event loop; the
step itself runs in the engine's own thread (torch releases the GIL), so the loop
keeps accepting requests while the model runs. An add or abort that arrives during a
step is applied right after it; one that arrives while the engine is idle is
applied at once (an abort frees its KV blocks immediately).

One thread, always the same one, runs every step, and ideally built the engine too
(``build`` / ``from_config``). The reason is OpenMP: every thread that runs parallel
torch work gets its own OpenMP thread pool, and once the pools hold more threads than
there are cores, GNU OpenMP stops spinning between parallel regions and puts its
workers to sleep, so each of a step's ~400 small parallel regions pays a wake-up: a
batch-1 decode step is markedly slower on a second thread than on the one that built
the model (docs/BENCHMARKS.md, 'Measurements behind design choices').
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import signal
from collections.abc import AsyncGenerator, Callable
from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.distributed.errors import ParallelRankError
from tokenloom.engine import LLMEngine
from tokenloom.engine.step_thread import StepThread
from tokenloom.lora.manager import AdapterRef
from tokenloom.metrics import EngineStats
from tokenloom.outputs import RequestError, StepDelta
from tokenloom.sampling_params import SamplingParams

log = logging.getLogger("tokenloom")


class AsyncLLMEngine:
    """``async for delta in engine.generate(prompt, params)``: streamed StepDeltas, the last
    one finished and carrying the CompletionOutput. Leaving the loop early aborts the request."""

    def __init__(self, engine: LLMEngine, engine_thread: StepThread | None = None) -> None:
        """`engine_thread`: another engine's step thread, to take turns on (step_thread.py); None:
        a thread of its own."""
        self.engine = engine
        self._owns_thread = engine_thread is None  # close() ends only a thread this engine made
        self._thread = engine_thread or StepThread()
        self._turn_key = object()  # this engine's account on the thread
        self.tokenizer = engine.tokenizer
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending: list[Callable[[], None]] = []
        self._stepping = False
        self._engine_turn = asyncio.Lock()  # a step, or another job on the engine (embed)
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._ids = itertools.count()

    @classmethod
    def build(cls, make_engine: Callable[[], LLMEngine]) -> AsyncLLMEngine:
        """Construct the engine on the thread that will run its steps (see the module doc)."""
        thread = StepThread()
        async_engine = cls(thread.submit(make_engine).result(), thread)
        async_engine._owns_thread = True
        return async_engine

    @property
    def step_thread(self) -> StepThread:
        """The thread that runs this engine's steps. Another engine (another model) given it runs
        its steps there too, the two taking turns by the time their steps take (step_thread.py),
        with one OpenMP pool (see the module doc); that engine's close() leaves the thread running."""
        return self._thread

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = False) -> AsyncLLMEngine:
        return cls.build(lambda: LLMEngine(config, progress=progress))

    # ---- what the server reads (the engine's public facts; safe while a step runs) -------------
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def context_shift(self) -> bool:
        return self.engine.context_shift

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.engine.eos_token_ids

    @property
    def sampling_defaults(self):
        """What a request gets for the sampling settings it leaves out (sampling/defaults.py)."""
        return self.engine.sampling_defaults

    @property
    def model_path(self) -> str:
        return self.engine.config.model

    @property
    def model_config(self):
        """The model's shapes (models/config.ModelConfig)."""
        return self.engine.model_config

    @property
    def kv_cache_budget(self) -> int:
        """The bytes the KV cache may hold at most (on the CPU its pages become resident as used)."""
        return self.engine.core.kv_cache_budget

    @property
    def weight_format(self) -> str:
        """How the weights run: --quantization's method, else the dtype."""
        return self.engine.config.quantization or self.engine.config.dtype

    def has_requests(self) -> bool:
        """Whether a request is streaming from this engine or still in it."""
        return bool(self._queues) or self.engine.has_unfinished_requests()

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """ValueError (naming the problem) for input the model cannot take; read-only."""
        self.engine.validate_request(prompt_token_ids, params)

    def check_constraint(self, constraint) -> None:
        """ValueError if a structured-output constraint does not compile (compiled once, cached)."""
        self.engine.check_constraint(constraint)

    def prepare_for_serving(self) -> None:
        """Work a long-running server does once before its first request rather than during one:
        the grammar tokenizer is built (it holds the GIL throughout: at the first constrained
        request it froze the event loop that long), and every object alive now moves out of the
        garbage collector's view (``gc.freeze``): a full collection walked the ~220k objects of
        torch, the model and the tokenizer each time, again holding the GIL (docs/BENCHMARKS.md,
        'Measurements behind design choices'). The heap for a full step's activations is
        reserved too (EngineCore.reserve_activation_memory): not in the first large prefill."""
        self.engine.warm_up_grammars()
        self.engine.reserve_activation_memory()
        gc.collect()
        gc.freeze()

    def grammar_special_tokens(self, texts: tuple[str, ...]) -> frozenset[str]:
        """LLMEngine.grammar_special_tokens (read-only; the first call builds the grammar tokenizer)."""
        return self.engine.grammar_special_tokens(texts)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; only while no request is in flight."""
        self.engine.reset_prefix_cache()

    def reserve_activation_memory(self) -> bool:
        """Re-grow the engine's activation heap, on its own thread (LLMEngine.reserve_activation_memory)."""
        return self.run_on_engine_thread(self.engine.reserve_activation_memory)

    def run_on_engine_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call fn(*args) on the engine's thread and return its result (blocking): for other
        torch work in the same process, e.g. a benchmark's baseline, so one thread runs it all."""
        return self._thread.submit(fn, *args).result()

    def close(self) -> None:
        """End the engine's thread (after shutdown()) unless it was another engine's (given to the
        constructor); the engine stays usable synchronously."""
        if self._owns_thread:
            self._thread.shutdown(wait=True)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        validated: bool = False,
        client: str | None = None,
    ) -> AsyncGenerator[StepDelta, None]:
        """Stream one request's deltas. Raises ValueError at once for input the model cannot take
        (unless the caller has already run ``validate_request`` on it: `validated`), and
        RequestError where the request failed in the engine (the others go on). `client`: the
        client it runs for (LLMEngine.enqueue)."""
        self._ensure_loop()
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if params.n != 1:
            raise ValueError("generate() streams one sequence; use n=1 (submit n requests for n samples)")
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already in use")
        if not validated:
            self.validate_request(ids, params)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        self._submit(lambda: self.engine.enqueue(rid, ids, params, client), rid)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestError(item.error)
                yield item
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed now, or right after the step in flight."""
        self._submit(lambda: self.engine.abort(request_id))

    def stats(self) -> EngineStats:
        return self.engine.stats()

    async def shutdown(self) -> None:
        self._thread.forget(self._turn_key)
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None

    # ---- the background loop ---------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _submit(self, op: Callable[[], object], request_id: str | None = None) -> None:
        """Run an engine mutation now if no step is running, else right after the step."""

        def guarded() -> None:
            try:
                op()
            except Exception as e:  # e.g. an add that became invalid: tell its caller
                if request_id in self._queues:
                    self._queues[request_id].put_nowait(e)

        if self._stepping:
            self._pending.append(guarded)
        else:
            guarded()
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        while True:
            if not self.engine.has_unfinished_requests():
                self._thread.idle(self._turn_key)  # a thread it kept for a next step goes on
                wake = self._wake
                assert wake is not None  # _ensure_loop sets it before starting this task
                wake.clear()
                await wake.wait()
                continue
            try:
                deltas = await self._on_engine(self.engine.step, more=self.engine.has_unfinished_requests)
            except ParallelRankError as e:  # a rank of a split model is gone: so is the engine
                self._fail_all(e)
                self._end_process(e)
                return
            except Exception as e:  # a failed step fails the requests in flight, not the engine
                deltas = []
                self._fail_all(e)
            for delta in deltas:
                queue = self._queues.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)
            # Let the streams just fed run before the next step starts: a caller that submits
            # its next request on seeing the last one finish (a chat client, a closed-loop
            # benchmark) joins that step instead of waiting one more step as pending.
            await asyncio.sleep(0)

    async def _on_engine(self, fn: Callable[..., Any], *args: Any, more: Callable[[], bool] | None = None) -> Any:
        """fn(*args) on the engine's thread, alone: no step runs meanwhile, and mutations that
        arrive are applied right after it. `more()`: whether another step follows at once
        (StepThread.run)."""
        async with self._engine_turn:
            self._stepping = True
            try:
                return await self._thread.run(self._turn_key, fn, *args, more=more)
            finally:
                self._stepping = False
                pending, self._pending = self._pending, []
                for op in pending:
                    op()

    async def add_lora(self, name: str, path: str) -> AdapterRef:
        """Load a LoRA adapter (LLMEngine.add_lora; ValueError as there): its files are read and checked
        on a worker thread while steps go on; only the slot write runs between two steps."""
        prepared = await asyncio.to_thread(self.engine.prepare_lora, name, path)
        return await self._on_engine(self.engine.add_lora, name, prepared)

    async def remove_lora(self, name: str) -> None:
        """Unload a LoRA adapter between two steps (ValueError while a request uses it)."""
        await self._on_engine(self.engine.remove_lora, name)

    def loras(self) -> list[AdapterRef]:
        """The LoRA adapters loaded (read-only)."""
        return self.engine.loras()

    @property
    def lora_enabled(self) -> bool:
        """The engine keeps slots for LoRA adapters (--lora or --enable-lora)."""
        return self.engine.lora_enabled

    @property
    def lora_runtime_updates(self) -> bool:
        """A server may load and unload this engine's adapters by request (--enable-lora)."""
        lora = self.engine.config.lora
        return lora is not None and lora.runtime_updates

    async def embed(self, token_ids: list[int], pooling: str = "mean") -> list[float]:
        """LLMEngine.embed between two steps (ValueError as there)."""
        return await self._on_engine(self.engine.embed, token_ids, pooling)

    @staticmethod
    def _end_process(error: Exception) -> None:
        """Stop the process serving this engine (a server shuts down on SIGTERM) with the reason logged."""
        log.critical("%s; shutting down", error)
        os.kill(os.getpid(), signal.SIGTERM)

    def _fail_all(self, error: Exception) -> None:
        for rid, queue in list(self._queues.items()):
            self.engine.abort(rid)
            queue.put_nowait(RuntimeError(f"engine step failed: {error!r}"))
