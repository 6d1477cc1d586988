"""/v1/models/{id}, /tokenize, /detokenize and /v1/embeddings on the default model; embeddings
checked against HF transformers' final hidden states of the same weights."""

from __future__ import annotations

import base64
import math

import httpx
import openai
import pytest
import torch

from tests.helpers.server_harness import ThreadedServer


@pytest.fixture(scope="module")
def served(default_model_dir):
    from tokenloom import LLM
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    engine = LLM(str(default_model_dir), dtype="float32", max_model_len=256, kv_cache_memory=32 << 20).engine
    with ThreadedServer(build_app(AsyncLLMEngine(engine), "smol")) as url:
        yield url, engine


def test_model_card_and_unknown_routes(served):
    url, _ = served
    card = httpx.get(f"{url}/v1/models/smol").json()
    assert card["id"] == "smol" and card["max_model_len"] == 256
    missing = httpx.get(f"{url}/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    nowhere = httpx.post(f"{url}/v1/nothing", json={})
    assert nowhere.status_code == 404 and "no route" in nowhere.json()["error"]["message"]


def test_tokenize_detokenize_round_trip(served):
    url, engine = served
    text = "The capital of France is Paris."
    got = httpx.post(f"{url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert got["tokens"] == engine.tokenizer.encode(text, add_special_tokens=False)
    assert got["count"] == len(got["tokens"])
    back = httpx.post(f"{url}/detokenize", json={"tokens": got["tokens"]}).json()
    assert back["prompt"] == text
    chat = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat["tokens"] == engine.tokenizer.encode(prompt, add_special_tokens=False)
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def _hf_embedding(model_dir, text: str, pooling: str) -> torch.Tensor:
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        hidden = model(**tok(text, return_tensors="pt")).last_hidden_state[0]  # (T, hidden), after the norm
    pooled = hidden.mean(0) if pooling == "mean" else hidden[-1]
    return torch.nn.functional.normalize(pooled, dim=0)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_match_hf_hidden_states(served, default_model_dir, pooling):
    url, _ = served
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    texts = ["The cat sat on the mat.", "A kitten rested on the rug.", "Quarterly revenue rose 4%."]
    reply = client.embeddings.create(model="smol", input=texts, extra_body={"pooling": pooling})
    vectors = [torch.tensor(d.embedding) for d in reply.data]
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.usage.prompt_tokens > 0
    for v in vectors:
        assert math.isclose(v.norm().item(), 1.0, rel_tol=1e-4)
    expected = _hf_embedding(default_model_dir, texts[0], pooling)
    assert torch.dot(vectors[0], expected).item() > 0.9999
    b64 = client.embeddings.create(
        model="smol", input=texts[0], encoding_format="base64", extra_body={"pooling": pooling}
    )  # little-endian float32, as OpenAI's
    decoded = torch.frombuffer(bytearray(base64.b64decode(b64.data[0].embedding)), dtype=torch.float32)
    assert torch.allclose(decoded, vectors[0], atol=1e-6)


def test_embedding_errors_are_400(served):
    url, _ = served
    for body, param in [
        ({"input": ""}, "input"),
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": "word " * 400}, "input"),
    ]:
        got = httpx.post(f"{url}/v1/embeddings", json=body)
        assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text


def test_a_pulled_model_answers_to_its_pulled_name_and_its_file_name(tiny_model_dir, tmp_path):
    """`serve -m qwen2.5-coder-0.5b` serves the file qwen2.5-coder-0.5b-instruct-q4_k_m.gguf: requests
    naming either get answers, /v1/models lists the pulled name, anything else is a 404 naming both."""
    from fastapi.testclient import TestClient

    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app, served_names

    gguf = tmp_path / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    gguf.write_bytes(b"")
    names = served_names("qwen2.5-coder-0.5b", str(gguf))
    assert names == ["qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m"]
    assert served_names(str(gguf), str(gguf)) == ["qwen2.5-coder-0.5b-instruct-q4_k_m"]  # a path: its stem
    assert served_names("qwen2.5-coder-0.5b", str(gguf), "mine") == ["mine"]
    assert served_names(None, str(tmp_path / "SmolLM2-135M-Instruct" / "hf")) == [
        "smollm2-135m",
        "SmolLM2-135M-Instruct",
    ]
    from tokenloom import LLM

    engine = LLM(str(tiny_model_dir("llama_gqa")), kv_cache_memory=8 << 20).engine
    app = build_app(AsyncLLMEngine(engine), names[0], model_aliases=tuple(names[1:]))
    with TestClient(app) as tc:
        assert [m["id"] for m in tc.get("/v1/models").json()["data"]] == ["qwen2.5-coder-0.5b"]
        for name in names:
            done = tc.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 2})
            assert done.status_code == 200, done.text
        other = tc.post("/v1/completions", json={"model": "gpt-9", "prompt": "Hi", "max_tokens": 2})
    assert other.status_code == 404
    assert "qwen2.5-coder-0.5b-instruct-q4_k_m" in other.json()["error"]["message"]


def test_unknown_request_fields_are_named_in_a_warning_and_a_header(tiny_model_dir, caplog):
    from fastapi.testclient import TestClient

    from tokenloom import LLM
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    engine = LLM(str(tiny_model_dir("llama_gqa")), kv_cache_memory=8 << 20).engine
    with TestClient(build_app(AsyncLLMEngine(engine), "tiny")) as tc:
        odd = tc.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temprature": 0.1, "best_guess": 1})
        streamed = tc.post(
            "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True, "frobnicate": True}
        )
        plain = tc.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert odd.status_code == 200 and odd.headers["x-tokenloom-ignored-fields"] == "best_guess, temprature"
    assert streamed.status_code == 200 and streamed.headers["x-tokenloom-ignored-fields"] == "frobnicate"
    assert "x-tokenloom-ignored-fields" not in plain.headers
    assert "ignored the request fields this server does not know: best_guess, temprature" in caplog.text
