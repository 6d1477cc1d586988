#!/usr/bin/env python
"""Online serving benchmark over HTTP, against the same workload run in-process.

Starts `tokenloom serve` as a subprocess (the server a user runs), then for each
concurrency C drives it with C streaming clients in a closed loop over
/v1/completions (prompts sent as token ids, greedy, EOS ignored, so both sides
generate exactly the same tokens). The same requests then run in-process on
AsyncLLMEngine with the same engine settings. Reported per C: output tokens/s,
TTFT and TPOT medians and p99s, and HTTP / in-process throughput (the server's
overhead: HTTP, JSON, SSE, detokenized streaming). With --llama-server PATH (a GGUF
--model), llama.cpp's own server runs the same requests over the same API on the same
file (one slot per client, the same threads; a fresh server per concurrency and its prompt
cache off, as tokenloom's prefix cache is), and the table gains tokenloom / llama.cpp.

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
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, parser
from bench_serving import Req, Run, add_workload_args, make_workload, run_tokenloom

from tokenloom.config import CacheConfig, EngineConfig, SchedulerConfig
from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.loader import hub


def start_server(model: str, port: int, max_num_seqs: int) -> subprocess.Popen:
    return _wait_healthy(
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokenloom",
                "serve",
                "-m",
                model,
                "--port",
                str(port),
                "--served-model-name",
                "bench",
                "--kv-cache-memory",
                "2",
                "--no-prefix-caching",
                "--max-num-seqs",
                str(max_num_seqs),
                "--log-level",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
        port,
    )


def start_llama_server(binary: str, model: str, port: int, slots: int, threads: int, slot_ctx: int) -> subprocess.Popen:
    """llama.cpp's server on `model`: `slots` parallel sequences of `slot_ctx` tokens each, no prompt cache reuse;
    its log goes to benchmarks/results/llama_server.log."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    with open(RESULTS / "llama_server.log", "w") as log:  # the child keeps its own copy of the descriptor
        return _wait_healthy(
            subprocess.Popen(
                [
                    binary,
                    "-m",
                    model,
                    "--port",
                    str(port),
                    "-np",
                    str(slots),
                    "-c",
                    str(slots * slot_ctx),
                    "-t",
                    str(threads),
                    "-tb",
                    str(threads),
                    "--cache-reuse",
                    "0",
                    "--no-webui",
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            ),
            port,
        )


def _wait_healthy(proc: subprocess.Popen, port: int) -> subprocess.Popen:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not come up")


async def _http_run(
    base: str, reqs: list[Req], concurrency: int, users: str | None = None, extra: dict | None = None
) -> Run:
    """`reqs` by `concurrency` streaming clients in a closed loop; with `users`, client i names
    itself f"{users}-{i}" in the requests' `user` field; `extra`: more fields for every body."""
    todo = list(reqs)
    ttft, tpot = [], []

    async def client(http: httpx.AsyncClient, index: int) -> None:
        while todo:
            r = todo.pop(0)
            body = {
                "model": "bench",
                "prompt": r.prompt,
                "max_tokens": r.out_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                **(extra or {}),
            }
            if users:
                body["user"] = f"{users}-{index}"
            t0 = time.perf_counter()
            first = None
            # a fresh connection per request: llama-server drops kept-alive ones after a stream
            async with http.stream(
                "POST", f"{base}/v1/completions", json=body, headers={"Connection": "close"}
            ) as response:
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
        await asyncio.gather(*(client(http, i) for i in range(concurrency)))
    return Run(time.perf_counter() - start, sum(r.out_len for r in reqs), ttft, tpot)


def _drive(
    base: str, warm_up: list[Req], reqs: list[Req], levels: list[int], into: dict, bar: tqdm, extra: dict | None = None
) -> None:
    """A warm-up (prompts of its own: none of the workload's is cached by it), then the workload
    at each concurrency against the server at `base`."""
    asyncio.run(_http_run(base, warm_up, 2, extra=extra))
    for c in levels:
        into[str(c)] = asyncio.run(_http_run(base, reqs, c, extra=extra)).summary()
        bar.update()


def print_table(res: dict, levels: list[int]) -> None:
    """Each path's numbers at each concurrency; ratios against tokenloom in-process and llama.cpp's server."""
    paths = ["http", "in_process"] + (["llama_server"] if "llama_server" in res else [])
    print(
        "\n| concurrency | path | output tok/s | / in-process | tokenloom HTTP / llama-server | TTFT median s | "
        "TTFT p99 s | TPOT median ms | TPOT p99 ms |\n|---:|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for c in levels:
        base_tps = res["in_process"][str(c)]["output_tok_s"]
        for path in paths:
            s = res[path][str(c)]
            vs = f"{res['http'][str(c)]['output_tok_s'] / s['output_tok_s']:.2f}x" if path == "llama_server" else ""
            print(
                f"| {c} | {path} | {s['output_tok_s']:.1f} | {s['output_tok_s'] / base_tps:.2f} | {vs} | "
                f"{s['ttft_median_s']:.2f} | {s['ttft_p99_s']:.2f} | {s['tpot_median_ms']:.0f} | "
                f"{s['tpot_p99_ms']:.0f} |"
            )


def main() -> None:
    p = parser(__doc__)
    add_workload_args(p)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (needs a GGUF --model)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    folder = args.model or str(hub.float32_folder())
    reqs = make_workload(args.requests, 0, args.prompt_len, args.output_len)
    warm_up = make_workload(2, 1, args.prompt_len, args.output_len)
    res: dict = {"http": {}, "in_process": {}, "config": vars(args)}
    if args.llama_server:
        res["llama_server"] = {}
        # A fresh server per level, prompt caching off: llama-server keeps each slot's last prompt
        # (and more in host memory), so a level after another found every prompt cached (at 16
        # after 1: one prompt token evaluated per request, 92 tok/s against 38 cold), while
        # tokenloom runs with its prefix cache off.
        with tqdm(total=len(args.concurrency), desc="llama-server", unit="run") as bar:
            for c in args.concurrency:
                proc = start_llama_server(
                    args.llama_server,
                    folder,
                    args.port,
                    max(args.concurrency),
                    args.threads,
                    args.prompt_len[1] + args.output_len[1] + 16,
                )
                try:
                    _drive(
                        f"http://127.0.0.1:{args.port}",
                        warm_up,
                        reqs,
                        [c],
                        res["llama_server"],
                        bar,
                        extra={"cache_prompt": False},
                    )
                finally:
                    proc.terminate()
                    proc.wait()
    with tqdm(total=2 * len(args.concurrency), desc="benchmarking", unit="run") as bar:
        proc = start_server(folder, args.port, max(args.concurrency))
        try:
            _drive(f"http://127.0.0.1:{args.port}", warm_up, reqs, args.concurrency, res["http"], bar)
        finally:
            proc.terminate()
            proc.wait()
        config = EngineConfig(
            folder,
            cache=CacheConfig(kv_cache_memory=2 << 30, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_seqs=max(args.concurrency)),
        )
        engine = AsyncLLMEngine.from_config(config)
        run_tokenloom(engine, warm_up, 2)  # warm-up
        for c in args.concurrency:
            res["in_process"][str(c)] = run_tokenloom(engine, reqs, c).summary()
            bar.update()
    print_table(res, args.concurrency)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_http.json").write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
