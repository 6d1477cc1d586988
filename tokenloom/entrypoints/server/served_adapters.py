"""The LoRA adapters a server serves by name (as vLLM does): each runs on the first model.

A request whose ``model`` names an adapter is served by the first model's engine through that
adapter (``OpenAIServing.adapter_named``). Adapters come from ``--lora`` at start and, with
``--enable-lora``, from ``/v1/load_lora_adapter`` (lora_routes.py); their paths are kept, so an
adapter loaded at run time is loaded into the model's engine again when the model was unloaded and
reloaded since (on its next use), never silently replaced by the base model, and a ``--lora``
adapter unloaded at run time stays unloaded when the model is reloaded (``settle``). Changes are
serialized; touched only from the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import TYPE_CHECKING

from tokenloom.entrypoints.server.protocol import APIError

if TYPE_CHECKING:
    from tokenloom.entrypoints.server.served_models import ServedModels
    from tokenloom.entrypoints.server.serving import OpenAIServing


def _holds(serving: OpenAIServing, name: str) -> bool:
    return any(ref.name == name for ref in serving.engine.loras())


class ServedAdapters:
    def __init__(self, models: ServedModels, first: OpenAIServing) -> None:
        self.models = models
        self.paths: dict[str, str] = {ref.name: ref.path for ref in first.engine.loras()}  # name -> its path
        self._changes = asyncio.Lock()

    def __contains__(self, name: object) -> bool:
        return name in self.paths

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.paths))

    def __len__(self) -> int:
        return len(self.paths)

    def check_names(self) -> None:
        """ValueError where a start-up adapter's name is also a served model's."""
        primary = self.models.primary
        for name in self.paths:
            entry = self.models.by_name.get(name)
            if name in primary.names or (entry is not None and entry is not primary):
                raise ValueError(f"LoRA adapter name {name!r} is a served model's name too")

    def card(self, name: str, serving: OpenAIServing | None) -> dict:
        """The adapter as /v1/models lists it: its base (`parent`) and path (`root`)."""
        parent = self.models.primary.name
        card = {"id": name, "object": "model", "created": 0, "owned_by": "tokenloom", "parent": parent}
        return card | {"root": self.paths[name], "loaded": serving is not None and _holds(serving, name)}

    def refuse(self, name: str | None, what: str) -> None:
        """400 where `name` is an adapter's: `what` does not run through adapters."""
        if name in self.paths:
            why = f"{what} through a LoRA adapter ({name!r}) is not supported: name its base model"
            raise APIError(400, why, "model")

    async def add(self, name: str, path: str, replace: bool = False) -> None:
        """Load adapter `path` into the first model's engine as `name` (400 when run-time updates are
        off (--enable-lora), the name is taken (unless `replace`: vLLM's load_inplace), no slot is free
        or the adapter does not fit)."""
        async with self._changes, self.models.use(self.models.primary.name) as serving:
            self._check_updates(serving, "loading")
            if name in self.paths and replace:
                await self._remove(name)
            if name in self.paths or self.models.knows(name):
                raise APIError(400, f"the name {name!r} is already served (a model or an adapter)", "lora_name")
            try:
                await serving.engine.add_lora(name, path)
            except ValueError as e:
                raise APIError(400, str(e), "lora_path") from None
            self.paths[name] = path

    async def remove(self, name: str) -> None:
        """Unload adapter `name` (400 when run-time updates are off, 404 if it is not served, 409 while
        requests use it)."""
        async with self._changes:
            serving = self.models.serving_of(self.models.primary.name)
            if serving is not None:
                self._check_updates(serving, "unloading")
            await self._remove(name)

    async def ensure(self, name: str, serving: OpenAIServing) -> None:
        """Adapter `name` is in `serving`'s engine: loaded again where the model was reloaded since
        (500 naming why where it no longer loads)."""
        if _holds(serving, name):
            return
        async with self._changes:
            if name not in self.paths or _holds(serving, name):
                return
            try:
                await serving.engine.add_lora(name, self.paths[name])
            except ValueError as e:
                raise APIError(500, f"LoRA adapter {name!r} could not be loaded again: {e}", "model") from None

    async def settle(self, serving: OpenAIServing) -> None:
        """A freshly loaded first model's engine holds only adapters still served: it was built with
        the start-up ``--lora`` list, some of which may have been unloaded at run time since. Called
        before the serving is published, so no request or change can race it."""
        for ref in serving.engine.loras():
            if ref.name not in self.paths:
                await serving.engine.remove_lora(ref.name)

    async def _remove(self, name: str) -> None:
        if name not in self.paths:
            raise APIError(404, f"no LoRA adapter named {name!r} is loaded", "lora_name", code="lora_not_found")
        serving = self.models.serving_of(self.models.primary.name)
        if serving is not None and _holds(serving, name):
            try:
                await serving.engine.remove_lora(name)
            except ValueError as e:
                raise APIError(409, str(e), "lora_name", code="lora_in_use") from None
        del self.paths[name]

    @staticmethod
    def _check_updates(serving: OpenAIServing, doing: str) -> None:
        if not serving.engine.lora_runtime_updates:
            why = f"{doing} LoRA adapters at run time is off: start the server with --enable-lora"
            raise APIError(400, why, None, code="lora_updates_off")
