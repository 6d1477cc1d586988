"""Stopping, split in two as in vLLM v1.

- Token stops (EOS, stop token ids, max_tokens, the context limit) are checked in the
  engine core on ids: ``check_token_stop``.
- Stop strings are matched on decoded text, incrementally and across token
  boundaries: ``StopStringMatcher``. While streaming, text that could still turn
  out to be the start of a stop string is held back until it is resolved.
"""

from __future__ import annotations

from tokenloom.sampling_params import SamplingParams


def check_token_stop(
    output_ids: list[int], params: SamplingParams, eos_ids: frozenset[int], total_len: int, max_model_len: int
) -> tuple[str, int | None] | None:
    """(finish_reason, stop_token) if the last generated token ends the sequence, else None.

    `total_len` is prompt + output length. EOS and stop ids only count once
    ``min_tokens`` tokens exist (the sampler masks them before that anyway).
    """
    last = output_ids[-1]
    if len(output_ids) >= params.min_tokens:
        if not params.ignore_eos and last in eos_ids:
            return "stop", last
        if last in params.stop_token_ids:
            return "stop", last
    if len(output_ids) >= params.max_tokens or total_len >= max_model_len:
        return "length", None
    return None


class StopStringMatcher:
    """Finds the first stop string in a growing text.

    ``feed(delta)`` appends text and returns ``(emit, stopped)``: the text that is now
    safe to show, and whether a stop string matched (the text is then cut before it,
    and nothing after it is ever emitted).
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.text = ""  # everything decoded so far, cut at a match
        self.emitted = 0  # len of self.text already returned to the caller
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        search_from = max(0, len(self.text) - self.max_len + 1)
        self.text += delta
        cut = self._first_match(search_from)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
            return self._take(len(self.text)), True
        return self._take(len(self.text) - self._held_back()), False

    def flush(self) -> str:
        """At the end of the sequence: everything not yet emitted."""
        return self._take(len(self.text))

    def _first_match(self, search_from: int) -> int | None:
        """Start of the earliest stop string (the longest one if several start there)."""
        hits = [(i, -len(s), s) for s in self.stops if (i := self.text.find(s, search_from)) >= 0]
        if not hits:
            return None
        start, _, self.matched = min(hits)
        return start

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        for n in range(min(self.max_len - 1, len(self.text) - self.emitted), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0

    def _take(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out
