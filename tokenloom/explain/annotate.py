"""Fill in what the sampler cannot know: texts, position, KV cache size and step time."""

from __future__ import annotations

from tokenloom.explain.records import StepRecord

CONTEXT_TOKENS = 4  # tokens decoded before a candidate, so its leading space and merges come out right


def piece(tokenizer, context: list[int], token: int) -> str:
    """The text `token` adds after `context` (its last CONTEXT_TOKENS tokens)."""
    context = context[-CONTEXT_TOKENS:]
    before = tokenizer.decode(context, skip_special_tokens=False)
    return tokenizer.decode(context + [token], skip_special_tokens=False)[len(before) :]


def annotate(
    record: StepRecord,
    tokenizer,
    context: list[int],
    kv_bytes_per_token: int,
    kv_blocks_used: int,
    step_time_s: float,
    index: int,
) -> StepRecord:
    """`context`: the request's tokens before this one (prompt + earlier outputs), all of which
    the model attended over to produce it, so all in the KV cache."""
    for c in record.candidates:
        c.text = piece(tokenizer, context, c.token_id)
    record.text = record.chosen.text
    record.index = index
    record.kv_tokens = len(context)
    record.kv_bytes = len(context) * kv_bytes_per_token
    record.kv_blocks_used = kv_blocks_used
    record.step_time_s = step_time_s
    return record
