"""User-facing sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.structured.spec import StructuredOutput

# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-45 overflows
# them to inf, and the softmax of that is NaN, not the argmax it tends to.
GREEDY_TEMPERATURE = 1e-5
SEED_LIMIT = 1 << 64  # seeds are unsigned 64-bit, as torch.Generator takes them

# The filters of the chain, in the order they run unless a request names its own (`samplers`). The
# processors (logit bias, min_tokens, bad words, n-gram blocking, penalties, DRY) always run first,
# in that order, for greedy rows too; the filters shape the distribution a sampled row draws from.
DEFAULT_SAMPLERS = (
    "temperature",
    "top_n_sigma",
    "top_k",
    "typical_p",
    "top_p",
    "min_p",
    "xtc",
    "epsilon_cutoff",
    "eta_cutoff",
)
SAMPLER_ALIASES = {
    "temp": "temperature",
    "typ_p": "typical_p",
    "typical": "typical_p",
    "epsilon": "epsilon_cutoff",
    "eta": "eta_cutoff",
    "top_nsigma": "top_n_sigma",
}
PROCESSOR_NAMES = ("penalties", "dry")  # llama.cpp's --samplers may start with these: they run first anyway
DRY_BREAKERS = ("\n", ":", '"', "*")  # llama.cpp's default DRY sequence breakers
MAX_DRY_BREAKER_CHARS = 40  # llama.cpp truncates longer ones; here they are refused


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop (vLLM's names and meanings).

    temperature 0 (or below GREEDY_TEMPERATURE, 1e-5) is greedy. top_k 0 (or -1) and top_p 1 and min_p 0 disable those
    filters. Penalties follow vLLM/OpenAI: repetition_penalty divides positive
    (multiplies negative) logits of tokens seen in prompt or output;
    frequency_penalty subtracts count x penalty and presence_penalty subtracts the
    penalty once, for tokens in the output. logprobs=N returns the chosen token's
    logprob plus the top N (raw model distribution, before any processing).
    explain=N records, per generated token, the top N candidates and what the
    processors and filters did to them (tokenloom.explain.StepRecord).
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # logprobs of the prompt's own tokens (+ top N): scoring
    structured_output: StructuredOutput | None = None  # JSON schema / JSON object / regex / grammar
    skip_special_tokens: bool = True
    explain: int | None = None  # per-step records of the distribution with the top N candidates
    context_keep: int | None = None  # context shift keeps the first N tokens (None: the engine's --keep)
    lora: str | None = None  # the name of a LoRA adapter the engine has loaded (None: the base model)
    # the rest of the chain (tokenloom/sampling/chain.py); each default is "off"
    typical_p: float = 1.0  # locally typical sampling (HF): keep the most typical mass
    top_n_sigma: float = 0.0  # keep logits within n standard deviations of the max (0 or -1: off)
    epsilon_cutoff: float = 0.0  # drop tokens below this probability (HF)
    eta_cutoff: float = 0.0  # drop tokens below min(eta, sqrt(eta) x exp(-entropy)) (HF)
    xtc_probability: float = 0.0  # exclude top choices: how often it fires
    xtc_threshold: float = 0.1  # ... and which tokens count as top choices
    mirostat: int = 0  # 1 or 2: mirostat v1/v2 replaces the truncation filters
    mirostat_tau: float = 5.0  # target surprise (bits)
    mirostat_eta: float = 0.1  # learning rate
    no_repeat_ngram_size: int = 0  # ban tokens completing an n-gram already in prompt + output (HF)
    bad_words: list[str] | None = None  # words never generated (vLLM): their token sequences are banned
    repetition_penalty_range: int = 0  # penalties see the last N tokens of prompt + output (0: all)
    dry_multiplier: float = 0.0  # DRY (llama.cpp): 0 is off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1: the whole prompt + output; 0: DRY off
    dry_sequence_breakers: list[str] = field(default_factory=lambda: list(DRY_BREAKERS))
    samplers: list[str] | None = None  # the filters' order (names of DEFAULT_SAMPLERS); None: the default

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.top_n_sigma == -1:
            self.top_n_sigma = 0.0
        self.bad_words = list(self.bad_words) if self.bad_words else None
        self.dry_sequence_breakers = list(self.dry_sequence_breakers)
        if isinstance(self.samplers, str):
            self.samplers = [n for n in self.samplers.replace(",", ";").split(";") if n.strip()]
        if self.samplers is not None:
            self.samplers = [SAMPLER_ALIASES.get(n.strip(), n.strip()) for n in self.samplers]
        if isinstance(self.temperature, int | float) and 0 < self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        self._validate()

    @property
    def scores_only(self) -> bool:
        """Prompt logprobs asked for: max_tokens may be 0 (score the prompt, generate nothing)."""
        return self.prompt_logprobs is not None

    def _validate(self) -> None:
        checks = [
            ("n", isinstance(self.n, int) and self.n >= 1, "must be an integer >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0 (0 means greedy)"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "must be >= 0, or -1 to disable"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0, "must be > 0"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "must be in [-2, 2]"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "must be in [-2, 2]"),
            (
                "max_tokens",
                isinstance(self.max_tokens, int) and self.max_tokens >= (0 if self.scores_only else 1),
                "must be an integer >= 1 (0 only with prompt_logprobs: scoring without generating)",
            ),
            (
                "min_tokens",
                isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
                "must be an integer in [0, max_tokens]",
            ),
            (
                "logprobs",
                self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
                "must be None or an integer >= 0",
            ),
            (
                "structured_output",
                self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
                "must be None or a StructuredOutput",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None
                or (isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
                "must be None or an integer in [0, 20]",
            ),
            (
                "context_keep",
                self.context_keep is None or (isinstance(self.context_keep, int) and self.context_keep >= 0),
                "must be None or an integer >= 0",
            ),
            ("lora", self.lora is None or (isinstance(self.lora, str) and bool(self.lora)), "must be None or a name"),
            (
                "explain",
                self.explain is None or (isinstance(self.explain, int) and 1 <= self.explain <= 100),
                "must be None or an integer in [1, 100] (candidates listed per step)",
            ),
            (
                "seed",
                self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < SEED_LIMIT),
                "must be None or an integer in [0, 2**64)",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop or ()), "must be non-empty strings"),
            (
                "stop_token_ids",
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "must be non-negative integers",
            ),
        ] + self._chain_checks()
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")
        for token, bias in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0 or not -100 <= bias <= 100:
                raise ValueError(
                    f"SamplingParams.logit_bias maps token ids >= 0 to biases in [-100, 100], got {token!r}: {bias!r}"
                )

    def _chain_checks(self) -> list[tuple[str, bool, str]]:
        def whole(value, low):
            return isinstance(value, int) and not isinstance(value, bool) and value >= low

        breakers = self.dry_sequence_breakers
        return [
            ("typical_p", 0 < self.typical_p <= 1, "must be in (0, 1] (1: off)"),
            ("top_n_sigma", self.top_n_sigma >= 0, "must be >= 0 (0 or -1: off)"),
            ("epsilon_cutoff", 0 <= self.epsilon_cutoff < 1, "must be in [0, 1) (0: off)"),
            ("eta_cutoff", 0 <= self.eta_cutoff < 1, "must be in [0, 1) (0: off)"),
            ("xtc_probability", 0 <= self.xtc_probability <= 1, "must be in [0, 1] (0: off)"),
            ("xtc_threshold", 0 <= self.xtc_threshold <= 1, "must be in [0, 1] (above 0.5 XTC never cuts)"),
            (
                "mirostat",
                self.mirostat in (0, 1, 2) and not isinstance(self.mirostat, bool),
                "must be 0 (off), 1 or 2 (mirostat version)",
            ),
            ("mirostat_tau", self.mirostat_tau > 0, "must be > 0 (target surprise in bits)"),
            ("mirostat_eta", 0 < self.mirostat_eta <= 1, "must be in (0, 1] (learning rate)"),
            ("no_repeat_ngram_size", whole(self.no_repeat_ngram_size, 0), "must be an integer >= 0 (0: off)"),
            (
                "bad_words",
                all(isinstance(w, str) and w.strip() for w in self.bad_words or ()),
                "must be non-blank strings",
            ),
            (
                "repetition_penalty_range",
                whole(self.repetition_penalty_range, 0),
                "must be an integer >= 0 (0: the whole prompt and output)",
            ),
            ("dry_multiplier", self.dry_multiplier >= 0, "must be >= 0 (0: off)"),
            ("dry_base", self.dry_base >= 1, "must be >= 1"),
            ("dry_allowed_length", whole(self.dry_allowed_length, 1), "must be an integer >= 1"),
            (
                "dry_penalty_last_n",
                whole(self.dry_penalty_last_n, -1),
                "must be an integer >= -1 (-1: the whole context, 0: DRY off)",
            ),
            (
                "dry_sequence_breakers",
                all(isinstance(b, str) and 0 < len(b) <= MAX_DRY_BREAKER_CHARS for b in breakers),
                f"must be non-empty strings of at most {MAX_DRY_BREAKER_CHARS} characters",
            ),
            (
                "samplers",
                self._samplers_ok(),
                f"must name each of {', '.join(DEFAULT_SAMPLERS)} at most once (llama.cpp's names too), "
                f"optionally after {' and '.join(PROCESSOR_NAMES)}",
            ),
        ]

    def _samplers_ok(self) -> bool:
        if self.samplers is None:
            return True
        names = list(self.samplers)
        while names and names[0] in PROCESSOR_NAMES:  # llama.cpp's "penalties;dry;..." prefix
            names.pop(0)
        return all(isinstance(n, str) and n in DEFAULT_SAMPLERS for n in names) and len(set(names)) == len(names)

    @property
    def sampler_order(self) -> tuple[str, ...]:
        """The filters this request runs, in order (its `samplers`, else DEFAULT_SAMPLERS)."""
        if self.samplers is None:
            return DEFAULT_SAMPLERS
        return tuple(n for n in self.samplers if n not in PROCESSOR_NAMES)

    def for_sample(self, index: int) -> SamplingParams:
        """The params of the index-th of n samples: n=1, and a distinct seed derived from the user's."""
        import dataclasses

        seed = None if self.seed is None else (self.seed + index) % SEED_LIMIT
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named in the params must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", list(self.logit_bias or {})), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
                raise ValueError(
                    f"SamplingParams.{name} names token ids {bad[:5]}{more} outside the vocabulary (size {vocab_size})"
                )
