"""What generation returns to users: results, streamed deltas, per-token logprobs, request errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenloom.metrics import RequestMetrics

if TYPE_CHECKING:
    from tokenloom.explain.records import StepRecord

# One generated token's logprobs: {token_id: logprob} holding the chosen token and the top N.
TokenLogprobs = dict[int, float]


def describe_error(error: BaseException) -> str:
    """The message a failed request reports: the exception's type and text."""
    return f"{type(error).__name__}: {error}"


class RequestError(RuntimeError):
    """One request failed inside the engine (its data or params broke a stage of a step);
    the engine and every other request went on."""


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request (there are `n` of them)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop id or stop string), "length", "abort", "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprobs] | None = None
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token (None for the first)
    explanation: list[StepRecord] | None = None  # per generated token, when explain was asked
    error: str | None = None  # finish_reason "error": what failed


@dataclass(slots=True)
class StepDelta:
    """What one step produced for one request: the engine's streaming unit."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    completion: CompletionOutput | None = None  # the whole result, on the finishing delta only
    logprobs: list[TokenLogprobs] | None = None  # the new tokens' logprobs, when the request asked
    explanation: list[StepRecord] | None = None  # the new tokens' records, when explain was asked
    error: str | None = None  # the request failed (finished, finish_reason "error")


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
