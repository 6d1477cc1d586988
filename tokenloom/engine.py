"""The engine core: requests in, one step at a time, text deltas out.

``step()`` is three verbs: the scheduler decides who computes how many tokens,
the runner runs the model and sampler, and ``_update`` appends tokens, checks
token stops, detokenizes, checks stop strings and frees finished requests.
"""

from __future__ import annotations

import itertools

import torch

from tokenloom.config import EngineConfig, parse_dtype
from tokenloom.detokenizer import IncrementalDetokenizer
from tokenloom.kv_cache.block_manager import BlockManager
from tokenloom.kv_cache.paged import PagedKVCache
from tokenloom.loader import load_model
from tokenloom.outputs import RunnerOutput, SchedulerOutput, StepDelta
from tokenloom.request import Request
from tokenloom.runner import ModelRunner
from tokenloom.sampling_params import SamplingParams
from tokenloom.scheduler import Scheduler
from tokenloom.stopping import check_token_stop


class LLMEngine:
    """Owns model, KV cache, scheduler and per-request detokenizers. Not thread-safe."""

    def __init__(self, config: EngineConfig, progress: bool = False) -> None:
        self.config = config
        loaded = load_model(config.model, config.dtype, config.device, config.max_model_len, progress)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.max_model_len = loaded.config.max_model_len
        kv = PagedKVCache.from_memory_budget(loaded.config, config.cache.kv_cache_memory,
                                             config.cache.block_size, parse_dtype(config.dtype), config.device)
        self.block_manager = BlockManager(kv.num_blocks, kv.block_size)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len)
        self.runner = ModelRunner(loaded.model, kv, config.device)
        self.requests: dict[str, Request] = {}
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._arrivals = itertools.count()

    @property
    def kv_cache_tokens(self) -> int:
        return self.runner.kv_cache.num_tokens

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Request:
        """Queue a request; ValueError (naming the problem) for input the model cannot take."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._validate_prompt(prompt_token_ids)
        params.check_vocab(self.model_config.vocab_size)
        req = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids, next(self._arrivals))
        self.scheduler.add(req)
        self.requests[request_id] = req
        self._detoks[request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.stop,
                                                          params.skip_special_tokens)
        return req

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens but the context window is {self.max_model_len} "
                             "tokens (the prompt must leave room for at least one new token)")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (size {vocab})")

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its KV blocks (no-op for unknown/finished ids)."""
        req = self.requests.pop(request_id, None)
        self._detoks.pop(request_id, None)
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[StepDelta]:
        """Run one engine step; returns a delta for every request that produced a token."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        out = self.runner.execute(sched)
        return self._update(sched, out)

    def _update(self, sched: SchedulerOutput, out: RunnerOutput) -> list[StepDelta]:
        self.scheduler.on_step_done(sched)
        deltas = []
        for rid, token, logprobs in zip(out.request_ids, out.sampled_token_ids, out.logprobs):
            req = self.requests[rid]
            req.output_token_ids.append(token)
            if logprobs is not None:
                req.logprobs.append(logprobs)
            deltas.append(self._detokenize_and_stop(req, token))
        return deltas

    def _detokenize_and_stop(self, req: Request, token: int) -> StepDelta:
        detok = self._detoks[req.request_id]
        token_stop = check_token_stop(req.output_token_ids, req.params, self.eos_token_ids,
                                      req.num_tokens, self.max_model_len)
        stopped_by_token = token_stop is not None and token_stop[1] is not None
        text, string_stop = ("", False) if stopped_by_token else detok.push(token)
        if string_stop:
            self.scheduler.finish(req, "stop", detok.matched_stop)
        elif token_stop is not None:
            self.scheduler.finish(req, token_stop[0], token_stop[1])
            text += detok.finish()
        return StepDelta(req.request_id, [token], text, req.is_finished, req.finish_reason)

    def output_text(self, request_id: str) -> str:
        return self._detoks[request_id].text

    def release(self, request_id: str) -> Request:
        """Forget a finished request; returns it for result collection."""
        self._detoks.pop(request_id, None)
        return self.requests.pop(request_id)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
