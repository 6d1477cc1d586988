#!/usr/bin/env python
"""Precision and quantization: speed, memory and perplexity, beside llama.cpp on the same GGUF.

For float32, bfloat16, int8 and int4 (the HF folder of SmolLM2), tokenloom's `gguf` mode
(the GGUF file's own Q4_1/Q8_0 blocks) and llama.cpp (llama-cpp-python) on that same GGUF
(on CPUs with AMX a second llama.cpp row, "llama.cpp AMX", with its weights repacked for
AMX: it only runs one-token batches there, so its prompt is fed token by token):
  - batch-1 prefill tokens/s (128-token prompt) and decode tokens/s (64 new tokens),
    medians of --runs after a warm-up;
  - peak resident memory of the process (each configuration runs in its own process);
  - perplexity on tokenloom/data/declaration.txt (windows of 512, the same token ids for all);
  - the decode limit set by memory bandwidth: measured read bandwidth / weight bytes per token.
Writes benchmarks/results/bench_quant.json and quant_decode.png.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from _common import RESULTS, cpu_name, finish_plot, parser
from tqdm import tqdm

CONFIGS = {  # name -> LLM kwargs; "model": "gguf" loads the GGUF file instead of the HF folder
    "float32": {},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "gguf (Q4_1 + Q8_0 blocks)": {"quantization": "gguf", "model": "gguf"},
}
PROMPT, NEW, WINDOW = 128, 64, 512


def read_bandwidth() -> float:
    """Bytes/s summing a 1 GiB float32 tensor (best of 5)."""
    x = torch.ones(1 << 28)
    best = math.inf
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best


def eval_ids() -> list[int]:
    from tokenloom.eval.scoring import default_eval_text
    from tokenloom.loader import hub
    from tokenloom.tokenizer import Tokenizer

    return Tokenizer.from_folder(hub.float32_folder()).encode(default_eval_text())


def panel_layers(weights: list[torch.Tensor]) -> list[torch.nn.Module]:
    """PanelLinear over each weight where this CPU runs the AVX-512 kernel; [] elsewhere."""
    from tokenloom.layers.prepacked import PanelLinear

    linears = []
    for w in weights:
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        linear.weight.data = w
        linears.append(linear)
    return [PanelLinear(x) for x in linears] if PanelLinear.supports(linears[0]) else []


def kernel_times(repeats: int = 20) -> dict[str, float]:
    """Milliseconds for one decode step's projections of SmolLM2 (30 layers + output head, one row)
    through each weight-only matmul available here, all weights distinct so they stream from DRAM."""
    from tokenloom.quant import quantize_int4, quantize_int8
    from tokenloom.quant.int8 import kernels

    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in shapes]
    x = torch.randn(1, 576)
    xs = {576: x, 1536: torch.randn(1, 1536)}
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    panels = panel_layers(weights)
    q8 = [quantize_int8(w) for w in weights]
    q4 = [quantize_int4(w, 32) for w in weights]
    t8 = [(torch.round(w / (s := w.abs().amax(1, keepdim=True) / 127)).to(torch.int8), s[:, 0]) for w in weights]
    t4 = []
    for w in weights:
        q = quantize_int4(w, 32)
        zeros_scales = torch.stack([q.scales, q.offsets + 8 * q.scales], -1).transpose(0, 1).contiguous()
        from tokenloom.quant.int8.formats import unpack_int4

        t4.append(
            (torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(q.data).to(torch.int32), 1), zeros_scales)
        )
    kernels.available()
    runs = {
        "float32 oneDNN prepacked (tokenloom's float path without AVX-512)": lambda: [
            torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "") for w, p in zip(weights, packed)
        ],
        **(
            {
                "float32 tokenloom panel kernel (its float path with AVX-512)": lambda: [
                    layer(xs[w.shape[1]]) for w, layer in zip(weights, panels)
                ]
            }
            if panels
            else {}
        ),
        "int8 torch._weight_int8pack_mm": lambda: [
            torch.ops.aten._weight_int8pack_mm(xs[w.shape[1]], q, s) for w, (q, s) in zip(weights, t8)
        ],
        "int4 torch._weight_int4pack_mm_for_cpu (g32)": lambda: [
            torch.ops.aten._weight_int4pack_mm_for_cpu(xs[w.shape[1]], q, 32, sz) for w, (q, sz) in zip(weights, t4)
        ],
        "int8 tokenloom kernel": lambda: [kernels.bind(q, None, False)(xs[w.shape[1]]) for w, q in zip(weights, q8)],
        "int4 tokenloom kernel (g32)": lambda: [
            kernels.bind(q, None, False)(xs[w.shape[1]]) for w, q in zip(weights, q4)
        ],
    }
    if kernels.panels_available():  # what the engine runs on AVX-512 VNNI CPUs
        from tokenloom.quant.int8 import panels as layout

        p8, p4 = [layout.to_panels(q) for q in q8], [layout.to_panels(q) for q in q4]
        runs["int8 tokenloom panel kernel (AVX-512 VNNI)"] = lambda: [
            kernels.bind(p, None, True)(xs[w.shape[1]]) for w, p in zip(weights, p8)
        ]
        runs["int4 tokenloom panel kernel (g32, AVX-512 VNNI)"] = lambda: [
            kernels.bind(p, None, True)(xs[w.shape[1]]) for w, p in zip(weights, p4)
        ]
    out = {}
    for name, fn in runs.items():
        try:
            fn()
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out[name] = 1000 * sorted(times)[len(times) // 2]
        except Exception as e:  # an op missing from this torch build
            print(f"{name}: {e}", file=sys.stderr)
    return out


def worker_tokenloom(name: str, runs: int, part: str) -> dict:
    from tokenloom import LLM
    from tokenloom.eval.bench import measure
    from tokenloom.eval.scoring import perplexity
    from tokenloom.loader import hub

    kwargs = dict(CONFIGS[name])
    model = str(hub.default_gguf_path()) if kwargs.pop("model", None) == "gguf" else str(hub.float32_folder())
    llm = LLM(model, kv_cache_memory=256 << 20, enable_prefix_caching=False, **kwargs)
    if part == "speed":
        return measure(llm, PROMPT, NEW, runs).as_dict()
    ppl = perplexity(llm.engine, eval_ids(), window=WINDOW)
    return {"perplexity": ppl.perplexity, "tokens_scored": ppl.tokens_scored}


def worker_llama_cpp(name: str, runs: int, part: str) -> dict:
    from tokenloom.loader import hub

    path, amx = str(hub.default_gguf_path()), name == "llama.cpp AMX"
    return llama_cpp_perplexity(path, amx) if part == "ppl" else llama_cpp_speed(path, runs, amx)


def cpu_has_amx() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def open_llama_cpp(path: str, amx: bool = False, **kwargs):
    """llama_cpp.Llama on `path`; without "extra buffer types" (weight repacking) unless `amx`.

    On CPUs with AMX (Intel Sapphire Rapids and later) llama.cpp repacks weights into an
    AMX buffer and then segfaults on the first multi-token batch (measured here with
    llama-cpp-python 0.3.36; ggml-org/llama.cpp#20824). Without extra buffers it runs its
    AVX-512/AVX2 kernels. With `amx` the repacked model is opened for one-token batches
    only. The high-level Llama class has no switch for this, so the default model params
    it reads are patched for the duration of the load.
    """
    import llama_cpp.llama_cpp as low
    from llama_cpp import Llama

    if amx:
        return Llama(model_path=path, verbose=False, **kwargs | {"n_batch": 1, "n_ubatch": 1, "logits_all": True})
    defaults = low.llama_model_default_params

    def without_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = without_extra_buffers
    try:
        return Llama(model_path=path, verbose=False, **kwargs)
    finally:
        low.llama_model_default_params = defaults


def llama_cpp_speed(path: str, runs: int, amx: bool) -> dict:
    """The same timing as tokenloom.eval.bench.measure, through llama-cpp-python's eval loop (greedy)."""
    import statistics

    import gguf

    from tokenloom.eval.bench import peak_rss_bytes

    llm = open_llama_cpp(path, amx, n_ctx=1024, n_threads=2, n_threads_batch=2, n_batch=512)
    vocab, gen = llm.n_vocab(), torch.Generator().manual_seed(0)
    prefill, decode, ttft = [], [], []
    for i in range(runs + 1):
        prompt = torch.randint(0, vocab, (PROMPT,), generator=gen).tolist()
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t1 = time.perf_counter()
        for _ in range(NEW - 1):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t2 = time.perf_counter()
        if i:
            ttft.append(t1 - t0)
            prefill.append(PROMPT / (t1 - t0))
            decode.append((NEW - 1) / (t2 - t1))
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    return {
        "prompt_tokens": PROMPT,
        "new_tokens": NEW,
        "prefill_tok_s": statistics.median(prefill),
        "decode_tok_s": statistics.median(decode),
        "ttft_s": statistics.median(ttft),
        "weight_bytes": file_bytes,
        "bytes_per_token": file_bytes,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def llama_cpp_perplexity(path: str, amx: bool) -> dict:
    scorer = open_llama_cpp(path, amx, n_ctx=WINDOW, n_threads=2, n_batch=WINDOW, logits_all=True)
    ids, nll = eval_ids(), []
    for start in range(0, len(ids) - 1, WINDOW):
        piece = ids[start : start + WINDOW]
        scorer.reset()
        scorer.eval(piece)
        logits = torch.tensor(np.array(scorer.scores[: len(piece) - 1]))
        nll.extend((-torch.log_softmax(logits, -1)[torch.arange(len(piece) - 1), torch.tensor(piece[1:])]).tolist())
    return {"perplexity": math.exp(sum(nll) / len(nll)), "tokens_scored": len(nll)}


def run_worker(name: str, runs: int, part: str) -> dict | None:
    cmd = [sys.executable, __file__, "--worker", name, "--runs", str(runs), "--part", part]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"{name}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median_round(runs: list[dict]) -> dict:
    """The round with the median decode speed (its other figures come with it) + every round's speed."""
    ordered = sorted(runs, key=lambda r: r["decode_tok_s"])
    return ordered[len(ordered) // 2] | {"decode_tok_s_rounds": [r["decode_tok_s"] for r in runs]}


def table(results: dict[str, dict], bandwidth: float) -> str:
    base = results["float32"]
    lines = [
        "| engine | weights | decode tok/s | vs tokenloom float32 | bandwidth limit tok/s | % of limit "
        "| prefill tok/s | weights MB | peak RSS MB | perplexity | vs float32 ppl |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        engine = name if name.startswith("llama.cpp") else "tokenloom"
        weights = "gguf (Q4_1 + Q8_0 blocks)" if name.startswith("llama.cpp") else name
        limit = bandwidth / r["bytes_per_token"]
        ratio = r["decode_tok_s"] / base["decode_tok_s"]
        lines.append(
            f"| {engine} | {weights} | {r['decode_tok_s']:.1f} | {ratio:.2f}x "
            f"| {limit:.0f} | {100 * r['decode_tok_s'] / limit:.0f}% | {r['prefill_tok_s']:.0f} "
            f"| {r['weight_bytes'] / 1e6:.0f} | {r['peak_rss_bytes'] / 1e6:.0f} | {r['perplexity']:.3f} "
            f"| {100 * (r['perplexity'] / base['perplexity'] - 1):+.1f}% |"
        )
    return "\n".join(lines)


def plot(results: dict[str, dict], bandwidth: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    names = list(results)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    xs = range(len(names))
    ax.bar(xs, [results[n]["decode_tok_s"] for n in names], label="decode tok/s (batch 1)")
    ax.scatter(
        xs,
        [bandwidth / results[n]["bytes_per_token"] for n in names],
        color="black",
        marker="_",
        s=900,
        label="memory-bandwidth limit",
        zorder=3,
    )
    ax.set_xticks(list(xs), [n.replace(" (", "\n(") for n in names], fontsize=8)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"SmolLM2-135M batch-1 decode by weight format ({cpu_name()})")
    finish_plot(fig, ax, path)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--worker", default=None, help=argparse_suppress())
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp")
    p.add_argument("--kernels-only", action="store_true", help="only time the matmul kernels")
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="speed is measured in this many rounds over all configurations (the median is "
        "reported), so a slow minute of a shared machine does not fall on one configuration",
    )
    p.add_argument("--part", default="speed", help=argparse_suppress())
    args = p.parse_args()
    if args.worker:
        torch.set_num_threads(2)
        out = (
            worker_llama_cpp(args.worker, args.runs, args.part)
            if args.worker.startswith("llama.cpp")
            else worker_tokenloom(args.worker, args.runs, args.part)
        )
        print(json.dumps(out))
        return
    torch.set_num_threads(2)
    kernel_ms = kernel_times()
    print("| weight-only matmul, SmolLM2 decode step (121 projections, 1 row) | ms | vs float32 |\n|---|---:|---:|")
    base_ms = next(iter(kernel_ms.values()))
    for name, ms in kernel_ms.items():
        print(f"| {name} | {ms:.1f} | {base_ms / ms:.2f}x |")
    if args.kernels_only:
        return
    bandwidth = read_bandwidth()
    llama_cpp = ["llama.cpp"] + (["llama.cpp AMX"] if cpu_has_amx() else [])
    names = list(CONFIGS) + ([] if args.no_llama_cpp else llama_cpp)
    rounds: dict[str, list[dict]] = {n: [] for n in names}
    for _ in tqdm(range(args.rounds), desc="speed rounds", unit="round"):
        for name in names:
            if (r := run_worker(name, args.runs, "speed")) is not None:
                rounds[name].append(r)
    results = {}
    for name in tqdm(names, desc="perplexity", unit="config"):
        if rounds[name] and (ppl := run_worker(name, args.runs, "ppl")) is not None:
            results[name] = median_round(rounds[name]) | ppl
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_quant.json").write_text(
        json.dumps({"read_bandwidth_bytes_s": bandwidth, "kernel_ms": kernel_ms, "results": results}, indent=2)
    )
    plot(results, bandwidth, RESULTS.parent.parent / "docs" / "img" / "quant_decode.png")
    print(
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s; prompt {PROMPT}, {NEW} new tokens; median of "
        f"{args.rounds} rounds, each the median of {args.runs} runs"
    )
    print(table(results, bandwidth))


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
