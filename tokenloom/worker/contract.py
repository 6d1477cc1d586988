"""The scheduler-to-runner contract: what one engine step asks of the model runner
(``SchedulerOutput``) and what the runner gives back (``RunnerOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenloom.outputs import TokenLogprobs

if TYPE_CHECKING:
    from tokenloom.engine.request import Request
    from tokenloom.explain.records import StepRecord


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens of this request computed in this step (prompt chunk or 1)
    samples: bool  # True when this step reaches the request's last known token
    block_ids: list[int]  # the request's whole block table after this step's allocation
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens verified this step (in num_tokens)
    decode_steps: int = 1  # tokens decoded in a row (each fed back on the device); KV room for all of them
    state_slot: int = -1  # the request's recurrent-state slot (a hybrid model's; -1: none)
    # the table its sliding-window layers attend with, in their own pool (kv_cache/window_pool.py);
    # None where every layer reads block_ids
    window_block_ids: list[int] | None = None


@dataclass(slots=True)
class KVShift:
    """One sequence's context shift (engine/context_shift.py): each (source, destination) block's
    keys turned back by `delta` positions into the destination (values copied where it differs);
    `window_pairs` the same in the window layers' pool."""

    pairs: list[tuple[int, int]]
    delta: int
    window_pairs: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """What the scheduler hands the runner for one step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)  # in batch order
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) KV blocks to copy first
    window_block_copies: list[tuple[int, int]] = field(default_factory=list)  # the same in the window pool
    kv_shifts: list[KVShift] = field(default_factory=list)  # context shifts, run after the copies

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass(slots=True)
class RunnerOutput:
    """What the runner returns: one entry per scheduled request that samples, in batch order."""

    request_ids: list[str]  # requests that sampled this step
    sampled_token_ids: list[list[int]]  # per request: its new tokens (accepted drafts + 1)
    logprobs: list[list[TokenLogprobs] | None]  # per request, per new token: chosen + top-N (if asked)
    # request -> (index of the first prompt token scored, entries) for this step's prompt chunk
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    explanations: dict[str, StepRecord] = field(default_factory=dict)  # request -> its token's record
    errors: dict[str, str] = field(default_factory=dict)  # request -> why its part of the step failed
