#!/usr/bin/env python
"""Mixture of experts: tokenloom vs HF transformers on one random Mixtral-style model.

Builds (once, cached under benchmarks/results/moe-model) a random MixtralForCausalLM:
hidden 1024, 8 layers, 8 experts of intermediate 2048, top-2, vocab 32000 (1.6 GB
float32), saved by transformers. Measures, same process, same threads, medians of
--repeats:
  1. batch 1, prompt --prompt, --new new tokens: decode tok/s of each engine;
  2. batch --batch: output tok/s of each engine;
  3. the share of tokenloom's batch-1 decode step spent routing: the router matmul,
     softmax/top-k, and grouping the tokens by expert (sort, gather, scatter-add), timed
     per sparse layer on the decode step's shape (the experts themselves replaced by the
     identity), times the sparse layers, over the measured step time.

Writes benchmarks/results/bench_moe.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from _common import RESULTS, median_time, parser
from tqdm import tqdm

from tokenloom import LLM, SamplingParams
from tokenloom.models.moe import route

CONFIG = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=4096,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def build_model(folder: Path) -> Path:
    """A random Mixtral (seeded) with a word-level tokenizer, saved as an HF folder."""
    if (folder / "config.json").exists():
        return folder
    import transformers
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**CONFIG)).eval()
    model.save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(CONFIG["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(folder / "tokenizer.json"))
    return folder


def decode_rates(generate, args) -> dict:
    """generate(prompts, new) -> {decode_tok_s, batch_tok_s}: batch-1 decode excludes the prefill."""
    prompt = [100 + i for i in range(args.prompt)]
    generate([prompt], 4)  # warm-up
    first = median_time(lambda: generate([prompt], 1), args.repeats)
    total = median_time(lambda: generate([prompt], args.new), args.repeats)
    batch = [[100 + 37 * b + i for i in range(args.prompt)] for b in range(args.batch)]
    batched = median_time(lambda: generate(batch, args.new), args.repeats)
    return {
        "decode_tok_s": (args.new - 1) / (total - first),
        "batch_tok_s": args.batch * args.new / batched,
        "decode_step_ms": 1000 * (total - first) / (args.new - 1),
    }


def routing_ms_per_step(llm: LLM, iterations: int = 2000) -> float:
    """Milliseconds a batch-1 decode step spends routing, summed over the sparse layers."""
    model = llm.engine.core.runner.model
    blocks = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    x = torch.randn(1, model.config.hidden_size)
    identity = torch.nn.ModuleList(torch.nn.Identity() for _ in blocks[0].experts)
    total = 0.0
    for block in blocks:
        experts, block.experts = block.experts, identity

        def step(block=block):
            weights, chosen = route(block.gate(x), block.moe)
            block.mix_experts(x, weights, chosen)

        for _ in range(50):
            step()
        t0 = time.perf_counter()
        for _ in range(iterations):
            step()
        total += (time.perf_counter() - t0) / iterations
        block.experts = experts
    return 1000 * total


def measure_tokenloom(folder: Path, args) -> tuple[dict, float]:
    llm = LLM(str(folder), kv_cache_memory=1 << 30, enable_prefix_caching=False)

    def generate(prompts, new):
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))

    return decode_rates(generate, args), routing_ms_per_step(llm)


def measure_transformers(folder: Path, args) -> dict:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    @torch.inference_mode()
    def generate(prompts, new):
        hf.generate(torch.tensor(prompts), max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    return decode_rates(generate, args)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    folder = build_model(Path(args.model) if args.model else RESULTS / "moe-model")
    res: dict = {}
    with tqdm(total=2, desc="benchmarking", unit="engine") as bar:
        res["tokenloom"], res["routing_ms_per_step"] = measure_tokenloom(folder, args)
        bar.update()
        res["transformers"] = measure_transformers(folder, args)
        bar.update()
    ours, theirs = res["tokenloom"], res["transformers"]
    share = res["routing_ms_per_step"] / ours["decode_step_ms"]
    res["config"] = vars(args) | {"model": CONFIG, "threads": torch.get_num_threads(), "torch": torch.__version__}
    print(
        f"\nrandom Mixtral-style MoE (hidden 1024, 8 layers, 8 experts x 2048, top-2) float32, prompt "
        f"{args.prompt}, {args.new} new, {torch.get_num_threads()} threads, medians of {args.repeats}"
    )
    print("| metric | tokenloom | transformers | ratio |\n|---|---:|---:|---:|")
    for label, key in (("batch-1 decode tok/s", "decode_tok_s"), (f"batch-{args.batch} output tok/s", "batch_tok_s")):
        print(f"| {label} | {ours[key]:.1f} | {theirs[key]:.1f} | {ours[key] / theirs[key]:.2f}x |")
    print(
        f"\ntokenloom decode step {ours['decode_step_ms']:.2f} ms, of which routing "
        f"{res['routing_ms_per_step']:.3f} ms ({share:.1%}: router matmul, softmax/top-k, grouping by expert)"
    )
    (RESULTS / "bench_moe.json").write_text(json.dumps(res, indent=2))
    print(f"json: {RESULTS / 'bench_moe.json'}")


if __name__ == "__main__":
    main()
