"""The allocator setting: large freed tensors are reused without new page faults."""

import resource
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")

# A decoder layer's pattern of activations (6k rows of SmolLM2 widths: 14-74 MB each, above
# glibc's default mmap threshold) over two warm-up steps, then the minor page faults of four
# more steps of other sizes. A fresh process: the setting is process-wide.
_PROBE = textwrap.dedent("""
    import resource, sys, threading, torch
    from tokenloom.memory.allocator import keep_freed_memory
    if sys.argv[1] == "on":
        assert keep_freed_memory()
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    def step(rows):
        x = torch.ones(rows, 576)
        for _ in range(4):
            qkv = torch.ones(rows, 960); o = torch.ones(rows, 576); del qkv
            gate_up = torch.ones(rows, 3072); act = torch.ones(rows, 1536); del gate_up
            x = torch.ones(rows, 576) + o; del act, o
    def run():
        for rows in (6000, 4000):
            step(rows)
        before = faults()
        for rows in (5000, 6000, 3000, 6000):
            step(rows)
        print(faults() - before)
    if sys.argv[2] == "thread":            # the async engine steps on its own thread
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    else:
        run()
""")


def _faults(mode: str, where: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode, where], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.parametrize("where", ["main", "thread"])
def test_freed_large_tensors_are_reused_without_page_faults(where):
    # ~ pages the four steps write (4 layers of ~20k floats per row)
    touched = 4 * 20 * 6000 * 4 // resource.getpagesize()
    off, on = _faults("off", where), _faults("on", where)
    assert off > touched // 4, f"default glibc should fault fresh pages in ({off} faults, ~{touched} pages written)"
    # heap fragmentation costs the odd fresh block (measured 2-17k faults main, 0-72k thread, against
    # ~300k without: the bound is a third, not a fifth, since one CI run saw 72k on the thread)
    assert on < off // 3, f"kept memory should be reused without faults ({on} faults vs {off} without)"


# The first step of a new size: page faults of one layer-shaped step in a fresh process, with
# or without the heap reserved for it first.
_FIRST_STEP = textwrap.dedent("""
    import resource, sys, torch
    from tokenloom.memory.allocator import keep_freed_memory, reserve_heap
    assert keep_freed_memory()
    if sys.argv[1] == "reserve":
        assert reserve_heap(160 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(6000, 576)
    for _ in range(2):
        qkv = torch.ones(6000, 960); o = torch.ones(6000, 576); del qkv
        act = torch.ones(6000, 1536); x = torch.ones(6000, 576) + o; del act, o
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def test_reserved_heap_serves_the_first_large_step_without_page_faults():
    def faults(mode):
        out = subprocess.run([sys.executable, "-c", _FIRST_STEP, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])

    written = 6000 * (576 * 3 + 960 + 1536) * 4 // resource.getpagesize()  # pages of the first layer alone
    plain, reserved = faults("plain"), faults("reserve")
    assert plain > written // 2, f"a fresh heap should fault the step's pages in ({plain} faults, ~{written} pages)"
    assert reserved < plain // 10, f"the reserved heap should serve the step ({reserved} faults vs {plain})"


def test_reserve_refuses_blocks_it_could_not_keep(monkeypatch):
    from tokenloom.memory import allocator

    assert allocator.reserve_heap(0) is False
    assert allocator.reserve_heap(allocator.KEEP_BELOW) is False  # would be mmapped, then unmapped on free
    monkeypatch.setattr(allocator, "_done", False)  # settings not in force (opted out)
    assert allocator.reserve_heap(1 << 20) is False


def test_applied_once_per_process(monkeypatch):
    from tokenloom.memory import allocator

    calls = []
    monkeypatch.setattr(allocator, "_done", None)
    monkeypatch.setattr(allocator, "_apply", lambda: calls.append(1) or True)
    assert allocator.keep_freed_memory() and allocator.keep_freed_memory()
    assert calls == [1], "applied once per process"


def test_opt_out(monkeypatch):
    from tokenloom.memory import allocator

    monkeypatch.setenv("TOKENLOOM_KEEP_FREED_MEMORY", "0")
    assert allocator._apply() is False


def test_runner_reserves_for_its_token_budget(monkeypatch):
    import types

    import torch

    from tokenloom.worker import model_runner as runner

    asked = []
    monkeypatch.setattr(runner, "reserve_heap", lambda n: asked.append(n) or True)
    config = types.SimpleNamespace(hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64)
    cpu = types.SimpleNamespace(device=torch.device("cpu"), model=types.SimpleNamespace(config=config))
    assert runner.ModelRunner.reserve_activation_memory(cpu, 1000, torch.float32)
    assert asked == [4 * (576 + 1536 + 15 * 64) * 4 * 1000]  # 4 x (hidden + intermediate + q + 2 kv) floats a token
    runner.ModelRunner.reserve_activation_memory(cpu, 10**9, torch.float32)
    assert asked[-1] == min(runner.KEEP_BELOW // 2, runner.RESERVE_AT_MOST)  # capped: kept resident
    gpu = types.SimpleNamespace(device=torch.device("cuda"), model=cpu.model)
    assert not runner.ModelRunner.reserve_activation_memory(gpu, 1000, torch.float32)
    assert len(asked) == 2


def test_engine_reserves_no_more_step_tokens_than_its_kv_cache_holds(tiny_model_dir, monkeypatch):
    """A step computes at most what the KV cache holds (each token it computes is written there):
    a one-context cache of 64 tokens reserves for 64, not the 8,192-token step budget."""
    from tokenloom.entrypoints.llm import LLM
    from tokenloom.worker import model_runner as runner

    asked = []
    monkeypatch.setattr(
        runner.ModelRunner, "reserve_activation_memory", lambda self, tokens, dtype: asked.append(tokens) or True
    )
    llm = LLM(str(tiny_model_dir("llama_gqa")), max_model_len=64, kv_cache_contexts=1, max_num_batched_tokens=8192)
    assert llm.engine.reserve_activation_memory()
    kv_tokens = llm.engine.core.runner.kv_cache.num_tokens
    assert kv_tokens < 8192 and asked == [kv_tokens]
    big = LLM(str(tiny_model_dir("llama_gqa")), max_num_batched_tokens=512)  # a 1 GiB cache: the budget binds
    assert big.engine.reserve_activation_memory()
    assert asked[-1] == 512 and big.engine.core.runner.kv_cache.num_tokens > 512


def test_the_heap_is_reserved_before_the_first_large_step_only(tiny_model_dir, monkeypatch):
    """A run of short prompts never pays the reserve (a CLI's one-off generate); the first step
    of RESERVE_FROM_TOKENS or more reserves before it runs, once."""
    from tokenloom import SamplingParams
    from tokenloom.engine import core
    from tokenloom.entrypoints.llm import LLM
    from tokenloom.worker import model_runner as runner

    asked = []
    monkeypatch.setattr(
        runner.ModelRunner, "reserve_activation_memory", lambda self, tokens, dtype: asked.append(tokens) or True
    )
    llm = LLM(str(tiny_model_dir("llama_gqa")), max_num_batched_tokens=512, max_model_len=128)
    params = SamplingParams(max_tokens=2, temperature=0)
    llm.generate([[5] * 40], params)
    assert asked == []  # a 40-token prefill
    prompts = [[t] * 100 for t in range(7, 7 + core.RESERVE_FROM_TOKENS // 100 + 1)]  # no shared prefix
    llm.generate(prompts, params)  # one step of 300 tokens
    llm.generate([[t + 10] * 100 for t in range(4)], params)
    assert asked == [512]
