"""The engine core: requests in, one step at a time, text deltas out.

``step()`` is three verbs: the scheduler decides who computes how many tokens,
the runner runs the model and sampler, and ``_update`` appends tokens, checks
token stops, detokenizes, checks stop strings and frees finished requests.
"""

from __future__ import annotations

import itertools
import logging
import time

from tokenloom.allocator import keep_freed_memory
from tokenloom.config import EngineConfig, parse_dtype
from tokenloom.detokenizer import IncrementalDetokenizer
from tokenloom.explain.annotate import annotate
from tokenloom.explain.records import StepRecord
from tokenloom.kv_cache.block_manager import BlockManager
from tokenloom.kv_cache.paged import PagedKVCache, kv_bytes_per_token
from tokenloom.loader import load_model
from tokenloom.metrics import EngineStats
from tokenloom.outputs import CompletionOutput, RunnerOutput, SchedulerOutput, StepDelta, TokenLogprobs
from tokenloom.request import Request
from tokenloom.runner import ModelRunner
from tokenloom.sampling_params import SamplingParams
from tokenloom.scheduler import Scheduler
from tokenloom.spec_decode.proposer import SpecProposer
from tokenloom.structured.grammars import GrammarCompiler
from tokenloom.stopping import check_token_stop

logger = logging.getLogger("tokenloom")


class LLMEngine:
    """Owns model, KV cache, scheduler and per-request detokenizers. Not thread-safe:
    one caller at a time (the AsyncLLMEngine serializes access for concurrent users)."""

    def __init__(self, config: EngineConfig, progress: bool = False) -> None:
        self.config = config
        keep_freed_memory()                # large activations reuse mapped pages (allocator.py)
        loaded = load_model(config.model, config.dtype, config.device, config.max_model_len, progress,
                            quantization=config.quantization)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.max_model_len = loaded.config.max_model_len
        dtype = parse_dtype(config.dtype)
        kv = PagedKVCache.from_memory_budget(loaded.config, config.cache.resolve_memory(),
                                             config.cache.block_size, dtype, config.device, config.kv_cache_dtype)
        self._kv_bytes_per_token = kv_bytes_per_token(loaded.config, dtype, config.kv_cache_dtype)
        self._report_cache(kv, self._kv_bytes_per_token)
        self.block_manager = BlockManager(kv.num_blocks, kv.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        self.runner = ModelRunner(loaded.model, kv, config.device)
        self.reserve_activation_memory()
        self.grammars = GrammarCompiler(self.tokenizer.backend.to_str(), loaded.config.vocab_size,
                                        sorted(self.eos_token_ids))
        self.proposer = None if config.speculative is None else SpecProposer.create(
            config.speculative, self, progress)
        self.requests: dict[str, Request] = {}
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()
        self._prompt_tokens_computed = 0
        self._generated_tokens = 0
        self._spec_steps = self._spec_drafts = self._spec_accepted = 0   # summed over requests
        self._last_step_s = 0.0

    def _report_cache(self, kv: PagedKVCache, per_token: int) -> None:
        c = self.model_config
        element = ("(%d head_dim x 1 B int8 + 4 B scale)" % c.head_dim if kv.kv_cache_dtype == "int8"
                   else "%d head_dim x %d B" % (c.head_dim, per_token // (2 * c.num_layers * c.num_kv_heads * c.head_dim)))
        logger.info("KV cache: %d tokens (%d blocks x %d) in %.2f GiB; per token 2 x %d layers x %d kv_heads x "
                    "%s = %d B", kv.num_tokens, kv.num_blocks, kv.block_size,
                    kv.num_tokens * per_token / 2**30, c.num_layers, c.num_kv_heads, element, per_token)

    def reserve_activation_memory(self) -> bool:
        """Grow the heap for one full step's activations now (ModelRunner.reserve_activation_memory);
        done at start-up. Again after other code in the process (a benchmark's second model)
        has taken the freed heap; True where reserved."""
        return self.runner.reserve_activation_memory(self.config.scheduler.max_num_batched_tokens,
                                                     parse_dtype(self.config.dtype))

    @property
    def kv_cache_tokens(self) -> int:
        return self.runner.kv_cache.num_tokens

    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError (naming the problem) for input the model cannot take; changes nothing."""
        ids = prompt_token_ids
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(ids) + min(params.max_tokens, 1) > self.max_model_len:   # scoring (max_tokens=0) needs no room
            raise ValueError(f"prompt has {len(ids)} tokens but the context window is {self.max_model_len} "
                             "tokens (the prompt must leave room for at least one new token)")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {vocab})")
        params.check_vocab(vocab)
        self.scheduler.check_fits(len(ids), params.max_tokens)
        if params.structured_output is not None:
            self.grammars.grammar(params.structured_output)     # compiles (cached); ValueError if invalid

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request (validated first: ValueError for input the model cannot take)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_request(prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, next(self._arrivals))
        if params.structured_output is not None:
            req.matcher = self.grammars.matcher(params.structured_output)
        self.scheduler.add(req)
        self.requests[request_id] = req
        self._detoks[request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.stop,
                                                          params.skip_special_tokens)
        return req

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks (no-op for unknown or finished ids)."""
        req = self.requests.pop(request_id, None)
        self._detoks.pop(request_id, None)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[StepDelta]:
        """Run one engine step; returns a delta for every request that produced a token.

        A request's finishing delta carries its CompletionOutput, and the engine
        forgets the request then.
        """
        started = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        out = self.runner.execute(sched)
        self._last_step_s = time.perf_counter() - started
        deltas = self._update(sched, out)
        if self.proposer is not None:
            self.proposer.propose_for(self.scheduler.running)
        return deltas

    def _update(self, sched: SchedulerOutput, out: RunnerOutput) -> list[StepDelta]:
        for s in sched.scheduled:
            prompt_left = s.request.num_prompt_tokens - s.request.num_computed_tokens
            self._prompt_tokens_computed += max(0, min(s.num_tokens, prompt_left))
        now = time.monotonic()
        drafted = {s.request.request_id: len(s.spec_token_ids) for s in sched.scheduled if s.spec_token_ids}
        deltas = []
        for rid, tokens, logprobs in zip(out.request_ids, out.sampled_token_ids, out.logprobs):
            req = self.requests[rid]
            if rid in drafted:
                self._record_speculation(req, drafted[rid], len(tokens) - 1)
            deltas.append(self._append(req, tokens, logprobs, now, out.explanations.get(rid)))
        for rid, (first, entries) in out.prompt_logprobs.items():
            _record_prompt_logprobs(self.requests[rid], first, entries)
        self.scheduler.on_step_done(sched)
        deltas.extend(self._finish_scored(sched, now))
        return deltas

    def _finish_scored(self, sched: SchedulerOutput, now: float) -> list[StepDelta]:
        """Requests with max_tokens=0 end once their whole prompt is computed (scored)."""
        deltas = []
        for s in sched.scheduled:
            req = s.request
            if req.params.max_tokens == 0 and not req.is_finished and req.num_computed_tokens >= req.num_prompt_tokens:
                self.scheduler.finish(req, "length", computed_tokens=req.num_computed_tokens)
                req.metrics.first_token_time = req.metrics.finish_time = now
                delta = StepDelta(req.request_id, [], "", True, "length")
                delta.completion = self._complete(req)
                deltas.append(delta)
        return deltas

    def _record_speculation(self, req: Request, proposed: int, accepted: int) -> None:
        m = req.metrics
        m.num_spec_steps += 1
        m.num_draft_tokens += proposed
        m.num_accepted_tokens += accepted
        self._spec_steps += 1
        self._spec_drafts += proposed
        self._spec_accepted += accepted
        req.spec_acceptance = 0.5 * req.spec_acceptance + 0.5 * accepted / proposed

    def _append(self, req: Request, tokens: list[int], logprobs: list[TokenLogprobs] | None,
                now: float, record: StepRecord | None = None) -> StepDelta:
        """Append this step's new tokens one by one, stopping exactly where plain decoding would.
        `record`: the (single) token's explain record, if the request asked for one."""
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        if record is not None:
            annotate(record, self.tokenizer, req.all_token_ids, self._kv_bytes_per_token,
                     self.block_manager.num_used_blocks, self._last_step_s, len(req.output_token_ids))
            req.explanation.append(record)
        texts, appended = [], []
        for i, token in enumerate(tokens):
            if req.matcher is not None:
                req.matcher.consume_token(token)
            req.output_token_ids.append(token)
            appended.append(token)
            if logprobs is not None:
                req.logprobs.append(logprobs[i])
            self._generated_tokens += 1
            texts.append(self._detokenize_and_stop(req, token))
            if req.is_finished:
                break
        delta = StepDelta(req.request_id, appended, "".join(texts), req.is_finished, req.finish_reason,
                          logprobs=None if logprobs is None else logprobs[:len(appended)],
                          explanation=None if record is None else [record])
        if req.is_finished:
            req.metrics.finish_time = now
            delta.completion = self._complete(req)
        return delta

    def _detokenize_and_stop(self, req: Request, token: int) -> str:
        """The text this token adds (held back while a stop string may be starting); finishes
        the request on EOS, a stop id or string, max_tokens or the context end."""
        detok = self._detoks[req.request_id]
        token_stop = check_token_stop(req.output_token_ids, req.params, self.eos_token_ids,
                                      req.num_tokens, self.max_model_len)
        if token_stop is None and req.matcher is not None and req.matcher.is_stopped():
            token_stop = ("stop", None)          # the constraint is complete: nothing may follow
        stopped_by_token = token_stop is not None and token_stop[1] is not None
        text, string_stop = ("", False) if stopped_by_token else detok.push(token)
        if string_stop:
            self.scheduler.finish(req, "stop", detok.matched_stop, computed_tokens=req.num_tokens - 1)
        elif token_stop is not None:
            self.scheduler.finish(req, token_stop[0], token_stop[1], computed_tokens=req.num_tokens - 1)
            text += detok.finish()
        return text

    def _complete(self, req: Request) -> CompletionOutput:
        """The finished request's result; the engine forgets the request."""
        text = self._detoks.pop(req.request_id).text
        del self.requests[req.request_id]
        m = req.metrics
        m.num_generated, m.num_preemptions = len(req.output_token_ids), req.num_preemptions
        return CompletionOutput(0, text, req.output_token_ids, req.finish_reason, req.stop_reason,
                                req.logprobs if req.params.logprobs is not None else None, m,
                                req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
                                req.explanation if req.params.explain else None)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(len(self.scheduler.running), len(self.scheduler.waiting), bm.num_used_blocks,
                           bm.num_free_blocks, bm.stats.hit_rate, self._prompt_tokens_computed,
                           self._generated_tokens, self.scheduler.num_preemptions,
                           spec_steps=self._spec_steps, spec_draft_tokens=self._spec_drafts,
                           spec_accepted_tokens=self._spec_accepted)


def _record_prompt_logprobs(req: Request, first: int, entries: list) -> None:
    """Append entries for prompt tokens first, first+1, ... (index 0 has none: None), skipping
    tokens already scored before a preemption made the request recompute its prompt."""
    if not req.prompt_logprobs:
        req.prompt_logprobs.append(None)
    for i, entry in enumerate(entries):
        if first + i == len(req.prompt_logprobs):
            req.prompt_logprobs.append(entry)
