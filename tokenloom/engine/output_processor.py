"""Above the engine core: token ids -> text, stop strings, logprob and explain records, results.

The OutputProcessor keeps one RequestState per request the core runs. Each step it turns
the core's CoreOutputs into StepDeltas: it detokenizes the new tokens, matches stop
strings across token boundaries (a match ends the request in the core through the
``finish`` callback it was given), collects logprobs, prompt logprobs and explain records,
and builds the CompletionOutput of every request that ended. A failure while processing
one request's output ends that request alone, with finish reason "error".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

from tokenloom.engine.core_output import CoreOutput
from tokenloom.engine.detokenizer import IncrementalDetokenizer
from tokenloom.engine.request import Request
from tokenloom.explain.annotate import annotate
from tokenloom.explain.records import StepRecord
from tokenloom.outputs import CompletionOutput, StepDelta, TokenLogprobs, describe_error
from tokenloom.tokenizer import Tokenizer

logger = logging.getLogger("tokenloom")

# (request id, finish reason, stop reason): ends a request in the engine core
Finish = Callable[[str, str, "str | int | None"], None]


@dataclass
class RequestState:
    """What the OutputProcessor knows of one request: its text and the records it returns."""

    request: Request
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)  # emitted so far (cut at a stop string)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    explanation: list[StepRecord] = field(default_factory=list)
    string_stop: str | None = None  # the stop string that ended it

    @property
    def finish_reason(self) -> str | None:
        return "stop" if self.string_stop is not None else self.request.finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.string_stop if self.string_stop is not None else self.request.stop_reason


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, finish: Finish, kv_bytes_per_token: int) -> None:
        self.tokenizer = tokenizer
        self.finish = finish
        self.kv_bytes_per_token = kv_bytes_per_token
        self.states: dict[str, RequestState] = {}

    def add(self, request: Request) -> None:
        p = request.params
        stop = cast("list[str]", p.stop)  # SamplingParams.__post_init__ makes it a list
        self.states[request.request_id] = RequestState(
            request, IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, stop, p.skip_special_tokens)
        )

    def drop(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(self, outputs: list[CoreOutput], step_seconds: float, kv_blocks_used: int) -> list[StepDelta]:
        """One StepDelta per request that got tokens or ended this step; an ended request's
        delta carries its CompletionOutput and its state is dropped."""
        now = time.monotonic()
        deltas = []
        for out in outputs:
            state = self.states.get(out.request.request_id)
            if state is None:
                continue  # aborted meanwhile
            try:
                delta = self._process_one(state, out, now, step_seconds, kv_blocks_used)
            except Exception as e:
                logger.exception("request %s failed while its output was processed", out.request.request_id)
                self.finish(out.request.request_id, "error", describe_error(e))
                delta = self._failed(state, describe_error(e), now)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _process_one(
        self, state: RequestState, out: CoreOutput, now: float, step_seconds: float, kv_blocks_used: int
    ) -> StepDelta | None:
        if out.error is not None:
            logger.warning("request %s failed: %s", out.request.request_id, out.error)
            return self._failed(state, out.error, now)
        if out.prompt_logprobs is not None:
            _record_prompt_logprobs(state, *out.prompt_logprobs)
        if not out.new_token_ids and not out.finished:
            return None  # a prompt chunk: nothing to show yet
        req = out.request
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        if out.explanation is not None:
            annotate(
                out.explanation,
                self.tokenizer,
                req.prompt_token_ids + state.token_ids,
                self.kv_bytes_per_token,
                kv_blocks_used,
                step_seconds,
                len(state.token_ids),
            )
            state.explanation.append(out.explanation)
        text, kept = self._detokenize(state, out)
        delta = StepDelta(
            req.request_id,
            out.new_token_ids[:kept],
            text,
            req.is_finished,
            state.finish_reason,
            logprobs=None if out.logprobs is None else out.logprobs[:kept],
            explanation=None if out.explanation is None else [out.explanation],
        )
        if req.is_finished:
            delta.completion = self._complete(state, now)
        return delta

    def _detokenize(self, state: RequestState, out: CoreOutput) -> tuple[str, int]:
        """The text the new tokens add (held back while a stop string may be starting) and how
        many of them are kept: a stop string ends the request at the token that completes it."""
        req, detok = out.request, state.detokenizer
        texts = []
        for i, token in enumerate(out.new_token_ids):
            state.token_ids.append(token)
            if out.logprobs is not None:
                state.logprobs.append(out.logprobs[i])
            last = i == len(out.new_token_ids) - 1
            stopped_by_token = last and req.finish_reason == "stop" and req.stop_reason == token  # EOS, stop id
            text, string_stop = ("", False) if stopped_by_token else detok.push(token)
            texts.append(text)
            if string_stop:
                state.string_stop = detok.matched_stop
                self.finish(req.request_id, "stop", detok.matched_stop)  # no-op if it ended in the core
                return "".join(texts), i + 1
        if req.is_finished:
            texts.append(detok.finish())
        return "".join(texts), len(out.new_token_ids)

    def _failed(self, state: RequestState, error: str, now: float) -> StepDelta:
        delta = StepDelta(state.request.request_id, [], "", True, "error", error=error)
        delta.completion = self._complete(state, now, error)
        return delta

    def _complete(self, state: RequestState, now: float, error: str | None = None) -> CompletionOutput:
        """The ended request's result; its state is dropped."""
        self.states.pop(state.request.request_id, None)
        req, p = state.request, state.request.params
        m = req.metrics
        m.finish_time = now
        if m.first_token_time is None:
            m.first_token_time = now  # scored: the prompt was the work
        m.num_generated, m.num_preemptions = len(state.token_ids), req.num_preemptions
        return CompletionOutput(
            0,
            state.detokenizer.text,
            state.token_ids,
            "error" if error is not None else state.finish_reason,
            error if error is not None else state.stop_reason,
            state.logprobs if p.logprobs is not None else None,
            m,
            state.prompt_logprobs if p.prompt_logprobs is not None else None,
            state.explanation if p.explain else None,
            error=error,
        )


def _record_prompt_logprobs(state: RequestState, first: int, entries: list[TokenLogprobs]) -> None:
    """Append entries for prompt tokens first, first+1, ... (index 0 has none: None), skipping
    tokens already scored before a preemption made the request recompute its prompt."""
    if not state.prompt_logprobs:
        state.prompt_logprobs.append(None)
    for i, entry in enumerate(entries):
        if first + i == len(state.prompt_logprobs):
            state.prompt_logprobs.append(entry)
