#!/usr/bin/env python
"""What a quantized KV cache costs in quality: each --kv-cache-dtype against the model's own float32
cache, teacher-forced on the shipped text at a depth (llama-perplexity --kl-divergence's figures:
the share of positions whose top-1 token is the same, the mean and 99th-percentile KL).

The text (tokenloom/data/declaration.txt, repeated to reach the depth) is prefilled in chunks, so
every position after the first chunk reads the earlier keys and values back from the cache, as
decoding does; the `--score` positions after `--depth` are scored.

    python benchmarks/kv_quality.py [--model FOLDER] [--depth 4096] [--score 512]
"""

from __future__ import annotations

import json
import time

from _common import RESULTS, cpu_name, parser

from tokenloom import LLM
from tokenloom.eval.agreement import agreement
from tokenloom.eval.scoring import default_eval_text
from tokenloom.loader import hub


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--depth", type=int, default=4096, help="context before the scored positions")
    p.add_argument("--score", type=int, default=512, help="positions scored after the depth")
    p.add_argument("--dtypes", default="int8,int4", help="the quantized caches to compare")
    args = p.parse_args()
    folder = args.model or str(hub.float32_folder())
    memory = 512 << 20
    reference = LLM(folder, kv_cache_memory=memory)
    text = default_eval_text()
    ids: list[int] = []
    while len(ids) < args.depth + args.score:
        ids += reference.tokenizer.encode(text)
    ids = ids[: args.depth + args.score]
    rows = []
    for dtype in args.dtypes.split(","):
        llm = LLM(folder, kv_cache_dtype=dtype, kv_cache_memory=memory)
        start = time.perf_counter()
        got = agreement(llm.engine, reference.engine, ids, window=len(ids), skip=args.depth)
        rows.append({"kv_cache_dtype": dtype, **vars(got), "seconds": time.perf_counter() - start})
        del llm
    print(f"{folder} on {cpu_name()}: depth {args.depth}, {args.score} positions scored against float32 KV")
    print("| KV cache | same top-1 | mean KL (nats) | KL p99 |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kv_cache_dtype']} | {r['same_top1']:.3f} | {r['kl_mean']:.4f} | {r['kl_p99']:.3f} |")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "kv_quality.json"
    out.write_text(json.dumps({"model": folder, "cpu": cpu_name(), "depth": args.depth, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
