"""The models one server serves by name, and which of them are loaded.

A request names its model; ``async with models.use(name) as serving`` gives that model's
OpenAIServing for the block, loading the model first where it is not loaded. Every model in
the catalog (server/catalog.py: the pulled and cached ones, and the one ``--model`` gave) is
servable; a loaded one has its own engine, whose steps take turns with the other models' on one
thread (AsyncLLMEngine.step_thread), so no model's step waits for more than one step of each other.

Loading: one load per model at a time (the requests that want it meanwhile wait for that one,
each up to ``load_timeout_s``, then 503; the load goes on), on a thread of its own that ends
with it (its OpenMP pool with it). A load first makes room: while loading would pass
``max_loaded`` models or ``memory_bytes`` (weights on disk plus the KV cache's budget, for each
model loaded or loading), the least recently used model that nothing is using is unloaded;
where every one is in use, the request gets 503 and the others keep serving. A model that fails
to load answers its requests with the reason; the next request for it tries again.

Unloading: a model nothing uses (no request being prepared, admitted or in its engine, no
``use`` block) for its keep-alive (the server's default, or the last request's ``keep_alive``:
negative keeps it, 0 unloads it as soon as it is idle) is unloaded by a reaper that looks every
``REAP_INTERVAL_S``. Its engine's memory goes back to the heap (the next load reuses it) and the
heap's free pages to the OS.

Touched only from the event loop, except the loads' own threads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from tokenloom.engine.step_thread import StepThread
from tokenloom.entrypoints.server.load_policy import LoadPolicy, ModelEntry
from tokenloom.entrypoints.server.protocol import APIError
from tokenloom.entrypoints.server.served_adapters import ServedAdapters
from tokenloom.entrypoints.server.serving import OpenAIServing
from tokenloom.memory.allocator import release_free_memory
from tokenloom.metrics import EngineStats

log = logging.getLogger("tokenloom.entrypoints.server")

REAP_INTERVAL_S = 0.5  # how often idle models are checked against their keep-alive
CATALOG_REFRESH_S = 1.0  # an unknown name reads the catalog again at most this often


@dataclass(eq=False)
class LoadedModel:
    """A model in memory: its serving, what it counts against the budget, and its keep-alive."""

    entry: ModelEntry
    serving: OpenAIServing
    keep_alive_s: float | None = None  # None: the server's default
    last_used: float = field(default_factory=time.monotonic)
    holds: int = 0  # `use` blocks open

    @property
    def footprint(self) -> int:
        """What it counts against the memory budget: its weights on disk and its KV cache's budget."""
        return self.entry.size_bytes + self.serving.engine.kv_cache_budget

    def in_use(self) -> bool:
        return self.holds > 0 or self.serving.busy()

    def expires_at(self, policy: LoadPolicy) -> float | None:
        """When it unloads if nothing uses it meanwhile (wall-clock seconds), None: never."""
        keep = policy.keep_alive_s if self.keep_alive_s is None else self.keep_alive_s
        if keep < 0:
            return None
        idle_from = time.monotonic() if self.in_use() else self.last_used
        return time.time() + (idle_from + keep - time.monotonic())


def _collect_freed() -> None:
    """Free an unloaded engine's objects: they were frozen out of the collector's view
    (prepare_for_serving), so a full collection sees them again, frees the cycles among them, and
    what is left is frozen again; then the heap's free pages go back to the OS."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    release_free_memory()


def _not_found(name: str, entries: list[ModelEntry]) -> APIError:
    served = ", ".join(
        repr(e.name) + (f" (also {', '.join(map(repr, e.aliases))})" if e.aliases else "") for e in entries
    )
    return APIError(
        404,
        f"the model {name!r} does not exist; this server serves {served} "
        "(GET /v1/models lists them; `tokenloom pull NAME` adds one)",
        "model",
        type="not_found_error",
        code="model_not_found",
    )


def _unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, "model", type="server_error", code=code, headers={"Retry-After": "5"})


class ServedModels:
    """The catalog, the loaded models and their loads (the module doc)."""

    def __init__(
        self,
        primary: LoadedModel,
        step_thread: StepThread,
        catalog: Callable[[], list[ModelEntry]] | None = None,
        make_serving: Callable[[ModelEntry], OpenAIServing] | None = None,
        policy: LoadPolicy | None = None,
    ) -> None:
        """`primary`: the model loaded at start (``--model``), whose `step_thread` runs every
        model's steps (shut down by close()); `catalog()`: the other models it may
        serve, read again when a request names one it does not know (at most every
        CATALOG_REFRESH_S) and after a pull or delete; `make_serving(entry)` loads one (called on a
        thread of its own). Without both the server serves the primary model alone."""
        self.policy = policy or LoadPolicy()
        self.step_thread = step_thread
        self.primary = primary.entry
        self.catalog = catalog if make_serving is not None else None
        self.make_serving = make_serving
        self.entries: dict[str, ModelEntry] = {}
        self.by_name: dict[str, ModelEntry] = {}
        self.loaded: dict[str, LoadedModel] = {primary.entry.name: primary}
        self.loading: dict[str, asyncio.Task] = {}
        self.reserved: dict[str, int] = {}  # the estimated footprints of the loads under way
        self.retired = EngineStats(0, 0, 0, 0, 0.0, 0, 0, 0)  # counters of the engines unloaded
        self.closing = False
        self._reaper: asyncio.Task | None = None
        self._refreshed = 0.0
        self.adapters = ServedAdapters(self, primary.serving)  # LoRA adapters by name, on the first model
        self.refresh()
        self.adapters.check_names()

    def refresh(self) -> None:
        """Read the catalog again: models pulled meanwhile become servable, removed ones go
        (unless loaded); the primary model's names come first."""
        now = time.monotonic()
        self._refreshed = now
        try:
            found = [] if self.catalog is None else self.catalog()
        except Exception:  # an unreadable cache must not take the server down: serve what is known
            log.exception("reading the models this server can serve failed")
            found = [e for e in self.entries.values() if e is not self.primary]
        kept = [self.primary, *(m.entry for m in self.loaded.values() if m.entry is not self.primary)]
        entries: dict[str, ModelEntry] = {}
        for entry in [*kept, *found]:
            entries.setdefault(entry.name, entry)
        by_name: dict[str, ModelEntry] = {}
        for entry in entries.values():
            for n in entry.names:
                by_name.setdefault(n, entry)
        self.entries, self.by_name = entries, by_name

    # ---- names -------------------------------------------------------------------------------
    def resolve(self, name: str | None) -> ModelEntry:
        """The catalog entry a request's `model` names (None or "": the primary model); 404 if none."""
        if not name:
            return self.primary
        entry = self._lookup(name)
        if entry is None and self.catalog is not None and time.monotonic() - self._refreshed >= CATALOG_REFRESH_S:
            self.refresh()  # pulled since?
            entry = self._lookup(name)
        if entry is None:
            raise _not_found(name, list(self.entries.values()))
        return entry

    def _lookup(self, name: str) -> ModelEntry | None:
        """The entry `name` names: as written, without ollama's ":latest", or in other case; a LoRA
        adapter's name names the model it runs on."""
        if name in self.adapters:
            return self.primary
        for candidate in (name, name.removesuffix(":latest")):
            if candidate in self.by_name:
                return self.by_name[candidate]
        folded = name.removesuffix(":latest").casefold()
        return next((e for n, e in self.by_name.items() if n.casefold() == folded), None)

    def knows(self, name: str) -> bool:
        """`name` names a model (or an adapter) this server serves."""
        return self._lookup(name) is not None

    def serving_of(self, name: str | None) -> OpenAIServing | None:
        """The named model's serving if it is loaded (404 if the name is unknown), without loading."""
        loaded = self.loaded.get(self.resolve(name).name)
        return loaded.serving if loaded is not None else None

    def card(self, name: str | None) -> dict:
        """The named model as /v1/models lists it, with whether it is loaded (404 if unknown)."""
        entry = self.resolve(name)
        loaded = self.loaded.get(entry.name)
        if name is not None and name in self.adapters:
            return self.adapters.card(name, loaded.serving if loaded is not None else None)
        if loaded is not None:
            return loaded.serving.model_card() | {"loaded": True}
        return {"id": entry.name, "object": "model", "created": 0, "owned_by": "tokenloom", "loaded": False}

    # ---- using a model -----------------------------------------------------------------------
    @asynccontextmanager
    async def use(self, name: str | None, keep_alive_s: float | None = None) -> AsyncIterator[OpenAIServing]:
        """The named model's serving, loaded first where it is not; it is not unloaded while the
        block runs (nor afterwards while requests admitted in it run). `keep_alive_s` replaces
        its keep-alive from now on."""
        entry = self.resolve(name)
        loaded = self.loaded.get(entry.name) or await self._load(entry)
        loaded.holds += 1
        if keep_alive_s is not None:
            loaded.keep_alive_s = keep_alive_s
        self._ensure_reaper()
        try:
            if name is not None and name in self.adapters:
                await self.adapters.ensure(name, loaded.serving)
            yield loaded.serving
        finally:
            loaded.holds -= 1
            loaded.last_used = time.monotonic()

    async def _load(self, entry: ModelEntry) -> LoadedModel:
        """Wait (at most load_timeout_s) for `entry`'s load, starting it unless one is under way."""
        task = self.loading.get(entry.name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load_now(entry))
            self.loading[entry.name] = task
            task.add_done_callback(lambda t: self._loaded(entry, t))
        try:
            return await asyncio.wait_for(asyncio.shield(task), self.policy.load_timeout_s)
        except asyncio.TimeoutError:
            raise _unavailable(
                f"the model {entry.name!r} is still loading after {self.policy.load_timeout_s:g} s; try again",
                "model_loading",
            ) from None

    def _loaded(self, entry: ModelEntry, task: asyncio.Task) -> None:
        self.loading.pop(entry.name, None)
        if not task.cancelled():
            task.exception()  # retrieved: a failed load nobody waits for any more is not logged twice

    async def _load_now(self, entry: ModelEntry) -> LoadedModel:
        if self.closing:
            raise _unavailable("the server is shutting down", "server_shutdown")
        if self.make_serving is None:
            raise _not_found(entry.name, list(self.entries.values()))
        need = entry.size_bytes + self.policy.kv_bound_bytes
        await self._make_room(entry, need)
        started = time.perf_counter()
        log.info("loading the model %r (%s)", entry.name, entry.source)
        thread = ThreadPoolExecutor(1, thread_name_prefix="tokenloom-load")  # its OpenMP pool ends with it
        self.reserved[entry.name] = need
        try:
            serving = await asyncio.get_running_loop().run_in_executor(thread, self.make_serving, entry)
        except Exception as e:
            log.exception("loading the model %r failed", entry.name)
            raise APIError(
                500,
                f"loading the model {entry.name!r} failed: {e}",
                "model",
                type="server_error",
                code="model_load_failed",
            ) from None
        finally:
            thread.shutdown(wait=False)
            self.reserved.pop(entry.name, None)
        if self.closing:  # the server stopped meanwhile
            await self._close_serving(serving)
            del serving
            _collect_freed()
            raise _unavailable("the server is shutting down", "server_shutdown")
        if entry is self.primary:
            await self.adapters.settle(serving)
        loaded = LoadedModel(entry, serving)
        self.loaded[entry.name] = loaded
        log.info("loaded the model %r in %.1f s", entry.name, time.perf_counter() - started)
        return loaded

    # ---- room for a load ---------------------------------------------------------------------
    def _held_bytes(self) -> int:
        return sum(m.footprint for m in self.loaded.values()) + sum(self.reserved.values())

    async def _make_room(self, entry: ModelEntry, need: int) -> None:
        """Unload idle models, least recently used first, until `entry` (`need` bytes) fits under
        max_loaded and the memory budget; 503 where the models in use leave no room, 500 where
        it would not fit with none loaded."""
        budget = self.policy.budget
        if budget and need > budget:
            raise APIError(
                500,
                f"the model {entry.name!r} needs about {need / 2**30:.1f} GiB (weights and KV cache), more "
                f"than the {budget / 2**30:.1f} GiB the server's models may hold (--models-memory)",
                "model",
                type="server_error",
                code="model_too_large",
            )

        def crowded() -> bool:
            over_count = len(self.loaded) + len(self.reserved) + 1 > self.policy.max_loaded
            return over_count or bool(budget and self._held_bytes() + need > budget)

        while crowded():
            idle = [m for m in self.loaded.values() if not m.in_use()]
            if not idle:
                busy = ", ".join(repr(n) for n in [*self.loaded, *self.reserved])
                raise _unavailable(
                    f"cannot load the model {entry.name!r} now: the models loaded ({busy}) are all serving "
                    f"requests and there is room for {self.policy.max_loaded} "
                    f"(--max-loaded-models) in {budget / 2**30:.1f} GiB (--models-memory); try again",
                    "models_busy",
                )
            await self.unload(min(idle, key=lambda m: m.last_used))

    # ---- unloading ---------------------------------------------------------------------------
    @property
    def reloadable(self) -> bool:
        """Whether a model unloaded could load again (else the primary model stays for good)."""
        return self.make_serving is not None

    async def unload(self, loaded: LoadedModel) -> None:
        """Stop and drop a loaded model (the caller checked that nothing uses it); its
        LoadedModel's serving is None from then on."""
        if self.loaded.get(loaded.entry.name) is not loaded or not self.reloadable:
            return
        del self.loaded[loaded.entry.name]
        stats = loaded.serving.engine.stats()
        self.retired = _plus(self.retired, EngineStats(0, 0, 0, 0, 0.0, *_counters(stats)))
        serving, loaded.serving = loaded.serving, None  # type: ignore[assignment]
        await self._close_serving(serving)
        del serving  # the last reference: the engine's memory goes now
        _collect_freed()
        log.info("unloaded the model %r", loaded.entry.name)

    @staticmethod
    async def _close_serving(serving: OpenAIServing) -> None:
        """Stop its engine's loop and its tokenizer processes (the step thread is close()'s)."""
        await serving.engine.shutdown()
        serving.close()

    async def unload_named(self, name: str | None) -> bool:
        """Unload the named model now if it is loaded and idle (else at its next idle moment:
        keep-alive 0); True if it is gone now."""
        entry = self.resolve(name)
        loaded = self.loaded.get(entry.name)
        if loaded is None:
            return True
        loaded.keep_alive_s = 0
        if loaded.in_use() or not self.reloadable:
            return False
        await self.unload(loaded)
        return True

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        """Unload every model idle for its keep-alive (the module doc)."""
        while not self.closing:
            now = time.monotonic()
            for loaded in list(self.loaded.values()):
                if self.loaded.get(loaded.entry.name) is not loaded:  # unloaded meanwhile
                    continue
                keep = self.policy.keep_alive_s if loaded.keep_alive_s is None else loaded.keep_alive_s
                if loaded.in_use():
                    loaded.last_used = now
                elif keep >= 0 and now - loaded.last_used >= max(keep, REAP_INTERVAL_S):
                    # (at least an interval idle: a model just loaded is not unloaded before the
                    # requests that waited for it take it)
                    try:
                        await self.unload(loaded)
                    except Exception:  # an unload that fails must not end the reaper
                        log.exception("unloading the model %r failed", loaded.entry.name)
            await asyncio.sleep(REAP_INTERVAL_S)

    # ---- the server's life -------------------------------------------------------------------
    def begin_shutdown(self, grace_s: float) -> None:
        """Every loaded model cuts its requests before the grace ends (OpenAIServing.begin_shutdown)."""
        for loaded in self.loaded.values():
            loaded.serving.begin_shutdown(grace_s)

    async def close(self) -> None:
        """At the server's end: stop the reaper, the loads and every engine, then the step thread."""
        self.closing = True
        if self._reaper is not None:
            self._reaper.cancel()
        for task in list(self.loading.values()):
            task.cancel()
        for loaded in list(self.loaded.values()):
            await self._close_serving(loaded.serving)
        self.loaded.clear()
        self.step_thread.shutdown(wait=True)

    def stats(self) -> EngineStats:
        """Every loaded engine's counts summed, the unloaded ones' counters kept (they only grow);
        the prefix-cache hit rate weighted by the prompt tokens each engine computed."""
        live = [m.serving.engine.stats() for m in self.loaded.values()]
        total = self.retired
        for s in live:
            total = _plus(total, s)
        weight = sum(s.prompt_tokens_computed for s in live)
        hits = sum(s.prefix_cache_hit_rate * s.prompt_tokens_computed for s in live)
        fallback = max((s.prefix_cache_hit_rate for s in live), default=0.0)
        return dataclasses.replace(total, prefix_cache_hit_rate=hits / weight if weight else fallback)


def _counters(s: EngineStats) -> tuple[int, ...]:
    """The counters of `s` (what only grows), in EngineStats' order."""
    return (
        s.prompt_tokens_computed,
        s.generated_tokens,
        s.num_preemptions,
        s.spec_steps,
        s.spec_draft_tokens,
        s.spec_accepted_tokens,
    )


def _plus(a: EngineStats, b: EngineStats) -> EngineStats:
    """`a` and `b`'s counts summed (the hit rate left at 0: ServedModels.stats weighs it)."""
    return EngineStats(
        a.num_running + b.num_running,
        a.num_waiting + b.num_waiting,
        a.kv_blocks_used + b.kv_blocks_used,
        a.kv_blocks_free + b.kv_blocks_free,
        0.0,
        *(x + y for x, y in zip(_counters(a), _counters(b), strict=True)),
    )
