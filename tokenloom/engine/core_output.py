"""What one engine-core step did for one request: the core's hand-off to the OutputProcessor."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenloom.outputs import TokenLogprobs

if TYPE_CHECKING:
    from tokenloom.engine.request import Request
    from tokenloom.explain.records import StepRecord


@dataclass(slots=True)
class CoreOutput:
    """What one engine-core step did for one request, handed to the OutputProcessor."""

    request: Request
    new_token_ids: list[int]  # appended this step (up to a token stop)
    logprobs: list[TokenLogprobs] | None = None  # per new token, when the request asked
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None = None  # (first prompt index, entries)
    explanation: StepRecord | None = None  # the new token's record (explain=N)
    finished: bool = False
    error: str | None = None  # set when the request failed (finished too)
