"""AsyncLLMEngine: concurrent streams, abort, errors, on the real model."""

from __future__ import annotations

import asyncio

import pytest

from tokenloom import SamplingParams
from tokenloom.engine.async_engine import AsyncLLMEngine

PROMPTS = ["Once upon a time, there was a little", "The three primary colors are", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def async_engine(smol_llm):
    return AsyncLLMEngine(smol_llm.engine)


async def collect(engine, prompt, params):
    deltas = [d async for d in engine.generate(prompt, params)]
    return "".join(d.text_delta for d in deltas), deltas[-1]


def test_concurrent_streams_equal_sync_results(async_engine, smol_llm):
    params = SamplingParams(temperature=0, max_tokens=16)

    async def main():
        try:
            return await asyncio.gather(*(collect(async_engine, p, params) for p in PROMPTS))
        finally:
            await async_engine.shutdown()

    results = asyncio.run(main())
    for prompt, (text, last) in zip(PROMPTS, results):
        expected = smol_llm.generate(prompt, params)[0].outputs[0]
        assert text == expected.text == last.completion.text
        assert last.finished and last.completion.token_ids == expected.token_ids
        assert last.completion.metrics.ttft > 0


def test_leaving_a_stream_aborts_and_frees_blocks(async_engine):
    bm = async_engine.engine.core.block_manager

    async def main():
        try:
            long = async_engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
            other_params = SamplingParams(temperature=0, max_tokens=30)
            other = asyncio.ensure_future(collect(async_engine, PROMPTS[1], other_params))
            seen = 0
            async for _ in long:
                seen += 1
                if seen == 3:
                    break
            await long.aclose()
            text, last = await other  # the other request is unaffected
            await asyncio.sleep(0)
            return seen, last
        finally:
            await async_engine.shutdown()

    seen, last = asyncio.run(main())
    assert seen == 3 and last.finished and last.completion.finish_reason == "length"
    assert bm.num_free_blocks == bm.num_blocks
    assert not async_engine.engine.has_unfinished_requests()


def test_bad_request_raises_without_disturbing_others(async_engine):
    async def main():
        try:
            with pytest.raises(ValueError, match="context window"):
                async for _ in async_engine.generate([5] * 9000, SamplingParams()):
                    pass
            return await collect(async_engine, PROMPTS[2], SamplingParams(temperature=0, max_tokens=5))
        finally:
            await async_engine.shutdown()

    text, last = asyncio.run(main())
    assert last.finished and len(last.completion.token_ids) == 5


def test_one_thread_builds_the_engine_and_runs_every_step(default_model_dir):
    """Every step runs on the thread that built the engine, never on the event loop's thread
    (one OpenMP pool per process: see async_engine's module doc), and close() ends it."""
    import threading

    from tokenloom.config import CacheConfig, EngineConfig

    built_on, stepped_on = [], set()

    def make():
        from tokenloom.engine import LLMEngine

        built_on.append(threading.get_ident())
        engine = LLMEngine(EngineConfig(str(default_model_dir), cache=CacheConfig(kv_cache_memory=64 << 20)))
        step = engine.step
        engine.step = lambda: (stepped_on.add(threading.get_ident()), step())[1]
        return engine

    engine = AsyncLLMEngine.build(make)

    async def main():
        try:
            return await asyncio.gather(
                *(collect(engine, p, SamplingParams(temperature=0, max_tokens=4)) for p in PROMPTS[:2])
            )
        finally:
            await engine.shutdown()

    results = asyncio.run(main())
    assert all(last.finished for _, last in results)
    assert stepped_on == set(built_on) and built_on[0] != threading.get_ident()
    assert engine.run_on_engine_thread(threading.get_ident) == built_on[0]
    engine.close()
    with pytest.raises(RuntimeError):  # the thread is gone
        engine.run_on_engine_thread(threading.get_ident)


def test_a_request_submitted_on_finishing_joins_the_next_step(async_engine):
    """A client that submits its next request when the previous one finishes (a closed loop)
    is in the very next step: with one long request beside it, every step has two requests."""
    engine = async_engine.engine
    known_per_step = []
    real_step = engine.step

    def counting_step():
        known_per_step.append(len(engine.requests))
        return real_step()

    async def closed_loop_client():
        for prompt in PROMPTS:
            await collect(async_engine, prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))

    async def main():
        try:
            long = asyncio.ensure_future(
                collect(async_engine, PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
            )
            await asyncio.sleep(0)
            await closed_loop_client()
            known_per_step.append(None)  # the client's last request is done
            await long
        finally:
            await async_engine.shutdown()

    engine.step = counting_step
    try:
        asyncio.run(main())
    finally:
        del engine.step
    while_client_ran = known_per_step[: known_per_step.index(None)]
    assert len(while_client_ran) >= 9 and set(while_client_ran) == {2}, while_client_ran


def test_prepare_for_serving_builds_the_grammar_tokenizer_and_freezes_the_heap(smol_llm):
    """Before a server's first request: the grammar tokenizer exists (its ~0.5 s build would hold
    the GIL inside the first constrained request) and the objects alive now are out of the garbage
    collector's walks (gc.freeze: a full collection walked ~220k of them for ~0.1 s)."""
    import gc

    engine = AsyncLLMEngine(smol_llm.engine)
    grammars = smol_llm.engine.core.grammars
    grammars._tokenizer = None  # as a fresh engine has it
    try:
        engine.prepare_for_serving()
        assert grammars._tokenizer is not None
        assert gc.get_freeze_count() > 100_000
    finally:
        gc.unfreeze()
