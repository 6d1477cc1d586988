"""LoRA adapters loaded and unloaded at run time, with vLLM's endpoints and bodies.

``POST /v1/load_lora_adapter {"lora_name", "lora_path"[, "load_inplace"]}`` loads a PEFT folder or
GGUF LoRA file into the served model's engine and serves it by that name: a request whose ``model``
is the name runs through the adapter, batched with everyone else's. ``POST /v1/unload_lora_adapter
{"lora_name"}`` frees its slot (409 while requests use it). Both only where the server was started
with ``--enable-lora`` (they read any path the server can: vLLM asks for an environment variable).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from tokenloom.entrypoints.server.protocol import STRICT
from tokenloom.entrypoints.server.served_models import ServedModels


class LoadLoRARequest(BaseModel):
    model_config = STRICT
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False  # vLLM's: replace an adapter already loaded under that name


class UnloadLoRARequest(BaseModel):
    model_config = STRICT
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's; names are what tokenloom goes by


def add_lora_routes(app: FastAPI, models: ServedModels) -> None:
    """Register the module's endpoints on `app`."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRARequest) -> PlainTextResponse:
        await models.adapters.add(req.lora_name, req.lora_path, replace=req.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRARequest) -> PlainTextResponse:
        await models.adapters.remove(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
