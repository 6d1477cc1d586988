"""Tensor vs pipeline parallelism on this machine: one process (tp 1) against the model split over
two processes (tp 2: each layer split, two all-reduces per layer; pp 2: the layers in two
stages, one send per micro-batch and stage), decode steps at batch 1 and 8, each step's time
split into compute and communication (rank 0's time inside torch.distributed calls, waiting for
the other rank included; ranks on one machine all-reduce through shared memory). Then the cost
of one all-reduce as a function of hidden size and rows, through gloo (what ranks on separate
machines use; its cost on a real link can be read off from this) and through shared memory.

All on one machine: the two ranks share its cores (each gets half; tp 1 gets all), so this
measures what splitting costs, not what a second machine would add.

    python benchmarks/bench_parallel.py [--model PATH] [--steps 16]
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import sys
import time

import torch
from _common import RESULTS, cpu_name, parser
from tqdm import tqdm

from tokenloom import LLM, SamplingParams

MODES = {"tp 1": {}, "tp 2": {"tensor_parallel_size": 2}, "pp 2": {"pipeline_parallel_size": 2}}
BATCHES = (1, 8)
HIDDEN = (576, 896, 2048, 4096, 8192)
ROWS = (1, 8, 64)


def decode_steps(llm: LLM, batch: int, steps: int) -> tuple[float, float]:
    """Median (step seconds, communication seconds) of engine steps in which `batch` greedy requests decode."""
    engine = llm.engine
    group = engine.ranks.group if engine.ranks is not None else None
    params = SamplingParams(temperature=0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"bench-{batch}-{i}", [100 + i] + list(range(200, 232)), params)
    times, comms = [], []
    while engine.has_unfinished_requests():
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.core.scheduler.running)
        full = len(engine.core.scheduler.running) == batch and not engine.core.scheduler.waiting
        comm_before = group.comm_seconds if group is not None else 0.0
        start = time.perf_counter()
        engine.step()
        if decoding and full:
            times.append(time.perf_counter() - start)
            comms.append((group.comm_seconds if group is not None else 0.0) - comm_before)
    return statistics.median(times), statistics.median(comms)


def measure_modes(model: str, steps: int) -> list[dict]:
    rows = []
    for mode, split in tqdm(MODES.items(), desc="parallel modes", unit="mode"):
        llm = LLM(model, dtype="float32", kv_cache_memory=256 << 20, **split)
        try:
            decode_steps(llm, 1, 4)  # warm-up
            for batch in BATCHES:
                step, comm = decode_steps(llm, batch, steps)
                rows.append({"mode": mode, "batch": batch, "step_s": step, "comm_s": comm, "tok_s": batch / step})
        finally:
            if llm.engine.ranks is not None:
                llm.engine.ranks.stop()
    return rows


def _median_seconds(all_reduce, x: torch.Tensor) -> float:
    for _ in range(20):
        all_reduce(x)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        all_reduce(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _all_reduce_rank(rank: int, port: int, shm_path: str, results) -> None:
    import torch.distributed as dist

    from tokenloom.distributed.shm import SharedMemoryAllReduce

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shm = SharedMemoryAllReduce(shm_path, rank, 2, 60.0)
    out = {}
    for hidden in HIDDEN:
        for rows in ROWS:
            x = torch.randn(rows, hidden)
            out[(hidden, rows)] = (
                _median_seconds(dist.all_reduce, x),
                _median_seconds(shm.all_reduce, x) if shm.fits(x) else None,
            )
    if rank == 0:
        results.put(out)
        shm.remove()
    dist.destroy_process_group()


def measure_all_reduce() -> dict:
    """(hidden, rows) -> median seconds of one all-reduce of a float32 (rows, hidden) tensor between
    two processes: (gloo, shared memory or None where it does not fit a slot)."""
    from tokenloom.distributed.group import free_port
    from tokenloom.distributed.shm import SharedMemoryAllReduce

    context = mp.get_context("spawn")
    results, port, path = context.Queue(), free_port(), SharedMemoryAllReduce.create(2)
    ranks = [context.Process(target=_all_reduce_rank, args=(r, port, path, results)) for r in range(2)]
    for p in ranks:
        p.start()
    out = results.get(timeout=600)
    for p in ranks:
        p.join()
    return out


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per batch (default: 16)")
    args = p.parse_args()
    from tokenloom.loader import hub

    model = args.model or str(hub.float32_folder())
    rows = measure_modes(model, args.steps)
    base = {r["batch"]: r["step_s"] for r in rows if r["mode"] == "tp 1"}
    print(f"\nDecode steps on {cpu_name()}, {model}, float32 (medians; ranks share the machine's cores)\n")
    print("| mode | batch | step (ms) | communication (ms) | compute (ms) | tok/s | vs tp 1 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['batch']} | {r['step_s'] * 1e3:.1f} | {r['comm_s'] * 1e3:.1f} | "
            f"{(r['step_s'] - r['comm_s']) * 1e3:.1f} | {r['tok_s']:.1f} | {base[r['batch']] / r['step_s']:.2f}x |"
        )
    reduce = measure_all_reduce()
    print(
        f"\nOne all-reduce between two processes on {cpu_name()}: gloo over loopback (what ranks on two "
        "machines use, there over their link) and shared memory (ranks on one machine); medians of 200\n"
    )
    print("| hidden | rows | gloo (us) | gloo, 32 layers x 2 (ms) | shared memory (us) | shared memory, 32 x 2 (ms) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for (hidden, n), (gloo, shm) in reduce.items():
        local = ("-", "-") if shm is None else (f"{shm * 1e6:.0f}", f"{64 * shm * 1e3:.2f}")
        print(f"| {hidden} | {n} | {gloo * 1e6:.0f} | {64 * gloo * 1e3:.2f} | {local[0]} | {local[1]} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "parallel.json").write_text(
        json.dumps(
            {
                "cpu": cpu_name(),
                "model": model,
                "modes": rows,
                "all_reduce_s": [
                    {"hidden": h, "rows": n, "gloo": g, "shared_memory": m} for (h, n), (g, m) in reduce.items()
                ],
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
