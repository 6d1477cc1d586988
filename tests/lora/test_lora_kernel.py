"""The batched LoRA op (every row its own adapter) against a float64 loop over rows."""

from __future__ import annotations

import pytest
import torch

from tokenloom.lora import kernel


def _case(T: int, K: int, bounds: list[int], S: int, R: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    G, N = len(bounds) - 1, bounds[-1]
    x = torch.randn(T, K, generator=g)
    y = torch.randn(T, N, generator=g)
    A = torch.randn(S, G * R, K, generator=g)
    B = torch.randn(S, R, N, generator=g)
    ranks = torch.randint(0, R + 1, (S, G), generator=g, dtype=torch.int32)
    ranks[0] = R  # at least one slot at the full rank
    rows = torch.randint(-1, S, (T,), generator=g, dtype=torch.int32)
    return y, x, A, B, ranks, rows


def _reference(y, x, A, B, ranks, rows, bounds):
    """Row by row in float64: only the first ranks[s, g] rows of each group's A (columns of B) count."""
    out = y.double().clone()
    R = B.shape[1]
    for t, s in enumerate(rows.tolist()):
        if s < 0:
            continue
        for gi in range(len(bounds) - 1):
            r = int(ranks[s, gi])
            a = A[s, gi * R : gi * R + r].double()
            b = B[s, :r, bounds[gi] : bounds[gi + 1]].double()
            out[t, bounds[gi] : bounds[gi + 1]] += (a @ x[t].double()) @ b
    return out


SHAPES = [
    (1, 64, [0, 96], 2, 8),  # decode, one group
    (5, 70, [0, 32, 48, 64], 3, 16),  # K with a tail past the 16-wide loop, q/k/v groups
    (37, 129, [0, 130, 260], 4, 5),  # gate/up groups, odd rank
    (3, 96, [0, 600, 1203], 2, 8),  # groups longer than a task's 256 columns, ending mid-vector
    (300, 64, [0, 64], 2, 4),  # enough work to run on every thread
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,K,bounds,S,R", SHAPES)
def test_compiled_and_torch_paths_match_the_row_loop(T, K, bounds, S, R, dtype):
    y, x, A, B, ranks, rows = _case(T, K, bounds, S, R, seed=T)
    args = y, x, A.to(dtype), B.to(dtype), ranks, rows  # the reference reads the same rounded values
    want = _reference(*args, bounds)
    got_torch = kernel.lora_add_torch(*args, bounds)
    assert torch.allclose(got_torch.double(), want, atol=1e-4, rtol=1e-4)
    if not kernel.kernel_built():
        pytest.skip("the compiled kernel does not build here")
    got = torch.ops.tokenloom_lora.lora_add(*args, bounds)
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4)
    y, rows = args[0], args[5]
    base_rows = (rows == -1).nonzero().squeeze(1)
    assert torch.equal(got[base_rows], y[base_rows])  # rows without an adapter untouched, bit for bit
    assert not torch.equal(got, y)  # and the others changed


@pytest.mark.parametrize("rows", [[2], [-1, 2, 2, -1], [1, 1, 1, 1], [-1, -1, 0]])
def test_the_rows_of_one_adapter_match_the_row_loop(rows):
    """A decode step's shape (one adapter's rows, up to four, among rows without one), which the
    kernel runs on one thread without task lists; a group at rank 0 stays untouched."""
    if not kernel.kernel_built():
        pytest.skip("the compiled kernel does not build here")
    bounds = [0, 40, 56, 72]
    y, x, A, B, ranks, _ = _case(len(rows), 70, bounds, 3, 16, seed=7)
    ranks[:, 1] = 0
    A, B = A.bfloat16(), B.bfloat16()
    rw = torch.tensor(rows + [0, 1], dtype=torch.int32)  # longer than T: the step's buffer
    got = torch.ops.tokenloom_lora.lora_add(y, x, A, B, ranks, rw, bounds)
    assert torch.allclose(got.double(), _reference(y, x, A, B, ranks, rw[: len(rows)], bounds), atol=1e-4, rtol=1e-4)
    assert torch.equal(got[:, 40:56], y[:, 40:56])
    assert not torch.equal(got, y)


def test_only_the_first_t_rows_are_read():
    y, x, A, B, ranks, rows = _case(5, 64, [0, 32, 48], 3, 4, seed=3)
    longer = torch.cat([rows, torch.tensor([2, 1, 0], dtype=torch.int32)])  # a step buffer past T
    want = kernel.lora_add_torch(y, x, A, B, ranks, rows, [0, 32, 48])
    assert torch.allclose(kernel.lora_add(y, x, A, B, ranks, longer, [0, 32, 48]), want, atol=1e-5)


def test_rows_without_any_adapter_return_y():
    y, x, A, B, ranks, _ = _case(4, 32, [0, 16], 2, 4, seed=1)
    none = torch.full((4,), -1, dtype=torch.int32)
    assert torch.equal(kernel.lora_add(y, x, A, B, ranks, none, [0, 16]), y)


def test_a_slot_out_of_range_is_an_error():
    if not kernel.kernel_built():
        pytest.skip("the compiled kernel does not build here")
    y, x, A, B, ranks, _ = _case(2, 32, [0, 16], 2, 4, seed=2)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.tokenloom_lora.lora_add(y, x, A, B, ranks, torch.tensor([0, 2], dtype=torch.int32), [0, 16])


BATCHES = [  # row 0 is the row watched: adapter slot 1, then the rows it is batched with
    [1, 1],  # a run of two rows of one adapter
    [1, 1, 1, 1],  # a full run of four
    [1, -1, 1, 0, 1],  # runs of its adapter among other adapters' rows and the base's
    [1] + [0, 1, 2, -1] * 75,  # enough work for every thread: the task lists
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K,bounds", [(70, [0, 40, 61, 83]), (96, [0, 600, 1203]), (576, [0, 960])])
@pytest.mark.parametrize("batch", BATCHES, ids=["two", "four", "mixed", "many"])
def test_a_row_gets_the_same_bits_alone_and_batched(K, bounds, batch, dtype):
    """A row's delta must not depend on which rows share its step (batched == single, to the bit):
    the same products in the same order whether it runs alone, in a run of its adapter's rows, or
    on the task lists. Ks and group widths with tails past every vector width."""
    if not kernel.kernel_built():
        pytest.skip("the compiled kernel does not build here")
    T = len(batch)
    y, x, A, B, ranks, _ = _case(T, K, bounds, 3, 16, seed=K)
    x[1:] = x[0] + torch.randn(T - 1, K) * 0.1  # rows of a run alike, not equal
    A, B = A.to(dtype), B.to(dtype)
    rows = torch.tensor(batch, dtype=torch.int32)
    together = torch.ops.tokenloom_lora.lora_add(y, x, A, B, ranks, rows, bounds)
    alone = torch.ops.tokenloom_lora.lora_add(y[:1], x[:1], A, B, ranks, rows[:1], bounds)
    assert torch.equal(together[:1], alone)
    assert not torch.equal(alone, y[:1])
