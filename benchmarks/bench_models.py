#!/usr/bin/env python
"""Several models from one server: what loading on demand costs, and how two models share the CPU.

Starts `tokenloom serve -m FIRST` as a subprocess (its catalog: every pulled model), then:

1. Time to first token of a chat request for SECOND (ollama's /api/chat, streamed) that loads it
   (its file in the page cache after the first round: the "cached file" case), against the same
   request once SECOND is loaded; SECOND is unloaded between rounds with ollama's keep_alive 0.
   Medians over --rounds.
2. Throughput: C streaming clients per model in a closed loop (/v1/completions, greedy, EOS
   ignored, --tokens each) for FIRST alone, SECOND alone, then both at once (C each); tokens/s
   per model and in all, and each model's share of its alone speed when the two run together.

Writes benchmarks/results/bench_models.json.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, cpu_name, parser
from bench_http import _wait_healthy

from tokenloom.loader import hub

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def start(first: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tokenloom", "serve", "-m", first, "--port", str(port), "--log-level", "warning"]
    cmd += ["--kv-cache-memory", "1", "--no-prefix-caching", "--keep-alive", "-1"]
    return _wait_healthy(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port)


def first_token_s(base: str, model: str) -> float:
    """Seconds from sending an ollama chat request for `model` to its first streamed token."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "options": {"num_predict": 8}}
    started = time.perf_counter()
    with httpx.stream("POST", f"{base}/api/chat", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line and json.loads(line)["message"]["content"]:
                return time.perf_counter() - started
    raise RuntimeError(f"{model} streamed no token")


def unload(base: str, model: str) -> None:
    reply = httpx.post(f"{base}/api/generate", json={"model": model, "keep_alive": 0}, timeout=60).json()
    assert reply["done_reason"] == "unload", reply


def loading_costs(base: str, model: str, rounds: int) -> dict[str, float]:
    """Median TTFT of a request that loads `model` and of one that finds it loaded."""
    cold, warm = [], []
    for _ in tqdm(range(rounds), desc=f"load {model}", file=sys.stderr):
        unload(base, model)
        cold.append(first_token_s(base, model))
        warm.append(first_token_s(base, model))
    return {"load_ttft_s": statistics.median(cold), "loaded_ttft_s": statistics.median(warm)}


async def closed_loop(base: str, models: list[str], clients: int, tokens: int, seconds: float) -> dict[str, float]:
    """Tokens/s per model with `clients` streaming clients each for `seconds`."""
    counts = dict.fromkeys(models, 0)
    deadline = time.perf_counter() + seconds

    async def client(model: str, http: httpx.AsyncClient) -> None:
        body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        while time.perf_counter() < deadline:
            r = await http.post(f"{base}/v1/completions", json=body)
            r.raise_for_status()
            counts[model] += r.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(m, http) for m in models for _ in range(clients)))
    elapsed = time.perf_counter() - started
    return {m: n / elapsed for m, n in counts.items()}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--first", default="smollm2-135m", help="the model loaded at start (default: smollm2-135m)")
    p.add_argument("--second", default="qwen2.5-coder-0.5b", help="the model loaded on demand")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=4, help="streaming clients per model")
    p.add_argument("--tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--seconds", type=float, default=20.0, help="each throughput run's length")
    p.add_argument("--port", type=int, default=8123)
    args = p.parse_args()
    for name in (args.first, args.second):
        hub.pull(name)
    base = f"http://127.0.0.1:{args.port}"
    server = start(args.first, args.port)
    try:
        names = {m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]}
        second = next(n for n in names if n.startswith(args.second) or n == args.second)
        first = next(n for n in names if n.startswith(args.first) or n == args.first)
        costs = loading_costs(base, second, args.rounds)
        run = lambda models: asyncio.run(closed_loop(base, models, args.clients, args.tokens, args.seconds))  # noqa: E731
        alone = {**run([first]), **run([second])}
        together = run([first, second])
    finally:
        server.terminate()
        server.wait()
    report(args, first, second, costs, alone, together)


def report(args, first: str, second: str, costs: dict, alone: dict, together: dict) -> None:
    rows = [
        f"CPU: {cpu_name()}; {args.clients} clients per model, {args.tokens} tokens per request",
        "",
        f"| {second} | TTFT (median of {args.rounds}) |",
        "|---|---:|",
        f"| request that loads it (cached file) | {costs['load_ttft_s']:.2f} s |",
        f"| request that finds it loaded | {costs['loaded_ttft_s']:.3f} s |",
        "",
        "| model | alone tok/s | both at once tok/s | share of alone |",
        "|---|---:|---:|---:|",
    ]
    for m in (first, second):
        rows.append(f"| {m} | {alone[m]:.1f} | {together[m]:.1f} | {together[m] / alone[m]:.2f} |")
    rows.append(f"| in all | | {sum(together.values()):.1f} | |")
    print("\n".join(rows))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"cpu": cpu_name(), "args": vars(args), "loading": costs, "alone": alone, "together": together}
    (RESULTS / "bench_models.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
