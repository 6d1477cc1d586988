"""Compiling constraints with llguidance, cached per constraint, bounded in work."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance

from tokenloom.structured.spec import StructuredOutput

# llguidance meters its work in "fuel"; these caps make a pathological schema or regex fail
# with an error instead of hanging (measured: a 10-property schema compiles in ~3 ms).
LIMITS = dict(initial_lexer_fuel=2_000_000, step_lexer_fuel=400_000, step_max_items=100_000,
              max_grammar_size=200_000, max_lexer_states=200_000, verbose_errors=False)


class GrammarCompiler:
    """Turns StructuredOutput into llguidance matchers for one tokenizer.

    The tokenizer's token trie is built on first use (~0.5 s); grammars are validated once
    and kept in an LRU cache, so a repeated schema costs only a matcher (microseconds).
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int], cache_size: int = 128) -> None:
        self._tokenizer_json, self._vocab_size, self._eos = tokenizer_json, vocab_size, sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutput, str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiled = 0            # grammars compiled (cache misses), for tests and metrics

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self._vocab_size,
                                                     eos_token=self._eos or None)   # None: its own guess
        return self._tokenizer

    def grammar(self, spec: StructuredOutput) -> str:
        """The validated llguidance grammar of `spec`; ValueError naming what is wrong."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        grammar = _to_grammar(spec)
        limits = llguidance.LLParserLimits(**LIMITS)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer, limits=limits)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"invalid {spec.kind.replace('_', ' ')}: {error.strip()}")
        with self._lock:
            self.compiled += 1
            self._cache[spec] = grammar
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the constrained output."""
        m = llguidance.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0,
                                 limits=llguidance.LLParserLimits(**LIMITS))
        if m.is_error():
            raise ValueError(f"invalid {spec.kind.replace('_', ' ')}: {m.get_error()}")
        return m


def _to_grammar(spec: StructuredOutput) -> str:
    M = llguidance.LLMatcher
    try:
        if spec.kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"})
        if spec.kind == "json_schema":
            return M.grammar_from_json_schema(json.loads(spec.value))
        if spec.kind == "regex":
            return M.grammar_from_regex(spec.value)
        return M.grammar_from_lark(spec.value)
    except (ValueError, TypeError, RuntimeError) as e:      # bad JSON, or a schema llguidance rejects
        raise ValueError(f"invalid {spec.kind.replace('_', ' ')}: {e}") from None
