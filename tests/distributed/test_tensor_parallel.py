"""Tensor parallelism over torch.distributed (gloo): a model split over 2 ranks gives the tokens
of one process, through the batched engine, the server and torchrun's rendezvous between two
network namespaces; each rank holds about half the weights; a dead rank is an error, not a hang."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.distributed.pipeline import PipelineStage
from tokenloom.distributed.shard import TensorParallelError, TensorShard
from tokenloom.loader.load import load_checkpoint

PROMPTS = ["The quick brown fox", "Once upon a time there was", "lazy dog", "a cat"]
GREEDY = SamplingParams(temperature=0, max_tokens=10, logprobs=1, ignore_eos=True)


def _tokens_and_logprobs(outputs) -> tuple[list[list[int]], list[list[float]]]:
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[lp[t] for lp, t in zip(o.outputs[0].logprobs, ts)] for o, ts in zip(outputs, tokens)]
    return tokens, logprobs


def _assert_same(one, two) -> None:
    (t1, l1), (t2, l2) = _tokens_and_logprobs(one), _tokens_and_logprobs(two)
    assert t1 == t2
    for a, b in zip(l1, l2):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


def _parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


# Tensor parallelism cuts inside each layer: every kind of layer. A pipeline cuts between layers:
# a dense model, tied embeddings (the first and last stage each hold them), experts beside dense.
SPLITS = [("tensor_parallel_size", n) for n in ("llama_gqa", "llama_mqa_tied", "qwen2", "smollm3", "mixtral")]
SPLITS += [("tensor_parallel_size", n) for n in ("qwen2_moe", "qwen3_moe")]
SPLITS += [("pipeline_parallel_size", n) for n in ("llama_gqa", "qwen2", "qwen3_moe")]


@pytest.mark.parametrize(("split", "name"), SPLITS)
def test_two_ranks_give_one_process_tokens_and_logprobs(tiny_model_dir, name, split):
    """GQA split (2 of 4 KV heads each), MQA (the one KV head replicated), q/k/v bias and tied
    embeddings (Qwen2), a layer without rope (SmolLM3), experts (Mixtral), a shared expert
    (Qwen2-MoE), a dense layer beside a sparse one (Qwen3-MoE); or the layers as two pipeline
    stages. Four prompts batched, with chunked prefill (the pipeline's micro-batches: two groups
    of sequences)."""
    folder = str(tiny_model_dir(name))
    one = LLM(folder, kv_cache_memory=8 << 20, max_num_batched_tokens=16)
    expected = one.generate(PROMPTS, GREEDY)
    two = LLM(folder, kv_cache_memory=8 << 20, max_num_batched_tokens=16, **{split: 2})
    try:
        _assert_same(expected, two.generate(PROMPTS, GREEDY))
        ours, whole = two.engine.core.runner.model, one.engine.core.runner.model
        if split == "tensor_parallel_size":
            assert _parameters(ours) <= 0.56 * _parameters(whole)  # norms and routers replicated: a little over half
        else:
            half = len(whole.model.layers) // 2  # rank 0: the first half of the layers only
            assert _parameters(ours.model.layers) == _parameters(whole.model.layers[:half])
            assert two.engine.core.runner.kv_cache.keys[half].numel() == 0  # and their KV only
    finally:
        two.engine.ranks.stop()


@pytest.mark.parametrize("split", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_a_rank_that_dies_is_an_error_naming_it(tiny_model_dir, split):
    two = LLM(str(tiny_model_dir("llama_gqa")), kv_cache_memory=8 << 20, **{split: 2})
    try:
        assert two.generate(["hello"], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids
        worker = two.engine.ranks.processes[0]
        worker.kill()
        worker.join(5)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="rank of the split model .* stopped answering"):
            two.generate(["hello there"], SamplingParams(temperature=0, max_tokens=3))
        assert time.monotonic() - start < 30
    finally:
        two.engine.ranks.stop()


def test_the_plan_refuses_what_does_not_split(tiny_model_dir):
    from tokenloom.models.registry import model_class

    config = load_checkpoint(tiny_model_dir("llama_gqa")).config
    with pytest.raises(TensorParallelError, match="must divide num_attention_heads 4"):
        TensorShard(0, 3).check(config, model_class(config))
    gemma = load_checkpoint(tiny_model_dir("gemma3")).config
    with pytest.raises(TensorParallelError, match="not Gemma3ForCausalLM: its layers .* no split"):
        TensorShard(0, 2).check(gemma, model_class(gemma))
    olmo3 = load_checkpoint(tiny_model_dir("olmo3")).config
    with pytest.raises(TensorParallelError, match="pipeline parallelism .* not Olmo3ForCausalLM: .*one process"):
        PipelineStage(0, 2, olmo3.num_layers).check(olmo3, model_class(olmo3))
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(str(tiny_model_dir("llama_gqa")), tensor_parallel_size=0)
    with pytest.raises(TensorParallelError, match="exceeds the model's 2 layers"):
        LLM(str(tiny_model_dir("llama_gqa")), pipeline_parallel_size=3)


def test_each_rank_cuts_its_share_of_each_tensor(tiny_model_dir):
    config = load_checkpoint(tiny_model_dir("llama_mqa_tied")).config  # 4 heads, 1 KV head, 320 tokens
    config.vocab_size = 321  # a vocabulary that does not split
    w = torch.arange(321 * 4, dtype=torch.float32).reshape(321, 4)
    first, second = TensorShard(0, 2), TensorShard(1, 2)
    assert torch.equal(first.narrow("model.embed_tokens.weight", w, config), w[:161])
    tail = second.narrow("lm_head.weight", w, config)
    assert tail.shape == (161, 4) and torch.equal(tail[:160], w[161:]) and not tail[160].any()  # padded
    k = torch.randn(config.head_dim, 64)  # the only KV head
    assert torch.equal(second.narrow("model.layers.0.self_attn.k_proj.weight", k, config), k)  # replicated
    o = torch.randn(64, 64)
    assert torch.equal(second.narrow("model.layers.1.self_attn.o_proj.weight", o, config), o[:, 32:])
    bias = torch.randn(64)
    assert torch.equal(first.narrow("model.layers.1.mlp.down_proj.bias", bias, config), bias)
    assert not second.narrow("model.layers.1.mlp.down_proj.bias", bias, config).any()  # added once
    norm = torch.randn(64)
    assert second.narrow("model.layers.0.input_layernorm.weight", norm, config) is norm


def _netns_available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = subprocess.run(["ip", "netns", "add", "tokenloom-probe"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "tokenloom-probe"], capture_output=True)
    return probe.returncode == 0


class TwoHosts:
    """Two network namespaces joined by a veth pair, 10.77.0.1 and 10.77.0.2 (loopback-only
    addresses), made and removed by the test; where they cannot be (not root), both "hosts" are
    this machine's loopback."""

    def __init__(self) -> None:
        self.netns = _netns_available()
        self.names = (f"tl-a-{os.getpid()}", f"tl-b-{os.getpid()}")
        self.addresses = ("10.77.0.1", "10.77.0.2") if self.netns else ("127.0.0.1", "127.0.0.1")

    def __enter__(self) -> TwoHosts:
        if self.netns:
            a, b = self.names
            commands = [
                ["netns", "add", a],
                ["netns", "add", b],
                ["link", "add", "veth-tl-a", "type", "veth", "peer", "name", "veth-tl-b"],
                ["link", "set", "veth-tl-a", "netns", a],
                ["link", "set", "veth-tl-b", "netns", b],
            ]
            for ns, dev, ip in ((a, "veth-tl-a", self.addresses[0]), (b, "veth-tl-b", self.addresses[1])):
                commands += [
                    ["-n", ns, "addr", "add", f"{ip}/24", "dev", dev],
                    ["-n", ns, "link", "set", dev, "up"],
                    ["-n", ns, "link", "set", "lo", "up"],
                ]
            for command in commands:
                subprocess.run(["ip", *command], check=True, capture_output=True)
        return self

    def run(self, host: int, argv: list[str], env: dict) -> subprocess.Popen:
        prefix = ["ip", "netns", "exec", self.names[host]] if self.netns else []
        if self.netns:
            env = env | {"GLOO_SOCKET_IFNAME": f"veth-tl-{'ab'[host]}"}
        return subprocess.Popen(prefix + argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def __exit__(self, *exc) -> None:
        if self.netns:
            for ns in self.names:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)


RANK0 = """
import json, sys
from tokenloom import LLM, SamplingParams
llm = LLM(sys.argv[1], kv_cache_memory=8 << 20, tensor_parallel_size=2)
out = llm.generate(["The quick brown fox", "a cat"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
print(json.dumps([o.outputs[0].token_ids for o in out]))
"""


def test_torchrun_rendezvous_between_two_hosts(tiny_model_dir, tmp_path):
    """Rank 0 as a Python program on one host, rank 1 as `tokenloom generate -tp 2` on the other,
    joined by torchrun's variables (MASTER_ADDR: rank 0's host): rank 0's tokens are one process's."""
    import json

    folder = str(tiny_model_dir("qwen2"))
    expected = [
        o.outputs[0].token_ids
        for o in LLM(folder, kv_cache_memory=8 << 20).generate(
            ["The quick brown fox", "a cat"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )
    ]
    script = tmp_path / "rank0.py"
    script.write_text(RANK0)
    tokenloom = [sys.executable, "-m", "tokenloom"]
    with TwoHosts() as hosts:
        base = os.environ | {
            "MASTER_ADDR": hosts.addresses[0],
            "MASTER_PORT": "29517",
            "WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
        }
        rank0 = hosts.run(0, [sys.executable, str(script), folder], base | {"RANK": "0"})
        rank1 = hosts.run(
            1,
            [*tokenloom, "generate", "-m", folder, "-tp", "2", "--threads", "1", "-n", "4", "x"],
            base | {"RANK": "1"},
        )
        out0, err0 = rank0.communicate(timeout=240)
        _, err1 = rank1.communicate(timeout=60)
    assert rank0.returncode == 0, err0[-2000:]
    assert rank1.returncode == 0, err1[-2000:]
    assert json.loads(out0.strip().splitlines()[-1]) == expected


RANK1_LEAVES = """
import sys
import torch.distributed as dist
from tokenloom.distributed.worker import worker_main
from tokenloom.engine.args import EngineArgs
worker_main(1, 2, "env://", EngineArgs(sys.argv[1], tensor_parallel_size=2).create_engine_config(), 1)
print("still in the group" if dist.is_initialized() else "left the group")
"""


def test_a_joined_rank_leaves_its_group_when_rank_0_says_stop(tiny_model_dir, tmp_path, monkeypatch):
    """A rank that leaves its gloo group to the interpreter's exit can abort there ("terminate called
    without an active exception", seen in CI): the worker leaves it itself once rank 0 says stop."""
    from tokenloom.distributed.group import free_port

    folder = str(tiny_model_dir("qwen2"))
    script = tmp_path / "rank1.py"
    script.write_text(RANK1_LEAVES)
    variables = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    rank1 = subprocess.Popen(
        [sys.executable, str(script), folder],
        env=os.environ | variables | {"RANK": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for name, value in (variables | {"RANK": "0"}).items():
        monkeypatch.setenv(name, value)
    two = LLM(folder, kv_cache_memory=8 << 20, tensor_parallel_size=2)
    try:
        assert two.generate(["a cat"], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids
    finally:
        two.engine.ranks.stop()
    out, err = rank1.communicate(timeout=60)
    assert rank1.returncode == 0, err[-2000:]
    assert out.strip().splitlines()[-1] == "left the group"


def _spawned_children(pid: int) -> list[int]:
    """The multiprocessing-spawned children of `pid` (its tensor-parallel ranks)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            children += [int(c) for c in f.read().split()]
    spawned = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"tokenloom.distributed.rank_main" in f.read():
                spawned.append(child)
    return spawned


def test_a_script_without_a_main_guard_gives_one_process_tokens(tiny_model_dir, tmp_path):
    """Ranks are fresh interpreters running tokenloom's entry point: a script that builds the LLM at
    module level (no `if __name__ == "__main__":`) is not imported again by them."""
    folder = str(tiny_model_dir("llama_gqa"))
    script = tmp_path / "plain.py"
    script.write_text(
        "from tokenloom import LLM, SamplingParams\n"
        f"llm = LLM({folder!r}, kv_cache_memory=8 << 20, tensor_parallel_size=2)\n"
        "params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)\n"
        "print(llm.generate(['The quick brown fox'], params)[0].outputs[0].token_ids)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    one = LLM(folder, kv_cache_memory=8 << 20).generate(
        ["The quick brown fox"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    )
    assert done.stdout.strip().splitlines()[-1] == str(one[0].outputs[0].token_ids)


@pytest.mark.parametrize("stage", ["start", "load", "cache", "forward3", "stall-start"])
def test_a_rank_lost_at_any_stage_is_an_error_within_seconds(tiny_model_dir, monkeypatch, stage):
    """Rank 1 killed before joining, while loading, at the KV cache's set-up, mid-generation (its
    third forward), or hung before joining: an error naming the rank (and its last words) in under
    10 s, never a wait."""
    import re

    monkeypatch.setenv("TOKENLOOM_TEST_RANK_FAULT", f"1:{stage}")
    if stage.startswith("stall"):
        monkeypatch.setenv("TOKENLOOM_RANK_START_TIMEOUT", "8")
    start = time.time()
    llm = None
    try:
        with pytest.raises(RuntimeError, match="rank 1") as raised:
            llm = LLM(str(tiny_model_dir("llama_gqa")), kv_cache_memory=8 << 20, tensor_parallel_size=2)
            llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        noticed, message = time.time(), str(raised.value)
        if stage.startswith("stall"):  # from rank 0's start: the 8 s limit
            assert "did not finish joined within 8 s" in message and noticed - start < 8 + 10
        else:  # from the kill, which the rank stamps in its last words
            assert "killed by signal 9" in message and f"killed at {stage}" in message
            killed = float(re.search(r"killed at \S+ \(TOKENLOOM_TEST_RANK_FAULT\) at ([\d.]+)", message).group(1))
            assert noticed - killed < 10
    finally:
        if llm is not None:
            llm.engine.ranks.stop()


@pytest.mark.parametrize("flag", ["-tp", "-pp"])
def test_the_server_splits_the_model_and_ends_when_a_rank_dies(tiny_model_dir, flag):
    """`tokenloom serve -tp 2` (and -pp 2) answers with one process's tokens and logprobs; when its
    rank 1 is killed, the next request fails and the server exits, saying why."""
    import signal

    import httpx

    from tests.helpers.server_harness import ServeProcess

    folder = tiny_model_dir("qwen2")
    one = LLM(str(folder), kv_cache_memory=8 << 20)
    expected = one.generate(["The quick brown fox"], GREEDY)[0].outputs[0]
    body = {
        "model": "smol",
        "prompt": "The quick brown fox",
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": True,
    }
    with ServeProcess(folder, flag, "2") as served:
        answer = httpx.post(f"{served.base}/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert answer["text"] == expected.text
        got = answer["logprobs"]["token_logprobs"]
        want = [lp[t] for lp, t in zip(expected.logprobs, expected.token_ids)]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
        (rank1,) = _spawned_children(served.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        failed = httpx.post(f"{served.base}/v1/completions", json=body, timeout=60)
        assert failed.status_code >= 500
        assert served.proc.wait(timeout=60) is not None
        log = served.output()
    assert "rank of the split model (tensor or pipeline parallel) stopped answering" in log


def test_pipeline_stages_and_micro_batches_cover_everything_once():
    from tokenloom.distributed.pipeline import PipelineStage, micro_batches
    from tokenloom.worker.batch import SeqChunk

    stages = [PipelineStage(r, 3, 8).layers for r in range(3)]
    assert stages == [range(3), range(3, 6), range(6, 8)]  # the first stages take the extra layer
    assert PipelineStage(1, 2, 30).owns("model.layers.15.mlp.down_proj.weight")
    assert not PipelineStage(1, 2, 30).owns("model.layers.14.mlp.down_proj.weight")
    assert not PipelineStage(1, 2, 30).owns("lm_head.weight") and PipelineStage(0, 2, 30).owns("model.norm.weight")
    chunks = [SeqChunk([1] * n, 0, []) for n in (5, 1, 1, 1, 6, 2)]
    groups = micro_batches(chunks, 2)
    assert [c for g in groups for c in g] == chunks and len(groups) == 2
    assert [sum(len(c.token_ids) for c in g) for g in groups] == [8, 8]
    assert micro_batches(chunks[:1], 2) == [chunks[:1]]  # one sequence: one micro-batch


@pytest.mark.parametrize("name", ["qwen2", "mixtral"])
def test_gguf_blocks_are_split_as_stored(tiny_model_dir, tmp_path, name):
    """A Q8_0 GGUF file under tensor parallelism keeps its blocks (rows cut anywhere, o_proj and
    down_proj's input columns at block boundaries) and gives one process's tokens."""
    from tests.helpers.gguf_writer import write_gguf
    from tokenloom.quant import QuantizedLinear
    from tokenloom.quant.gguf.modules import GGMLLinear

    path = write_gguf(tiny_model_dir(name), tmp_path / f"{name}.gguf", quantize="Q8_0")
    expected = LLM(str(path), kv_cache_memory=8 << 20).generate(PROMPTS, GREEDY)
    two = LLM(str(path), kv_cache_memory=8 << 20, tensor_parallel_size=2)
    try:
        _assert_same(expected, two.generate(PROMPTS, GREEDY))
        o_proj = two.engine.core.runner.model.model.layers[0].self_attn.o_proj.module
        assert isinstance(o_proj, (GGMLLinear, QuantizedLinear)) and o_proj.in_features == 32  # half of 64, blocks
    finally:
        two.engine.ranks.stop()


def test_gguf_blocks_that_a_split_would_cut_are_an_error_naming_the_tensor():
    from tokenloom.models.config import ModelConfig
    from tokenloom.quant.gguf.tensor import GGMLTensor

    config = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 64,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "max_position_embeddings": 64,
        }
    )
    q8 = GGMLTensor(8, torch.zeros(64, 2 * 34, dtype=torch.uint8), 64)  # Q8_0: 32 values in 34 bytes
    assert TensorShard(1, 2).narrow("model.layers.0.self_attn.o_proj.weight", q8, config).in_features == 32
    with pytest.raises(TensorParallelError, match="o_proj.weight.*block boundaries.*--dtype float32"):
        TensorShard(1, 4).narrow("model.layers.0.self_attn.o_proj.weight", q8, config)


@pytest.mark.serial  # a liveness interval timed in seconds: the machine to itself under pytest -n
def test_shared_memory_all_reduce_sums_bit_for_bit_and_notices_a_dead_peer(tmp_path):
    """Two ranks (threads here, processes in the engine) on one file: each gets the same sum, in
    rank order, for tensors of several shapes and dtypes in a row (the two buffers alternate);
    a rank whose peer is gone is told so within the liveness interval, not the step timeout."""
    import threading

    from tokenloom.distributed.errors import ParallelRankError
    from tokenloom.distributed.shm import SharedMemoryAllReduce

    path = SharedMemoryAllReduce.create(2)
    g = torch.Generator().manual_seed(0)
    shapes = (((1, 64), torch.float32), ((7, 896), torch.float32), ((3, 5), torch.bfloat16), ((1, 64), torch.float32))
    inputs = [[torch.randn(shape, generator=g).to(dtype) for shape, dtype in shapes] for _ in range(2)]
    outputs: list[list[torch.Tensor]] = [[], []]

    def rank(r: int) -> None:
        shm = SharedMemoryAllReduce(path, r, 2, timeout_s=30)
        outputs[r] = [shm.all_reduce(x.clone()) for x in inputs[r]]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for a, b, x0, x1 in zip(outputs[0], outputs[1], inputs[0], inputs[1]):
        assert torch.equal(a, b) and torch.equal(a, x0 + x1)
    lonely = SharedMemoryAllReduce(path, 0, 2, timeout_s=30, peers_alive=lambda: False)
    lonely.seq = 100  # past anything the peer wrote
    start = time.monotonic()
    with pytest.raises(ParallelRankError, match="its process ended"):
        lonely.all_reduce(torch.ones(4))
    assert time.monotonic() - start < 5
    lonely.remove()
