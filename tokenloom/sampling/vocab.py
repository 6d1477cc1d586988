"""The tokenizer's side of the sampler's string settings: bad words and DRY sequence breakers in
token form, resolved once per request when it is added (breaker sets cached per engine, since
finding them reads the text of every token in the vocabulary)."""

from __future__ import annotations

from functools import cached_property

from tokenloom.sampling.bans import bad_words_token_ids
from tokenloom.sampling.dry import DryBreakers
from tokenloom.sampling.state import SamplingState, dry_enabled
from tokenloom.sampling_params import SamplingParams
from tokenloom.tokenizer import Tokenizer


class SamplingVocab:
    """Resolves SamplingParams' bad_words and dry_sequence_breakers for one model's vocabulary."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's (may exceed the tokenizer's: padding rows)
        self._breakers: dict[tuple[str, ...], DryBreakers] = {}

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    @cached_property
    def token_texts(self) -> list[str]:
        """Each token's text on its own (special tokens included), "" past the tokenizer's vocabulary."""
        known = min(self.tokenizer.vocab_size, self.vocab_size)
        texts = self.tokenizer.backend.decode_batch([[i] for i in range(known)], skip_special_tokens=False)
        return texts + [""] * (self.vocab_size - known)

    def dry_breakers(self, breakers: list[str]) -> DryBreakers:
        key = tuple(breakers)
        if key not in self._breakers:
            self._breakers[key] = DryBreakers.build(key, self.token_texts, self.encode)
        return self._breakers[key]

    def resolve(self, params: SamplingParams) -> SamplingState:
        """The request's initial SamplingState with its bad words and DRY breakers in token form."""
        state = SamplingState.initial(params)
        if params.bad_words:
            state.bad_words_ids = bad_words_token_ids(params.bad_words, self.encode)
        if dry_enabled(params):
            state.dry_breakers = self.dry_breakers(params.dry_sequence_breakers)
        return state
