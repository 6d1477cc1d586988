#!/usr/bin/env python
"""The cost of structured output: JSON-schema-constrained vs free generation, same run.

At batch 1 and 16 (the same chat prompt, sampled with seeds, 96 new tokens at most):
output tokens/s and median time to first token, constrained (llguidance masks, computed
while the model runs) vs free text; the grammar engine's own costs: tokenizer set-up,
schema compile cold and cached, mask computation per token. Writes
benchmarks/results/bench_structured.json.
"""

from __future__ import annotations

import json
import statistics
import time

from _common import RESULTS, parser

from tokenloom import LLM, SamplingParams
from tokenloom.loader import hub
from tokenloom.structured import StructuredOutput

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "role", "skills"],
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "role": {"enum": ["engineer", "artist", "doctor"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
}
ASK = [{"role": "user", "content": "Describe a person as JSON: name, age, role and skills."}]


def run(llm: LLM, batch: int, constrained: bool, repeats: int) -> dict:
    so = StructuredOutput.json(SCHEMA) if constrained else None
    prompt = llm.tokenizer.encode_chat(ASK)
    rates, ttfts = [], []
    for r in range(repeats + 1):
        params = [
            SamplingParams(temperature=0.8, seed=100 * r + i, max_tokens=96, structured_output=so) for i in range(batch)
        ]
        t0 = time.perf_counter()
        outs = llm.generate([prompt] * batch, params)
        dt = time.perf_counter() - t0
        if r:
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
            ttfts.append(statistics.median(o.outputs[0].metrics.ttft for o in outs))
    return {"tok_s": statistics.median(rates), "ttft_s": statistics.median(ttfts)}


def engine_costs(llm: LLM) -> dict:
    import llguidance
    import llguidance.torch as lt

    g = llm.engine.core.grammars
    t0 = time.perf_counter()
    g.tokenizer
    setup = time.perf_counter() - t0
    spec = StructuredOutput.json(SCHEMA | {"title": "cold"})
    t0 = time.perf_counter()
    g.grammar(spec)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        g.grammar(spec)
    cached = (time.perf_counter() - t0) / 100
    text = json.dumps({"name": "Ada", "age": 36, "role": "engineer", "skills": ["math", "looms"]})
    matcher, ids = g.matcher(spec), llm.tokenizer.encode(text)
    mask = lt.allocate_token_bitmask(1, llm.engine.model_config.vocab_size)
    t0 = time.perf_counter()
    for tok in ids:
        lt.fill_next_token_bitmask(matcher, mask, 0)
        matcher.consume_token(tok)
    per_token = (time.perf_counter() - t0) / len(ids)
    return {
        "tokenizer_setup_s": setup,
        "compile_cold_s": cold,
        "compile_cached_s": cached,
        "mask_per_token_s": per_token,
        "llguidance": getattr(llguidance, "__version__", "?"),
    }


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    llm = LLM(args.model or str(hub.float32_folder()), kv_cache_memory=512 << 20, enable_prefix_caching=False)
    costs = engine_costs(llm)
    rows = []
    for batch in (1, 16):
        free, json_ = run(llm, batch, False, args.repeats), run(llm, batch, True, args.repeats)
        rows.append({"batch": batch, "free": free, "json_schema": json_})
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_structured.json").write_text(json.dumps({"engine": costs, "rows": rows}, indent=2))
    print(
        f"llguidance: tokenizer set-up {costs['tokenizer_setup_s'] * 1000:.0f} ms (once per model), schema compile "
        f"cold {costs['compile_cold_s'] * 1000:.2f} ms, cached {costs['compile_cached_s'] * 1e6:.1f} us, "
        f"mask {costs['mask_per_token_s'] * 1e6:.0f} us per token"
    )
    print("| batch | output | tokens/s | vs free | TTFT median ms |\n|---:|---|---:|---:|---:|")
    for r in rows:
        for kind in ("free", "json_schema"):
            m = r[kind]
            print(
                f"| {r['batch']} | {kind} | {m['tok_s']:.1f} | {m['tok_s'] / r['free']['tok_s']:.2f}x "
                f"| {m['ttft_s'] * 1000:.0f} |"
            )


if __name__ == "__main__":
    main()
