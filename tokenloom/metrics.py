"""What the engine counts: a snapshot of its state and per-request latencies."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestMetrics:
    """Latencies of one request, in seconds (None until they exist)."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_generated: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    num_spec_steps: int = 0  # steps that verified drafts for this request
    num_draft_tokens: int = 0  # draft tokens proposed and verified
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_per_step(self) -> float | None:
        """Tokens produced per speculative step: accepted drafts plus the target's own token."""
        return (self.num_accepted_tokens + self.num_spec_steps) / self.num_spec_steps if self.num_spec_steps else None

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finish_time is None or self.first_token_time is None or self.num_generated < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_generated - 1)


@dataclass(slots=True)
class EngineStats:
    """A snapshot of the engine (``LLMEngine.stats()``)."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    prefix_cache_hit_rate: float  # cached prompt tokens / prompt tokens looked up
    prompt_tokens_computed: int  # prompt positions run through the model (prefill, recompute)
    generated_tokens: int  # tokens sampled
    num_preemptions: int
    spec_steps: int = 0  # request-steps that verified drafts
    spec_draft_tokens: int = 0  # draft tokens verified
    spec_accepted_tokens: int = 0  # draft tokens accepted

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_accepted_per_step(self) -> float:
        return (self.spec_accepted_tokens + self.spec_steps) / self.spec_steps if self.spec_steps else 0.0
