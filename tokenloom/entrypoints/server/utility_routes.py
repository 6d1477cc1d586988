"""The smaller endpoints agents and tools call: /v1/models/{id}, /tokenize, /detokenize (vLLM's
shapes) and /v1/embeddings.

Embeddings are the loaded model's own: its final hidden states (after the last norm) pooled over
the input's tokens (mean, the default, or the last token's), L2-normalized. A generative model is
not trained for embeddings; these are for similarity over what this model reads, not a
replacement for a trained embedding model.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, Field, ValidationError

from tokenloom.entrypoints.server.admission import server_busy
from tokenloom.entrypoints.server.protocol import STRICT, APIError, ChatCompletionRequest, prompt_list
from tokenloom.entrypoints.server.served_models import ServedModels
from tokenloom.entrypoints.server.serving import OpenAIServing

MAX_EMBEDDING_INPUTS = 256


class TokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None  # chat messages, templated first
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    pooling: Literal["mean", "last"] = "mean"  # tokenloom's extension


def _inputs(req: EmbeddingRequest) -> list[str | list[int]]:
    inputs = prompt_list(req.input, "input")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise APIError(400, f"at most {MAX_EMBEDDING_INPUTS} inputs per request", "input")
    return inputs


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # little-endian float32, as OpenAI's SDKs decode it
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


def add_utility_routes(app: FastAPI, models: ServedModels) -> None:
    """Register the module's endpoints on `app`."""

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        return models.card(model_id)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        models.resolve(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give prompt or messages (one of them)", "prompt")
        chat = None
        if req.messages is not None:
            try:
                chat = ChatCompletionRequest.model_validate({"messages": req.messages})
            except ValidationError as e:
                raise APIError(400, f"messages: {e.errors()[0]['msg']}", "messages") from None
        async with models.use(req.model) as serving:

            def encode(r: TokenizeRequest) -> list[int]:
                if chat is not None:
                    prompt = serving.chat_prompt(chat, r.add_generation_prompt)
                    return serving.tokenizer.encode(prompt, add_special_tokens=False)
                assert r.prompt is not None
                return serving.tokenizer.encode(r.prompt, r.add_special_tokens)

            ids = await serving.off_loop(encode, req)
            return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        async with models.use(req.model) as serving:
            serving.check_token_ids(req.tokens, "tokens")
            return {"prompt": serving.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest) -> dict[str, Any]:
        models.resolve(req.model)
        models.adapters.refuse(req.model, "embeddings")
        if req.dimensions is not None:
            raise APIError(400, "dimensions is not supported: the embedding has the model's hidden size", "dimensions")
        inputs = _inputs(req)
        async with models.use(req.model) as serving:
            token_lists = await serving.off_loop(lambda _: [serving.input_ids(x, "input") for x in inputs], req)
            vectors = await embed_all(serving, token_lists, req.pooling)
        data = [
            {"object": "embedding", "index": i, "embedding": _encoded(v, req.encoding_format)}
            for i, v in enumerate(vectors)
        ]
        tokens = sum(len(ids) for ids in token_lists)
        return {
            "object": "list",
            "data": data,
            "model": serving.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


async def embed_all(serving: OpenAIServing, token_lists: list[list[int]], pooling: str) -> list[list[float]]:
    """Each token list's embedding, in turn between the engine's steps: 400 for input the model
    cannot embed, 429 when the KV cache has no room for it now."""
    vectors = []
    for ids in token_lists:
        try:
            vectors.append(await serving.engine.embed(ids, pooling))
        except ValueError as e:
            raise APIError(400, str(e), "input") from None
        except RuntimeError as e:  # no KV room now
            raise server_busy(str(e), serving.admission.limits.retry_after_s) from None
    return vectors
