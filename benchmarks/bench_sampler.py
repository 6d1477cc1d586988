"""The sampler's cost per step: plain top-p, llama.cpp's defaults, every processor and filter at
once, and mirostat, at 1 and 64 sequences, against a decode step of the same model at that batch
(target: the whole chain under 10% of a decode step at 64). The yardstick is HF transformers'
LogitsProcessorList with the processors it has (repetition penalty, n-gram blocking,
temperature, top-k, top-p, min-p, typical, epsilon, eta) and a multinomial draw, on the same logits.

Histories are real text (128 prompt + 128 output tokens of the shipped declaration), so n-gram
blocking and DRY find real repeats; the logits are the model's own at the last 64 positions of
that text (row i of a batch of B takes position i), so nucleus sizes are real ones.

    python benchmarks/bench_sampler.py [--model DIR] [--repeats 30]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from _common import RESULTS, cpu_name, median_time, parser
from tqdm import tqdm

from tokenloom import LLM, SamplingParams
from tokenloom.sampling import Sampler, SamplingMetadata

TEXT = Path(__file__).resolve().parents[1] / "tokenloom" / "data" / "declaration.txt"
CHAINS = {
    "plain top-p": dict(temperature=0.8, top_p=0.95),
    "llama.cpp defaults": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "every processor and filter": dict(
        temperature=0.8,
        top_k=40,
        top_p=0.95,
        min_p=0.05,
        typical_p=0.95,
        top_n_sigma=2.0,
        xtc_probability=0.3,
        xtc_threshold=0.1,
        epsilon_cutoff=1e-4,
        eta_cutoff=1e-3,
        repetition_penalty=1.1,
        repetition_penalty_range=64,
        frequency_penalty=0.1,
        presence_penalty=0.1,
        no_repeat_ngram_size=3,
        bad_words=["tyranny", "King"],
        dry_multiplier=0.8,
        logit_bias={100: 1.0},
    ),
    "mirostat v2 + DRY": dict(mirostat=2, dry_multiplier=0.8),
}
HF_EQUIVALENT = {
    "plain top-p": ["temperature", "top_p"],
    "llama.cpp defaults": ["temperature", "top_k", "top_p", "min_p"],
    "every processor and filter": [
        "repetition",
        "ngram",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "typical",
        "epsilon",
        "eta",
    ],
}


def decode_step_seconds(llm: LLM, prompt: list[int], batch: int, steps: int = 12) -> float:
    """Median wall time of an engine step in which `batch` greedy requests all decode (distinct
    prompts: the scheduler admits requests sharing a prefix one per step, for the cache's sake)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=batch + steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"decode-{batch}-{i}", [i + 1000] + prompt, params)
    times = []
    while engine.has_unfinished_requests():
        running = len(engine.core.scheduler.running)
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.core.scheduler.running)
        start = time.perf_counter()
        engine.step()
        if running == batch and decoding and not engine.core.scheduler.waiting:
            times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def model_logits(llm: LLM, ids: list[int], rows: int) -> torch.Tensor:
    """The model's logits (rows, V) at the last `rows` positions of `ids`, in KV blocks borrowed for the call."""
    from tokenloom.worker.batch import SeqChunk

    blocks, core = llm.engine.core.block_manager, llm.engine.core
    blocks.allocate("bench-logits", len(ids))
    try:
        with torch.inference_mode():
            hidden, _ = core.runner.forward([SeqChunk(list(ids), 0, blocks.block_ids("bench-logits"))])
            return core.runner.model.compute_logits(hidden[-rows:]).float()
    finally:
        blocks.free("bench-logits")


def requests(llm: LLM, settings: dict, history: list[int], batch: int) -> list:
    """`batch` requests with `history` (half prompt, half output), their states resolved by the engine."""
    from tokenloom.engine.request import Request

    params = SamplingParams(**settings, seed=None)
    made = [Request(str(i), history[:128], params) for i in range(batch)]
    for r in made:
        r.output_token_ids = list(history[128:])
        r.sampling_state = llm.engine.core.sampling_vocab.resolve(params)
    return made


def hf_chain(names: list[str], settings: dict):
    from transformers.generation import logits_process as hf

    make = {
        "repetition": lambda: hf.RepetitionPenaltyLogitsProcessor(settings["repetition_penalty"]),
        "ngram": lambda: hf.NoRepeatNGramLogitsProcessor(settings["no_repeat_ngram_size"]),
        "temperature": lambda: hf.TemperatureLogitsWarper(settings["temperature"]),
        "top_k": lambda: hf.TopKLogitsWarper(settings["top_k"]),
        "top_p": lambda: hf.TopPLogitsWarper(settings["top_p"]),
        "min_p": lambda: hf.MinPLogitsWarper(settings["min_p"]),
        "typical": lambda: hf.TypicalLogitsWarper(settings["typical_p"]),
        "epsilon": lambda: hf.EpsilonLogitsWarper(settings["epsilon_cutoff"]),
        "eta": lambda: hf.EtaLogitsWarper(settings["eta_cutoff"]),
    }
    chain = hf.LogitsProcessorList([make[n]() for n in names])

    def step(input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return torch.multinomial(chain(input_ids, logits.clone()).softmax(-1), 1)

    return step


def measure(llm: LLM, logits: torch.Tensor, history: list[int], repeats: int) -> list[dict]:
    rows = []
    sampler = Sampler()
    with tqdm(total=len(CHAINS) * 2, desc="sampler chains", unit="config") as bar:
        for name, settings in CHAINS.items():
            row = {"chain": name}
            for batch in (1, 64):
                rows_of = requests(llm, settings, history, batch)
                x = logits[:batch].contiguous()
                # the metadata (and the history matrix the processors share) is built every step, as in the engine
                row[f"ours_{batch}_s"] = median_time(
                    lambda: sampler.sample(x, SamplingMetadata.for_requests(rows_of)), repeats
                )
                if name in HF_EQUIVALENT:
                    step, ids = hf_chain(HF_EQUIVALENT[name], settings), torch.tensor([history] * batch)
                    row[f"hf_{batch}_s"] = median_time(lambda: step(ids, x), repeats)
                bar.update()
            rows.append(row)
    return rows


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=30, help="timed calls per configuration (default: 30)")
    args = p.parse_args()
    from tokenloom.loader import hub

    torch.set_num_threads(2)
    llm = LLM(args.model or str(hub.float32_folder()), kv_cache_memory=512 << 20)
    history = llm.engine.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)[:256]
    logits = model_logits(llm, history, 64)  # (64, V)
    steps = {b: decode_step_seconds(llm, history[:128], b) for b in tqdm((1, 64), desc="decode steps", unit="batch")}
    rows = measure(llm, logits, history, args.repeats)
    print(
        f"\nSampler cost per step on {cpu_name()}, SmolLM2-135M vocabulary ({logits.shape[1]:,} tokens); "
        f"decode step: {steps[1] * 1e3:.1f} ms at 1, {steps[64] * 1e3:.1f} ms at 64 (medians)\n"
    )
    print(
        "| chain | 1 seq (ms) | of a step | HF, 1 seq (ms) | 64 seqs (ms) | of a step | HF, 64 seqs (ms) "
        "| HF / ours at 64 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        hf1, hf64, ours1, ours64 = r.get("hf_1_s"), r.get("hf_64_s"), r["ours_1_s"], r["ours_64_s"]
        print(
            f"| {r['chain']} | {ours1 * 1e3:.2f} | {ours1 / steps[1]:.0%} | {_ms(hf1)} | {ours64 * 1e3:.2f} | "
            f"{ours64 / steps[64]:.0%} | {_ms(hf64)} | {'-' if hf64 is None else f'{hf64 / ours64:.2f}x'} |"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sampler.json").write_text(
        json.dumps({"cpu": cpu_name(), "decode_step_s": steps, "rows": rows}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
