"""One sampling-defaults policy for the CLI, the server, the playground and ``LLM``.

A setting the user leaves out takes the model's own recommendation where the checkpoint has one
(an HF folder's generation_config.json; a GGUF file's ``general.sampling.*`` keys), else
llama.cpp's sampler defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, no repetition
penalty: ollama's 1.1 over the last 64 tokens would here cover the whole prompt and output, and
would change greedy output too). A model that recommends any
setting is taken at its word: the settings it leaves out are off (not filled from llama.cpp's),
and ``do_sample: false`` means greedy. ``SamplingParams()`` itself keeps vLLM's plain defaults
(temperature 1, no filters): the policy applies where a setting is left out of a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenloom.sampling_params import SamplingParams

FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
OFF = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
LLAMA_CPP = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


@dataclass(frozen=True)
class SamplingDefaults:
    """The settings a request that leaves them out gets, and where they come from."""

    values: dict[str, float | int]  # every name in FIELDS
    source: str  # "generation_config.json", "the GGUF file" or "llama.cpp's defaults"

    def fill(self, given: dict[str, Any]) -> dict[str, Any]:
        """`given` (SamplingParams fields; None: left out) with the left-out FIELDS filled in."""
        filled = {k: v for k, v in given.items() if v is not None}
        return {**{k: v for k, v in self.values.items() if k not in filled}, **filled}

    def params(self, **given: Any) -> SamplingParams:
        """SamplingParams of `given` (None: left out), the rest of FIELDS from the defaults."""
        return SamplingParams(**self.fill(given))

    def describe(self) -> str:
        v = self.values
        return (
            f"temperature {v['temperature']:g}, top-k {v['top_k']}, top-p {v['top_p']:g}, min-p {v['min_p']:g}, "
            f"repetition penalty {v['repetition_penalty']:g} (from {self.source})"
        )


FALLBACK = SamplingDefaults(dict(LLAMA_CPP), "llama.cpp's defaults")


def from_generation_config(config: dict[str, Any] | None, source: str = "generation_config.json") -> SamplingDefaults:
    """The defaults of an HF generation_config.json dict (None or no sampling settings: FALLBACK)."""
    config = config or {}
    recommended = {k: config[k] for k in FIELDS if config.get(k) is not None}
    if not recommended and config.get("do_sample") is None:
        return FALLBACK
    values = {**OFF, **recommended}
    if config.get("do_sample") is False:
        values["temperature"] = 0.0
    values["top_k"] = max(int(values["top_k"]), 0)
    return SamplingDefaults(values, source)


def from_gguf_metadata(field) -> SamplingDefaults:
    """The defaults of a GGUF file's ``general.sampling.*`` keys, read with `field(key)` (None if absent)."""
    recommended = {name: value for key, name in _GGUF_KEYS.items() if (value := field(key)) is not None}
    return from_generation_config(recommended, "the GGUF file") if recommended else FALLBACK
