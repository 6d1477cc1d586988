"""SchedulerOutput -> tensors -> model forward -> sampler -> RunnerOutput."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch

from tokenloom.attention import AttentionMetadata
from tokenloom.attention.backend import reads_past_context
from tokenloom.distributed.errors import ParallelRankError
from tokenloom.kernels import triton as triton_kernels
from tokenloom.kv_cache.paged import PagedKVCache
from tokenloom.layers.op_tape import StepTapes
from tokenloom.lora.kernel import kernel_runs
from tokenloom.lora.manager import LoRAManager, storage_dtype
from tokenloom.memory.allocator import KEEP_BELOW, reserve_heap
from tokenloom.models.base import CausalLM
from tokenloom.outputs import TokenLogprobs, describe_error
from tokenloom.sampling import Sampler, SamplingMetadata
from tokenloom.sampling import device as device_sampling
from tokenloom.sampling.sparse import take_rows
from tokenloom.spec_decode.verifier import Draft, verify
from tokenloom.structured.masks import MaskStep
from tokenloom.worker.batch import SeqChunk, build_batch
from tokenloom.worker.contract import RunnerOutput, SchedulerOutput
from tokenloom.worker.cuda_graphs import start_decode_graphs
from tokenloom.worker.prompt_logprobs import chunk_targets, prompt_logprobs

if TYPE_CHECKING:
    from tokenloom.config import LoRAConfig
    from tokenloom.distributed.group import ParallelGroup
    from tokenloom.distributed.pipeline import Pipeline

log = logging.getLogger(__name__)

# The activation heap reserved at start-up stays resident: at most this much (see reserve_activation_memory).
RESERVE_AT_MOST = 128 << 20


class ModelRunner:
    """Owns the model and its KV cache tensors; runs one step of a ragged batch."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: PagedKVCache,
        device: torch.device | str,
        cuda_graphs: bool = False,
        max_num_seqs: int = 64,
        max_model_len: int | None = None,
        peers: ParallelGroup | None = None,
        pipeline: Pipeline | None = None,
        recompute_tokens: int = 8192,
        lora: LoRAConfig | None = None,
    ) -> None:
        """`cuda_graphs`: on a GPU, capture decode steps of up to `max_num_seqs` sequences of up to
        `max_model_len` positions as CUDA graphs now (worker/cuda_graphs.py), where the model allows.
        `peers`: rank 0 of a split model, the group each call is broadcast on; `pipeline`: a pipeline
        stage's model, the Pipeline each model call goes through (distributed/). `recompute_tokens`:
        the most tokens a forward recomputing a hybrid's sequence takes (the step's token budget).
        `lora`: give the model's projections slots for LoRA adapters (lora/manager.py; ``self.lora``)."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = torch.device(device)
        self.sampler = Sampler()
        # Blocks are cleared on their first write only where a reader looks past a sequence's
        # end (60 index_fill calls in most steps of a float32 SmolLM2 batch otherwise, a cost
        # worth avoiding: docs/BENCHMARKS.md, 'Measurements behind design choices').
        self.zero_fresh_blocks = reads_past_context(kv_cache)
        self.peers = peers
        self.pipeline = pipeline
        parallel = getattr(model, "tensor_shard", None) is not None or self.pipeline is not None
        self.lora: LoRAManager | None = None
        if lora is not None:
            if parallel or peers is not None:
                raise ValueError("LoRA adapters with a model split over processes are not implemented")
            # rows a forward may take: a whole context (embeddings, scoring) or a step's budget, plus drafts
            rows = max(max_model_len or model.config.max_model_len, recompute_tokens) + 16 * max_num_seqs
            self.lora = _lora_slots(model, lora, rows, self.device)
        # LoRA's torch fallback reads each step's rows on the host: a tape would bake one step's in
        lora_replays = self.lora is None or kernel_runs(_activation_dtype(model), self.device)
        self.tapes = (
            StepTapes(model, kv_cache, self._lora_variant)
            if self.device.type == "cpu" and StepTapes.usable(model) and not parallel and lora_replays
            else None
        )
        self.graphs = None
        # a hybrid's recurrent state advances with every forward: a step that failed part-way is
        # recomputed from position 0 (_forward_isolated); set when a multi-step decode failed
        self.recurrent = kv_cache.states is not None
        self._states_suspect = False
        self.recompute_tokens = recompute_tokens
        self.failed_batches = 0  # batched forwards that raised, their requests then run alone (logged)
        if (
            cuda_graphs
            and self.device.type == "cuda"
            and not parallel
            and not self.recurrent
            and triton_kernels.takes_cache(kv_cache)
            and self.lora is None
        ):
            self.graphs = start_decode_graphs(
                model, kv_cache, max_num_seqs, max_model_len or model.config.max_model_len
            )

    def _lora_variant(self) -> bool:
        """Whether some row of the step runs through a LoRA adapter (its decode tapes differ)."""
        return self.lora is not None and self.lora.rows.active

    def reserve_activation_memory(self, max_tokens: int, dtype: torch.dtype) -> bool:
        """On the CPU, grow the heap once for the activations of a `max_tokens`-token step, so
        that the first large step does not page-fault them in (allocator.reserve_heap). Sized
        at 4 x (hidden + intermediate + q + 2 kv) elements per token: a 6.4k-token SmolLM2
        prefill grew the heap by 3.2x that (live tensors and fragmentation). At most
        RESERVE_AT_MOST: the reservation stays resident, and for a quantized 0.5B model at
        the default 8192 tokens it would be ~0.9 GB, twice the weights; a larger first step
        grows the heap then. True if reserved."""
        if self.device.type != "cpu":
            return False
        c = self.model.config
        width = c.hidden_size + c.intermediate_size + (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        nbytes = 4 * width * torch.empty((), dtype=dtype).element_size() * max_tokens
        return reserve_heap(min(nbytes, KEEP_BELOW // 2, RESERVE_AT_MOST))

    def _chunks(self, sched: SchedulerOutput) -> list[SeqChunk]:
        chunks = []
        for s in sched.scheduled:
            req, start = s.request, s.request.num_computed_tokens
            tokens = req.token_ids_from(start, s.num_tokens)  # pending tokens, then drafts
            if len(tokens) < s.num_tokens:
                tokens = tokens + s.spec_token_ids[: s.num_tokens - len(tokens)]
            slot = req.lora.slot if req.lora is not None else -1
            chunks.append(SeqChunk(tokens, start, s.block_ids, s.state_slot, s.window_block_ids, slot))
        return chunks

    def forward(
        self, chunks: list[SeqChunk], input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, AttentionMetadata | None]:
        """Run the model over `chunks` (writing their KV): hidden states (T, hidden) and the batch
        layout (None where a CUDA graph or a pipeline ran the step). `input_ids` (T,) on the
        device, where given, replace the chunks' token ids (tokens sampled on the device that the
        host has not read)."""
        if self.peers is not None:
            self.peers.send("forward", chunks)
        if self.pipeline is not None:
            # None on ranks past 0, whose callers (distributed.worker) never read it
            return cast(torch.Tensor, self.pipeline.forward(self, chunks)), None
        if self.graphs is not None and self.graphs.takes(chunks):
            return self.graphs.run(chunks, input_ids), None
        batch = self.batch(chunks)
        if self.lora is not None:
            self.lora.set_rows([(c.lora_slot, len(c.token_ids)) for c in chunks])
        if input_ids is not None:
            batch.input_ids = input_ids
        if self.tapes is not None:
            return self.tapes.forward(batch.input_ids, batch.positions, batch.meta), batch.meta
        return self.model(batch.input_ids, batch.positions, batch.meta, self.kv_cache), batch.meta

    def batch(self, chunks: list[SeqChunk]):
        """The model inputs of `chunks` (build_batch), their fresh KV blocks cleared where a reader
        looks past a sequence's end."""
        kv = self.kv_cache
        batch = build_batch(chunks, kv.block_size, self.device, kv.null_block, kv.window_null)
        if self.zero_fresh_blocks and (batch.fresh_blocks or batch.fresh_window_blocks):
            window = batch.fresh_window_blocks
            kv.zero_blocks(
                torch.tensor(batch.fresh_blocks, dtype=torch.int64, device=self.device),
                None if window is None else torch.tensor(window, dtype=torch.int64, device=self.device),
            )
        return batch

    def decodes_ahead(self, request) -> bool:
        """The request's next tokens can be decoded several in a row, each fed back on the device
        (the scheduler's decode_steps): sampled by the device path's settings, with nothing that
        needs the host between tokens (logprobs, penalties over the growing output, a grammar)."""
        p = request.params
        return (
            self.peers is None
            and self.pipeline is None
            and p.logprobs is None
            and p.prompt_logprobs is None
            and request.matcher is None
            and p.repetition_penalty == 1
            and not p.frequency_penalty
            and not p.presence_penalty
            and device_sampling.row_takes(p, len(request.output_token_ids))
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Run one step. A failure that one request's data causes (in the forward, its sampling,
        draft verification or prompt logprobs) lands in ``errors`` for that request alone."""
        self._move_blocks(sched)
        steps = sched.scheduled[0].decode_steps if sched.scheduled else 1
        if steps > 1 and (ahead := self._decode_ahead(sched, steps)) is not None:
            return ahead
        errors: dict[str, str] = {}
        constrained = [
            s.request.matcher
            for s in sched.scheduled
            if s.samples and not s.spec_token_ids and s.request.matcher is not None
        ]
        masks = MaskStep(constrained, self.model.config.vocab_size) if constrained else None  # runs meanwhile
        hidden = self._forward_isolated(sched, errors)  # (T, hidden)
        plain, spec, rows_plain, rows_spec = [], [], [], []
        start = 0
        for s in sched.scheduled:
            end, start = start + s.num_tokens, start + s.num_tokens
            if s.request.request_id in errors:
                continue
            if s.spec_token_ids:
                spec.append(s)
                rows_spec.append(list(range(end - 1 - len(s.spec_token_ids), end)))
            elif s.samples:
                plain.append(s)
                rows_plain.append(end - 1)
        results: dict[str, tuple[list[int], list | None]] = {}
        explanations: dict = {}
        if plain:
            self._sample(plain, take_rows(hidden, rows_plain), masks, constrained, results, explanations, errors)
        if spec:
            self._verify(spec, hidden, rows_spec, results, errors)
        prompt = self._prompt_logprobs(sched, hidden, errors)
        ids = [s.request.request_id for s in sched.scheduled if s.request.request_id in results]
        return RunnerOutput(
            ids, [results[i][0] for i in ids], [results[i][1] for i in ids], prompt, explanations, errors
        )

    def _move_blocks(self, sched: SchedulerOutput) -> None:
        """Before the step's forward: the scheduler's block copies (copy-on-write), then its
        context shifts (each moved block's keys turned back, kv_cache.shift_keys)."""
        if sched.block_copies:
            if self.peers is not None:
                self.peers.send("copy", sched.block_copies)
            self.kv_cache.copy_blocks(sched.block_copies, sched.window_block_copies)
        for shift in sched.kv_shifts:
            self.kv_cache.shift_keys(shift.pairs, self.model.key_turns(shift.delta), shift.window_pairs)

    def _decode_ahead(self, sched: SchedulerOutput, steps: int) -> RunnerOutput | None:
        """`steps` one-token steps in a row for every scheduled request, each step's sampled tokens
        the next one's inputs on the device; the host waits once, for all of them. None if it
        raised (seeded generators restored): the caller runs one plain step instead."""
        requests = [s.request for s in sched.scheduled]
        chunks = self._chunks(sched)
        generators = [r.generator for r in requests if r.generator is not None]
        states = [g.get_state() for g in generators]
        try:
            tokens, drawn = None, []
            for j in range(steps):
                step = chunks if j == 0 else [dataclasses.replace(c, start=c.start + j) for c in chunks]
                hidden = self.forward(step, tokens)[0]  # (B, hidden)
                logits = self.model.compute_logits(hidden)
                tokens = self.sampler.sample(logits, SamplingMetadata.for_requests(requests)).tokens  # (B,)
                drawn.append(tokens)
            rows = torch.stack(drawn, 1).tolist()  # (B, steps)
        except ParallelRankError:
            raise
        except Exception:
            log.exception("decoding %d steps in a row failed; running one step", steps)
            for g, state in zip(generators, states):
                g.set_state(state)
            self._states_suspect = self.recurrent  # some of the steps may have advanced the state
            return None
        return RunnerOutput([r.request_id for r in requests], rows, [None] * len(requests))

    def _forward_isolated(self, sched: SchedulerOutput, errors: dict[str, str]) -> torch.Tensor:
        """The step's hidden states (T, hidden). Should the batched forward raise, each request's
        chunk runs alone (rewriting the same cache slots): those that fail again get an error
        and zero rows, the rest their own hidden states. A hybrid's chunk runs alone from position
        0 (its recurrent state may have advanced in the failed forward): the same KV rewritten, the
        state rebuilt, its own rows the last of the output."""
        chunks = self._chunks(sched)
        suspect, self._states_suspect = self._states_suspect, False
        if not suspect:
            try:
                return self.forward(chunks)[0]
            except ParallelRankError:
                raise  # not one request's fault: the engine cannot go on
            except Exception as batch_error:
                self.failed_batches += 1
                reason = describe_error(batch_error)
                log.warning("a batched step of %d requests failed (%s): each runs alone", len(chunks), reason)
                if len(chunks) == 1 and not self.recurrent:
                    errors[sched.scheduled[0].request.request_id] = describe_error(batch_error)
                    return torch.zeros(len(chunks[0].token_ids), self.model.config.hidden_size, device=self.device)
        parts = []
        for s, chunk in zip(sched.scheduled, chunks):
            try:
                parts.append(self._recompute(s.request, chunk) if self.recurrent else self.forward([chunk])[0])
            except ParallelRankError:
                raise
            except Exception as e:
                errors[s.request.request_id] = describe_error(e)
                parts.append(torch.zeros(len(chunk.token_ids), self.model.config.hidden_size, device=self.device))
        return torch.cat(parts)

    def _recompute(self, request, chunk: SeqChunk) -> torch.Tensor:
        """A hybrid's chunk run again from position 0 (its recurrent state rebuilt, its KV rewritten
        with the same values), in pieces of at most recompute_tokens: the chunk's own rows
        (len(chunk.token_ids), hidden)."""
        tokens = request.all_token_ids[: chunk.start] + chunk.token_ids
        rows = []
        for start in range(0, len(tokens), self.recompute_tokens):
            piece = dataclasses.replace(chunk, token_ids=tokens[start : start + self.recompute_tokens], start=start)
            hidden = self.forward([piece])[0]
            end = start + len(piece.token_ids)
            if end > chunk.start:
                rows.append(hidden[max(chunk.start - start, 0) :])
        return torch.cat(rows)

    def _sample(
        self,
        plain: list,
        hidden: torch.Tensor,
        masks: MaskStep | None,
        constrained: list,
        results: dict,
        explanations: dict,
        errors: dict[str, str],
    ) -> None:
        """One token for each of `plain`'s requests from its row of hidden (B, hidden)."""
        logits = self.model.compute_logits(hidden)  # (B, vocab) float32
        mask_row = {id(m): j for j, m in enumerate(constrained)}
        requests = [s.request for s in plain]

        def sample(rows: list[int]) -> list:
            sub = [requests[i] for i in rows]
            constrain = None
            if masks is not None and any(r.matcher is not None for r in sub):
                local = [j for j, r in enumerate(sub) if r.matcher is not None]
                which = [mask_row[id(sub[j].matcher)] for j in local]
                constrain = lambda lg: masks.apply(lg, local, which)  # noqa: E731
            # a retry recomputes its logits: the failed batch may have processed them in place
            rows_logits = logits if len(rows) == len(plain) else self.model.compute_logits(hidden[rows])
            out = self.sampler.sample(rows_logits, SamplingMetadata.for_requests(sub), constrain)
            return list(zip(out.tokens.tolist(), out.logprobs, out.explanations))

        for req, got in zip(requests, isolated(requests, sample, errors, seeded=True)):
            if got is not None:
                token, lp, record = got
                results[req.request_id] = ([token], None if lp is None else [lp])
                if record is not None:
                    explanations[req.request_id] = record

    def _verify(
        self, spec: list, hidden: torch.Tensor, rows: list[list[int]], results: dict, errors: dict[str, str]
    ) -> None:
        """Accept or reject each of `spec`'s drafts against the target's logits at its rows."""

        def verify_rows(which: list[int]) -> list:
            flat = [r for i in which for r in rows[i]]
            logits = self.model.compute_logits(hidden[flat])  # (sum(k + 1), vocab)
            drafts = [Draft(spec[i].request, spec[i].spec_token_ids, spec[i].request.spec_draft_probs) for i in which]
            return verify(logits, drafts)

        requests = [s.request for s in spec]
        for req, got in zip(requests, isolated(requests, verify_rows, errors, seeded=True)):
            if got is not None:
                results[req.request_id] = got

    def _prompt_logprobs(
        self, sched: SchedulerOutput, hidden: torch.Tensor, errors: dict[str, str]
    ) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Scoring requests' prompt-chunk rows -> logprobs of the prompt tokens they predict."""
        out = {}
        row = 0
        for s in sched.scheduled:
            req, first_row, row = s.request, row, row + s.num_tokens
            if (
                req.params.prompt_logprobs is None
                or req.num_computed_tokens >= req.num_prompt_tokens
                or req.request_id in errors
            ):
                continue
            start = req.num_computed_tokens
            k, targets = chunk_targets(req.prompt_token_ids, start, s.num_tokens)
            if not k:
                continue
            try:
                out[req.request_id] = (
                    start + 1,
                    prompt_logprobs(self.model, hidden[first_row : first_row + k], targets, req.params.prompt_logprobs),
                )
            except Exception as e:
                errors[req.request_id] = describe_error(e)
        return out


def isolated(requests: list, run: Callable[[list[int]], list], errors: dict[str, str], seeded: bool = False) -> list:
    """run(indices) -> one result per index, for the whole batch of `requests` at once. Should
    that raise, each request runs alone: those that raise again get an error in `errors` (and
    result None), the others their own results. With `seeded`, seeded requests' generators are
    put back before the retry, so a retried request draws what it would have drawn."""
    everyone = list(range(len(requests)))
    generators = [r.generator for r in requests if seeded and r.generator is not None]
    states = [g.get_state() for g in generators]
    try:
        return run(everyone)
    except ParallelRankError:
        raise
    except Exception as batch_error:
        if len(requests) == 1:
            errors[requests[0].request_id] = describe_error(batch_error)
            return [None]
    for g, state in zip(generators, states):
        g.set_state(state)
    results = []
    for i, req in enumerate(requests):
        try:
            results.append(run([i])[0])
        except ParallelRankError:
            raise
        except Exception as e:
            errors[req.request_id] = describe_error(e)
            results.append(None)
    return results


def _activation_dtype(model: CausalLM) -> torch.dtype:
    """The dtype the model computes in: its floating parameters' (a norm's, at least)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _lora_slots(model: CausalLM, lora: LoRAConfig, rows: int, device: torch.device) -> LoRAManager:
    """The model's projections given `lora`'s slots, stored as its dtype asks (auto: as the start-up
    adapters are stored); the adapters themselves are loaded by the engine."""
    dtype = storage_dtype(lora.dtype, list(lora.adapters.values()))
    return LoRAManager(model, lora.max_loras, lora.max_lora_rank, rows, device, dtype)
