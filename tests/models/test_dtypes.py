"""--dtype bfloat16 / float16 run end to end and stay close to float32."""

from __future__ import annotations

import pytest
import torch

from tokenloom import LLM, SamplingParams

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.parametrize("dtype,torch_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_reduced_precision_answers_like_float32(default_model_dir, smol_llm, dtype, torch_dtype):
    llm = LLM(str(default_model_dir), dtype=dtype, kv_cache_memory=32 << 20)
    model = llm.engine.core.runner.model
    assert model.model.embed_tokens.weight.dtype == torch_dtype
    assert llm.engine.core.runner.kv_cache.keys[0].dtype == torch_dtype
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0)
    out = llm.chat(CHAT, params)[0].outputs[0]
    ref = smol_llm.chat(CHAT, params)[0].outputs[0]
    assert out.text == ref.text == "The capital of France is Paris."
    got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
    want = [lp[t] for lp, t in zip(ref.logprobs, ref.token_ids)]
    assert got == pytest.approx(want, abs=0.25)  # measured: within 0.15 in bf16
    assert got != pytest.approx(want, abs=1e-6)  # and really computed in reduced precision


def test_unknown_dtype_is_rejected(default_model_dir):
    with pytest.raises(ValueError, match="dtype must be one of"):
        LLM(str(default_model_dir), dtype="float8")
