#!/usr/bin/env python
"""Context shift over a long generation: one sequence generates `--tokens` tokens in a context of
`--context` (engine/context_shift.py), and every `--window` tokens the speed, the KV blocks in use
and the process's resident memory are recorded. Flat columns are the point: a shift costs a turn of
the moved keys, not a recompute, and memory never grows past one context.

    python benchmarks/context_shift.py [--model PATH] [--context 2048] [--tokens 20000] [--window 1000]

Writes results/context_shift.json and, with matplotlib, results/context_shift.png.
"""

from __future__ import annotations

import json
import resource
import time

from _common import RESULTS, cpu_name, finish_plot, parser

from tokenloom import LLM, SamplingParams
from tokenloom.loader import hub


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--context", type=int, default=2048, help="max_model_len")
    p.add_argument("--tokens", type=int, default=20_000, help="tokens generated")
    p.add_argument("--window", type=int, default=1000, help="tokens per row")
    args = p.parse_args()
    model = args.model or str(hub.float32_folder())
    llm = LLM(model, max_model_len=args.context, context_shift=True, kv_cache_contexts=1)
    engine = llm.engine
    blocks = engine.core.block_manager
    params = SamplingParams(temperature=0.8, seed=0, max_tokens=args.tokens, ignore_eos=True)
    engine.add_request("long", llm.tokenizer.encode("Once upon a time"), params)
    rows: list[dict] = []
    done, counted, start, most_blocks = 0, 0, time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for delta in engine.step():
            done += len(delta.new_token_ids)
        most_blocks = max(most_blocks, blocks.num_used_blocks)
        if done - counted >= args.window or not engine.has_unfinished_requests():
            now = time.perf_counter()
            row = {"tokens": done, "tok_s": (done - counted) / (now - start), "blocks": most_blocks}
            rows.append(row | {"rss_mib": rss_mib(), "shifts": engine.core.scheduler.num_context_shifts})
            counted, start, most_blocks = done, now, 0
    print(f"{model} on {cpu_name()}: {args.tokens} tokens in a {args.context}-token context, context shift on")
    print("| tokens | tok/s | most KV blocks in use | RSS MiB | shifts so far |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tokens']} | {r['tok_s']:.1f} | {r['blocks']} | {r['rss_mib']:.0f} | {r['shifts']} |")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "context_shift.json"
    out.write_text(json.dumps({"model": model, "cpu": cpu_name(), "context": args.context, "rows": rows}, indent=1))
    print(f"wrote {out}")
    _plot(rows, args.context)


def _plot(rows: list[dict], context: int) -> None:
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = [r["tokens"] for r in rows]
    ax.plot(xs, [r["tok_s"] for r in rows], marker="o", label="tok/s")
    ax2 = ax.twinx()
    ax2.plot(xs, [r["rss_mib"] for r in rows], color="tab:orange", marker="s", label="RSS MiB")
    ax.set_xlabel(f"tokens generated (context {context})")
    ax.set_ylabel("tok/s")
    ax2.set_ylabel("RSS MiB")
    ax.set_ylim(bottom=0)
    ax2.set_ylim(bottom=0)
    finish_plot(fig, ax, RESULTS / "context_shift.png")


if __name__ == "__main__":
    main()
