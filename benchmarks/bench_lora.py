#!/usr/bin/env python
"""LoRA adapters: what serving several of them over one base costs, against the base alone.

For each model (default: the packaged SmolLM2-135M and Qwen2.5-Coder-0.5B GGUFs, blocks kept as
stored), four random rank-R adapters on every projection PEFT targets (q/k/v/o, gate/up/down) are
written as PEFT folders, then in the same process, alternating engines round by round:

1. Serving: 16 concurrent requests (distinct prompts, greedy, EOS ignored, --tokens each) spread
   over the four adapters in one engine, against the same 16 on an engine without LoRA; output
   tokens per second over the whole run (prefill included). Also the LoRA engine with every
   request on the base (what the adapter slots cost by themselves).
2. Batch-1 decode: one request through one adapter against the base engine; tokens per second
   after the first token.

The adapters are saved in bfloat16, as adapters trained in bfloat16 are (--adapter-dtype float32:
float32 files, which the engine then keeps in float32).

Medians over --rounds. Writes benchmarks/results/bench_lora.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, cpu_name, parser

from tokenloom import LLM, SamplingParams
from tokenloom.loader import hub

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOPICS = ["a lighthouse", "the moon", "a river", "bread", "a violin", "winter", "a robot", "tea"]


def write_adapter(config, folder: Path, rank: int, seed: int, dtype: str = "bfloat16") -> str:
    """A PEFT LoRA folder for a model of `config`'s shapes: every target, factors ~ N(0, 0.02), stored
    as `dtype` (adapters trained in bfloat16 are saved so)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {  # (out, in)
        "self_attn.q_proj": (q, c.hidden_size),
        "self_attn.k_proj": (kv, c.hidden_size),
        "self_attn.v_proj": (kv, c.hidden_size),
        "self_attn.o_proj": (c.hidden_size, q),
        "mlp.gate_proj": (c.intermediate_size, c.hidden_size),
        "mlp.up_proj": (c.intermediate_size, c.hidden_size),
        "mlp.down_proj": (c.hidden_size, c.intermediate_size),
    }
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(c.num_layers):
        for module, (out, inp) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, inp, generator=g) * 0.02).to(getattr(torch, dtype))
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * 0.02).to(getattr(torch, dtype))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (folder / "adapter_config.json").write_text(json.dumps(config_json))
    return str(folder)


def serve_tok_s(llm: LLM, prompts: list[str], tokens: int, adapters: list[str | None]) -> float:
    """Output tokens per second of all prompts at once, request i through adapters[i % len]."""
    params = [
        SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, lora=adapters[i % len(adapters)])
        for i in range(len(prompts))
    ]
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started)


def decode_tok_s(llm: LLM, prompt: str, tokens: int, adapter: str | None) -> float:
    """Tokens per second after the first, one request alone."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, lora=adapter)
    times = [time.perf_counter() for delta in llm.stream_deltas(prompt, params) if delta.new_token_ids]
    return (len(times) - 1) / (times[-1] - times[0])


def bench_model(path: str, args, folder: Path) -> dict:
    base = LLM(path, kv_cache_memory=256 << 20)
    config = base.engine.model_config
    names = [f"adapter{i}" for i in range(4)]
    adapters = {n: write_adapter(config, folder / n, args.rank, i, args.adapter_dtype) for i, n in enumerate(names)}
    lora = LLM(path, kv_cache_memory=256 << 20, lora=adapters, max_loras=4, max_lora_rank=args.rank)
    prompts = [f"Write a short story about {TOPICS[i % len(TOPICS)]} (number {i})." for i in range(args.requests)]
    runs: dict[str, list[float]] = {
        k: [] for k in ("serve_base", "serve_lora", "serve_lora_engine_base", "b1_base", "b1_lora")
    }
    for llm in (base, lora):  # warm-up: kernels, tapes, heap
        serve_tok_s(llm, prompts[:4], 8, [None])
    for _ in tqdm(range(args.rounds), desc=Path(path).name, unit="round"):
        runs["serve_base"].append(serve_tok_s(base, prompts, args.tokens, [None]))
        runs["serve_lora"].append(serve_tok_s(lora, prompts, args.tokens, names))
        runs["serve_lora_engine_base"].append(serve_tok_s(lora, prompts, args.tokens, [None]))
        runs["b1_base"].append(decode_tok_s(base, prompts[0], args.tokens, None))
        runs["b1_lora"].append(decode_tok_s(lora, prompts[0], args.tokens, names[0]))
    return {k: statistics.median(v) for k, v in runs.items()} | {"runs": runs}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--models", nargs="*", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--adapter-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="how the adapters are saved"
    )
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            path = hub.resolve_model(name)
            results[name] = bench_model(path, args, Path(tmp) / name)
    load = f"{args.requests} requests x {args.tokens} tokens, rank-{args.rank} adapters on q/k/v/o/gate/up/down"
    print(f"\n{cpu_name()}; {load}")
    print(
        "| model | base alone tok/s | 4 adapters tok/s | ratio | LoRA engine, base rows "
        "| batch-1 base | batch-1 adapter | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {r['serve_base']:.1f} | {r['serve_lora']:.1f} | {r['serve_lora'] / r['serve_base']:.2f}x "
            f"| {r['serve_lora_engine_base']:.1f} | {r['b1_base']:.1f} | {r['b1_lora']:.1f} "
            f"| {r['b1_lora'] / r['b1_base']:.2f}x |"
        )
    RESULTS.mkdir(exist_ok=True)
    out = {"cpu": cpu_name(), "args": vars(args), "results": results}
    (RESULTS / "bench_lora.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
