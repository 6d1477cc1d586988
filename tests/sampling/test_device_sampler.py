"""The sampler's device path (sampling/device.py) against the general sampler: the same penalized
logits, the same distribution for every sampled row, the same token for a seed, and draws that
follow the distribution. Plain torch, so it runs on the CPU here and on a GPU where there is one."""

from __future__ import annotations

import pytest
import torch

from tokenloom.sampling import device as device_path
from tokenloom.sampling.chain import sampling_distribution
from tokenloom.sampling.metadata import SamplingMetadata
from tokenloom.sampling.processors import apply_processors
from tokenloom.sampling.sampler import Sampler
from tokenloom.sampling_params import SamplingParams

DEVICES = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
V = 300

ROWS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.3, min_p=0.1),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=12, repetition_penalty=1.5),
    SamplingParams(temperature=1.1, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty_range=4),
    SamplingParams(temperature=0, repetition_penalty=2.0),
]


def metadata(params, seeds=None):
    n = len(params)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, V, (6,), generator=gen).tolist() for _ in range(n)]
    outputs = [torch.randint(0, V, (i % 4,), generator=gen).tolist() for i in range(n)]
    generators = [None if s is None else torch.Generator().manual_seed(s) for s in (seeds or [None] * n)]
    return SamplingMetadata(list(params), prompts, outputs, generators, [frozenset()] * n)


def random_logits(n, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(n, V, generator=gen)).to(device)


def settings_of(meta, device):
    return device_path._host_settings(meta).to(device)[:, :8].float()


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_equal_the_general_processors(device):
    meta = metadata(ROWS)
    logits = random_logits(len(ROWS), device)
    want = apply_processors(logits.cpu(), metadata(ROWS))
    got = device_path._penalized(logits, meta, settings_of(meta, device)).cpu()
    assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(got, logits.cpu())  # they did something


@pytest.mark.parametrize("device", DEVICES)
def test_each_sampled_rows_distribution_equals_the_chain(device):
    sampled = [p for p in ROWS if not p.greedy]
    meta = metadata(sampled)
    logits = random_logits(len(sampled), device, seed=1)
    want = sampling_distribution(logits.cpu(), metadata(sampled))
    for rows in ([0, 1, 2, 3, 4, 5, 6], [1, 4, 5]):  # full rows / narrowed to top-k
        sub = SamplingMetadata(
            [meta.params[i] for i in rows],
            [meta.prompt_token_ids[i] for i in rows],
            [meta.output_token_ids[i] for i in rows],
            [None] * len(rows),
            [frozenset()] * len(rows),
        )
        probs, columns = device_path._filtered(
            logits[rows], settings_of(sub, device), [p.top_k for p in sub.params], True, True
        )
        full = (
            probs
            if columns is None
            else torch.zeros(len(rows), V, dtype=probs.dtype, device=probs.device).scatter(1, columns, probs)
        )
        assert torch.allclose(full.cpu(), want[rows], atol=1e-6), rows


@pytest.mark.parametrize("device", DEVICES)
def test_a_seed_draws_what_the_general_sampler_draws(device):
    """Same u from the row's generator, same distribution: the same token, seed after seed."""
    params = [SamplingParams(temperature=1.0, top_k=50, seed=s) for s in range(3)] + [
        SamplingParams(temperature=0.8, top_p=0.9, seed=7),
        SamplingParams(temperature=0),
    ]
    seeds = [0, 1, 2, 7, None]
    logits = random_logits(len(params), device, seed=2)
    general, on_device = metadata(params, seeds), metadata(params, seeds)
    for _ in range(30):
        want = Sampler().sample(logits.cpu(), general).tokens
        got, _ = device_path.sample_on_device(logits, on_device)
        assert got.cpu().tolist() == want.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_draws_follow_the_distribution(device):
    from scipy.stats import chisquare

    params = SamplingParams(temperature=0.9, top_k=6)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5] + [-1.0] * (V - 6)]).to(device)
    probs = sampling_distribution(logits.cpu(), metadata([params]))[0, :6].double()
    probs = probs / probs.sum()
    n = 4000
    meta = metadata([params] * n)
    tokens, _ = device_path.sample_on_device(logits.expand(n, V).contiguous(), meta)
    counts = torch.bincount(tokens.cpu(), minlength=V)
    assert counts[6:].sum() == 0  # top-k held
    assert chisquare(counts[:6].double().numpy(), (probs * n).numpy()).pvalue > 1e-3


def test_rows_the_device_path_does_not_take():
    assert device_path.row_takes(SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=3), 0)
    for other in (
        dict(logit_bias={1: 2.0}),
        dict(min_tokens=4),
        dict(no_repeat_ngram_size=2),
        dict(dry_multiplier=0.8),
        dict(mirostat=2),
        dict(typical_p=0.9),
        dict(xtc_probability=0.5),
        dict(explain=2),
        dict(samplers=["top_k", "temperature"]),
    ):
        assert not device_path.row_takes(SamplingParams(temperature=0.8, **other), 0), other
    assert device_path.row_takes(SamplingParams(temperature=0.8, min_tokens=4), 4)  # satisfied
    assert not device_path.takes(torch.zeros(1, V), metadata([SamplingParams()]))  # CPU logits: general


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampler_takes_the_device_path_and_returns_logprobs():
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.8, top_k=20, logprobs=1, seed=4)]
    logits = random_logits(2, "cuda", seed=3)
    out = Sampler().sample(logits, metadata(params, [None, 4]))
    assert out.tokens.device.type == "cuda"
    raw = logits.log_softmax(-1).cpu()
    assert out.tokens[0].item() == raw[0].argmax().item()
    for row, entry in enumerate(out.logprobs):
        token = out.tokens[row].item()
        assert entry[token] == pytest.approx(raw[row, token].item(), abs=1e-5)
    assert len(out.logprobs[0]) == 3
