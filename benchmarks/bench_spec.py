#!/usr/bin/env python
"""Speculative decoding benchmark: speedup over plain decoding, with acceptance rates.

Input-grounded chat tasks (rewrite, edit code, quote, summarize a given text) on the
real default model, greedy, same run, same engine settings:
  - plain decoding vs the n-gram (prompt lookup) proposer, at batch 1 and at 8
    concurrent requests, and at 32 with speculation forced on (max_batch=64) vs the
    default fallback (plain decoding above 8 running requests);
  - the draft-model proposer: no smaller model with SmolLM2's tokenizer can be
    installed here (../shared/MODELS.md), so two stand-ins bound it: the target
    drafting for itself (every draft accepted, but a draft costs a target pass) and
    a random 2-layer model with SmolLM2's tokenizer (almost nothing accepted).
Outputs are checked token-identical to plain decoding. Writes benchmarks/results/bench_spec.json.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))  # tests.helpers
from _common import RESULTS, parser

from tests.helpers.draft_model import save_random_draft
from tokenloom import LLM, SamplingParams
from tokenloom.loader import hub

STORY = (
    "Maria opened the bakery at six every morning. She baked bread, croissants and small apple "
    "pies, and by seven the first customers were waiting at the door. Her brother Tom delivered "
    "the orders to the cafes in the old town on his bicycle, and in the afternoon the two of them "
    "planned the next day's baking over a cup of coffee."
)
CODE = (
    "def total_price(items, tax_rate):\n    total = 0\n    for item in items:\n"
    '        total = total + item["price"] * item["quantity"]\n    total = total * (1 + tax_rate)\n'
    "    return round(total, 2)\n"
)
TASKS = [
    f"Rewrite this text, replacing the name Maria with Anna and Tom with Peter. Change nothing else.\n\n{STORY}",
    f"Rename the function total_price to compute_total and keep everything else the same.\n\n{CODE}",
    f"Repeat the following text exactly, word for word.\n\n{STORY}",
    f"Add a docstring to this function. Return the whole function.\n\n{CODE}",
    f"Summarize this text in two sentences, reusing its wording.\n\n{STORY}",
    f"Rewrite this text in the past perfect tense.\n\n{STORY}",
    f"Convert this function to use the built-in sum() and keep the same name.\n\n{CODE}",
    f"Copy this text and put each sentence on its own line.\n\n{STORY}",
]


def timed(llm: LLM, batches: list[list[list[dict]]], params: SamplingParams) -> dict:
    """Run each batch of conversations together; output tok/s and the tokens produced."""
    before = llm.engine.stats()
    tokens, outputs = 0, []
    start = time.perf_counter()
    for batch in batches:
        for out in llm.chat(batch, params):
            tokens += len(out.outputs[0].token_ids)
            outputs.append(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    after = llm.engine.stats()
    drafted = after.spec_draft_tokens - before.spec_draft_tokens
    accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
    steps = after.spec_steps - before.spec_steps
    return {
        "tok_s": tokens / seconds,
        "tokens": tokens,
        "outputs": outputs,
        "acceptance": accepted / drafted if drafted else None,
        "tokens_per_spec_step": (accepted + steps) / steps if steps else None,
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=4)
    args = p.parse_args()
    folder = Path(args.model or hub.float32_folder())
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    convs = [[{"role": "user", "content": t}] for t in TASKS]
    workloads = {"batch 1": [[c] for c in convs], "8 concurrent": [convs], "32 concurrent": [convs * 4]}
    draft_dir = save_random_draft(Path(tempfile.mkdtemp()), folder, vocab_size=49152)
    k = args.k
    configs = [
        ("plain", None),
        (f"ngram k={k}", f"ngram,k={k}"),
        (f"ngram k={k}, forced at any batch", f"ngram,k={k},max_batch=64"),
        ("draft = target itself, k=3", f"draft={folder},k=3"),
        ("draft = random 2-layer, k=3", f"draft={draft_dir},k=3,min_acceptance=0"),
        ("draft = random 2-layer, k=3, fallback", f"draft={draft_dir},k=3"),
    ]
    plan = {"batch 1": [0, 1, 3, 4, 5], "8 concurrent": [0, 1, 3, 4, 5], "32 concurrent": [0, 1, 2]}
    res: dict = {"config": vars(args) | {"threads": torch.get_num_threads()}, "runs": {}}
    llms = {}
    with tqdm(total=sum(len(v) for v in plan.values()), desc="benchmarking", unit="run") as bar:
        for workload, indices in plan.items():
            for i in indices:
                name, spec = configs[i]
                if name not in llms:
                    llms[name] = LLM(str(folder), kv_cache_memory=512 << 20, speculative=spec)
                    timed(llms[name], [[convs[0]]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
                res["runs"].setdefault(workload, {})[name] = timed(llms[name], workloads[workload], params)
                bar.update()
    print("\n| workload | decoding | output tok/s | speedup | acceptance | tokens per spec step | same tokens |")
    print("|---|---|---:|---:|---:|---:|---|")
    for workload, runs in res["runs"].items():
        base = runs["plain"]
        for name, r in runs.items():
            acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
            per = "-" if r["tokens_per_spec_step"] is None else f"{r['tokens_per_spec_step']:.2f}"
            same = "yes" if r["outputs"] == base["outputs"] else "NO"
            ratio = r["tok_s"] / base["tok_s"]
            print(f"| {workload} | {name} | {r['tok_s']:.1f} | {ratio:.2f}x | {acc} | {per} | {same} |")
    for runs in res["runs"].values():
        for r in runs.values():
            del r["outputs"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_spec.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
