"""Compiling constraints with llguidance, cached per constraint, bounded in work."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tokenloom.structured.spec import StructuredOutput

if TYPE_CHECKING:  # llguidance is imported where a grammar is first needed: a plain run never loads it
    import llguidance
    from llguidance._lib import JsonCompileOptions

# llguidance meters its work in "fuel"; these caps make a pathological schema or regex fail
# with an error instead of hanging (an ordinary schema compiles quickly: docs/BENCHMARKS.md,
# 'Measurements behind design choices').
LIMITS: dict[str, Any] = dict(
    initial_lexer_fuel=2_000_000,
    step_lexer_fuel=400_000,
    step_max_items=100_000,
    max_grammar_size=200_000,
    max_lexer_states=200_000,
    verbose_errors=False,
)
# Whitespace between JSON tokens: none, a space, or one or two newlines and up to 20 indentation
# characters (llama.cpp's `space` rule). Unbounded, a sampled small model can spend every token it
# has left on whitespace inside an object and never close it. A schema's own
# {"x-guidance": {"whitespace_pattern": ...}} wins.
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_pattern": r"( |\n{1,2}[ \t]{0,20})?"}


class GrammarCompiler:
    """Turns StructuredOutput into llguidance matchers for one tokenizer.

    The tokenizer's token trie is built on first use, from the JSON text that
    `tokenizer_json()` makes then (a 151k-token vocabulary's text and trie hold ~33 MB that a
    process never asked for structured output need not). A grammar is compiled once into a
    pristine matcher kept in an LRU cache; each request gets a ``deep_copy`` of it, orders of
    magnitude cheaper than building a matcher from the grammar text again, time the server's
    event loop or engine step would wait (docs/BENCHMARKS.md, 'Measurements behind design
    choices').
    """

    def __init__(
        self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: list[int], cache_size: int = 128
    ) -> None:
        self._tokenizer_json, self._vocab_size, self._eos = tokenizer_json, vocab_size, sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()  # pristine matchers
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.compiled = 0  # grammars compiled (cache misses), for tests and metrics

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            import llguidance

            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json(), n_vocab=self._vocab_size, eos_token=self._eos or None
            )  # None: its own guess
        return self._tokenizer

    def warm_up(self) -> None:
        """Build the tokenizer's token trie now (a server, before its first constrained request)."""
        _ = self.tokenizer

    def special_tokens(self, texts: tuple[str, ...], encode) -> frozenset[str]:
        """Those of `texts` that are a single special token to llguidance (a grammar must name
        them as <token>: their bytes never match a string); `encode(text)` gives a text's ids."""
        found = set()
        for text in texts:
            ids = encode(text)
            if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]):
                found.add(text)
        return frozenset(found)

    def grammar(self, spec: StructuredOutput) -> None:
        """Compile `spec` (once: cached); ValueError naming what is wrong."""
        self._pristine(spec)

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the constrained output."""
        return self._pristine(spec).deep_copy()

    def _pristine(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        import llguidance

        matcher = llguidance.LLMatcher(
            self.tokenizer,
            _to_grammar(spec),
            log_level=0,  # compiles it
            limits=llguidance.LLParserLimits(**LIMITS),
        )
        if matcher.is_error():  # the error validate_grammar would give, without compiling twice
            raise ValueError(f"invalid {spec.kind.replace('_', ' ')}: {matcher.get_error().strip()}")
        with self._lock:
            self.compiled += 1
            self._cache[spec] = matcher
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher


def _to_grammar(spec: StructuredOutput) -> str:
    import llguidance

    M = llguidance.LLMatcher
    try:
        if spec.kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if spec.kind == "json_schema":
            return M.grammar_from_json_schema(json.loads(spec.value), defaults=JSON_DEFAULTS)
        if spec.kind == "regex":
            return M.grammar_from_regex(spec.value)
        return M.grammar_from_lark(spec.value)
    except (ValueError, TypeError, RuntimeError) as e:  # bad JSON, or a schema llguidance rejects
        raise ValueError(f"invalid {spec.kind.replace('_', ' ')}: {e}") from None
