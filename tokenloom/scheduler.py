"""Decides, each step, which requests compute how many tokens. No torch here.

The rule is vLLM v1's: every request has ``num_computed_tokens`` and
``num_tokens``; a step hands out up to ``max_num_batched_tokens`` tokens of work,
running requests first (each decodes one token or continues its prompt), then
waiting requests in arrival order while there is budget, a sequence slot and
KV blocks. A prompt larger than the remaining budget is prefilled in chunks.

This first version reserves KV blocks for a request's whole possible length
when it is admitted, so a running request can never run out of cache.
"""

from __future__ import annotations

from collections import deque

from tokenloom.config import SchedulerConfig
from tokenloom.kv_cache.block_manager import BlockManager
from tokenloom.outputs import ScheduledRequest, SchedulerOutput
from tokenloom.request import Request, RequestStatus


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int) -> None:
        self.config = config
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        need = request.max_total_tokens(self.max_model_len)
        if self.blocks.blocks_needed(need) > self.blocks.num_blocks:
            raise ValueError(f"request {request.request_id} needs {need} tokens of KV cache but the "
                             f"whole cache holds {self.blocks.num_blocks * self.blocks.block_size}; "
                             "lower max_tokens or raise --kv-cache-memory")
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        for req in self.running:
            if budget == 0:
                break
            budget -= self._schedule_one(out, req, budget)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            need = req.max_total_tokens(self.max_model_len)
            if not self.blocks.can_allocate(req.request_id, need):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            req.block_table = self.blocks.allocate(req.request_id, need)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            budget -= self._schedule_one(out, req, budget)
        return out

    @staticmethod
    def _schedule_one(out: SchedulerOutput, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        samples = req.num_computed_tokens + n == req.num_tokens
        out.scheduled.append(ScheduledRequest(req, n, samples))
        return n

    def finish(self, request: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """End a request (stop, length or abort): free its blocks and drop it from the queues."""
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.blocks.free(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
