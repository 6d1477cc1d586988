#!/usr/bin/env python
"""Decode attention alone over each KV cache format: the CPU kernel vs the torch path.

One sequence's decode-step attention (one query) at each --contexts length, in a model of
--heads query heads, --kv-heads kv heads and --head-dim (default: Qwen2.5-0.5B's 14 / 2 / 64),
on --threads threads. Each step reads --layers layers' caches in turn (default 24, as the model
has), so every layer's blocks come from memory as in a real decode step, not from a cache the
previous call warmed. Paths: the torch path over an int4 cache (its blocks gathered and
dequantized, then SDPA) and the kernel over int4, int8, float16 and float32 caches. Medians over
--repeats steps, the paths interleaved within each repeat; prints ms per step (all layers)
and per layer.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from _common import cpu_name, parser

from tokenloom.attention import cpu_decode, torch_sdpa
from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.kv_cache.quantized import HalfCache, Int4Cache, Int8Cache

BS = 16
KINDS = ("int4", "int8", "float16", "float32")  # the kernel's cache formats timed


def layer_caches(kind: str, n: int, kv_heads: int, head_dim: int, gen: torch.Generator):
    """(keys, values) of one layer of random rows at every position of a cache just big enough for
    n positions (plus its null block): float32 tensors, Int8Caches, Int4Caches or HalfCaches."""
    blocks = -(-n // BS)
    shape = (blocks + 1, BS, kv_heads, head_dim)
    pair = []
    for _ in range(2):
        x = torch.randn(blocks * BS, kv_heads, head_dim, generator=gen)
        if kind == "float32":
            pair.append(torch.cat([x, torch.zeros(BS, kv_heads, head_dim)]).view(shape))
            continue
        zeros = lambda size, dtype: torch.zeros(size, dtype=dtype)  # noqa: E731
        if kind == "int8":
            cache = Int8Cache(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape[:3]), torch.float32)
        elif kind == "float16":
            cache = HalfCache.allocate(shape, torch.float16, torch.float32, zeros)
        else:
            cache = Int4Cache.allocate(shape, torch.float32, zeros)
        cache.store(torch.arange(blocks * BS), x)
        pair.append(cache)
    return pair


def steps(n: int, args, gen: torch.Generator) -> dict:
    """Path name -> a call running one decode step's attention over every layer."""
    blocks = -(-n // BS)
    table = torch.randperm(blocks, generator=gen)  # scattered blocks, as a long-running server's
    meta = AttentionMetadata(torch.zeros(1, dtype=torch.long), [0], [1], [n], [table], null_block=blocks)
    q = torch.randn(1, args.heads, args.head_dim, generator=gen)
    scale = args.head_dim**-0.5
    new = torch.zeros(1, args.kv_heads, args.head_dim)  # this step's k/v: already in the cache, unread
    caches = {
        kind: [layer_caches(kind, n, args.kv_heads, args.head_dim, gen) for _ in range(args.layers)] for kind in KINDS
    }

    def torch_int4() -> None:
        for k, v in caches["int4"]:
            torch_sdpa.paged_attention(q, new, new, k, v, meta, scale)

    def kernel(kind: str) -> Callable[[], None]:
        def step() -> None:
            for k, v in caches[kind]:
                cpu_decode.attend(q, k, v, meta, [0], scale)

        return step

    return {"torch, int4": torch_int4, **{f"kernel, {kind}": kernel(kind) for kind in KINDS}}


def interleaved_medians(paths: dict, repeats: int) -> dict:
    """Path name -> median seconds per call over `repeats` rounds, each calling every path once."""
    for fn in paths.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    assert cpu_decode.build(), "the decode kernel does not build here"
    gen = torch.Generator().manual_seed(0)
    rows = {n: interleaved_medians(steps(n, args, gen), args.repeats) for n in args.contexts}
    print(
        f"\n{args.heads} heads, {args.kv_heads} kv heads, head_dim {args.head_dim}, {args.layers} layers, "
        f"{args.threads} threads, {cpu_name()}"
    )
    print("ms per step (per layer)\n| context | " + " | ".join(rows[args.contexts[0]]) + " |")
    print("|---:|" + "---:|" * len(rows[args.contexts[0]]))
    for n, medians in rows.items():
        cells = [f"{s * 1e3:.2f} ({s * 1e6 / args.layers:.0f} us)" for s in medians.values()]
        print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
