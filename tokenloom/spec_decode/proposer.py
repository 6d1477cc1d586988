"""Proposers: before each engine step is scheduled, give decoding requests draft tokens to verify in it.

``SpecProposer.propose_for(running)`` decides who speculates (the fallback rules of
SpeculativeConfig) and how far (never past max_tokens or the context), then the
subclass fills ``request.spec_token_ids`` (and ``spec_draft_probs`` where drafts were
sampled). The scheduler verifies them in the next step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tokenloom.config import SpeculativeConfig
from tokenloom.kv_cache.paged import PagedKVCache
from tokenloom.loader import load_model
from tokenloom.sampling.chain import greedy_and_distribution
from tokenloom.sampling.metadata import SamplingMetadata
from tokenloom.sampling.processors import apply_processors
from tokenloom.spec_decode.ngram import propose_ngram
from tokenloom.tokenizer import Tokenizer
from tokenloom.worker.batch import SeqChunk
from tokenloom.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from tokenloom.engine.request import Request

# (request, number of its positions to hold KV for) -> its block table, or None if they do not fit
Reserve = Callable[["Request", int], "list[int] | None"]

_RECOVERY_PER_STEP = 0.02  # how fast a backed-off request's acceptance estimate climbs back to retry


class SpecProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    @staticmethod
    def create(
        config: SpeculativeConfig,
        target: ModelRunner,
        tokenizer: Tokenizer,
        max_model_len: int,
        dtype: str,
        progress: bool = False,
    ) -> SpecProposer:
        """The proposer `config` names, for a target model run by `target` with `tokenizer`."""
        if config.method == "ngram":
            return NgramProposer(config, max_model_len)
        return DraftModelProposer(config, target, tokenizer, max_model_len, dtype, progress)

    def propose_for(self, running: list[Request], reserve: Reserve) -> None:
        """Set drafts on the running requests that decode next step, unless speculation would not pay."""
        if len(running) > self.config.max_batch:
            return  # compute bound: plain decoding is cheaper
        todo = []
        for r in running:
            if r.is_finished or r.num_computed_tokens != r.num_tokens - 1 or r.matcher is not None or r.params.explain:
                continue  # still prefilling, constrained or explained: decoded plainly
            if r.spec_acceptance < self.config.min_acceptance:
                r.spec_acceptance += _RECOVERY_PER_STEP  # backed off: decode plainly for a while
                continue
            k = min(
                self.config.k, r.params.max_tokens - len(r.output_token_ids) - 1, self.max_model_len - r.num_tokens - 1
            )
            if k > 0:
                todo.append((r, k))
        if todo:
            self.propose(todo, reserve)

    def propose(self, todo: list[tuple[Request, int]], reserve: Reserve) -> None:
        """Set up to k drafts on each (request, k) of `todo`; `reserve` gives KV room ahead."""
        raise NotImplementedError


class NgramProposer(SpecProposer):
    """Prompt lookup: drafts are copied from earlier in the sequence (deterministic proposals)."""

    def propose(self, todo: list[tuple[Request, int]], reserve: Reserve) -> None:
        for r, k in todo:
            r.spec_token_ids = propose_ngram(r.all_token_ids, k, self.config.ngram_max, self.config.ngram_min)
            r.spec_draft_probs = None


class DraftModelProposer(SpecProposer):
    """A smaller model with the target's tokenizer, run autoregressively for k tokens.

    Its KV cache is paged with the target's block ids (same tables, own tensors), so it
    follows the target's allocation, preemption and prefix sharing for free. Greedy
    requests get the draft's argmax; sampled ones a draw from the draft's distribution
    under the request's own processors, kept for the rejection rule.
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        target: ModelRunner,
        tokenizer: Tokenizer,
        max_model_len: int,
        dtype: str,
        progress: bool = False,
    ) -> None:
        super().__init__(config, max_model_len)
        assert config.draft_model is not None  # SpeculativeConfig requires it for this method
        loaded = load_model(config.draft_model, dtype, target.device, progress=progress)
        if loaded.config.recurrent is not None:
            raise ValueError(
                f"draft model {config.draft_model} ({loaded.config.architecture}) has recurrent layers: "
                "their state cannot be rolled back over rejected drafts; draft with an attention-only model"
            )
        vocab = target.model.config.vocab_size
        if loaded.tokenizer.backend.get_vocab() != tokenizer.backend.get_vocab() or loaded.config.vocab_size != vocab:
            raise ValueError(
                f"draft model {config.draft_model} does not share the target's tokenizer "
                f"(vocabularies differ: {loaded.tokenizer.vocab_size} vs {tokenizer.vocab_size})"
            )
        target_kv = target.kv_cache
        kv = PagedKVCache(
            loaded.config,
            target_kv.num_blocks,
            target_kv.block_size,
            target_kv.dtype,
            target.device,
            target_kv.kv_cache_dtype,
        )
        self.runner = ModelRunner(loaded.model, kv, target.device)
        self.max_len = min(max_model_len, loaded.config.max_model_len)

    @torch.inference_mode()
    def propose(self, todo: list[tuple[Request, int]], reserve: Reserve) -> None:
        batch, tables = [], {}
        for r, k in todo:
            k = min(k, self.max_len - r.num_tokens - 1)
            table = reserve(r, r.num_tokens + k) if k > 0 else None  # room for the drafts' KV
            if table is not None:
                batch.append((r, k))
                tables[r.request_id] = table
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in batch}
        probs: dict[str, list[torch.Tensor]] = {r.request_id: [] for r, _ in batch}
        # pass 0 catches up on every token the draft has not seen; pass i feeds draft i - 1
        chunks = [
            SeqChunk(r.all_token_ids[r.draft_num_computed :], r.draft_num_computed, tables[r.request_id])
            for r, _ in batch
        ]
        active = batch
        for i in range(max((k for _, k in batch), default=0)):
            if i > 0:
                active = [(r, k) for r, k in active if k > i]
                chunks = [
                    SeqChunk([drafts[r.request_id][-1]], r.num_tokens + i - 1, tables[r.request_id]) for r, _ in active
                ]
            hidden, meta = self.runner.forward(chunks)
            assert meta is not None  # the draft's runner runs eagerly: no graphs, no pipeline
            rows = [s + q - 1 for s, q in zip(meta.query_start, meta.query_lens)]
            logits = self.runner.model.compute_logits(hidden[rows])  # (B, vocab)
            self._draw(logits, [r for r, _ in active], drafts, probs)
        for r, k in batch:
            r.draft_num_computed = r.num_tokens + k - 1
            r.spec_token_ids = drafts[r.request_id]
            r.spec_draft_probs = torch.stack(probs[r.request_id]) if probs[r.request_id] else None

    @staticmethod
    def _draw(logits: torch.Tensor, reqs: list[Request], drafts: dict, probs_by_request: dict) -> None:
        """Each request's next draft token, under its own processors (as the target will see it)."""
        meta = SamplingMetadata.for_requests(reqs, [r.output_token_ids + drafts[r.request_id] for r in reqs])
        argmax_rows, sampled, probs = greedy_and_distribution(apply_processors(logits, meta), meta)  # (S, vocab)
        argmax = argmax_rows.tolist()
        next_sampled = iter(range(len(sampled)))
        for i, r in enumerate(reqs):
            if r.params.greedy:
                drafts[r.request_id].append(argmax[i])
                continue
            assert probs is not None  # a sampled row: the distributions exist
            q = probs[next(next_sampled)]
            drafts[r.request_id].append(int(torch.multinomial(q, 1, generator=r.generator)))
            probs_by_request[r.request_id].append(q)
