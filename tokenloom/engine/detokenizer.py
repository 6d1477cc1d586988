"""Incremental detokenization of one sequence, with stop strings.

Built on ``tokenizers.decoders.DecodeStream``, which holds back bytes of a
multi-byte UTF-8 character split across tokens until the character is complete.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from tokenloom.engine.stopping import StopStringMatcher
from tokenloom.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns one sequence's new token ids into safe-to-show text deltas.

    ``push(token_id)`` returns ``(delta, stopped)``; once ``stopped`` is True a stop
    string matched and the sequence must end. ``finish()`` returns held-back text
    (a partial stop-string match that never completed). ``text`` is the output so far.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer.backend
        # Seed the stream with the prompt's tail so the first output token decodes
        # with its proper leading space/merge context.
        self._stream = DecodeStream(ids=prompt_ids[-8:], skip_special_tokens=skip_special_tokens)
        self._matcher = StopStringMatcher(stop)

    @property
    def text(self) -> str:
        return self._matcher.text

    def push(self, token_id: int) -> tuple[str, bool]:
        chunk = self._stream.step(self._tokenizer, token_id)
        return self._matcher.feed(chunk or "")

    def finish(self) -> str:
        return self._matcher.flush()

    @property
    def matched_stop(self) -> str | None:
        return self._matcher.matched
