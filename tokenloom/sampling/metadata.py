"""Per-row sampling inputs, gathered once per step from the requests that sample."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.sampling.sparse import right_aligned
from tokenloom.sampling.state import SamplingState
from tokenloom.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingMetadata:
    """Row i of the logits belongs to a request with these params and histories."""

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    generators: list[torch.Generator | None]  # per-request RNG when a seed was given
    eos_token_ids: list[frozenset[int]]
    states: list[SamplingState] | None = None  # per-request sampler state; None: each row's initial state
    _histories: list[list[int]] | None = None  # prompt + output per row, made on first use
    _history_matrix: torch.Tensor | None = None  # the same right-aligned (R, L), made on first use

    def __post_init__(self) -> None:
        if self.states is None:
            self.states = [SamplingState.initial(p) for p in self.params]
        for p, s in zip(self.params, self.states):
            s.check_resolved(p)

    @classmethod
    def for_requests(cls, requests: list, output_token_ids: list[list[int]] | None = None) -> SamplingMetadata:
        """One row per request (a Request may repeat); `output_token_ids` overrides each row's
        output history (speculation: outputs plus the drafts before that row)."""
        outputs = output_token_ids if output_token_ids is not None else [r.output_token_ids for r in requests]
        return cls(
            [r.params for r in requests],
            [r.prompt_token_ids for r in requests],
            outputs,
            [r.generator for r in requests],
            [r.eos_token_ids for r in requests],
            [r.sampling_state for r in requests],
        )

    def rows(self, index: list[int]) -> SamplingMetadata:
        """The metadata of a subset of rows, in the order given."""
        assert self.states is not None  # __post_init__ fills it
        return SamplingMetadata(
            [self.params[i] for i in index],
            [self.prompt_token_ids[i] for i in index],
            [self.output_token_ids[i] for i in index],
            [self.generators[i] for i in index],
            [self.eos_token_ids[i] for i in index],
            [self.states[i] for i in index],
        )

    def histories(self) -> list[list[int]]:
        """Per row: prompt + output token ids (what n-gram blocking, bad words and DRY look at)."""
        if self._histories is None:
            self._histories = [prompt + output for prompt, output in zip(self.prompt_token_ids, self.output_token_ids)]
        return self._histories

    def history_matrix(self) -> torch.Tensor:
        """(R, L) int64 CPU: each row's prompt + output at the end of its row after -1 padding (the
        last tokens of every row share columns); what the processors index."""
        if self._history_matrix is None:
            self._history_matrix = right_aligned(self.histories())
        return self._history_matrix

    @property
    def num_rows(self) -> int:
        return len(self.params)

    @property
    def max_logprobs(self) -> int | None:
        asked = [p.logprobs for p in self.params if p.logprobs is not None]
        return max(asked) if asked else None
