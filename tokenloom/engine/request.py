"""One sequence's state in the engine core."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenloom.lora.manager import AdapterRef
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

    Context shift (engine/context_shift.py) drops ``num_dropped`` tokens right after the first
    ``keep_tokens``: the counts, positions and token views here (``num_tokens``,
    ``all_token_ids``, ``token_ids_from``, ``num_prompt_tokens``) are then of the context, the
    tokens still in the cache, while ``prompt_token_ids`` and ``output_token_ids`` keep everything.
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
    # context shift: the first keep_tokens stay, the num_dropped after them left the context
    keep_tokens: int = 0
    num_dropped: int = 0
    lora: AdapterRef | None = None  # the LoRA adapter its tokens run through (params.lora, resolved)

    def __post_init__(self) -> None:
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        if self.sampling_state is None:
            self.sampling_state = SamplingState.initial(self.params)

    @property
    def num_tokens(self) -> int:
        """Tokens in the context (every token, less those context shift dropped)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_dropped

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens in the context."""
        gone = min(self.num_dropped, max(0, len(self.prompt_token_ids) - self.keep_tokens))
        return len(self.prompt_token_ids) - gone

    @property
    def all_token_ids(self) -> list[int]:
        """The context's token ids (prompt + output, less the dropped ones)."""
        everything = self.prompt_token_ids + self.output_token_ids
        if not self.num_dropped:
            return everything
        return everything[: self.keep_tokens] + everything[self.keep_tokens + self.num_dropped :]

    def token_ids_from(self, start: int, count: int) -> list[int]:
        """all_token_ids[start:start + count], without building all_token_ids (a decode step wants
        the last token of a long history)."""
        if self.num_dropped and start + count > self.keep_tokens:
            if start < self.keep_tokens:
                return self.all_token_ids[start : start + count]
            start += self.num_dropped  # past the kept head: skip the dropped run
        prompt = len(self.prompt_token_ids)
        if start >= prompt:
            return self.output_token_ids[start - prompt : start - prompt + count]
        head = self.prompt_token_ids[start : start + count]
        return head + self.output_token_ids[: count - len(head)]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
