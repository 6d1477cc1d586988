#!/usr/bin/env python
"""Time to first token for a long shared system prompt: computed (cold), found in memory (a second
question in the same process), and read back from the prefix cache's disk tier after a restart
(a new process over the same --prefix-cache-dir). Each figure is the median of `--repeats` questions.

    python benchmarks/prefix_disk.py [--model PATH] [--system-tokens 8192] [--repeats 3]

Writes results/prefix_disk.json.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time

from _common import RESULTS, cpu_name, parser

from tokenloom import LLM, SamplingParams
from tokenloom.eval.scoring import default_eval_text
from tokenloom.loader import hub

QUESTIONS = [" Question: who signed it?", " Question: when was it written?", " Question: what does it say?"]


def system_prompt(llm: LLM, tokens: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < tokens:
        ids += llm.tokenizer.encode(default_eval_text())
    return ids[:tokens]


def first_token_seconds(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - start


def run(model: str, directory: str, tokens: int, repeats: int, phase: str) -> dict:
    """One process's figures: "first" (cold, then memory hits, then save) or "restart" (disk hits)."""
    llm = LLM(model, prefix_cache_dir=directory, max_model_len=tokens + 256, kv_cache_contexts=2)
    system = system_prompt(llm, tokens)
    prompts = [system + llm.tokenizer.encode(q) for q in (QUESTIONS * repeats)[: repeats + 1]]
    blocks = llm.engine.core.block_manager
    if phase == "first":
        cold = first_token_seconds(llm, prompts[0])
        memory = [first_token_seconds(llm, p) for p in prompts[1:]]
        started = time.perf_counter()
        saved = blocks.save_to_disk()
        return {
            "cold_s": cold,
            "memory_hit_s": statistics.median(memory),
            "saved_blocks": saved,
            "save_s": time.perf_counter() - started,
        }
    disk = first_token_seconds(llm, prompts[1])
    read_back = blocks.stats.disk_hit_tokens
    memory = [first_token_seconds(llm, p) for p in prompts[2:]] or [float("nan")]
    return {"disk_hit_s": disk, "disk_hit_tokens": read_back, "memory_hit_after_s": statistics.median(memory)}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--system-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--phase", choices=["first", "restart"], default=None, help=argparse_hidden())
    p.add_argument("--dir", default=None, help=argparse_hidden())
    args = p.parse_args()
    model = args.model or str(hub.gguf_path("qwen2.5-coder-0.5b"))
    if args.phase is not None:  # a child: one process's part
        print(json.dumps(run(model, args.dir, args.system_tokens, args.repeats, args.phase)))
        return
    figures: dict = {}
    with tempfile.TemporaryDirectory() as directory:
        for phase in ("first", "restart"):
            cmd = [
                sys.executable,
                __file__,
                "--model",
                model,
                "--dir",
                directory,
                "--phase",
                phase,
                "--system-tokens",
                str(args.system_tokens),
                "--repeats",
                str(args.repeats),
            ]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            figures |= json.loads(out.strip().splitlines()[-1])
    print(f"{model} on {cpu_name()}: a {args.system_tokens}-token system prompt, then a question")
    print("| first token | seconds | vs cold |")
    print("|---|---:|---:|")
    for name, key in (
        ("cold (computed)", "cold_s"),
        ("memory hit", "memory_hit_s"),
        ("disk hit after a restart", "disk_hit_s"),
    ):
        print(f"| {name} | {figures[key]:.2f} | {figures['cold_s'] / figures[key]:.1f}x |")
    print(
        f"saving {figures['saved_blocks']} blocks took {figures['save_s']:.2f} s; "
        f"{figures['disk_hit_tokens']} tokens read back"
    )
    RESULTS.mkdir(exist_ok=True)
    out_path = RESULTS / "prefix_disk.json"
    out_path.write_text(json.dumps({"model": model, "cpu": cpu_name(), **figures}, indent=1))
    print(f"wrote {out_path}")


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
