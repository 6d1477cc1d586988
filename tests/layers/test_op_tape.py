"""Decode steps replayed from op tapes (tokenloom/layers/op_tape.py): the same bits as the eager
forward, on HF folders and on GGUF blocks; tapes refused wherever a step could differ."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.gguf_writer import write_gguf
from tokenloom import LLM, SamplingParams
from tokenloom.layers import op_tape
from tokenloom.layers.op_tape import NotReplayable, record

pytestmark = pytest.mark.skipif(op_tape.tape_module() is None, reason="the replayer does not build here")

# a prompt past one block, one shorter, one that grows from 2 to 5 blocks (its padded block
# table widens from 2 to 4 to 8: three shapes, three tapes)
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 64, 12, 77, 31, 9, 4, 6, 8, 10, 11], [200, 1, 2, 3], [8] * 20]


def _generate(model: str, monkeypatch, tapes: bool, **kwargs):
    if not tapes:
        monkeypatch.setenv("TOKENLOOM_NO_TAPES", "1")
    llm = LLM(model, kv_cache_memory=16 << 20, **kwargs)
    monkeypatch.delenv("TOKENLOOM_NO_TAPES", raising=False)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS, params) + llm.generate(PROMPTS[:1], params)  # batch 3, then batch 1
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm.engine.core.runner.tapes


@pytest.mark.parametrize(
    "arch", ["llama_gqa", "qwen2", "qwen3", "phi3_partial_rotary", "olmo2", "stablelm", "gemma2", "gemma3"]
)
def test_taped_decode_is_bit_identical_to_eager(arch, tiny_model_dir, monkeypatch):
    folder = str(tiny_model_dir(arch))
    taped, tapes = _generate(folder, monkeypatch, tapes=True)
    eager, none = _generate(folder, monkeypatch, tapes=False)
    assert none is None and tapes is not None
    # batch 3 and batch 1 at each block-table width they reached: at least 2 shapes each
    assert len(tapes.tapes) >= 4 and not tapes.refused
    assert taped == eager  # tokens and every logprob, exactly


def test_taped_decode_over_onednn_packed_weights(tiny_model_dir, monkeypatch):
    """CPUs without AVX-512 prepack float32 weights with oneDNN (PackedLinear), whose blocked tensors
    have no storage: a tape holds them as constants all the same (it failed on the third step)."""
    from tokenloom.layers import prepacked

    if not prepacked.PackedLinear.supports(torch.nn.Linear(2, 2)):
        pytest.skip("torch has no oneDNN linear here")
    monkeypatch.setattr(prepacked.PanelLinear, "supports", staticmethod(lambda linear: False))
    folder = str(tiny_model_dir("llama_gqa"))
    taped, tapes = _generate(folder, monkeypatch, tapes=True)
    eager, _ = _generate(folder, monkeypatch, tapes=False)
    packed = [m for m in tapes.model.modules() if isinstance(m, prepacked.PackedLinear)]
    assert packed and packed[0].packed_weight.is_mkldnn
    assert tapes.tapes and not tapes.refused and taped == eager


@pytest.mark.parametrize("quantize", ["Q8_0", "Q4_0"])
def test_taped_decode_on_gguf_blocks(quantize, tiny_model_dir, tmp_path, monkeypatch):
    path = str(write_gguf(tiny_model_dir("llama_gqa"), tmp_path / f"m-{quantize}.gguf", quantize=quantize))
    taped, tapes = _generate(path, monkeypatch, tapes=True)
    eager, _ = _generate(path, monkeypatch, tapes=False)
    assert tapes.tapes and not tapes.refused
    assert taped == eager


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16", "int8", "int4"])
def test_taped_decode_over_a_stored_format_cache(kv_cache_dtype, tiny_model_dir, monkeypatch):
    """A 16-bit, int8 or int4 KV cache's layers are HalfCache/Int8Cache/Int4Cache objects, not
    tensors: their codes and scales are the KV cache's all the same, so the fused decode steps over
    them are taped (every one was refused)."""
    arch = "llama3_rope_scaling" if kv_cache_dtype == "int4" else "llama_gqa"  # int4 needs heads of 32
    folder = str(tiny_model_dir(arch))
    taped, tapes = _generate(folder, monkeypatch, tapes=True, kv_cache_dtype=kv_cache_dtype)
    eager, _ = _generate(folder, monkeypatch, tapes=False, kv_cache_dtype=kv_cache_dtype)
    assert len(tapes.tapes) >= 4 and not tapes.refused
    assert taped == eager


def test_models_with_python_decisions_in_their_layers_are_not_taped(tiny_model_dir):
    for arch, taped in [
        ("llama_gqa", True),
        ("gemma2", True),
        ("mixtral", False),
        ("qwen2_moe", False),
        ("gpt2", False),
    ]:
        llm = LLM(str(tiny_model_dir(arch)), kv_cache_memory=16 << 20)
        assert (llm.engine.core.runner.tapes is not None) is taped, arch


def test_a_recording_is_replayed_on_new_inputs():
    weight = torch.randn(8, 8)
    body = lambda x: torch.relu(x @ weight).view(2, 8) * 2  # noqa: E731
    x = torch.randn(2, 8)
    out, tape = record(body, [x], owned={weight.untyped_storage().data_ptr()})
    assert torch.equal(out, body(x))
    fresh = torch.randn(2, 8)
    assert torch.equal(tape.run([fresh]), body(fresh)) and not torch.equal(body(fresh), out)


def test_a_tensor_from_outside_the_model_refuses_the_tape():
    outside = torch.randn(4)
    with pytest.raises(NotReplayable, match="neither an input") as refused:
        record(lambda x: x + outside, [torch.randn(4)], owned=set())
    assert refused.value.output is not None  # the eager run's output still stands


def test_a_value_read_by_python_refuses_the_tape():
    def body(x):
        return x * 2 if (x.sum() > 0).item() else x * 3  # the branch would be baked in

    with pytest.raises(NotReplayable, match="returns"):
        record(body, [torch.ones(3)], owned=set())


def test_recording_does_not_import_dynamo():
    """TorchDispatchMode wraps __torch_dispatch__ in a dynamo guard unless told not to, importing
    torch._dynamo (~1 s) inside the first decode step."""
    import subprocess
    import sys

    code = (
        "import sys, torch\nfrom tokenloom.layers.op_tape import record\n"
        "w = torch.ones(3)\nrecord(lambda x: x * w, [torch.ones(3)], {w.untyped_storage().data_ptr()})\n"
        "print('torch._dynamo' in sys.modules)"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )
