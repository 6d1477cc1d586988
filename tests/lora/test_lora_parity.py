"""LoRA adapters against transformers + peft on the same random weights, in float32: greedy tokens
identical and logprobs within 1e-4, alone and mixed in one batch with other adapters and the base."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from tests.helpers.hf_reference import hf_greedy, load_hf_reference
from tests.helpers.peft_adapters import load_peft_reference, make_peft_adapter
from tokenloom import LLM, SamplingParams

NEW_TOKENS = 32
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 64, 12, 77, 31], [200, 1, 2, 3], [8] * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)

# (arch, adapter options): ranks, targets, rsLoRA and per-module patterns
CASES = {
    "llama_all": ("llama_gqa", dict(r=8, alpha=16)),
    "llama_qv_rslora": ("llama_gqa", dict(r=4, alpha=8, targets=("q_proj", "v_proj"), use_rslora=True)),
    "qwen2_mlp_patterns": (
        "qwen2",
        dict(
            r=16,
            alpha=8,
            targets=("k_proj", "gate_proj", "down_proj"),
            rank_pattern={"down_proj": 4},
            alpha_pattern={"k_proj": 32},
        ),
    ),
}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """case -> (base folder, adapter folder)."""
    made = {}
    for case, (arch, options) in CASES.items():
        base = tiny_model_dir(arch)
        made[case] = (base, make_peft_adapter(base, tmp_path_factory.mktemp(case), seed=len(made), **options))
    return made


def _check_against(reference, outputs) -> None:
    for prompt, result in zip(PROMPTS, outputs):
        ref = hf_greedy(reference, prompt, NEW_TOKENS)
        assert min(ref.margins) > 1e-4, "reference has a near-tie; pick another seed"
        out = result.outputs[0]
        assert out.token_ids == ref.tokens
        got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        assert got == pytest.approx(ref.logprobs, abs=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_adapter_matches_peft(case, adapters):
    base, adapter = adapters[case]
    llm = LLM(str(base), kv_cache_memory=16 << 20, lora={"a": str(adapter)})
    outputs = llm.generate(PROMPTS, GREEDY, lora="a")
    assert llm.engine.core.runner.failed_batches == 0
    reference = load_peft_reference(base, adapter)
    _check_against(reference, outputs)
    plain = llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0]  # the base model, same engine
    assert plain.token_ids == hf_greedy(load_hf_reference(base), PROMPTS[0], NEW_TOKENS).tokens
    assert plain.token_ids != outputs[0].outputs[0].token_ids  # the adapter changes the model


def test_a_bfloat16_adapter_is_kept_in_bfloat16_and_matches_peft(tiny_model_dir, tmp_path):
    base = tiny_model_dir("llama_gqa")
    adapter = make_peft_adapter(base, tmp_path / "bf16", r=8, seed=7, dtype=torch.bfloat16)
    llm = LLM(str(base), kv_cache_memory=16 << 20, lora={"a": str(adapter)})
    assert llm.engine.core.runner.lora.dtype == torch.bfloat16  # half the bytes, the same values
    _check_against(load_peft_reference(base, adapter), llm.generate(PROMPTS, GREEDY, lora="a"))


def test_batch_mixing_adapters_and_the_base_equals_each_alone(tiny_model_dir, tmp_path):
    base = tiny_model_dir("llama_gqa")
    paths = {
        name: str(make_peft_adapter(base, tmp_path / name, r=r, seed=seed, targets=targets))
        for name, r, seed, targets in [
            ("a", 8, 1, ("q_proj", "v_proj", "down_proj")),
            ("b", 4, 2, ("k_proj", "o_proj", "up_proj")),
            ("c", 16, 3, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
        ]
    }
    llm = LLM(str(base), kv_cache_memory=16 << 20, lora=paths, max_lora_rank=16)
    names = [None, "a", "b", "c"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0, lora=names[i % 4]) for i in range(8)
    ]
    mixed = llm.generate(prompts, params)
    assert llm.engine.core.runner.failed_batches == 0
    for prompt, p, together in zip(prompts, params, mixed):
        alone = llm.generate([prompt], p)[0].outputs[0]
        assert together.outputs[0].token_ids == alone.token_ids
        for lt, la in zip(together.outputs[0].logprobs, alone.logprobs):
            assert list(lt.values()) == pytest.approx(list(la.values()), abs=1e-5)
    firsts = {p.lora: m.outputs[0].token_ids for p, m in zip(params[:4], mixed[:4])}
    assert len({tuple(v) for v in firsts.values()}) == 4  # the base and each adapter differ (prompt 0,1,2,0)
