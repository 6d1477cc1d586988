"""SchedulerOutput -> tensors -> model forward -> sampler -> RunnerOutput."""

from __future__ import annotations

import torch

from tokenloom.allocator import KEEP_BELOW, reserve_heap
from tokenloom.attention import AttentionMetadata, reads_past_context
from tokenloom.batch import SeqChunk, build_batch
from tokenloom.kv_cache.paged import PagedKVCache
from tokenloom.models.base import CausalLM
from tokenloom.outputs import RunnerOutput, SchedulerOutput, TokenLogprobs
from tokenloom.prompt_logprobs import chunk_targets, prompt_logprobs
from tokenloom.sampling import Sampler, SamplingMetadata
from tokenloom.spec_decode.verifier import Draft, verify
from tokenloom.structured.masks import MaskStep


class ModelRunner:
    """Owns the model and its KV cache tensors; runs one step of a ragged batch."""

    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, device: torch.device | str) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.sampler = Sampler()
        # Blocks are cleared on their first write only where a reader looks past a sequence's
        # end (60 index_fill calls, ~1 ms, in most steps of a float32 SmolLM2 batch otherwise).
        self.zero_fresh_blocks = reads_past_context(kv_cache)

    def reserve_activation_memory(self, max_tokens: int, dtype: torch.dtype) -> bool:
        """On the CPU, grow the heap once for the activations of a `max_tokens`-token step, so
        that the first large step does not page-fault them in (allocator.reserve_heap). Sized
        at 4 x (hidden + intermediate + q + 2 kv) elements per token: a 6.4k-token SmolLM2
        prefill grew the heap by 3.2x that (live tensors and fragmentation). At most half of
        allocator.KEEP_BELOW; True if reserved."""
        if self.device.type != "cpu":
            return False
        c = self.model.config
        width = c.hidden_size + c.intermediate_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        nbytes = 4 * width * torch.empty((), dtype=dtype).element_size() * max_tokens
        return reserve_heap(min(nbytes, KEEP_BELOW // 2))

    def _chunks(self, sched: SchedulerOutput) -> list[SeqChunk]:
        chunks = []
        for s in sched.scheduled:
            req, start = s.request, s.request.num_computed_tokens
            tokens = req.all_token_ids[start:] + s.spec_token_ids       # pending tokens, then drafts
            chunks.append(SeqChunk(tokens[:s.num_tokens], start, s.block_ids))
        return chunks

    def forward(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, AttentionMetadata]:
        """Run the model over `chunks` (writing their KV): hidden states (T, hidden) and the batch layout."""
        batch = build_batch(chunks, self.kv_cache.block_size, self.device, self.kv_cache.null_block,
                            self.model.config.sliding_window)
        if batch.fresh_blocks and self.zero_fresh_blocks:
            self.kv_cache.zero_blocks(torch.tensor(batch.fresh_blocks, dtype=torch.int64, device=self.device))
        return self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache), batch.meta

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        constrained = [s.request.matcher for s in sched.scheduled
                       if s.samples and not s.spec_token_ids and s.request.matcher is not None]
        masks = MaskStep(constrained, self.model.config.vocab_size) if constrained else None  # runs meanwhile
        if sched.block_copies:
            self.kv_cache.copy_blocks(sched.block_copies)
        hidden, meta = self.forward(self._chunks(sched))                     # (T, hidden)
        plain, spec, rows_plain, rows_spec = [], [], [], []
        for s, start, q_len in zip(sched.scheduled, meta.query_start, meta.query_lens):
            if s.spec_token_ids:
                spec.append(s)
                rows_spec.extend(range(start + q_len - 1 - len(s.spec_token_ids), start + q_len))
            elif s.samples:
                plain.append(s)
                rows_plain.append(start + q_len - 1)
        results: dict[str, tuple[list[int], list | None]] = {}
        explanations = {}
        if plain:
            logits = self.model.compute_logits(hidden[rows_plain])            # (B, vocab) float32
            rows = [i for i, s in enumerate(plain) if s.request.matcher is not None]
            constrain = (lambda lg: masks.apply(lg, rows)) if masks else None
            sampled = self.sampler.sample(logits, SamplingMetadata.for_requests([s.request for s in plain]),
                                          constrain)
            for s, t, lp, record in zip(plain, sampled.tokens.tolist(), sampled.logprobs, sampled.explanations):
                results[s.request.request_id] = ([t], None if lp is None else [lp])
                if record is not None:
                    explanations[s.request.request_id] = record
        if spec:
            logits = self.model.compute_logits(hidden[rows_spec])             # (sum(k + 1), vocab)
            drafts = [Draft(s.request, s.spec_token_ids, s.request.spec_draft_probs) for s in spec]
            for s, result in zip(spec, verify(logits, drafts)):
                results[s.request.request_id] = result
        ids = [s.request.request_id for s in sched.scheduled if s.request.request_id in results]
        return RunnerOutput(ids, [results[i][0] for i in ids], [results[i][1] for i in ids],
                            self._prompt_logprobs(sched, hidden, meta), explanations)

    def _prompt_logprobs(self, sched: SchedulerOutput, hidden: torch.Tensor, meta: AttentionMetadata
                         ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Scoring requests' prompt-chunk rows -> logprobs of the prompt tokens they predict."""
        out = {}
        for s, row in zip(sched.scheduled, meta.query_start):
            req = s.request
            if req.params.prompt_logprobs is None or req.num_computed_tokens >= req.num_prompt_tokens:
                continue
            start = req.num_computed_tokens
            k, targets = chunk_targets(req.prompt_token_ids, start, s.num_tokens)
            if k:
                out[req.request_id] = (start + 1, prompt_logprobs(self.model, hidden[row:row + k], targets,
                                                                   req.params.prompt_logprobs))
        return out
