#!/usr/bin/env python
"""Well-behaved clients beside an abusive one: what the abuse costs them.

Starts `tokenloom serve` (default admission limits) as a subprocess, then runs the same
workload of 16 streaming clients (bench_http's closed loop over /v1/completions, greedy, EOS
ignored; each names itself in `user`, the abuser does not, so it is known by its address)
twice: alone, and while one abusive client sends, in rounds (each abuse of a round at once)
until the workload ends, every abuse of the server-under-abuse issue: a 2,000-prompt x n=16
burst, a 4 x n=16 request of 4,096 tokens each (kept streaming), a 4 MB prompt, an anyOf x 5,000 JSON schema, a lone
surrogate, a 2**64 seed, 10^5 stop strings, a body that never arrives, temperature 1e-45, beam
search left by its client, and 300 requests at once. A probe times /health every 100 ms. The
abuser and the probe each run in a process of their own, as other clients would.

Reported: the well-behaved clients' TTFT and TPOT (median, p99) alone and beside the abuser and
their ratio (target: within 2x), their errors (target: 0), what the abuser was answered, /health's
worst latency, and the KV blocks in use once all is done (target: 0).
Writes benchmarks/results/bench_abuse.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from _common import RESULTS, cpu_name, parser
from bench_http import _http_run, start_server
from bench_serving import make_workload

from tokenloom.loader import hub

SCHEMA = {
    "anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]} for i in range(5000)
    ]
}


def abuses(base: str) -> dict[str, dict]:
    """name -> request body (posted to /v1/completions)."""
    return {
        "burst 2000 prompts x n=16": {"prompt": ["Hi there"] * 2000, "n": 16, "max_tokens": 1},
        "4 MB prompt": {"prompt": "Hello world, this is a test. " * 140_000, "max_tokens": 2},
        "anyOf x 5000 schema": {"prompt": "Hi", "max_tokens": 1, "guided_json": SCHEMA},
        "lone surrogate": "LONE",
        "seed 2**64": {"prompt": "Hi", "max_tokens": 1, "seed": 2**64},
        "10^5 stop strings": {"prompt": "Hi", "max_tokens": 1, "stop": [f"s{i}" for i in range(100_000)]},
        "temperature 1e-45": {"prompt": "Hi", "max_tokens": 4, "temperature": 1e-45},
    }


def encoded(body) -> bytes:
    """A request body as the bytes sent: encoded once, before the rounds, since an abuser on
    another machine spends none of the server's CPU on its JSON (here it shares the 2 cores;
    encoding the 4 MB prompt and the 10^5 stop strings every round cost the abuser's process
    ~0.2 s of CPU a round)."""
    if body == "LONE":
        return b'{"model": "bench", "prompt": "a\\ud800b", "max_tokens": 2}'
    return json.dumps({"model": "bench"} | body).encode()


async def _post(http: httpx.AsyncClient, base: str, content: bytes) -> int:
    r = await http.post(f"{base}/v1/completions", content=content, headers={"content-type": "application/json"})
    return r.status_code


async def _hog(http: httpx.AsyncClient, base: str, done: asyncio.Event, answers: Counter) -> None:
    """4 prompts x n=16 x 4096 tokens, streamed until the workload ends."""
    body = {
        "model": "bench",
        "prompt": ["Tell me a story"] * 4,
        "n": 16,
        "max_tokens": 4096,
        "ignore_eos": True,
        "stream": True,
    }
    async with http.stream("POST", f"{base}/v1/completions", json=body) as response:
        answers[f"hog 4 x n=16 x 4096 tokens: {response.status_code}"] += 1
        async for _ in response.aiter_lines():
            if done.is_set():
                return


async def _slow_body(base: str, answers: Counter) -> None:
    """Content-Length 1000, 10 bytes sent, then nothing: answered 408 after the body timeout."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"prompt":'
    )
    await writer.drain()
    try:
        status = (await asyncio.wait_for(reader.readline(), 60)).decode().split(" ")[1]
    except (TimeoutError, IndexError):
        status = "none"
    answers[f"body that never arrives: {status}"] += 1
    writer.close()


async def _left_beam_search(http: httpx.AsyncClient, base: str, answers: Counter) -> None:
    body = {"model": "bench", "prompt": "Hi", "max_tokens": 200, "use_beam_search": True, "best_of": 4}
    try:
        await asyncio.wait_for(http.post(f"{base}/v1/completions", json=body), 1.0)
    except TimeoutError:
        answers["beam search, client gone after 1 s"] += 1


async def _crowd(http: httpx.AsyncClient, base: str, answers: Counter) -> None:
    body = encoded({"prompt": "Hi", "max_tokens": 64})
    codes = await asyncio.gather(*(_post(http, base, body) for _ in range(300)), return_exceptions=True)
    for code in codes:
        answers[f"300 requests at once: {code if isinstance(code, int) else type(code).__name__}"] += 1


SIDE_ABUSES = ("hog", "slow", "beam", "crowd", "requests")


async def abuser(base: str, done: asyncio.Event, answers: Counter, skip: set[str]) -> None:
    """Until `done`: every single bad request, the left beam search and the crowd of 300, all at once,
    in rounds; the hog and the slow body beside them from the start."""
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=400)) as http:
        side = [asyncio.create_task(_hog(http, base, done, answers))] if "hog" not in skip else []
        side += [asyncio.create_task(_slow_body(base, answers))] if "slow" not in skip else []

        async def one(name: str, body: bytes) -> None:
            answers[f"{name}: {await _post(http, base, body)}"] += 1

        bodies = {name: encoded(body) for name, body in abuses(base).items()}
        while not done.is_set():
            round_ = [one(name, body) for name, body in bodies.items()] if "requests" not in skip else []
            round_ += [_left_beam_search(http, base, answers)] if "beam" not in skip else []
            round_ += [_crowd(http, base, answers)] if "crowd" not in skip else []
            await asyncio.gather(*round_)
            await asyncio.sleep(0.1)
        await asyncio.gather(*side, return_exceptions=True)


async def probe(base: str, done: asyncio.Event) -> float:
    """/health every 100 ms until `done`; the worst latency seen."""
    worst = 0.0
    async with httpx.AsyncClient(timeout=30) as http:
        while not done.is_set():
            started = time.perf_counter()
            await http.get(f"{base}/health")
            worst = max(worst, time.perf_counter() - started)
            await asyncio.sleep(0.1)
    return worst


async def side_role(role: str, base: str, skip: set[str], abuser_nice: int = 0) -> None:
    """This process is the probe or the abuser until its stdin closes; then it prints what it saw
    as JSON. Each has a process of its own, as it would be another client: in the clients'
    process, 300 requests at once delay that process's own event loop, and the probe would time
    it instead of the server (seen: /health 2.6 s from inside, 8 ms from another process).
    The abuser runs at niceness `abuser_nice`: an abusive client on another machine spends none
    of the server's CPU, while here its process (~2.7 s of CPU a phase, in bursts: 300 requests
    at once) shares the server's 2 cores, which the engine's steps then wait for."""
    done, loop, stdin = asyncio.Event(), asyncio.get_running_loop(), sys.stdin.fileno()

    def on_stdin() -> None:
        if not os.read(stdin, 4096):  # closed: time to stop
            loop.remove_reader(stdin)
            done.set()

    loop.add_reader(stdin, on_stdin)
    print("ready", flush=True)
    if role == "abuser":
        os.nice(abuser_nice)
    if role == "probe":
        print(json.dumps({"health_worst_s": await probe(base, done)}))
    else:
        answers: Counter = Counter()
        started = time.process_time()
        await abuser(base, done, answers, skip)
        print(json.dumps({"abuser_answers": dict(answers), "abuser_cpu_s": time.process_time() - started}))


async def _start_side(role: str, base: str, skip: set[str], abuser_nice: int) -> asyncio.subprocess.Process:
    """The role's process, once it has started (its imports would otherwise share the first
    second of the workload's CPU)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--role",
        role,
        "--base",
        base,
        "--abuser-nice",
        str(abuser_nice),
        "--skip",
        *skip,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    await proc.stdout.readline()
    return proc


async def _stop_side(proc: asyncio.subprocess.Process) -> dict:
    out, _ = await proc.communicate(b"")  # stdin closed: the role ends and reports
    return json.loads(out.decode().strip().splitlines()[-1])


async def phase(base: str, reqs, abusive: bool, skip: set[str], abuser_nice: int) -> tuple[dict, dict, float, int]:
    """(the clients' summary, the abuser's report: its answers and CPU seconds, /health's worst, errors)."""
    sides = [await _start_side("probe", base, skip, abuser_nice)]
    if abusive:
        sides.append(await _start_side("abuser", base, skip, abuser_nice))
        await asyncio.sleep(2)  # the abuse under way first
    errors = 0
    try:
        run = await _http_run(base, reqs, 16, users="good")  # 16 clients, each its own user
    except httpx.HTTPError:
        errors, run = 1, None
    reports = [await _stop_side(proc) for proc in sides]
    return (run.summary() if run else {}), reports[1] if abusive else {}, reports[0]["health_worst_s"], errors


def blocks_in_use(base: str) -> float:
    for _ in range(100):
        text = httpx.get(f"{base}/metrics").text
        values = {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.splitlines()
            if line.startswith("tokenloom_") and " " in line and "{" not in line.split(" ")[0]
        }
        if values.get("tokenloom_num_requests_running", 0) + values.get("tokenloom_num_requests_waiting", 0) == 0:
            return values.get("tokenloom_kv_cache_blocks_used", float("nan"))
        time.sleep(0.5)
    return float("nan")


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument(
        "--skip",
        nargs="*",
        default=[],
        choices=SIDE_ABUSES,
        help="leave these abuses out (to see what each costs): hog, slow (body), beam, crowd (300 "
        "requests at once), requests (the single bad requests)",
    )
    p.add_argument(
        "--abuser-nice",
        type=int,
        default=10,
        help="niceness of the abuser's process (default 10): on one machine its own CPU, which a remote "
        "abuser would not take from the server, slows the engine's steps; 0 to measure that too",
    )
    p.add_argument("--role", choices=["probe", "abuser"], help=argparse.SUPPRESS)
    p.add_argument("--base", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role:
        asyncio.run(side_role(args.role, args.base, set(args.skip), args.abuser_nice))
        return
    model = args.model or str(hub.float32_folder())
    server = start_server(model, args.port, 64)
    base = f"http://127.0.0.1:{args.port}"
    reqs = make_workload(args.requests, 0, (16, 64), (32, 32))
    results = {}
    try:
        asyncio.run(_http_run(base, reqs[:4], 4))  # warm-up
        for label, abusive in tqdm([("alone", False), ("beside the abuser", True)], desc="phases"):
            summary, abuser, worst, errors = asyncio.run(phase(base, reqs, abusive, set(args.skip), args.abuser_nice))
            results[label] = {
                "clients": summary,
                "client_errors": errors,
                "health_worst_s": worst,
                "abuser_answers": abuser.get("abuser_answers", {}),
                "abuser_cpu_s": abuser.get("abuser_cpu_s"),
            }
        results["kv_blocks_after"] = blocks_in_use(base)
    finally:
        server.terminate()
        server.wait(timeout=60)
    print_report(results, cpu_name())
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_abuse.json").write_text(
        json.dumps(results | {"cpu": cpu_name(), "skipped": args.skip, "abuser_nice": args.abuser_nice}, indent=2)
    )


def print_report(res: dict, cpu: str) -> None:
    alone, abused = res["alone"], res["beside the abuser"]
    print(f"\n16 well-behaved streaming clients, {cpu}")
    print("| metric | alone | beside the abuser | ratio |\n|---|---:|---:|---:|")
    for key in ("ttft_median_s", "ttft_p99_s", "tpot_median_ms", "tpot_p99_ms", "output_tok_s"):
        a, b = alone["clients"].get(key, float("nan")), abused["clients"].get(key, float("nan"))
        print(f"| {key} | {a:.3f} | {b:.3f} | {b / a:.2f}x |")
    print(f"| client errors | {alone['client_errors']} | {abused['client_errors']} | |")
    print(f"| /health worst (s) | {alone['health_worst_s']:.3f} | {abused['health_worst_s']:.3f} | |")
    print(f"KV blocks in use after: {res['kv_blocks_after']:g}")
    print(f"the abuser's own process used {abused['abuser_cpu_s']:.1f} s of CPU")
    print("\nwhat the abuser was answered (status: count)")
    for answer, count in sorted(abused["abuser_answers"].items()):
        print(f"  {answer} x {count}")


if __name__ == "__main__":
    main()
