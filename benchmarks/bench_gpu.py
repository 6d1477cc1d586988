#!/usr/bin/env python
"""The GPU path: tokenloom against HF transformers on one CUDA device, the same weights, one process.

The lent GPU machines reach no hub, so models are random weights of real shapes, built there by
transformers (speed does not depend on the values): SmolLM2-135M's config and tokenizer from
--config-dir (default: the pulled default model's folder), and Llama-3.2-1B's shapes with the
same tokenizer (its ids past the tokenizer's decode to nothing). Sections (--only picks some):

- bandwidth: the device's measured copy bandwidth (bytes read + written) and bf16 matmul rate;
- smollm2: batch-1 decode tok/s and time to first token in bf16 and float32 (and bf16 without
  CUDA graphs), the decode graph's own replay time, where a decode step's host time goes, and
  greedy tokens against transformers in float32 (32 tokens);
- llama1b: batch-1 bf16 decode against the memory-bandwidth limit (weight bytes read per token /
  the measured copy bandwidth);
- concurrency: 64 and 256 requests at once (prompts 128-512 tokens, 128-256 new tokens) against
  transformers' static batching of the same requests: output tok/s, TTFT and TPOT p50/p99.

Writes JSON (--out) and prints the tables last.
"""

from __future__ import annotations

import cProfile
import gc
import io
import json
import pstats
import random
import statistics
import time
from pathlib import Path

import torch
from _common import RESULTS, parser

from tokenloom import LLM, SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
PROMPT, NEW = 128, 128
LLAMA_1B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    hidden_act="silu",
    bos_token_id=1,
    eos_token_id=2,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)


def log(*args) -> None:
    print(*args, flush=True)


def synced(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def median_time(fn, repeats: int = 3) -> float:
    return statistics.median(synced(fn) for _ in range(repeats))


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


# ---- models ------------------------------------------------------------------------------------
def random_model(config: dict, tokenizer_dir: Path, out: Path, dtype: torch.dtype) -> Path:
    """Random weights of `config` saved as an HF folder with the tokenizer of `tokenizer_dir`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(out)
    del model
    free()
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def prompts_of(vocab: int, n: int, lengths: list[int] | None = None, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i] if lengths else PROMPT,), generator=gen).tolist() for i in range(n)]


# ---- measurements --------------------------------------------------------------------------------
def bandwidth() -> dict:
    n = 1 << 29  # 1 GiB of bf16
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy = median_time(lambda: dst.copy_(src), 10)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    a @ b
    mm = median_time(lambda: a @ b, 10)
    return {"copy_GBps": 2 * n * 2 / copy / 1e9, "bf16_matmul_TFLOPs": 2 * 8192**3 / mm / 1e12}


def tokenloom_decode(folder: str, dtype: str, prompt: list[int], eager: bool = False, **engine) -> dict:
    llm = LLM(
        folder,
        dtype=dtype,
        device="cuda",
        kv_cache_memory=2 << 30,
        enable_prefix_caching=False,
        max_num_seqs=engine.pop("max_num_seqs", 16),
        enforce_eager=eager,
        **engine,
    )
    one = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([prompt, prompt], one)  # warm-up
    ttft = median_time(lambda: llm.generate([prompt], first))
    total = median_time(lambda: llm.generate([prompt], one))
    out = {
        "ttft_s": ttft,
        "decode_tok_s": (NEW - 1) / (total - ttft),
        "llm": llm,
        "tokens": llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
        .outputs[0]
        .token_ids,
    }
    graphs = llm.engine.core.runner.graphs
    if graphs is not None:
        graph = graphs.graphs[1]
        graph.replay()
        out["graph_replay_ms"] = median_time(lambda: [graph.replay() for _ in range(100)], 3) * 10
    return out


def kernel_profile(llm, top: int = 14) -> str:
    """What one batch-1 decode graph replay spends on the device, by kernel (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    graph = llm.engine.core.runner.graphs.graphs[1]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60)


def host_profile(llm, prompt: list[int], top: int = 22) -> str:
    """Where a 128-token greedy decode's host time goes (cProfile, by own time)."""
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    prof = cProfile.Profile()
    prof.enable()
    llm.generate([prompt], params)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def hf_decode(folder: str, dtype: str, prompt: list[int]) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype]).to("cuda").eval()
    ids = torch.tensor([prompt], device="cuda")

    def gen(new):
        with torch.no_grad():
            return model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )

    gen(NEW)
    ttft = median_time(lambda: gen(1))
    total = median_time(lambda: gen(NEW))
    tokens = gen(32)[0, len(prompt) :].tolist()
    return {"ttft_s": ttft, "decode_tok_s": (NEW - 1) / (total - ttft), "tokens": tokens}


def same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def weight_bytes_per_token(llm) -> int:
    """Bytes of weights a decode step reads: every parameter once (a tied embedding is the LM head),
    less an untied input embedding (one row of it is read)."""
    model = llm.engine.core.runner.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        emb = model.get_submodule(model.input_embedding_name).weight
        total -= emb.numel() * emb.element_size()
    return total


def section_smollm2(folder: str, vocab: int, with_eager: bool) -> dict:
    prompt = prompts_of(vocab, 1)[0]
    rows = {}
    for dtype in ("bfloat16", "float32"):
        ours = tokenloom_decode(folder, dtype, prompt)
        llm = ours.pop("llm")
        if dtype == "bfloat16":
            rows["profile"] = host_profile(llm, prompt)
            try:
                rows["kernels"] = kernel_profile(llm)
            except Exception as e:  # the profiler is a report, not the benchmark
                rows["kernels"] = f"kernel profile failed: {e!r}"
        del llm
        free()
        hf = hf_decode(folder, dtype, prompt)
        free()
        rows[dtype] = {
            "tokenloom": ours,
            "transformers": hf,
            "same_greedy_prefix": same_prefix(ours["tokens"], hf["tokens"]),
        }
        log(
            f"smollm2 {dtype}: tokenloom {ours['decode_tok_s']:.0f} tok/s (graph replay "
            f"{ours.get('graph_replay_ms', float('nan')):.3f} ms), transformers {hf['decode_tok_s']:.0f} tok/s, "
            f"greedy same for {rows[dtype]['same_greedy_prefix']} of 32"
        )
    if with_eager:
        eager = tokenloom_decode(folder, "bfloat16", prompt, eager=True)
        del eager["llm"]
        free()
        rows["bfloat16_eager"] = eager
        log(f"smollm2 bf16 --enforce-eager: {eager['decode_tok_s']:.0f} tok/s")
    return rows


def section_llama1b(folder: str, vocab: int, copy_GBps: float) -> dict:
    prompt = prompts_of(vocab, 1)[0]
    ours = tokenloom_decode(folder, "bfloat16", prompt, max_model_len=4096)
    llm = ours.pop("llm")
    weights = weight_bytes_per_token(llm)
    del llm
    free()
    hf = hf_decode(folder, "bfloat16", prompt)
    free()
    limit = copy_GBps * 1e9 / weights
    row = {
        "tokenloom": ours,
        "transformers": hf,
        "weight_bytes": weights,
        "limit_tok_s": limit,
        "fraction_of_limit": ours["decode_tok_s"] / limit,
    }
    log(
        f"llama1b bf16: tokenloom {ours['decode_tok_s']:.0f} tok/s = {row['fraction_of_limit']:.0%} of "
        f"{limit:.0f} (weights {weights / 1e9:.2f} GB / {copy_GBps:.0f} GB/s), transformers "
        f"{hf['decode_tok_s']:.0f} tok/s"
    )
    return row


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def tokenloom_concurrent(folder: str, prompts: list[list[int]], news: list[int]) -> dict:
    llm = LLM(
        folder,
        dtype="bfloat16",
        device="cuda",
        kv_cache_memory=8 << 30,
        enable_prefix_caching=False,
        max_num_seqs=len(prompts),
    )
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in news]
    llm.generate(prompts[:8], params[:8])  # warm-up
    started = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    ttft = [o.outputs[0].metrics.ttft for o in outs]
    tpot = [o.outputs[0].metrics.tpot for o in outs]
    del llm
    free()
    return {
        "tok_s": sum(news) / elapsed,
        "seconds": elapsed,
        "ttft_p50": percentile(ttft, 50),
        "ttft_p99": percentile(ttft, 99),
        "tpot_p50": percentile(tpot, 50),
        "tpot_p99": percentile(tpot, 99),
    }


def hf_static(folder: str, prompts: list[list[int]], news: list[int]) -> dict:
    """One static batch: prompts padded on the left, every row generating max(news) tokens; only
    each request's own tokens count as output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to("cuda").eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")

    def gen(new):
        with torch.no_grad():
            return model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )

    gen(2)
    ttft = synced(lambda: gen(1))
    elapsed = synced(lambda: gen(max(news)))
    tpot = (elapsed - ttft) / (max(news) - 1)
    return {
        "tok_s": sum(news) / elapsed,
        "seconds": elapsed,
        "ttft_p50": ttft,
        "ttft_p99": ttft,
        "tpot_p50": tpot,
        "tpot_p99": tpot,
    }


def section_concurrency(folder: str, vocab: int, levels: list[int]) -> dict:
    rows = {}
    for n in levels:
        rng = random.Random(n)
        lengths = [rng.randint(128, 512) for _ in range(n)]
        news = [rng.randint(128, 256) for _ in range(n)]
        prompts = prompts_of(vocab, n, lengths, seed=n)
        ours = tokenloom_concurrent(folder, prompts, news)
        hf = hf_static(folder, prompts, news)
        free()
        rows[str(n)] = {"tokenloom": ours, "transformers": hf, "ratio": ours["tok_s"] / hf["tok_s"]}
        log(
            f"concurrency {n}: tokenloom {ours['tok_s']:.0f} tok/s, transformers static {hf['tok_s']:.0f} tok/s "
            f"({rows[str(n)]['ratio']:.1f}x)"
        )
    return rows


# ---- report --------------------------------------------------------------------------------------
def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """A markdown table under its title: the first column left-aligned, the others right."""
    log(f"\n{title}\n")
    log("| " + " | ".join(header) + " |")
    log("|---|" + "---:|" * (len(header) - 1))
    for row in rows:
        log("| " + " | ".join(row) + " |")


def report_smollm2(s: dict) -> None:
    hf = {dtype: s[dtype]["transformers"]["decode_tok_s"] for dtype in ("bfloat16", "float32")}
    rows = []
    for dtype in ("bfloat16", "float32"):
        for eng in ("tokenloom", "transformers"):
            m = s[dtype][eng]
            rows.append(
                [
                    dtype,
                    eng,
                    f"{m['decode_tok_s']:.0f}",
                    f"{m['decode_tok_s'] / hf[dtype]:.2f}x",
                    f"{m['ttft_s'] * 1e3:.1f}",
                    f"{m['graph_replay_ms']:.3f}" if "graph_replay_ms" in m else "-",
                    str(s[dtype]["same_greedy_prefix"]) if eng == "tokenloom" else "-",
                ]
            )
    if "bfloat16_eager" in s:
        e = s["bfloat16_eager"]
        rows.append(
            [
                "bfloat16",
                "tokenloom --enforce-eager",
                f"{e['decode_tok_s']:.0f}",
                f"{e['decode_tok_s'] / hf['bfloat16']:.2f}x",
                f"{e['ttft_s'] * 1e3:.1f}",
                "-",
                "-",
            ]
        )
    table(
        "SmolLM2-135M shapes, batch 1, prompt 128, 128 new tokens, greedy (medians of 3)",
        ["dtype", "engine", "decode tok/s", "vs HF", "TTFT ms", "graph replay ms", "greedy = HF (of 32)"],
        rows,
    )


def report_llama1b(r: dict) -> None:
    hf = r["transformers"]["decode_tok_s"]
    rows = [
        [
            eng,
            f"{r[eng]['decode_tok_s']:.0f}",
            f"{r['limit_tok_s']:.0f}",
            f"{r[eng]['decode_tok_s'] / r['limit_tok_s']:.0%}",
            f"{r[eng]['decode_tok_s'] / hf:.2f}x",
        ]
        for eng in ("tokenloom", "transformers")
    ]
    table(
        "Llama-3.2-1B shapes, bf16, batch 1, prompt 128, 128 new tokens",
        ["engine", "decode tok/s", "bandwidth limit tok/s", "of limit", "vs HF"],
        rows,
    )


def report_concurrency(c: dict) -> None:
    rows = [
        [
            n,
            eng,
            f"{r[eng]['tok_s']:.0f}",
            f"{r[eng]['tok_s'] / r['transformers']['tok_s']:.1f}x",
            f"{r[eng]['ttft_p50']:.2f} / {r[eng]['ttft_p99']:.2f}",
            f"{r[eng]['tpot_p50'] * 1e3:.1f} / {r[eng]['tpot_p99'] * 1e3:.1f}",
        ]
        for n, r in c.items()
        for eng in ("tokenloom", "transformers")
    ]
    table(
        "Concurrent requests, SmolLM2-135M shapes, bf16, prompts 128-512, 128-256 new tokens "
        "(transformers: one static batch)",
        ["requests", "engine", "output tok/s", "vs HF", "TTFT p50 / p99 s", "TPOT p50 / p99 ms"],
        rows,
    )


def report(result: dict) -> None:
    log(f"\ndevice: {result['device']}, torch {result['torch']}, transformers {result['transformers']}")
    if "bandwidth" in result:
        b = result["bandwidth"]
        log(
            f"copy bandwidth {b['copy_GBps']:.0f} GB/s (read + write), "
            f"bf16 matmul {b['bf16_matmul_TFLOPs']:.0f} TFLOP/s"
        )
    if "smollm2" in result:
        report_smollm2(result["smollm2"])
    if "llama1b" in result:
        report_llama1b(result["llama1b"])
    if "concurrency" in result:
        report_concurrency(result["concurrency"])
    if "smollm2" in result:
        log("\nhost time of a bf16 batch-1 decode of 128 tokens (cProfile, own time):\n")
        log(result["smollm2"]["profile"])
        log("\ndevice time of 10 bf16 batch-1 decode graph replays, by kernel:\n")
        log(result["smollm2"].get("kernels", ""))


def main() -> None:
    p = parser(__doc__)
    p.add_argument(
        "--config-dir", default=None, help="SmolLM2 config.json + tokenizer folder (default: the pulled model)"
    )
    p.add_argument("--only", default="bandwidth,smollm2,llama1b,concurrency", help="sections, comma-separated")
    p.add_argument("--levels", default="64,256", help="concurrency levels")
    p.add_argument("--workdir", default="/tmp/tokenloom-gpu-bench", help="where the random models are written")
    p.add_argument("--no-eager", action="store_true", help="skip the --enforce-eager comparison")
    p.add_argument("--out", default=str(RESULTS / "bench_gpu.json"))
    args = p.parse_args()
    if args.config_dir is None:
        from tokenloom.loader import hub

        args.config_dir = str(hub.float32_folder())
    import transformers

    sections = args.only.split(",")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    smol_config = json.loads((Path(args.config_dir) / "config.json").read_text())
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "random_weights": True,
    }
    copy = None
    if "bandwidth" in sections or "llama1b" in sections:
        result["bandwidth"] = bandwidth()
        copy = result["bandwidth"]["copy_GBps"]
        log(f"bandwidth: {result['bandwidth']}")
    if {"smollm2", "concurrency"} & set(sections):
        smol = random_model(smol_config, Path(args.config_dir), work / "smollm2", torch.float32)
    if "smollm2" in sections:
        result["smollm2"] = section_smollm2(str(smol), smol_config["vocab_size"], not args.no_eager)
    if "concurrency" in sections:
        result["concurrency"] = section_concurrency(
            str(smol), smol_config["vocab_size"], [int(x) for x in args.levels.split(",")]
        )
    if "llama1b" in sections:
        big = random_model(LLAMA_1B, Path(args.config_dir), work / "llama1b", torch.bfloat16)
        result["llama1b"] = section_llama1b(str(big), LLAMA_1B["vocab_size"], copy)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    report(result)


if __name__ == "__main__":
    main()
