"""Plain dataclasses passed between the engine's parts and returned to users."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenloom.metrics import RequestMetrics
from tokenloom.request import Request

if TYPE_CHECKING:
    from tokenloom.explain.records import StepRecord

# One generated token's logprobs: {token_id: logprob} holding the chosen token and the top N.
TokenLogprobs = dict[int, float]


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int          # tokens of this request computed in this step (prompt chunk or 1)
    samples: bool            # True when this step reaches the request's last known token
    block_ids: list[int]     # the request's whole block table after this step's allocation
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens verified this step (in num_tokens)
    decode_steps: int = 1    # tokens decoded in a row (each fed back on the device); KV room for all of them


@dataclass(slots=True)
class SchedulerOutput:
    """What the scheduler hands the runner for one step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)  # in batch order
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) KV blocks to copy first

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass(slots=True)
class RunnerOutput:
    """What the runner returns: one entry per scheduled request that samples, in batch order."""

    request_ids: list[str]                            # requests that sampled this step
    sampled_token_ids: list[list[int]]                # per request: its new tokens (accepted drafts + 1)
    logprobs: list[list[TokenLogprobs] | None]        # per request, per new token: chosen + top-N (if asked)
    # request -> (index of the first prompt token scored, entries) for this step's prompt chunk
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    explanations: dict[str, StepRecord] = field(default_factory=dict)   # request -> its token's record
    errors: dict[str, str] = field(default_factory=dict)   # request -> why its part of the step failed


def describe_error(error: BaseException) -> str:
    """The message a failed request reports: the exception's type and text."""
    return f"{type(error).__name__}: {error}"


class RequestError(RuntimeError):
    """One request failed inside the engine (its data or params broke a stage of a step);
    the engine and every other request went on."""


@dataclass(slots=True)
class CoreOutput:
    """What one engine-core step did for one request, handed to the OutputProcessor."""

    request: Request
    new_token_ids: list[int]                          # appended this step (up to a token stop)
    logprobs: list[TokenLogprobs] | None = None       # per new token, when the request asked
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None = None   # (first prompt index, entries)
    explanation: StepRecord | None = None           # the new token's record (explain=N)
    finished: bool = False
    error: str | None = None                          # set when the request failed (finished too)


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (there are `n` of them)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None        # "stop" (EOS, stop id or stop string), "length", "abort", "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprobs] | None = None
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None   # per prompt token (None for the first)
    explanation: list[StepRecord] | None = None    # per generated token, when explain was asked
    error: str | None = None                         # finish_reason "error": what failed


@dataclass(slots=True)
class StepDelta:
    """What one step produced for one request: the engine's streaming unit."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    completion: CompletionOutput | None = None   # the whole result, on the finishing delta only
    logprobs: list[TokenLogprobs] | None = None    # the new tokens' logprobs, when the request asked
    explanation: list[StepRecord] | None = None  # the new tokens' records, when explain was asked
    error: str | None = None                       # the request failed (finished, finish_reason "error")


@dataclass(slots=True)
class RequestOutput:
    """The result of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True

    @property
    def prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        """Per prompt token {token: logprob} (None for the first), when prompt_logprobs was asked."""
        return self.outputs[0].prompt_logprobs if self.outputs else None
