"""Many models in one server, on small random-weight models (they load in well under a second):
loading on first use (one load for concurrent requests), keep-alive and ollama's keep_alive 0,
least-recently-used eviction under max_loaded, a model in use never evicted (503 instead), a
model that fails to load, the memory budget, /v1/models and /api/ps, and /api/pull and
/api/delete against a local Hub."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import weakref

import httpx
import pytest

from tests.helpers.fake_hub import FakeHub, Repo
from tests.helpers.gguf_writer import write_gguf
from tests.helpers.server_harness import ThreadedServer
from tokenloom import LLM
from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.entrypoints.server import build_app
from tokenloom.entrypoints.server.load_policy import LoadPolicy, ModelEntry, duration_seconds

PROMPT = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def files(tiny_model_dir, tmp_path_factory):
    """Two different small models as GGUF files, and a file that is not a model."""
    made = tmp_path_factory.mktemp("models")
    a = write_gguf(tiny_model_dir("llama_gqa"), made / "alpha-Q8_0.gguf", quantize="Q8_0")
    b = write_gguf(tiny_model_dir("qwen2"), made / "beta-Q8_0.gguf", quantize="Q8_0")
    broken = made / "broken.gguf"
    broken.write_bytes(b"GGUF but not really a model")
    return a, b, broken


def _engine(path) -> object:
    return LLM(str(path), max_model_len=256, kv_cache_memory=8 << 20).engine


class Loads:
    """A load_engine that counts its calls per source (and can be made slow)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls: list[str] = []
        self.engines: list[weakref.ref] = []  # each engine it made, not kept alive
        self.delay_s = delay_s
        self.lock = threading.Lock()

    def __call__(self, source: str):
        with self.lock:
            self.calls.append(source)
        time.sleep(self.delay_s)
        engine = _engine(source)
        self.engines.append(weakref.ref(engine))
        return engine


def _server(files, policy: LoadPolicy, loads: Loads, extra: list[ModelEntry] = ()):
    a, b, broken = files
    catalog = [ModelEntry("beta", str(b), ("beta-q8",), b.stat().st_size), ModelEntry("broken", str(broken)), *extra]
    engine = AsyncLLMEngine(_engine(a))
    app = build_app(engine, "alpha", catalog=lambda: catalog, load_engine=loads, load_policy=policy)
    return ThreadedServer(app)


def _complete(url: str, model: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json=PROMPT | {"model": model} | fields, timeout=60)


def _listed(url: str) -> dict[str, bool]:
    return {m["id"]: m["loaded"] for m in httpx.get(f"{url}/v1/models").json()["data"]}


def _running(url: str) -> list[str]:
    return [m["name"] for m in httpx.get(f"{url}/api/ps").json()["models"]]


def _wait_for(check, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def test_a_model_loads_on_first_use_once_and_serves_beside_the_first(files):
    loads = Loads(delay_s=0.5)  # the requests below arrive while it loads
    with _server(files, LoadPolicy(max_loaded=3), loads) as url:
        assert _listed(url) == {"alpha": True, "beta": False, "broken": False}
        alone = {m: _complete(url, m).json()["choices"][0]["text"] for m in ("alpha", "beta")}
        assert loads.calls == [str(files[1])]
        assert alone["alpha"] != alone["beta"]  # two models, two replies

        async def both() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                asks = [client.post(f"{url}/v1/completions", json=PROMPT | {"model": m}) for m in ["alpha", "beta"] * 3]
                return await asyncio.gather(*asks)

        for r, model in zip(asyncio.run(both()), ["alpha", "beta"] * 3, strict=True):
            assert r.status_code == 200 and r.json()["model"] == model
            assert r.json()["choices"][0]["text"] == alone[model]  # at once == alone
        assert _complete(url, "beta-q8").json()["choices"][0]["text"] == alone["beta"]  # an alias
        assert loads.calls == [str(files[1])]  # loaded once
        assert _listed(url) == {"alpha": True, "beta": True, "broken": False}
        assert sorted(_running(url)) == ["alpha", "beta"]


def test_concurrent_requests_for_an_unloaded_model_share_one_load(files):
    loads = Loads(delay_s=1.0)
    with _server(files, LoadPolicy(), loads) as url:

        async def four() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                asks = [client.post(f"{url}/v1/completions", json=PROMPT | {"model": "beta"}) for _ in range(4)]
                return await asyncio.gather(*asks)

        replies = asyncio.run(four())
        assert [r.status_code for r in replies] == [200] * 4
        assert len({r.json()["choices"][0]["text"] for r in replies}) == 1
        assert loads.calls == [str(files[1])]


def test_a_request_waits_for_a_load_only_so_long_and_the_load_goes_on(files):
    loads = Loads(delay_s=1.5)
    with _server(files, LoadPolicy(load_timeout_s=0.5), loads) as url:
        late = _complete(url, "beta")
        assert late.status_code == 503 and late.json()["error"]["code"] == "model_loading"
        assert "still loading after 0.5 s" in late.json()["error"]["message"]
        assert _wait_for(lambda: "beta" in _running(url), timeout=10)  # the load finished anyway
        assert _complete(url, "beta").status_code == 200 and loads.calls == [str(files[1])]


def test_keep_alive_unloads_an_idle_model_and_zero_unloads_it_now(files):
    loads = Loads()
    with _server(files, LoadPolicy(keep_alive_s=1.0), loads) as url:
        assert _complete(url, "beta").status_code == 200
        assert "beta" in _running(url) and loads.engines[0]() is not None
        assert _wait_for(lambda: "beta" not in _running(url), timeout=5)  # its 1 s of idleness
        # its engine (weights, KV cache) is freed once the unload that began there ends
        assert _wait_for(lambda: loads.engines[0]() is None, timeout=5)
        assert _running(url) == ["alpha"]  # --model stays (keep-alive -1)
        ollama = {"model": "beta", "prompt": "", "keep_alive": "-1"}  # ollama's load, kept
        assert httpx.post(f"{url}/api/generate", json=ollama, timeout=60).json()["done_reason"] == "load"
        time.sleep(1.5)
        assert "beta" in _running(url)
        ps = {m["name"]: m for m in httpx.get(f"{url}/api/ps").json()["models"]}
        assert ps["beta"]["expires_at"].startswith("9999") and ps["beta"]["size"] > 8 << 20
        unload = httpx.post(f"{url}/api/generate", json={"model": "beta", "prompt": "", "keep_alive": 0}).json()
        assert unload["done_reason"] == "unload" and "beta" not in _running(url)
        load = httpx.post(f"{url}/api/chat", json={"model": "beta", "keep_alive": "10s"}).json()
        assert load["done_reason"] == "load"
        expires = {m["name"]: m["expires_at"] for m in httpx.get(f"{url}/api/ps").json()["models"]}["beta"]
        assert not expires.startswith("9999")
        bad = httpx.post(f"{url}/api/generate", json={"model": "beta", "prompt": "", "keep_alive": "soon"})
        assert bad.status_code == 400 and "keep_alive" in bad.json()["error"]


def test_max_loaded_evicts_the_least_recently_used_idle_model(files):
    loads = Loads()
    with _server(files, LoadPolicy(max_loaded=1), loads) as url:
        first = _complete(url, "alpha").json()["choices"][0]["text"]
        assert _complete(url, "beta").status_code == 200
        assert _running(url) == ["beta"]  # alpha made room
        assert _complete(url, "alpha").json()["choices"][0]["text"] == first  # reloaded, same reply
        assert _running(url) == ["alpha"]
        assert loads.calls == [str(files[1]), str(files[0])]


def test_a_model_in_use_is_not_evicted_the_other_request_gets_503(files):
    with _server(files, LoadPolicy(max_loaded=1), Loads()) as url:
        stream = {"prompt": "Once upon a time", "max_tokens": 200, "stream": True, "model": "alpha", "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=stream, timeout=60) as long_one:
            lines = long_one.iter_lines()
            next(lines)  # it runs
            busy = _complete(url, "beta")
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "models_busy"
            assert "Retry-After" in busy.headers and "alpha" in busy.json()["error"]["message"]
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert _complete(url, "beta").status_code == 200  # once it ended, there is room


def test_a_model_that_fails_to_load_says_why_and_the_others_keep_serving(files):
    with _server(files, LoadPolicy(), Loads()) as url:
        failed = _complete(url, "broken")
        assert failed.status_code == 500 and failed.json()["error"]["code"] == "model_load_failed"
        assert "broken" in failed.json()["error"]["message"]
        ollama = httpx.post(f"{url}/api/generate", json={"model": "broken", "prompt": "hi", "stream": False})
        assert ollama.status_code == 500 and "loading the model 'broken' failed" in ollama.json()["error"]
        assert _complete(url, "alpha").status_code == 200 and _complete(url, "beta").status_code == 200
        missing = _complete(url, "gamma")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert "'alpha', 'beta' (also 'beta-q8'), 'broken'" in missing.json()["error"]["message"]


def test_a_model_over_the_memory_budget_is_refused(files):
    with _server(files, LoadPolicy(memory_bytes=4 << 20, kv_bound_bytes=8 << 20), Loads()) as url:
        refused = _complete(url, "beta")
        assert refused.status_code == 500 and refused.json()["error"]["code"] == "model_too_large"
        assert "--models-memory" in refused.json()["error"]["message"]
        assert _complete(url, "alpha").status_code == 200


def test_keep_alive_durations_read_as_ollama_writes_them():
    assert duration_seconds("5m") == 300 and duration_seconds("1h30m") == 5400 and duration_seconds("300ms") == 0.3
    assert duration_seconds("-1") == -1 and duration_seconds(0) == 0 and duration_seconds("90") == 90
    assert duration_seconds("-1m") == -60
    for bad in ("", "5 minutes", "m", "5x", "1h-3m"):
        with pytest.raises(ValueError, match="not a duration"):
            duration_seconds(bad)
    with pytest.raises(ValueError, match="max_loaded"):
        LoadPolicy(max_loaded=0)


@pytest.fixture
def hub(tiny_model_dir, tmp_path, monkeypatch):
    """A local Hub holding one GGUF repo, and an empty Hub cache."""
    gguf = write_gguf(tiny_model_dir("llama_gqa"), tmp_path / "tiny-Q8_0.gguf", quantize="Q8_0")
    fake = FakeHub({"tl/tiny-GGUF": Repo({gguf.name: gguf.read_bytes()})})
    with ThreadedServer(fake.app) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        yield gguf


def test_pull_streams_progress_then_the_model_serves_and_delete_removes_it(files, hub):
    from tokenloom.entrypoints.server.catalog import known_models

    a = files[0]
    app = build_app(AsyncLLMEngine(_engine(a)), "alpha", catalog=lambda: known_models(str(a)), load_engine=Loads())
    with ThreadedServer(app) as url:
        assert httpx.post(f"{url}/v1/completions", json=PROMPT | {"model": "tl/tiny-GGUF:Q8_0"}).status_code == 404
        with httpx.stream("POST", f"{url}/api/pull", json={"model": "tl/tiny-GGUF:q8_0"}, timeout=60) as r:
            lines = [json.loads(line) for line in r.iter_lines() if line]
        assert lines[0] == {"status": "pulling manifest"} and lines[-1] == {"status": "success"}
        progress = [x for x in lines if "completed" in x]
        assert progress and progress[-1]["completed"] == hub.stat().st_size
        tags = [m["name"] for m in httpx.get(f"{url}/api/tags").json()["models"]]
        assert "tl/tiny-GGUF:Q8_0" in tags
        served = _complete(url, "tl/tiny-GGUF:q8_0")  # the name as pulled (any case)
        assert served.status_code == 200
        assert served.json()["choices"][0]["text"] == _complete(url, "alpha").json()["choices"][0]["text"]
        gone = httpx.request("DELETE", f"{url}/api/delete", json={"model": "tl/tiny-GGUF:Q8_0"})
        assert gone.status_code == 200
        assert "tl/tiny-GGUF:Q8_0" not in [m["name"] for m in httpx.get(f"{url}/api/tags").json()["models"]]
        again = httpx.request("DELETE", f"{url}/api/delete", json={"model": "tl/tiny-GGUF:Q8_0"})
        assert again.status_code == 404
        own = httpx.request("DELETE", f"{url}/api/delete", json={"model": "alpha"})
        assert own.status_code == 400 and "started with" in own.json()["error"]
        unknown = httpx.post(f"{url}/api/pull", json={"model": "llama3.2", "stream": False})
        assert unknown.status_code == 400 and "Hugging Face Hub name" in unknown.json()["error"]
        failed = httpx.post(f"{url}/api/pull", json={"model": "tl/absent-GGUF:Q8_0", "stream": False}, timeout=60)
        assert failed.status_code == 502 and "tl/absent-GGUF" in failed.json()["error"]
