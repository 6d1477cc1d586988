"""One sequence's state in the engine core."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenloom.metrics import RequestMetrics
from tokenloom.sampling.state import SamplingState
from tokenloom.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """A prompt being extended one token at a time.

    ``num_computed_tokens`` counts tokens whose keys/values are in the cache; the
    scheduler hands out work as ``num_tokens - num_computed_tokens``, so prefill,
    chunked prefill and decode are one rule.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival: int = 0  # FCFS order
    client: str | None = None  # the client it runs for (engine/fair_share.py)
    last_step: int = -1  # the last scheduler step that computed it
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None  # set when params.seed is given
    matcher: Any = None  # llguidance matcher when structured output is asked
    sampling_state: SamplingState | None = None  # bad words / DRY in token form, mirostat's mu
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    # speculative decoding: drafts to verify at the next step, and the proposer's state
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: torch.Tensor | None = None  # (k, V) the distributions drafts came from; None: deterministic
    draft_num_computed: int = 0  # tokens whose KV the draft model holds
    spec_acceptance: float = 1.0  # moving average of accepted / proposed

    def __post_init__(self) -> None:
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        if self.sampling_state is None:
            self.sampling_state = SamplingState.initial(self.params)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_from(self, start: int, count: int) -> list[int]:
        """all_token_ids[start:start + count], without building all_token_ids (a decode step wants
        the last token of a long history)."""
        prompt = len(self.prompt_token_ids)
        if start >= prompt:
            return self.output_token_ids[start - prompt : start - prompt + count]
        head = self.prompt_token_ids[start : start + count]
        return head + self.output_token_ids[: count - len(head)]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
