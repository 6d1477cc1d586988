"""Beam search against HF transformers' generate(num_beams=...) on the same weights:
the same hypotheses in the same order with the same scores."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.hf_reference import load_hf_reference
from tokenloom import LLM

transformers = pytest.importorskip("transformers")

PROMPT = [5, 17, 42, 99, 7, 3, 250, 64]


def hf_beams(folder, prompt, beams, new, length_penalty, early_stopping, eos, n):
    model = load_hf_reference(folder)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=beams,
            num_return_sequences=n,
            max_new_tokens=new,
            do_sample=False,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=eos,
            pad_token_id=eos if eos is not None else 0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    seqs = []
    for row in out.sequences[:, len(prompt) :].tolist():
        if eos is not None and eos in row:
            row = row[: row.index(eos) + 1]  # the rest is padding
        seqs.append(row)
    scores = getattr(out, "sequences_scores", None)  # none for a greedy (1-beam) run
    return seqs, [] if scores is None else scores.tolist()


@pytest.mark.parametrize(
    "arch,beams,new,length_penalty,early_stopping,use_eos",
    [
        ("llama_gqa", 4, 12, 1.0, False, False),
        ("llama_gqa", 3, 10, 0.0, True, True),
        ("qwen2", 4, 10, 1.5, False, True),
        ("gpt2", 2, 8, -0.5, "never", True),
    ],
)
def test_beam_search_equals_transformers(tiny_model_dir, arch, beams, new, length_penalty, early_stopping, use_eos):
    folder = tiny_model_dir(arch)
    llm = LLM(str(folder), kv_cache_memory=16 << 20)
    eos = None
    if use_eos:  # an EOS the beams will meet: a token the model likes early on (from HF's own greedy run)
        eos = hf_beams(folder, PROMPT, 1, 4, 1.0, False, None, 1)[0][0][2]
        llm.engine.eos_token_ids = frozenset({eos})
    want_seqs, want_scores = hf_beams(folder, PROMPT, beams, new, length_penalty, early_stopping, eos, beams)
    got = llm.beam_search(
        PROMPT, beam_width=beams, max_tokens=new, length_penalty=length_penalty, early_stopping=early_stopping
    )
    assert [h.token_ids for h in got] == want_seqs
    assert [h.score for h in got] == pytest.approx(want_scores, abs=1e-4)
    for h in got:
        assert h.score == pytest.approx(h.cumulative_logprob / len(h.token_ids) ** length_penalty)
    assert llm.engine.core.block_manager.num_used_blocks == 0


def test_beams_share_blocks_and_compute_one_token_each_per_step(smol_llm):
    """Full blocks are shared through the prefix cache and each beam's last, partial block is
    continued (taken over or copied on write): after the prompt, every step computes exactly
    one new token per beam, never a beam's history again."""
    prompt = smol_llm.tokenizer.encode("Beam search test: the three primary colors are red, blue and")
    engine, steps = smol_llm.engine, []
    generate = smol_llm.generate

    def recording(prompts, params):
        steps.append(len(prompts))
        return generate(prompts, params)

    smol_llm.generate = recording
    stats = engine.core.block_manager.stats
    computed, copies = engine.stats().prompt_tokens_computed, stats.copied_blocks
    try:
        best = smol_llm.beam_search(prompt, beam_width=3, max_tokens=6, n=2)
    finally:
        del smol_llm.generate
    assert len(best) == 2 and best[0].score >= best[1].score and best[0].text
    assert engine.stats().prompt_tokens_computed - computed == len(prompt) + sum(steps[1:])
    assert steps[1:] == [3] * (len(steps) - 1)
    assert stats.copied_blocks - copies >= len(steps) - 1  # siblings of a beam write into copies
    assert engine.core.block_manager.num_used_blocks == 0
    engine.core.block_manager.check_integrity()


def test_server_use_beam_search_returns_the_same_beams(smol_llm):
    import openai

    from tests.helpers.server_harness import ThreadedServer, wait_until_idle
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    prompt = smol_llm.tokenizer.encode("Once upon a time, in a small village,")
    want = smol_llm.beam_search(prompt, beam_width=3, max_tokens=6, n=2, length_penalty=0.5)
    with ThreadedServer(build_app(AsyncLLMEngine(smol_llm.engine), "smol")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        resp = client.completions.create(
            model="smol",
            prompt=prompt,
            max_tokens=6,
            n=2,
            best_of=3,
            extra_body={"use_beam_search": True, "length_penalty": 0.5},
        )
        assert [c.text for c in resp.choices] == [h.text for h in want]
        # The server's run hits the prefix cache the direct run filled: the prompt's last token is
        # computed apart from the rest, its attention summed in another order (float32 noise:
        # 1.6e-6 apart through oneDNN, 1.2e-5 through the panel kernel on AVX2)
        assert [c.model_extra["score"] for c in resp.choices] == pytest.approx([h.score for h in want], abs=1e-4)
        for bad, param in [
            ({"best_of": 1, "n": 2}, "best_of"),
            ({"stream": True}, "stream"),
            ({"best_of": 3}, "best_of"),
        ]:
            extra = {"use_beam_search": True} if param != "best_of" or "n" in bad else {}
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(
                    model="smol", prompt="Hi", max_tokens=4, extra_body=extra, **{k: v for k, v in bad.items()}
                )
            assert err.value.body["param"] == param
        assert wait_until_idle(url) == 0
