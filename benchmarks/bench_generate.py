#!/usr/bin/env python
"""tokenloom vs HF transformers generate(), same model, same process, same threads.

Measures (medians of --repeats runs):
  1. batch 1, prompt 128 / 128 new tokens, with the KV cache: time to first token
     and decode tokens/s;
  2. the same without a KV cache (each token recomputes the whole sequence);
  3. per-token latency against context length, cached vs uncached (plotted);
  4. batch 8, prompt 128 / 128 new tokens: output tokens/s.
Also reports the batch-1 decode limit set by memory bandwidth: bytes of weights
read per token / measured read bandwidth.

Writes benchmarks/results/bench_generate.json and uncached_vs_cached.png.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from _common import RESULTS, finish_plot, median_time, parser
from tqdm import tqdm

from tokenloom import LLM, SamplingParams
from tokenloom.loader import hub


def read_bandwidth() -> float:
    """Bytes/s for summing a 1 GiB float32 tensor (best of 5): the machine's read bandwidth."""
    x = torch.ones(1 << 28)
    best = min(median_time(x.sum, 1) for _ in range(5))
    return x.numel() * 4 / best


def weight_bytes_per_token(model: torch.nn.Module, vocab: int, hidden: int) -> int:
    """Every weight is read once per decoded token, except the embedding table (one row).

    Counts parameters and prepacked projection weights (PackedLinear / PanelLinear buffers,
    which hold the output projection even when it is tied to the embedding)."""
    tensors = {id(p): p for p in model.parameters()}
    packed = [b for name, b in model.named_buffers() if name.endswith(("packed_weight", "panels"))]
    total = sum(t.numel() * t.element_size() for t in list(tensors.values()) + packed)
    embed = vocab * hidden * 4
    head = vocab * hidden * 4  # the output projection is read in full (tied or not)
    head_counted = (
        any(name.startswith("lm_head.") for name, _ in model.named_buffers()) or not model.config.tie_word_embeddings
    )
    return total - embed + (0 if head_counted else head)


class Tokenloom:
    name = "tokenloom"

    def __init__(self, folder: str) -> None:
        # Prefix caching off: the same prompts repeat, and hits would fake TTFT and "no cache" figures.
        self.llm = LLM(folder, kv_cache_memory=1 << 30, enable_prefix_caching=False)

    def generate(self, prompts: list[list[int]], new: int) -> None:
        self.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))

    def generate_uncached(self, prompt: list[int], new: int) -> None:
        ids = list(prompt)
        for _ in range(new):  # every token is a fresh prefill of the whole sequence
            out = self.llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            ids.append(out[0].outputs[0].token_ids[0])


class HF:
    name = "transformers"

    def __init__(self, folder: str) -> None:
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    @torch.inference_mode()
    def _gen(self, prompts, new, use_cache=True):
        self.model.generate(
            torch.tensor(prompts),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            use_cache=use_cache,
            pad_token_id=0,
        )

    def generate(self, prompts, new):
        self._gen(prompts, new)

    def generate_uncached(self, prompt, new):
        self._gen([prompt], new, use_cache=False)


def measure(engine, args, bar) -> dict:
    prompt = [1000 + i for i in range(args.prompt)]
    r: dict = {}
    engine.generate([prompt], 4)  # warm-up
    r["ttft_s"] = median_time(lambda: engine.generate([prompt], 1), args.repeats)
    bar.update()
    total = median_time(lambda: engine.generate([prompt], args.new), args.repeats)
    bar.update()
    r["decode_tok_s"] = (args.new - 1) / (total - r["ttft_s"])
    r["e2e_128_s"] = total
    uncached = median_time(lambda: engine.generate_uncached(prompt, args.new_uncached), 1)
    bar.update()
    r["uncached_tok_s"] = args.new_uncached / uncached
    batch = [[1000 + 37 * b + i for i in range(args.prompt)] for b in range(args.batch)]
    t = median_time(lambda: engine.generate(batch, args.new), args.repeats)
    bar.update()
    r[f"batch{args.batch}_tok_s"] = args.batch * args.new / t
    r["latency_by_length"] = {}
    for length in args.lengths:
        # Without a cache, each token costs a forward over the whole context: the 1-token time.
        # With it, a token costs the marginal time of 8 more tokens after the first.
        ctx = [1000 + i % 20000 for i in range(length)]
        one = median_time(lambda: engine.generate([ctx], 1), args.repeats)
        nine = median_time(lambda: engine.generate([ctx], 9), args.repeats)
        r["latency_by_length"][length] = {"cached_ms": 1000 * (nine - one) / 8, "uncached_ms": 1000 * one}
        bar.update()
    return r


def print_table(res: dict, args, limit_tok_s: float) -> None:
    ours, hf = res["tokenloom"], res["transformers"]
    rows = [
        ("batch-1 decode tok/s (KV cache)", "decode_tok_s", True),
        ("batch-1 time to first token, s", "ttft_s", False),
        (f"batch-1 tok/s without KV cache ({args.new_uncached} new)", "uncached_tok_s", True),
        (f"batch-{args.batch} output tok/s", f"batch{args.batch}_tok_s", True),
    ]
    print(
        f"\nSmolLM2-135M-Instruct float32, prompt {args.prompt}, {args.new} new tokens, "
        f"{torch.get_num_threads()} threads, medians of {args.repeats}"
    )
    print("| metric | tokenloom | transformers | tokenloom / HF |\n|---|---:|---:|---:|")
    for label, key, higher_better in rows:
        ratio = ours[key] / hf[key] if higher_better else hf[key] / ours[key]
        print(f"| {label} | {ours[key]:.2f} | {hf[key]:.2f} | {ratio:.2f}x |")
    print(
        f"\nbandwidth limit for batch-1 decode: {limit_tok_s:.1f} tok/s "
        f"(tokenloom at {ours['decode_tok_s'] / limit_tok_s:.0%}, transformers at "
        f"{hf['decode_tok_s'] / limit_tok_s:.0%})"
    )
    print(
        "\n| context | tokenloom cached ms | tokenloom uncached ms | HF cached ms | HF uncached ms |\n"
        "|---:|---:|---:|---:|---:|"
    )
    for length in args.lengths:
        a, b = ours["latency_by_length"][length], hf["latency_by_length"][length]
        print(
            f"| {length} | {a['cached_ms']:.1f} | {a['uncached_ms']:.1f} | {b['cached_ms']:.1f} "
            f"| {b['uncached_ms']:.1f} |"
        )


def plot(res: dict, args, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, style in (("tokenloom", "-"), ("transformers", "--")):
        lat = res[name]["latency_by_length"]
        for kind, marker in (("cached_ms", "o"), ("uncached_ms", "s")):
            ax.plot(
                args.lengths,
                [lat[n][kind] for n in args.lengths],
                style,
                marker=marker,
                label=f"{name}, {kind.split('_')[0]}",
            )
    ax.set(
        xlabel="context length (tokens)",
        ylabel="ms per generated token",
        xscale="log",
        yscale="log",
        title="Per-token latency: the KV cache keeps it flat (SmolLM2-135M fp32, CPU)",
    )
    ax.set_xticks(args.lengths, [str(n) for n in args.lengths])
    return finish_plot(fig, ax, path)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--new-uncached", type=int, default=32, help="new tokens for the no-cache run")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512, 1024])
    args = p.parse_args()
    folder = args.model or str(hub.float32_folder())
    RESULTS.mkdir(parents=True, exist_ok=True)
    res = {}
    with tqdm(total=2 * (4 + len(args.lengths)), desc="benchmarking", unit="task") as bar:
        for cls in (Tokenloom, HF):
            engine = cls(folder)
            res[cls.name] = measure(engine, args, bar)
            if cls is Tokenloom:
                model = engine.llm.engine.core.runner.model
                cfg = engine.llm.engine.model_config
                bytes_per_token = weight_bytes_per_token(model, cfg.vocab_size, cfg.hidden_size)
            del engine
    bw = read_bandwidth()
    limit = bw / bytes_per_token
    res["bandwidth"] = {"read_GB_s": bw / 1e9, "weight_bytes_per_token": bytes_per_token, "limit_tok_s": limit}
    res["config"] = vars(args) | {"threads": torch.get_num_threads(), "torch": torch.__version__}
    print_table(res, args, limit)
    print(f"\nread bandwidth {bw / 1e9:.1f} GB/s, {bytes_per_token / 1e6:.0f} MB of weights per token")
    (RESULTS / "bench_generate.json").write_text(json.dumps(res, indent=2))
    if plot(res, args, RESULTS / "uncached_vs_cached.png"):
        print(f"plot: {RESULTS / 'uncached_vs_cached.png'}")
    print(f"json: {RESULTS / 'bench_generate.json'}")


if __name__ == "__main__":
    main()
