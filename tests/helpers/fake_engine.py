"""The engine's schedule -> execute -> update loop with a fake model: no torch, exact and fast."""

from __future__ import annotations

from tokenloom.config import SchedulerConfig
from tokenloom.engine.request import Request
from tokenloom.engine.scheduler import Scheduler
from tokenloom.kv_cache.block_manager import BlockManager
from tokenloom.sampling_params import SamplingParams
from tokenloom.worker.contract import RunnerOutput


class FakeEngine:
    """Every sampled token is `1000 + number of tokens the request had`, so outputs are predictable."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 4,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 16,
        max_model_len: int = 1024,
        prefix_caching: bool = True,
        fair_share_seqs: int | None = None,
    ) -> None:
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, fair_share_seqs), self.blocks, max_model_len
        )
        self.requests: dict[str, Request] = {}
        self.arrivals = 0
        self.log: list[list[tuple[str, int]]] = []  # per step: (request id, tokens computed)

    def add(self, rid: str, prompt: list[int], max_tokens: int, client: str | None = None) -> Request:
        req = Request(
            rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), arrival=self.arrivals, client=client
        )
        self.arrivals += 1
        self.scheduler.check_fits(len(prompt), max_tokens)  # as EngineCore.validate does
        self.scheduler.add(req)
        self.requests[rid] = req
        return req

    def abort(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is not None:
            self.scheduler.finish(req, "abort")

    def step(self) -> None:
        out = self.scheduler.schedule()
        self.log.append([(s.request.request_id, s.num_tokens) for s in out.scheduled])
        sampled = [s.request for s in out.scheduled if s.samples]
        tokens = [[1000 + r.num_tokens] for r in sampled]
        self.scheduler.update_from_output(
            out, RunnerOutput([r.request_id for r in sampled], tokens, [None] * len(sampled))
        )
        self.blocks.check_integrity()

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished:
                return
            self.step()
        raise AssertionError("requests did not finish")
