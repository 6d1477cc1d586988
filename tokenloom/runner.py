"""SchedulerOutput -> tensors -> model forward -> sampler -> RunnerOutput."""

from __future__ import annotations

import torch

from tokenloom.attention import AttentionMetadata
from tokenloom.kv_cache.paged import PagedKVCache
from tokenloom.models.base import CausalLM
from tokenloom.outputs import RunnerOutput, SchedulerOutput
from tokenloom.sampling import Sampler, SamplingMetadata


class ModelRunner:
    """Owns the model and its KV cache tensors; runs one step of a ragged batch."""

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, device: torch.device | str) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.sampler = Sampler()

    def _prepare(self, sched: SchedulerOutput
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flatten the scheduled chunks: input ids and positions (T,), attention metadata, and the
        blocks whose first slot this step writes (to be zeroed first, see PagedKVCache)."""
        bs = self.kv_cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts, q_lens, ctx_lens, tables, fresh = [], [], [], [], []
        for s in sched.scheduled:
            req, start = s.request, s.request.num_computed_tokens
            end = start + s.num_tokens
            tokens = req.all_token_ids
            starts.append(len(ids))
            ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            table = s.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            fresh.extend(table[p // bs] for p in range(-(-start // bs) * bs, end, bs))  # first write of a block
            q_lens.append(s.num_tokens)
            ctx_lens.append(end)
            tables.append(torch.tensor(table[:-(-end // bs)], dtype=torch.int64, device=self.device))
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=self.device)
        meta = AttentionMetadata(as_tensor(slots), starts, q_lens, ctx_lens, tables,
                                 null_block=self.kv_cache.null_block, sliding_window=self.model.config.sliding_window)
        return as_tensor(ids), as_tensor(positions), meta, fresh

    @staticmethod
    def _sampling_metadata(sched: SchedulerOutput) -> SamplingMetadata:
        reqs = [s.request for s in sched.scheduled if s.samples]
        return SamplingMetadata(
            params=[r.params for r in reqs],
            prompt_token_ids=[r.prompt_token_ids for r in reqs],
            output_token_ids=[r.output_token_ids for r in reqs],
            generators=[r.generator for r in reqs],
            eos_token_ids=[r.eos_token_ids for r in reqs])

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        input_ids, positions, meta, fresh_blocks = self._prepare(sched)
        if fresh_blocks:
            self.kv_cache.zero_blocks(torch.tensor(fresh_blocks, dtype=torch.int64, device=self.device))
        hidden = self.model(input_ids, positions, meta, self.kv_cache)      # (T, hidden)
        last_rows = [start + q_len - 1 for s, start, q_len in zip(sched.scheduled, meta.query_start, meta.query_lens)
                     if s.samples]
        if not last_rows:
            return RunnerOutput([], [], [])
        logits = self.model.compute_logits(hidden[last_rows])               # (B, vocab) float32
        smeta = self._sampling_metadata(sched)
        tokens, logprobs = self.sampler(logits, smeta)
        ids = [s.request.request_id for s in sched.scheduled if s.samples]
        return RunnerOutput(ids, tokens.tolist(), logprobs)
