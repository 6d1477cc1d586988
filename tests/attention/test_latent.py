"""Latent attention (DeepSeek's MLA, absorbed): every query head against one cached key a token
whose last value_dim dims are its value. The decode kernel and the torch path (padded decode
batches, prompts, chunks after cached positions) against float64 arithmetic written from the
definition; a sequence decodes to the same bits alone or batched."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_attention import NUM_BLOCKS, paged_setup
from tests.attention.test_sinks import meta_of, new_keys
from tokenloom.attention import cpu_latent, torch_sdpa

HEADS, DIM, VALUE_DIM = 6, 48, 32  # keys of 16 rope dims, then a 32-dim latent that is the value


def latent_paged(lens: list[int], rows: int, seed: int = 0):
    """test_attention's scattered random caches with one kv head, and `rows` random queries."""
    k, _, tables, _ = paged_setup(lens, HEADS, 1, seed, DIM)
    gen = torch.Generator().manual_seed(seed + 100)
    return k, tables, 3 * torch.randn(rows, HEADS, DIM, generator=gen) / DIM**0.5


def reference(q, k, lens, q_lens, tables, scale, window=None) -> torch.Tensor:
    """Float64: per query row, softmax over the positions it sees, times their keys' last VALUE_DIM dims."""
    out = torch.empty(q.shape[0], HEADS, VALUE_DIM, dtype=torch.float64)
    row = 0
    for n, q_len, table in zip(lens, q_lens, tables):
        keys = k[table].reshape(-1, DIM)[:n].double()  # (n, D)
        for p in range(n - q_len, n):
            first = 0 if window is None else max(0, p + 1 - window)
            weights = (q[row].double() @ keys[first : p + 1].T * scale).softmax(-1)  # (heads, positions)
            out[row] = weights @ keys[first : p + 1, DIM - VALUE_DIM :]
            row += 1
    return out


@pytest.mark.parametrize("window", [None, 20])
def test_the_decode_kernel_reads_values_from_the_keys(window):
    if not cpu_latent.usable(torch.zeros(1, 1, DIM), torch.zeros(1, 1, 1, DIM), VALUE_DIM):
        pytest.skip("the latent decode kernel does not build here")
    lens = [1, 17, 150, 45]  # within a tile, several tiles, a long one
    k, tables, q = latent_paged(lens, len(lens), seed=1)
    scale = DIM**-0.5
    got = cpu_latent.attend(q, k, meta_of(lens, [1] * 4, tables), scale, VALUE_DIM, window)
    torch.testing.assert_close(
        got.double(), reference(q, k, lens, [1] * 4, tables, scale, window), atol=5e-6, rtol=1e-5
    )
    alone = cpu_latent.attend(q[2:3], k, meta_of(lens[2:3], [1], tables[2:3]), scale, VALUE_DIM, window)
    assert torch.equal(alone[0], got[2])


@pytest.mark.parametrize("window", [None, 5])
def test_the_torch_path_for_prompts_chunks_and_decode_batches(window):
    """A whole prompt, a chunk after cached positions and a decoding row in one step; then a batch
    of decoding rows (one padded call)."""
    lens, q_lens = [9, 30, 12], [9, 7, 1]
    k, tables, q = latent_paged(lens, sum(q_lens), seed=3)
    scale = DIM**-0.5
    step = new_keys(k, lens, q_lens, tables)  # (T, 1, D)
    got = torch_sdpa.latent_attention(q, step, k, meta_of(lens, q_lens, tables), scale, VALUE_DIM, window)
    want = reference(q, k, lens, q_lens, tables, scale, window)
    torch.testing.assert_close(got.double(), want, atol=5e-6, rtol=1e-5)

    lens = [3, 40, 17]
    k, tables, q = latent_paged(lens, 3, seed=4)
    k[NUM_BLOCKS] = 0  # the null block pads the batch's tables
    got = torch_sdpa.latent_attention(
        q, new_keys(k, lens, [1] * 3, tables), k, meta_of(lens, [1] * 3, tables), scale, VALUE_DIM, window
    )
    torch.testing.assert_close(
        got.double(), reference(q, k, lens, [1] * 3, tables, scale, window), atol=5e-6, rtol=1e-5
    )
