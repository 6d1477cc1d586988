"""Structured output: constrain generation to a JSON schema, a regex or a Lark grammar.

llguidance (a maintained Rust grammar engine) compiles the constraint and, at every
step, computes the set of allowed next tokens as a bitmask; the sampler masks the
logits with it. Masks are computed on llguidance's threads while the model runs.
"""

from tokenloom.structured.spec import StructuredOutput

__all__ = ["StructuredOutput"]
