#!/usr/bin/env python
"""Attention on the CPU kernels vs the torch path, same model, same process.

For a model whose attention has a twist the kernels learned late (Gemma 2's soft-capped
scores, Phi-4-mini's partial rotary, Gemma's head size 256), this measures what the kernels
buy: prefill tok/s of a --prompt-token prompt and decode tok/s of --new tokens after it, once
with the kernels (default) and once with them turned off (KernelAttention declined and the
decode/prefill kernels unusable, so every sequence runs torch ops: SDPA, or transformers'
eager arithmetic where scores are soft-capped). Medians of --repeats; prefix caching off.

--model: an HF folder or GGUF file; default: a random Gemma 2 (hidden 1024, 8 layers,
8 heads of 128, 4 kv heads, window 512, scores capped at 50), built once under
benchmarks/results/gemma2-model. Writes benchmarks/results/bench_attention_paths.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from _common import RESULTS, cpu_name, median_time, parser
from tqdm import tqdm

from tokenloom import LLM, SamplingParams
from tokenloom.attention import backend, cpu_decode, cpu_prefill

GEMMA2 = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    query_pre_attn_scalar=128,
    sliding_window=512,
    attn_logit_softcapping=50.0,
    max_position_embeddings=4096,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def random_gemma2(folder: Path) -> Path:
    """A seeded random Gemma 2 with the tests' tiny tokenizer, saved as an HF folder (once)."""
    if (folder / "config.json").exists():
        return folder
    import sys

    import torch
    import transformers

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from conftest import make_tiny_tokenizer

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Gemma2Config(**GEMMA2), dtype=torch.float32)
    model.save_pretrained(folder)
    make_tiny_tokenizer(folder)
    return folder


def torch_path_only() -> None:
    """Turn the attention kernels off for the rest of the process."""
    backend.kernels_take = lambda *args: False
    cpu_decode.usable = cpu_prefill.usable = lambda *args: False


def measure(llm: LLM, prompt: list[int], new: int, repeats: int) -> dict:
    def run(tokens: int):
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)

    run(2)  # warm-up
    prefill = median_time(lambda: run(1), repeats)
    whole = median_time(lambda: run(new + 1), repeats)
    return {"prefill_tok_s": len(prompt) / prefill, "decode_tok_s": new / (whole - prefill)}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    model = args.model or str(random_gemma2(RESULTS / "gemma2-model"))
    llm = LLM(model, enable_prefix_caching=False, max_model_len=args.prompt + args.new + 8)
    prompt = [5 + i % 250 for i in range(args.prompt)]
    results = {}
    for path in tqdm(["kernels", "torch"], desc="attention paths"):
        if path == "torch":
            torch_path_only()
        results[path] = measure(llm, prompt, args.new, args.repeats)
    print(f"\n{Path(model).name}, prompt {args.prompt}, {args.new} new tokens, {cpu_name()}")
    print("| path | prefill tok/s | decode tok/s |\n|---|---:|---:|")
    for path, r in results.items():
        print(f"| {path} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.1f} |")
    k, t = results["kernels"], results["torch"]
    print(
        f"| kernels / torch | {k['prefill_tok_s'] / t['prefill_tok_s']:.2f}x | "
        f"{k['decode_tok_s'] / t['decode_tok_s']:.2f}x |"
    )
    out = RESULTS / "bench_attention_paths.json"
    out.write_text(json.dumps({"model": model, "prompt": args.prompt, "new": args.new, **results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
