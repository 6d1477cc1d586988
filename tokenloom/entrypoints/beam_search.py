"""Beam search over the engine, step for step the algorithm of HF transformers' generate().

Each step asks the engine for one greedy token with the top-K logprobs of every running
beam (K = max(2, 1 + #EOS) x beam width), batched. The beams share their KV blocks through
the prefix cache: every full block of the prompt and of a common history is computed once
and referenced by all beams that contain it, and a beam's last, partial block is continued
by its children copy-on-write (the first takes it over, each sibling writes into a copy;
see BlockManager), so a step computes one token per beam. Candidates are ranked by cumulative
logprob; finished hypotheses are scored
cum_logprob / generated_length ** length_penalty. ``early_stopping``: True stops once
`beam_width` hypotheses are finished; False stops when the best running beam, scored at
its current length, cannot beat the worst finished one; "never" as False, but with a
positive length penalty it assumes the best running beam reaches max_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenloom.sampling_params import SamplingParams

NEG = -1.0e9


@dataclass
class BeamHypothesis:
    token_ids: list[int]  # generated tokens (prompt excluded)
    cumulative_logprob: float  # sum of the tokens' logprobs
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    text: str = ""


@dataclass
class _Beam:
    tokens: list[int]  # generated so far
    logprob: float  # cumulative


Expansion = tuple[list[list[int]], SamplingParams]  # prompts to run one step for, and their params


def beam_search(
    llm,
    prompt_ids: list[int],
    beam_width: int,
    max_tokens: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    n: int | None = None,
    lora: str | None = None,
) -> list[BeamHypothesis]:
    """The `n` (default: beam_width) best hypotheses, best first, on the synchronous LLM (through LoRA
    adapter `lora` where named)."""
    search = _search(
        prompt_ids, set(llm.engine.eos_token_ids), beam_width, max_tokens, length_penalty, early_stopping, n, lora
    )
    try:
        prompts, params = next(search)
        while True:
            prompts, params = search.send([o.outputs[0] for o in llm.generate(prompts, params)])
    except StopIteration as done:
        return _with_text(done.value, llm.tokenizer)


async def beam_search_async(
    engine,
    prompt_ids: list[int],
    beam_width: int,
    max_tokens: int,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    n: int | None = None,
    client: str | None = None,
    lora: str | None = None,
) -> list[BeamHypothesis]:
    """The same search over an AsyncLLMEngine (the server): each step's beams run as requests
    among everyone else's (as `client`'s)."""
    import asyncio
    from contextlib import aclosing

    async def final(prompt: list[int], params: SamplingParams):
        async with aclosing(engine.generate(prompt, params, client=client)) as stream:  # cancelled: aborted at once
            async for delta in stream:
                if delta.finished:
                    return delta.completion

    eos = set(engine.eos_token_ids)
    search = _search(prompt_ids, eos, beam_width, max_tokens, length_penalty, early_stopping, n, lora)
    try:
        prompts, params = next(search)
        while True:
            prompts, params = search.send(await asyncio.gather(*(final(p, params) for p in prompts)))
    except StopIteration as done:
        return _with_text(done.value, engine.tokenizer)


def _with_text(hypotheses: list[BeamHypothesis], tokenizer) -> list[BeamHypothesis]:
    for h in hypotheses:
        h.text = tokenizer.decode(h.token_ids)
    return hypotheses


def _search(
    prompt_ids: list[int],
    eos: set[int],
    beam_width: int,
    max_tokens: int,
    length_penalty: float,
    early_stopping: bool | str,
    n: int | None,
    lora: str | None = None,
):
    """The algorithm, as a generator: yields the step's expansions (prompts + params), is sent
    their CompletionOutputs, returns the n best BeamHypothesis (HF transformers' rules)."""
    n = beam_width if n is None else n
    if beam_width < 1 or not 1 <= n <= beam_width or max_tokens < 1:
        raise ValueError("need beam_width >= 1, 1 <= n <= beam_width and max_tokens >= 1")
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    keep = max(2, 1 + len(eos)) * beam_width
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=keep, lora=lora)
    finished: list[BeamHypothesis] = []
    running, improvable = [_Beam([], 0.0)], True
    for step in range(max_tokens):
        outs = yield [prompt_ids + b.tokens for b in running], params
        candidates = _rank(running, outs)[:keep]  # best cumulative first
        last = step + 1 == max_tokens
        hits = [last or c.tokens[-1] in eos for c in candidates]
        running = [c for c, h in zip(candidates, hits) if not h][:beam_width]
        if improvable and not (early_stopping is True and len(finished) == beam_width):
            finished += [
                BeamHypothesis(c.tokens, c.logprob, c.logprob / (step + 1) ** length_penalty)
                for rank, (c, h) in enumerate(zip(candidates, hits))
                if h and rank < beam_width
            ]
            finished = sorted(finished, key=lambda f: -f.score)[:beam_width]
        if len(finished) == beam_width and running:
            length = max_tokens if early_stopping == "never" and length_penalty > 0 else step + 1
            improvable = improvable and running[0].logprob / length**length_penalty > finished[-1].score
        if not running or not improvable or (early_stopping is True and len(finished) == beam_width):
            break
    return finished[:n]


def _rank(running: list[_Beam], outs: list) -> list[_Beam]:
    """Every running beam's top one-token continuations, ranked by cumulative logprob."""
    candidates = [
        _Beam(b.tokens + [token], b.logprob + lp)
        for b, out in zip(running, outs)
        for token, lp in out.logprobs[0].items()
    ]
    return sorted(candidates, key=lambda c: -c.logprob)
