#!/usr/bin/env python
"""Sliding-window layers that keep only the blocks their window reads (kv_cache/window_pool.py)
against every layer keeping every block, on Gemma 3 (5 of every 6 layers slide over 512
positions): KV bytes one sequence holds at the full context (from the cache's geometry), and,
measured over one long prompt then `--tokens` decoded, the KV blocks in use, the process's resident
memory growth, prefill and decode speed. Each mode runs in its own process, alternated `--repeats`
times (medians).

    python benchmarks/window_blocks.py [--model PATH] [--context 32768] [--prompt 8192] [--tokens 64] [--chunk 2048]

Writes results/window_blocks.json.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time

from _common import RESULTS, cpu_name, parser

from tokenloom import LLM, SamplingParams
from tokenloom.engine.kv_layout import sequence_kv_bytes
from tokenloom.eval.scoring import default_eval_text


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def run(model: str, apart: bool, context: int, prompt_tokens: int, tokens: int, chunk: int) -> dict:
    """One process's figures for one mode."""
    llm = LLM(model, max_model_len=context, kv_cache_contexts=1, window_blocks=apart, max_num_batched_tokens=chunk)
    core = llm.engine.core
    ids: list[int] = []
    while len(ids) < prompt_tokens:
        ids += llm.tokenizer.encode(default_eval_text())
    ids = ids[:prompt_tokens]
    before = rss_mib()
    start = time.perf_counter()
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    prefill_s = time.perf_counter() - start
    engine, blocks = llm.engine, core.block_manager
    engine.add_request("d", ids, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    engine.step()  # the prompt: a prefix hit but its last token
    start, most_window = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        if blocks.window is not None:
            most_window = max(most_window, blocks.window.num_blocks - blocks.window.num_available)
    decode_s = time.perf_counter() - start
    kv = core.runner.kv_cache
    c = core.cache_config
    window = c.sliding_window or 0
    layers = len(kv.layers)
    per_token = core.kv_bytes_per_token
    held, whole = sequence_kv_bytes(len(kv.window_layers) if apart else 0, window, layers, per_token, context, 16)
    return {
        "prefill_tok_s": prompt_tokens / prefill_s,
        "decode_tok_s": (tokens - 1) / decode_s,
        "rss_growth_mib": rss_mib() - before,
        "window_blocks_held": most_window,
        "kv_mib_per_sequence_at_context": held / 2**20,
        "kv_mib_every_block": whole / 2**20,
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--prompt", type=int, default=8192, help="prompt tokens")
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded after it")
    p.add_argument("--chunk", type=int, default=2048, help="prompt tokens a step computes (llama.cpp's -b)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--mode", choices=["apart", "whole"], default=None, help="(a child's mode)")
    args = p.parse_args()
    model = args.model or "gemma3-270m"
    if args.mode is not None:
        print(json.dumps(run(model, args.mode == "apart", args.context, args.prompt, args.tokens, args.chunk)))
        return
    runs: dict[str, list[dict]] = {"apart": [], "whole": []}
    for _ in range(args.repeats):
        for mode in ("apart", "whole"):  # alternated: the machine's drift lands on both
            cmd = [sys.executable, __file__, "--model", model, "--mode", mode]
            cmd += ["--context", str(args.context), "--prompt", str(args.prompt), "--tokens", str(args.tokens)]
            cmd += ["--chunk", str(args.chunk)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    a, w = med["apart"], med["whole"]
    print(
        f"{model} on {cpu_name()}: context {args.context}, a {args.prompt}-token prompt in chunks of "
        f"{args.chunk}, {args.tokens} decoded"
    )
    print("| | window layers keep their window's blocks | every layer keeps every block | ratio |")
    print("|---|---:|---:|---:|")
    rows = (
        ("KV MiB a sequence holds at the full context", "kv_mib_per_sequence_at_context", "{:.1f}", True),
        ("resident memory growth over the run, MiB", "rss_growth_mib", "{:.0f}", True),
        ("prefill tok/s", "prefill_tok_s", "{:.0f}", False),
        ("decode tok/s", "decode_tok_s", "{:.1f}", False),
    )
    for name, key, fmt, smaller in rows:
        ratio = w[key] / a[key] if smaller else a[key] / w[key]
        print(f"| {name} | {fmt.format(a[key])} | {fmt.format(w[key])} | {ratio:.2f}x |")
    print(f"window-layer blocks held at once while decoding: {a['window_blocks_held']:.0f}")
    RESULTS.mkdir(exist_ok=True)
    out_path = RESULTS / "window_blocks.json"
    out_path.write_text(json.dumps({"model": model, "cpu": cpu_name(), "args": vars(args), "runs": runs}, indent=1))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
