"""Per-step records of one generated token: the distribution, the cuts, the pick, the cost.

No torch here: plain dataclasses the engine fills, the CLI renders and the server sends.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# Why a candidate got probability 0: a processor's ban (logit bias / min_tokens / penalties: "banned"),
# the grammar, or a filter of the chain (tokenloom/sampling/chain.py; XTC: in the draws where it fires).
CUT_REASONS = (
    "banned",
    "bad_words",
    "no_repeat_ngram",
    "grammar",
    "top_n_sigma",
    "top_k",
    "typical_p",
    "top_p",
    "min_p",
    "xtc",
    "epsilon_cutoff",
    "eta_cutoff",
    "mirostat",
)


@dataclass(slots=True)
class Candidate:
    """One token of the step's distribution."""

    token_id: int
    logit: float  # the model's raw logit
    model_prob: float  # softmax of the raw logits: what the model itself believes
    adjusted_prob: float  # after the processors (bias, min_tokens, penalties), the grammar and
    # temperature; before top-k/top-p/min-p. Greedy: temperature 1.
    prob: float  # in the distribution the token was drawn from (0 if cut); greedy:
    # adjusted_prob, whose argmax is taken
    cut_by: str | None  # which filter (CUT_REASONS) removed it, None if kept
    penalty: float  # how much the processors moved its logit (0: untouched)
    text: str = ""  # the text it would have added


@dataclass(slots=True)
class StepRecord:
    """One generated token and how it was chosen."""

    index: int  # position in the output: 0 is the first generated token
    token_id: int
    prob: float  # the chosen token's `prob` (see Candidate)
    model_prob: float  # the chosen token's `model_prob`
    greedy: bool
    temperature: float
    candidates: list[Candidate]  # the top N by adjusted_prob, best first, then the chosen one if not among them
    num_kept: int  # tokens left with probability > 0 after the cuts (greedy: all)
    num_cut: dict[str, int]  # reason -> how many tokens it removed (reasons that removed none omitted)
    num_penalized: int  # tokens whose logit the processors moved
    num_moved: dict[str, int] = field(default_factory=dict)  # processor (penalties, dry, ...) -> tokens it moved
    text: str = ""  # the text this token added to the output
    kv_tokens: int = 0  # tokens whose keys and values this request attended over
    kv_bytes: int = 0  # kv_tokens x 2 x layers x kv_heads x head_dim x bytes per element
    kv_blocks_used: int = 0  # KV blocks in use in the whole engine after this step
    step_time_s: float = 0.0  # wall time of the engine step that produced it
    extras: dict = field(default_factory=dict)

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.candidates if c.token_id == self.token_id)

    def to_dict(self) -> dict:
        """JSON-ready (the server's `explain` field)."""
        return asdict(self)
