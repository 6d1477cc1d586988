"""The generation inspector's records, checked against an independent computation: HF
transformers' model on the same tokens, with HF's own logits processors and warpers."""

from __future__ import annotations

import math
import re

import pytest
import torch

from tests.helpers.hf_reference import load_hf_reference
from tokenloom import SamplingParams
from tokenloom.explain.render import render_compact, render_full
from tokenloom.structured import StructuredOutput

transformers = pytest.importorskip("transformers")
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

PROMPT = "The three primary colors are red, blue and"


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    return load_hf_reference(default_model_dir)


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0, -1].float()  # (V,)


def hf_stages(logits: torch.Tensor, ids: list[int], p: SamplingParams):
    """(raw, after temperature, final) logits and each warper's removals, by HF's own classes."""
    ids_t = torch.tensor([ids])
    x = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids_t, logits[None].clone())
    x = TemperatureLogitsWarper(p.temperature)(ids_t, x)
    adjusted, removed = x.clone(), {}
    for name, warper in (
        ("top_k", TopKLogitsWarper(p.top_k)),
        ("top_p", TopPLogitsWarper(p.top_p)),
        ("min_p", MinPLogitsWarper(p.min_p)),
    ):
        after = warper(ids_t, x.clone())
        removed[name] = set((torch.isinf(after) & ~torch.isinf(x))[0].nonzero()[:, 0].tolist())
        x = after
    return adjusted[0], x[0], removed


def test_sampled_records_equal_hf_processors_and_warpers(smol_llm, hf_model):
    params = SamplingParams(
        temperature=0.7,
        top_k=30,
        top_p=0.8,
        min_p=0.05,
        repetition_penalty=1.3,
        seed=7,
        max_tokens=6,
        ignore_eos=True,
        explain=20,
    )
    out = smol_llm.generate(PROMPT, params)[0]
    prompt, records = out.prompt_token_ids, out.outputs[0].explanation
    assert [r.token_id for r in records] == out.outputs[0].token_ids and len(records) == 6
    for i, r in enumerate(records):
        ids = prompt + out.outputs[0].token_ids[:i]
        raw = hf_logits(hf_model, ids)
        adjusted, final, removed = hf_stages(raw, ids, params)
        model_p, adjusted_p, final_p = raw.softmax(-1), adjusted.softmax(-1), final.softmax(-1)
        assert r.index == i and r.kv_tokens == len(ids)
        assert r.num_kept == int((final_p > 0).sum())
        assert r.num_cut == {k: len(v) for k, v in removed.items() if v}
        want_top = set(adjusted_p.topk(20).indices.tolist())
        listed = [c.token_id for c in r.candidates]
        assert set(listed[:20]) == want_top
        for c in r.candidates:
            assert c.model_prob == pytest.approx(float(model_p[c.token_id]), abs=2e-5)
            assert c.adjusted_prob == pytest.approx(float(adjusted_p[c.token_id]), abs=2e-5)
            assert c.prob == pytest.approx(float(final_p[c.token_id]), abs=2e-5)
            want_cut = next((k for k, v in removed.items() if c.token_id in v), None)
            assert c.cut_by == want_cut
        assert r.prob == r.chosen.prob > 0 and r.chosen.cut_by is None


def test_greedy_records_list_softmax_after_penalties_and_bias(smol_llm, hf_model):
    """Frequency/presence penalties and logit bias (no HF class for the first two: by hand)."""
    bias_token = smol_llm.tokenizer.encode(" green")[0]
    params = SamplingParams(
        temperature=0,
        frequency_penalty=0.8,
        presence_penalty=0.4,
        logit_bias={bias_token: 2.5},
        max_tokens=5,
        ignore_eos=True,
        explain=8,
    )
    out = smol_llm.generate(PROMPT, params)[0]
    prompt, tokens = out.prompt_token_ids, out.outputs[0].token_ids
    for i, r in enumerate(out.outputs[0].explanation):
        raw = hf_logits(hf_model, prompt + tokens[:i])
        counts = torch.bincount(torch.tensor(tokens[:i], dtype=torch.long), minlength=raw.shape[0]).float()
        shift = -0.8 * counts - 0.4 * (counts > 0).float()
        shift[bias_token] += 2.5
        want = (raw + shift).softmax(-1)
        assert r.greedy and r.token_id == int((raw + shift).argmax()) and not r.num_cut
        assert r.num_penalized == int((shift != 0).sum())
        for c in r.candidates:
            assert c.prob == c.adjusted_prob == pytest.approx(float(want[c.token_id]), abs=2e-5)
            assert c.penalty == pytest.approx(float(shift[c.token_id]), abs=1e-4)


def test_kv_cache_size_follows_the_formula(smol_llm):
    cfg = smol_llm.engine.model_config
    out = smol_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, explain=3))[0]
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # float32
    for i, r in enumerate(out.outputs[0].explanation):
        assert r.kv_tokens == len(out.prompt_token_ids) + i
        assert r.kv_bytes == r.kv_tokens * per_token
        assert r.kv_blocks_used >= math.ceil(r.kv_tokens / smol_llm.engine.core.block_manager.block_size)
        assert r.step_time_s > 0


def test_explaining_changes_no_token(smol_llm):
    params = dict(temperature=1.0, top_p=0.9, seed=3, max_tokens=12, ignore_eos=True)
    plain = smol_llm.generate(PROMPT, SamplingParams(**params))[0].outputs[0]
    explained = smol_llm.generate(PROMPT, SamplingParams(**params, explain=5))[0].outputs[0]
    assert explained.token_ids == plain.token_ids and plain.explanation is None


def test_grammar_cuts_are_reported(smol_llm):
    params = SamplingParams(
        temperature=0, max_tokens=4, explain=10, structured_output=StructuredOutput.regex("[0-9]{4}")
    )
    out = smol_llm.generate("The year the war ended was", params)[0].outputs[0]
    assert re.fullmatch("[0-9]{4}", out.text)
    first = out.explanation[0]
    assert first.num_cut["grammar"] > 1000 and first.chosen.cut_by is None
    for c in first.candidates:
        assert (c.cut_by == "grammar") == (not c.text.strip().isdigit()) or c.text.strip() == ""
        if c.cut_by == "grammar":
            assert c.prob == 0


def test_rendering_fits_80_columns_and_colors_only_when_asked(smol_llm):
    params = SamplingParams(temperature=0.9, top_k=10, repetition_penalty=1.2, seed=1, max_tokens=5, explain=20)
    records = smol_llm.generate("Write a long word:", params)[0].outputs[0].explanation
    for r in records:
        plain, full = render_compact(r), render_full(r)
        for line in (plain + "\n" + full).splitlines():
            assert len(line) <= 80 and "\x1b[" not in line
        assert plain.count("\n") in (1, 2) and f"p {r.prob:.2f}" in plain
        assert len(full.splitlines()) == len(r.candidates) + 3
        colored = render_compact(r, color=True)
        assert "\x1b[" in colored and re.sub(r"\x1b\[[0-9;]*m", "", colored) == plain
    assert any("top-k" in render_compact(r) for r in records)


def test_explained_requests_decode_plainly_under_speculation(default_model_dir):
    """Speculative steps verify several tokens at once and would have no record per token:
    an explained request is left out of speculation, and every token gets its record."""
    from tokenloom import LLM

    llm = LLM(str(default_model_dir), kv_cache_memory=64 << 20, speculative="ngram,k=4")
    prompt = "a b c d a b c d a b c d a b c"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = llm.generate(prompt, params)[0].outputs[0]
    explained = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, explain=2))
    out = explained[0].outputs[0]
    assert out.token_ids == plain.token_ids and [r.token_id for r in out.explanation] == out.token_ids
    assert out.metrics.num_spec_steps == 0 < plain.metrics.num_spec_steps
