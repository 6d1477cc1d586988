"""LoRA adapters in the server, through the openai client: a request's `model` names the adapter
(as with vLLM), /v1/models lists each with its base, adapters load and unload at run time, and
requests for two adapters and the base at once get what each gets alone."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytest.importorskip("peft")
openai = pytest.importorskip("openai")

from tests.helpers.peft_adapters import make_peft_adapter
from tests.helpers.server_harness import ThreadedServer
from tokenloom import LLM, SamplingParams
from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.entrypoints.server import build_app

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory):
    base = tiny_model_dir("llama_gqa")
    root = tmp_path_factory.mktemp("server_adapters")
    paths = {
        n: str(make_peft_adapter(base, root / n, r=8, seed=s)) for n, s in (("sql", 21), ("poet", 22), ("late", 23))
    }
    return base, paths


def _llm(base, **options) -> LLM:
    return LLM(str(base), kv_cache_memory=16 << 20, max_model_len=256, **options)


def _expected(base, paths) -> dict[str | None, str]:
    """Each adapter's (and the base's) greedy text, from the Python API on its own."""
    llm = _llm(base, lora=paths)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return {name: llm.generate([PROMPT], params, lora=name)[0].outputs[0].text for name in [None, *paths]}


def test_adapters_by_name_listed_loaded_and_unloaded_at_run_time(setup):
    base, paths = setup
    want = _expected(base, paths)
    lora = {"sql": paths["sql"], "poet": paths["poet"]}
    engine = AsyncLLMEngine(_llm(base, lora=lora, max_loras=3, enable_lora=True).engine)
    with ThreadedServer(build_app(engine, "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
        listed = {m.id: m for m in client.models.list().data}
        assert set(listed) == {"tiny", "sql", "poet"}
        assert listed["sql"].model_extra["parent"] == "tiny" and listed["sql"].model_extra["root"] == paths["sql"]

        def complete(model: str) -> tuple[str, str]:
            r = client.completions.create(
                model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            return r.model, r.choices[0].text

        assert complete("sql") == ("sql", want["sql"])
        assert complete("tiny") == ("tiny", want[None])

        async def at_once() -> list[tuple[str, str]]:
            aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none")
            asks = [
                aclient.completions.create(
                    model=m, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
                )
                for m in ["sql", "poet", "tiny"] * 2
            ]
            return [(r.model, r.choices[0].text) for r in await asyncio.gather(*asks)]

        for model, text in asyncio.run(at_once()):
            assert text == want[None if model == "tiny" else model]
        stream = client.completions.create(
            model="poet", prompt=PROMPT, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = list(stream)
        assert {c.model for c in chunks} == {"poet"} and "".join(c.choices[0].text for c in chunks) == want["poet"]

        with pytest.raises(openai.NotFoundError):
            complete("late")
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": paths["late"]})
        assert loaded.status_code == 200, loaded.text
        assert complete("late") == ("late", want["late"])
        again = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": paths["late"]})
        assert again.status_code == 400 and "already served" in again.text
        full = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": paths["late"]})
        assert full.status_code == 400 and "all 3 slots are in use" in full.text
        bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": "/nonexistent"})
        assert bad.status_code == 400
        gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert gone.status_code == 200, gone.text
        assert "late" not in {m.id for m in client.models.list().data}
        with pytest.raises(openai.NotFoundError):
            complete("late")
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
        embed = httpx.post(f"{url}/v1/embeddings", json={"model": "sql", "input": "hi"})
        assert embed.status_code == 400 and "LoRA adapter" in embed.text


def test_run_time_loading_needs_lora_room(setup):
    base, paths = setup
    with ThreadedServer(build_app(AsyncLLMEngine(_llm(base).engine), "tiny")) as url:
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": paths["sql"]})
        assert r.status_code == 400 and "--enable-lora" in r.text


def test_malformed_adapter_requests_are_client_errors(setup):
    base, paths = setup
    with ThreadedServer(build_app(AsyncLLMEngine(_llm(base, enable_lora=True).engine), "tiny")) as url:
        bodies = [
            b"{not json",
            b"[]",
            b'{"lora_name": "x"}',
            b'{"lora_name": 5, "lora_path": "/tmp"}',
            b'{"lora_name": "", "lora_path": "/tmp"}',
            b'{"lora_name": "x", "lora_path": "/tmp", "extra": 1}',
        ]
        for route in ("load_lora_adapter", "unload_lora_adapter"):
            for body in bodies:
                r = httpx.post(f"{url}/v1/{route}", content=body, headers={"Content-Type": "application/json"})
                assert 400 <= r.status_code < 500, (route, body, r.status_code)
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": paths["sql"]})
        assert r.status_code == 400 and "already served" in r.text  # a model's own name
        ok = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": paths["sql"]})
        assert ok.status_code == 200  # the server took all of the above and still serves


def test_run_time_adapters_survive_the_model_unloading_and_updates_need_enable_lora(setup, tiny_model_dir):
    base, paths = setup
    want = _expected(base, paths)

    def load_engine(source: str):
        return _llm(source, lora={"late": paths["late"]}, enable_lora=True).engine

    engine = AsyncLLMEngine(load_engine(str(base)))
    app = build_app(engine, "tiny", catalog=list, load_engine=load_engine)
    with ThreadedServer(app) as url:
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": paths["sql"]})
        assert r.status_code == 200, r.text
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        assert (
            httpx.post(f"{url}/v1/completions", json=body | {"model": "sql"}).json()["choices"][0]["text"]
            == want["sql"]
        )
        unloaded = httpx.post(f"{url}/api/generate", json={"model": "tiny", "keep_alive": 0}, timeout=60).json()
        assert unloaded["done_reason"] == "unload"
        assert _wait_unloaded(url)
        again = httpx.post(f"{url}/v1/completions", json=body | {"model": "sql"}, timeout=60).json()
        assert again["model"] == "sql" and again["choices"][0]["text"] == want["sql"]  # loaded again, not the base
        reloaded = app.state.models.serving_of("tiny")
        assert [ref.name for ref in reloaded.engine.loras()] == ["sql"]  # the unloaded --lora one stays out
        gone = httpx.post(f"{url}/v1/completions", json=body | {"model": "late"}, timeout=60)
        assert gone.status_code == 404, gone.text
        inplace = {"lora_name": "sql", "lora_path": paths["poet"], "load_inplace": True}
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=inplace).status_code == 200
        assert (
            httpx.post(f"{url}/v1/completions", json=body | {"model": "sql"}).json()["choices"][0]["text"]
            == want["poet"]
        )
    fixed = AsyncLLMEngine(_llm(base, lora={"sql": paths["sql"]}).engine)  # --lora without --enable-lora
    with ThreadedServer(build_app(fixed, "tiny")) as url:
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": paths["poet"]})
        assert r.status_code == 400 and "--enable-lora" in r.text
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 400
    with pytest.raises(ValueError, match="is a served model's name too"):
        build_app(AsyncLLMEngine(_llm(base, lora={"tiny": paths["sql"]}).engine), "tiny")


def _wait_unloaded(url: str, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not httpx.get(f"{url}/api/ps").json()["models"]:
            return True
        time.sleep(0.1)
    return False
