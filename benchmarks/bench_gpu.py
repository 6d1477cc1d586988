#!/usr/bin/env python
"""The GPU path: tokenloom vs HF transformers generate() on one CUDA device, same weights.

Model: --model (an HF folder), default SmolLM2-135M. On a machine without the model files
(the lent GPU machines reach no hub), --random-from CONFIG_DIR builds a random-weight model
of that config with transformers (same shapes, same speed as the real weights).
For float32, bfloat16 and float16: batch-1 decode tokens/s and time to first token
(prompt 128, 128 new tokens), batch-16 output tokens/s, and whether greedy tokens match HF.
Writes benchmarks/results/bench_gpu.json (or --out).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from _common import RESULTS, parser

from tokenloom import LLM, SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROMPT, NEW, BATCH = 128, 128, 16


def timed(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def random_model(config_dir: str, out: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    for f in Path(config_dir).iterdir():
        if f.name.startswith("tokenizer") or f.name in ("generation_config.json", "chat_template.jinja"):
            (out / f.name).write_bytes(f.read_bytes())
    return out


def bench_tokenloom(folder: str, dtype: str, prompts: list[list[int]]) -> dict:
    llm = LLM(folder, dtype=dtype, device="cuda", kv_cache_memory=2 << 30, enable_prefix_caching=False)
    one = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts[:2], one)                                        # warm-up
    ttft = timed(lambda: llm.generate([prompts[0]], first))
    total = timed(lambda: llm.generate([prompts[0]], one))
    batch = timed(lambda: llm.generate(prompts[:BATCH], one))
    tokens = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    return {"ttft_s": ttft, "decode_tok_s": (NEW - 1) / (total - ttft), "batch_tok_s": BATCH * NEW / batch,
            "tokens": tokens[0].outputs[0].token_ids}


def bench_hf(folder: str, dtype: str, prompts: list[list[int]]) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype]).to("cuda").eval()

    def gen(batch, new):
        ids = torch.tensor(batch, device="cuda")
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, pad_token_id=0)
    gen(prompts[:2], NEW)
    ttft = timed(lambda: gen([prompts[0]], 1))
    total = timed(lambda: gen([prompts[0]], NEW))
    batch = timed(lambda: gen(prompts[:BATCH], NEW))
    tokens = gen([prompts[0]], 32)[0, PROMPT:].tolist()
    return {"ttft_s": ttft, "decode_tok_s": (NEW - 1) / (total - ttft), "batch_tok_s": BATCH * NEW / batch,
            "tokens": tokens}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--random-from", default=None, help="config + tokenizer folder: benchmark random weights")
    p.add_argument("--out", default=str(RESULTS / "bench_gpu.json"))
    args = p.parse_args()
    if args.random_from:
        folder = str(random_model(args.random_from, Path("/tmp/tokenloom-random-model")))
    else:
        from tokenloom import hub
        folder = args.model or str(hub.pull())
    gen = torch.Generator().manual_seed(0)
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    prompts = [torch.randint(0, vocab, (PROMPT,), generator=gen).tolist() for _ in range(BATCH)]
    rows = []
    for dtype in DTYPES:
        ours, hf = bench_tokenloom(folder, dtype, prompts), bench_hf(folder, dtype, prompts)
        same = next((i for i, (a, b) in enumerate(zip(ours["tokens"], hf["tokens"])) if a != b), 32)
        rows.append({"dtype": dtype, "tokenloom": ours, "transformers": hf, "same_greedy_prefix": same})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                          "random_weights": bool(args.random_from), "rows": rows}, indent=2))
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}; prompt {PROMPT}, {NEW} new tokens")
    print("| dtype | engine | batch-1 decode tok/s | vs HF | TTFT ms | batch-16 tok/s | vs HF "
          "| greedy tokens = HF (of 32) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        for eng in ("tokenloom", "transformers"):
            m, h = r[eng], r["transformers"]
            print(f"| {r['dtype']} | {eng} | {m['decode_tok_s']:.1f} | {m['decode_tok_s'] / h['decode_tok_s']:.2f}x "
                  f"| {m['ttft_s'] * 1000:.1f} | {m['batch_tok_s']:.0f} | {m['batch_tok_s'] / h['batch_tok_s']:.2f}x "
                  f"| {r['same_greedy_prefix'] if eng == 'tokenloom' else '-'} |")


if __name__ == "__main__":
    main()
