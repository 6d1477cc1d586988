#!/usr/bin/env python
"""Online serving benchmark over HTTP, against the same workload run in-process.

Starts `tokenloom serve` as a subprocess (the server a user runs), then for each
concurrency C drives it with C streaming clients in a closed loop over
/v1/completions (prompts sent as token ids, greedy, EOS ignored, so both sides
generate exactly the same tokens). The same requests then run in-process on
AsyncLLMEngine with the same engine settings. Reported per C: output tokens/s,
TTFT and TPOT medians and p99s, and HTTP / in-process throughput (the server's
overhead: HTTP, JSON, SSE, detokenized streaming).

Writes benchmarks/results/bench_http.json.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, parser
from bench_serving import Req, Run, add_workload_args, make_workload, run_tokenloom

from tokenloom import hub
from tokenloom.async_engine import AsyncLLMEngine
from tokenloom.config import CacheConfig, EngineConfig, SchedulerConfig


def start_server(model: str, port: int, max_num_seqs: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "serve", "-m", model, "--port", str(port),
                             "--served-model-name", "bench", "--kv-cache-memory", "2", "--no-prefix-caching",
                             "--max-num-seqs", str(max_num_seqs), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not come up")


async def _http_run(base: str, reqs: list[Req], concurrency: int) -> Run:
    todo = list(reqs)
    ttft, tpot = [], []

    async def client(http: httpx.AsyncClient) -> None:
        while todo:
            r = todo.pop(0)
            body = {"model": "bench", "prompt": r.prompt, "max_tokens": r.out_len, "temperature": 0,
                    "ignore_eos": True, "stream": True}
            t0 = time.perf_counter()
            first = None
            async with http.stream("POST", f"{base}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data:") and first is None:
                        first = time.perf_counter()
            end = time.perf_counter()
            ttft.append(first - t0)
            if r.out_len > 1:
                tpot.append((end - first) / (r.out_len - 1))

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return Run(time.perf_counter() - start, sum(r.out_len for r in reqs), ttft, tpot)


def main() -> None:
    p = parser(__doc__)
    add_workload_args(p)
    p.add_argument("--port", type=int, default=8765)
    args = p.parse_args()
    folder = args.model or str(hub.pull())
    reqs = make_workload(args.requests, 0, args.prompt_len, args.output_len)
    res: dict = {"http": {}, "in_process": {}, "config": vars(args)}
    with tqdm(total=2 * len(args.concurrency), desc="benchmarking", unit="run") as bar:
        proc = start_server(folder, args.port, max(args.concurrency))
        try:
            base = f"http://127.0.0.1:{args.port}"
            asyncio.run(_http_run(base, reqs[:2], 2))                      # warm-up
            for c in args.concurrency:
                res["http"][str(c)] = asyncio.run(_http_run(base, reqs, c)).summary()
                bar.update()
        finally:
            proc.terminate()
            proc.wait()
        config = EngineConfig(folder, cache=CacheConfig(kv_cache_memory=2 << 30, enable_prefix_caching=False),
                              scheduler=SchedulerConfig(max_num_seqs=max(args.concurrency)))
        engine = AsyncLLMEngine.from_config(config)
        run_tokenloom(engine, reqs[:2], 2)                                  # warm-up
        for c in args.concurrency:
            res["in_process"][str(c)] = run_tokenloom(engine, reqs, c).summary()
            bar.update()
    print("\n| concurrency | path | output tok/s | HTTP / in-process | TTFT median s | TTFT p99 s | "
          "TPOT median ms | TPOT p99 ms |\n|---:|---|---:|---:|---:|---:|---:|---:|")
    for c in args.concurrency:
        base_tps = res["in_process"][str(c)]["output_tok_s"]
        for path in ("http", "in_process"):
            s = res[path][str(c)]
            print(f"| {c} | {path} | {s['output_tok_s']:.1f} | {s['output_tok_s'] / base_tps:.2f} | "
                  f"{s['ttft_median_s']:.2f} | {s['ttft_p99_s']:.2f} | {s['tpot_median_ms']:.0f} | "
                  f"{s['tpot_p99_ms']:.0f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_http.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
