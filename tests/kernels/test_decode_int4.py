"""The CPU decode kernel over an int4 (q4_0) KV cache (paged_decode_int4: packed codes and float16
group scales read in place) against attention in float64 over the same cache dequantized by
Int4Cache itself; the checks the int8 and int4 paths share (the float64 reference at every head
size, windows, soft-capping, sinks, the same
bits alone, batched and on any thread count); and the step-level tests every stored format (int8,
int4, 16-bit) shares."""

from __future__ import annotations

import math

import pytest
import torch

from tests.kernels.test_decode_half import paged_half
from tests.kernels.test_decode_int8 import (
    BS,
    assert_matches,
    attend,
    decode_meta,
    paged,
    paged_int8,
    reference,
    spy_on_attend,
)
from tokenloom.attention import backend, cpu_decode, cpu_prefill
from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.kernels import native
from tokenloom.kv_cache.quantized import HALF_DTYPES, INT4_GROUP, HalfCache, Int4Cache, Int8Cache

pytestmark = pytest.mark.skipif(not native.cpu_has_avx2(), reason="the kernel needs AVX2 + FMA")

# Around block edges (16) and the kernel's tiles (scores: 8 or 16 positions; values: 16 or 32).
EDGES = [1, 7, 8, 9, BS - 1, BS, BS + 1, 31, 32, 33, 3 * BS, 63, 64, 65, 5 * BS + 7, 1000]


def zeros(size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(size, dtype=dtype)


def int4_cache(num_blocks: int, kv_heads: int, head_dim: int, gen: torch.Generator) -> Int4Cache:
    """An Int4Cache of random rows whose groups differ in magnitude (so the group scales do), the
    null block zero."""
    cache = Int4Cache.allocate((num_blocks + 1, BS, kv_heads, head_dim), torch.float32, zeros)
    groups = torch.randn(num_blocks * BS, kv_heads, head_dim // INT4_GROUP, INT4_GROUP, generator=gen)
    groups *= torch.exp(torch.randn(*groups.shape[:-1], 1, generator=gen))
    cache.store(torch.arange(num_blocks * BS), groups.flatten(-2))
    return cache


def paged_int4(lens: list[int], heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """Key and value caches, each sequence's blocks scattered, one query per sequence."""
    return paged(lambda n, gen: int4_cache(n, kv_heads, head_dim, gen), lens, heads, head_dim, seed)


def context_slots(lens: list[int], tables: list[torch.Tensor]) -> torch.Tensor:
    """The flat cache slots of every sequence's positions, in order."""
    return torch.tensor([int(table[p // BS]) * BS + p % BS for n, table in zip(lens, tables) for p in range(n)])


def group_and_a_half() -> Int4Cache:
    """An Int4Cache of head_dim 48, which Int4Cache.allocate refuses: 2 kv heads, 3 blocks."""
    codes, scales = torch.zeros(3, BS, 2, 24, dtype=torch.uint8), torch.zeros(3, BS, 2, 1, dtype=torch.float16)
    return Int4Cache(codes, scales, torch.float32)


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_one_attended_position_reads_its_value_as_int4cache_dequantizes_it(kernel_build, head_dim):
    """A softmax over one position weighs it by exactly 1: each head's output is that position's
    value, unpacked and scaled to the bit as Int4Cache's own reads give it (a context of one, and
    a window of one over long contexts)."""
    lens = [1, 40, 1000]
    k, v, tables, q = paged_int4(lens, 8, 2, head_dim, seed=head_dim)
    values = v[torch.stack([t[-1] for t in tables])]  # (3, block_size, kv_heads, head_dim), dequantized
    last = values[torch.arange(3), torch.tensor([(n - 1) % BS for n in lens])].repeat_interleave(4, 1)
    assert torch.equal(attend(q, k, v, lens, tables, 0.1, window=1), last)
    assert torch.equal(attend(q[:1], k, v, lens[:1], tables[:1], 0.1), last[:1])


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_int4_kernel_reads_nothing_past_a_context(kernel_build, head_dim):
    """Slots after each sequence's last position (and every block not in its table) may hold
    anything, NaN scales included: the kernel reads only the context (idle lanes of a last tile
    included), so no clearing is needed (backend.reads_past_context)."""
    lens = [3, 17, 40, 9]
    k, v, tables, q = paged_int4(lens, 4, 2, head_dim, seed=2)
    want = attend(q, k, v, lens, tables, 0.2)
    rows = context_slots(lens, tables)
    for cache in (k, v):
        data = cache.data.view(-1, *cache.data.shape[2:])  # (slots, kv_heads, head_dim // 2)
        scales = cache.scales.view(-1, *cache.scales.shape[2:])  # (slots, kv_heads, groups)
        kept = data[rows].clone(), scales[rows].clone()
        data.fill_(0xFF)
        scales.fill_(float("nan"))
        data[rows], scales[rows] = kept
    got = attend(q, k, v, lens, tables, 0.2)
    assert torch.equal(got, want)
    assert got.isfinite().all()


def test_the_kernel_takes_an_int4_cache_in_whole_groups_only(kernel_build):
    assert cpu_decode.usable(torch.randn(1, 2, 32), paged_int4([4], 2, 2, 32)[0])
    assert not cpu_decode.usable(torch.randn(1, 2, 48), group_and_a_half())


def test_the_int4_op_refuses_a_head_size_of_part_groups(kernel_build):
    c, q = group_and_a_half(), torch.randn(1, 2, 48)
    tables, ctx = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_decode.ops().paged_decode_int4(q, c.data, c.scales, c.data, c.scales, tables, ctx, 1.0, 0, 0.0)


QUANTIZED = {  # (caches and tables, layer type)
    "int8": (paged_int8, Int8Cache),
    "int4": (paged_int4, Int4Cache),
    "float16": (paged_half, HalfCache),
}


# The checks every code format's kernel path gets alike (the 16-bit one has its own, test_decode_half.py).
CODES = ["int8", "int4"]


@pytest.mark.parametrize("kind", CODES)
def test_the_kernel_takes_a_code_cache_read_as_float32_only(kernel_build, kind):
    make, layer_type = QUANTIZED[kind]
    k, *_ = make([4], 2, 2, 32)
    q = torch.randn(1, 2, 32)
    assert cpu_decode.usable(q, k)
    assert not cpu_decode.usable(q.bfloat16(), k)
    assert not cpu_decode.usable(q, layer_type(k.data, k.scales, torch.bfloat16))


@pytest.mark.parametrize(
    "kind,head_dim",  # int8's 20: scalar lanes; 80 and 96: a column tail of the 16-lane build
    [*(("int8", d) for d in (20, 32, 64, 80, 128, 256)), *(("int4", d) for d in (32, 64, 96, 128, 256))],
)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (14, 2), (4, 1)])  # 1, 4, 7 and 4 heads a kv head
def test_the_kernel_equals_the_dequantized_cache(kernel_build, kind, head_dim, heads, kv_heads):
    k, v, tables, q = QUANTIZED[kind][0](EDGES, heads, kv_heads, head_dim, seed=head_dim + heads)
    assert cpu_decode.usable(q, k)
    got = attend(q, k, v, EDGES, tables, head_dim**-0.5)
    assert got.shape == q.shape and got.dtype == torch.float32
    assert_matches(got, reference(q, k, v, EDGES, tables, head_dim**-0.5))


@pytest.mark.parametrize("kind", CODES)
@pytest.mark.parametrize("window", [1, 7, 16, 40, 5000])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_kernel_attends_to_the_last_window_positions(kernel_build, kind, window, head_dim):
    k, v, tables, q = QUANTIZED[kind][0](EDGES, 6, 2, head_dim, seed=window)
    got = attend(q, k, v, EDGES, tables, 0.1, window)
    assert_matches(got, reference(q, k, v, EDGES, tables, 0.1, window))


@pytest.mark.parametrize("kind", CODES)
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_the_kernel_soft_caps_scores(kernel_build, kind, window, head_dim):
    k, v, tables, q = QUANTIZED[kind][0](EDGES, 8, 2, head_dim, seed=5)
    q *= 4  # scores large enough for the cap to bend them
    got = attend(q, k, v, EDGES, tables, head_dim**-0.5, window, softcap=5.0)
    assert_matches(got, reference(q, k, v, EDGES, tables, head_dim**-0.5, window, softcap=5.0))
    plain = attend(q, k, v, EDGES, tables, head_dim**-0.5, window)
    assert not torch.allclose(got, plain, atol=1e-3)  # the cap changed something


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("kind,head_dim", [("int8", 20), ("int8", 32), ("int8", 64), ("int4", 32), ("int4", 64)])
def test_the_kernel_counts_each_heads_sink(kernel_build, kind, window, head_dim):  # int8's 20: scalar lanes
    k, v, tables, q = QUANTIZED[kind][0](EDGES, 4, 2, head_dim, seed=11)
    sinks = 2 * torch.randn(4, generator=torch.Generator().manual_seed(1))
    got = attend(q, k, v, EDGES, tables, 0.3, window, sinks=sinks)
    assert_matches(got, reference(q, k, v, EDGES, tables, 0.3, window, sinks=sinks))
    plain = attend(q, k, v, EDGES, tables, 0.3, window)
    assert not torch.allclose(got, plain, atol=1e-3)


@pytest.mark.parametrize("kind", CODES)
def test_a_sequence_gets_the_same_bits_alone_batched_and_on_any_thread_count(kernel_build, kind):
    """Each head's arithmetic does not depend on the task it runs in: a sequence alone, among
    others, split over 1 or 2 threads (by kv head, or by share of a kv head's query heads)."""
    lens = [5, 200, 33, 1000]
    for heads, kv_heads in [(8, 2), (4, 1), (14, 2)]:
        k, v, tables, q = QUANTIZED[kind][0](lens, heads, kv_heads, 64, seed=heads)
        before = torch.get_num_threads()
        try:
            results = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                batched = attend(q, k, v, lens, tables, 0.125, softcap=20.0)
                for i in range(len(lens)):
                    alone = attend(q[i : i + 1], k, v, lens[i : i + 1], tables[i : i + 1], 0.125, softcap=20.0)
                    assert torch.equal(batched[i : i + 1], alone)
                results.append(batched)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(results[0], results[1])


FUSED = {  # kv_cache_dtype -> (caches and tables, the fused all-decode op, the cache arrays it takes)
    "float16": (paged_half, "rope_write_decode_half", lambda c: [c.data]),
    "bfloat16": (
        lambda *a, **kw: paged_half(*a, **kw, storage="bfloat16"),
        "rope_write_decode_half",
        lambda c: [c.data],
    ),
    "int8": (paged_int8, "rope_write_decode_int8", lambda c: [c.data, c.scales]),
    "int4": (paged_int4, "rope_write_decode_int4", lambda c: [c.data, c.scales]),
}


def values_at_rounding_edges(kind: str, value_row: torch.Tensor) -> None:
    """Write into one value row (head_dim,) (values are not rotated) elements that land exactly on
    the format's rounding edges: ties of float16/bfloat16 and of int8's round (scale 1), int4's
    first-of-equal-magnitudes maximum, an element at a code's edge, one clamped, an all-zero group."""
    value_row.zero_()
    if kind in HALF_DTYPES:
        value_row[0] = 1 + (2**-11 if kind == "float16" else 2**-8)  # halfway: to 1.0, the even side
    elif kind == "int8":
        value_row[:4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # scale 1: codes 127, 0, 2, -2
    else:  # int4: m = +4 (the first of +-4), d = -0.5, codes trunc(x * -2 + 8.5): 0, 15, 8, 15
        value_row[:4] = torch.tensor([4.0, -4.0, 0.25, -3.75])  # the next 32 stay zero: d = 0, codes 8


def expected_edge_values(kind: str) -> list[float]:
    """values_at_rounding_edges' first four elements as the cache reads them back."""
    return {
        "float16": [1.0, 0.0, 0.0, 0.0],
        "bfloat16": [1.0, 0.0, 0.0, 0.0],
        "int8": [127.0, 0.0, 2.0, -2.0],
        "int4": [4.0, -3.5, 0.0, -3.5],
    }[kind]


@pytest.mark.parametrize("kind", sorted(FUSED))
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(6, 2, 32, 32), (9, 3, 64, 64), (4, 2, 64, 48)])
def test_the_fused_decode_block_stores_what_it_writes_as_the_cache_layer_does(
    kernel_build, kind, heads, kv_heads, head_dim, rotary_dim
):
    """rope_write_decode_half/_int8/_int4 (one call) against the op-by-op path: the fused rope in
    float32, the cache layer's own ``store`` (torch's rounding or quantization), the decode kernel.
    The same bits for the written codes, scales and output, rounding edges included."""
    from tokenloom.layers import fused
    from tokenloom.layers.rope import apply_rope, rope_cos_sin

    make, op_name, arrays = FUSED[kind]
    lens = [5, 40, 17]
    k, v, tables, _ = make(lens, heads, kv_heads, head_dim, seed=4)
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    values_at = (heads + kv_heads) * head_dim
    values_at_rounding_edges(kind, qkv[0, values_at : values_at + head_dim])  # sequence 0, value head 0
    positions = torch.tensor(lens) - 1
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cos, sin = rope_cos_sin(inv_freq, positions, torch.float32)
    slots = torch.stack([tables[i][(n - 1) // BS] * BS + (n - 1) % BS for i, n in enumerate(lens)])
    k_ref, v_ref = (type(c)(c.data.clone(), c.scales.clone(), c.dtype) for c in (k, v))
    assert fused.build()
    qk = apply_rope(qkv[:, :values_at].view(len(lens), -1, head_dim), cos, sin)
    k_ref.store(slots, qk[:, heads:])
    v_ref.store(slots, qkv[:, values_at:].view(len(lens), kv_heads, head_dim))
    meta = AttentionMetadata(slots, [0, 1, 2], [1, 1, 1], lens, tables, null_block=k.data.shape[0] - 1)
    want = cpu_decode.attend(qk[:, :heads].contiguous(), k_ref, v_ref, meta, [0, 1, 2], 0.3)
    tables_padded, ctx = cpu_decode.decode_inputs(meta)
    op = getattr(cpu_decode.ops(), op_name)
    got = op(qkv, cos, sin, *arrays(k), *arrays(v), slots, tables_padded, ctx, heads, 0.3, 0, 0.0)
    for mine, theirs in zip([*arrays(k), *arrays(v)], [*arrays(k_ref), *arrays(v_ref)]):
        assert torch.equal(mine, theirs)
    written = v[slots[0].view(1) // BS][0, slots[0] % BS, 0]  # (head_dim,) as the layer reads it back
    assert written[:4].tolist() == expected_edge_values(kind)
    assert torch.equal(got, want.reshape(len(lens), -1))


@pytest.mark.parametrize("kind", sorted(QUANTIZED))
def test_a_stored_cache_is_read_only_inside_each_context_and_fused_only_where_a_kernel_writes_it(kernel_build, kind):
    """reads_past_context: every decoding row of an int8, int4 or 16-bit cache is on the kernel, so fresh
    blocks need no clearing. kernels_take: rope_write_decode_half/_int8/_int4 and rope_write_stored
    round or quantize keys and values as they write them, so all-decode and mixed steps run on the
    kernels; a mixed step of a model with attention sinks (the prefill kernel has none) does not."""
    k, v, tables, _ = QUANTIZED[kind][0]([9, 12], 4, 2, 32)
    fields = {"keys": {0: k}, "values": {0: v}, "layers": [0], "dtype": torch.float32, "latent": False}
    cache = type("Cache", (), fields | {"device": torch.device("cpu")})()  # a PagedKVCache's fields read here
    assert not backend.reads_past_context(cache)
    cache.dtype = torch.bfloat16  # read as bf16: the torch path's padded batches, which look past each end
    assert backend.reads_past_context(cache)
    shape = backend.AttentionShape(4, 2, 32, 0.2)
    rope = (torch.ones(2, 1, 32), torch.zeros(2, 1, 32))
    all_decode = decode_meta([9, 12], tables, k.data.shape[0] - 1)
    assert backend.kernels_take(shape, all_decode, cache, rope)
    mixed = AttentionMetadata(torch.zeros(4, dtype=torch.long), [0, 1], [1, 3], [9, 12], tables, k.data.shape[0] - 1)
    mixed_rope = (torch.ones(4, 1, 32), torch.zeros(4, 1, 32))
    assert backend.kernels_take(shape, mixed, cache, mixed_rope)
    with_sinks = backend.AttentionShape(4, 2, 32, 0.2, sinks=True)
    assert not backend.kernels_take(with_sinks, mixed, cache, mixed_rope)


@pytest.mark.parametrize("kind", sorted(QUANTIZED))
def test_paged_attention_puts_stored_format_rows_on_the_kernels(kernel_build, monkeypatch, kind):
    """A step of a decoding row, a whole prompt and another decoding row over a stored-format cache
    (decoding rows on the decode kernel, the prompt on the prefill kernel): the same result (within
    float rounding) as the torch path's, which dequantizes and gathers every sequence."""
    paged, layer_type = QUANTIZED[kind]
    lens, q_lens, heads, kv_heads, D = [30, 17, 50], [1, 17, 1], 6, 2, 64
    k, v, tables, _ = paged(lens, heads, kv_heads, D, seed=4)
    gen = torch.Generator().manual_seed(8)
    T = sum(q_lens)
    q = torch.randn(T, heads, D, generator=gen)
    k_new, v_new = torch.randn(T, kv_heads, D, generator=gen), torch.randn(T, kv_heads, D, generator=gen)
    positions = [(i, p) for i, (n, m) in enumerate(zip(lens, q_lens)) for p in range(n - m, n)]  # this step's
    slots = torch.tensor([int(tables[i][p // BS]) * BS + p % BS for i, p in positions])
    starts = [sum(q_lens[:i]) for i in range(3)]

    def run() -> torch.Tensor:
        kc, vc = (layer_type(c.data.clone(), c.scales.clone(), c.dtype) for c in (k, v))
        meta = AttentionMetadata(slots, starts, q_lens, lens, tables, null_block=k.data.shape[0] - 1)
        return backend.paged_attention(q, k_new, v_new, kc, vc, meta, D**-0.5, window=24)

    calls: list = []
    spy_on_attend(monkeypatch, calls)
    got = run()
    assert len(calls) == 1 and isinstance(calls[0], layer_type)  # the two decoding rows, one kernel call
    monkeypatch.setattr(cpu_decode, "usable", lambda *args: False)
    monkeypatch.setattr(cpu_prefill, "usable", lambda *args: False)
    want = run()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


ENGINE_CASES = [  # heads of 32 (int4's groups, a size the prefill kernel takes)
    ("int8", "llama3_rope_scaling"),
    ("int8", "gemma3"),  # window layers with their own rope tables, one kv head
    ("int4", "llama3_rope_scaling"),
    ("int4", "gemma2"),  # windows and soft-capped scores
    ("float16", "gemma3"),
    ("bfloat16", "gemma2"),
]


@pytest.mark.parametrize("kind,arch", ENGINE_CASES)
def test_stored_cache_greedy_decoding_is_the_same_on_the_kernels_as_on_the_torch_path(
    kind, arch, tiny_model_dir, monkeypatch
):
    """A tiny random model with an int8, int4, float16 or bfloat16 KV cache, 15 tokens a step (two
    whole prompts, then the third in chunks beside their decoding): the tokens (and their logprobs, to float
    rounding) with the kernels reading the stored values in place (all-decode steps fused, prompt
    and mixed steps on the prefill and decode kernels), and with the torch path that widens a
    padded copy of every sequence's blocks."""
    pytest.importorskip("transformers")
    if not cpu_decode.build() or cpu_prefill.ops() is None:
        pytest.skip("the kernels are not built here")
    from tokenloom import LLM, SamplingParams

    prompts = [[5, 17, 42, 99, 7, 3, 250, 64, 12, 77, 31], [200, 1, 2, 3], [8] * 20]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=0)
    folder = str(tiny_model_dir(arch))

    def generate():
        llm = LLM(folder, kv_cache_memory=16 << 20, kv_cache_dtype=kind, max_num_batched_tokens=15)
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return llm, [o.token_ids for o in outs], [[lp[t] for lp, t in zip(o.logprobs, o.token_ids)] for o in outs]

    steps: dict[str, list] = {"fused": [], "mixed": [], "prompt": [], "torch": []}  # what each kind of call read
    kernel_call, torch_call = backend.KernelAttention.__call__, backend.TorchAttention.__call__

    def spy_kernels(self, layer, *args, **kwargs):
        step = "fused" if self.all_decode else "mixed" if self.decoding else "prompt"
        steps[step].append(self.kv_cache.keys[layer])
        return kernel_call(self, layer, *args, **kwargs)

    def spy_torch(self, layer, *args, **kwargs):
        steps["torch"].append(layer)
        return torch_call(self, layer, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(backend.KernelAttention, "__call__", spy_kernels)
        m.setattr(backend.TorchAttention, "__call__", spy_torch)
        llm, tokens, logprobs = generate()
    layer_type = HalfCache if kind in HALF_DTYPES else QUANTIZED[kind][1]
    for step in ("fused", "mixed", "prompt"):  # each kind of step ran on the kernels, reading the layer in place
        assert steps[step] and all(isinstance(k, layer_type) for k in steps[step]), step
    assert not steps["torch"]
    assert not llm.engine.core.runner.zero_fresh_blocks  # nothing reads past a context
    monkeypatch.setattr(cpu_decode, "usable", lambda *args: False)  # the torch path
    monkeypatch.setattr(cpu_prefill, "usable", lambda *args: False)
    torch_llm, torch_tokens, torch_logprobs = generate()
    assert torch_llm.engine.core.runner.zero_fresh_blocks
    assert tokens == torch_tokens
    # int8/int4 codes are written from keys and values whose float inputs differ by rounding between
    # the two paths, so a value at a rounding edge can take the neighbouring code on one of them (seen
    # on AVX-512: 5.7e-4 on one logprob of 30); a kernel that misreads a code is off by far more
    tolerance = 2e-3 if kind in CODES else 1e-4
    for got, want in zip(logprobs, torch_logprobs):
        assert got == pytest.approx(want, abs=tolerance)
        assert all(math.isfinite(x) for x in got)
