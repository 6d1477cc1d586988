"""What a request's sampler needs beyond its params: the token-level forms of its string settings
(bad words, DRY sequence breakers), resolved once when the request is added, and mirostat's
running target surprise, carried from step to step."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.sampling.dry import DryBreakers
from tokenloom.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingState:
    """One request's sampler state. `mirostat_mu` starts at 2 x tau (llama.cpp) and moves by
    eta x (observed surprise - tau) after each sampled token."""

    bad_words_ids: list[list[int]] = field(default_factory=list)  # token sequences never completed
    dry_breakers: DryBreakers | None = None  # None: DRY off
    mirostat_mu: float = 0.0

    @classmethod
    def initial(cls, params: SamplingParams) -> SamplingState:
        """The state before any token, without the token-level settings (see `SamplingVocab.resolve`)."""
        return cls(mirostat_mu=2.0 * params.mirostat_tau)

    def check_resolved(self, params: SamplingParams) -> None:
        """RuntimeError if `params` asks for bad words or DRY that no tokenizer resolved: a request
        built outside the engine must resolve them (SamplingVocab.resolve) first."""
        if (params.bad_words and not self.bad_words_ids) or (dry_enabled(params) and self.dry_breakers is None):
            raise RuntimeError("bad_words / DRY need the tokenizer: resolve the request's SamplingState first")


def dry_enabled(params: SamplingParams) -> bool:
    """DRY is on: a multiplier, and a window (dry_penalty_last_n -1: all, 0: off)."""
    return params.dry_multiplier > 0 and params.dry_penalty_last_n != 0
