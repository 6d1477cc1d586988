"""The synchronous Python API: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

from tqdm import tqdm

from tokenloom.engine import LLMEngine
from tokenloom.engine.args import EngineArgs
from tokenloom.entrypoints.beam_search import BeamHypothesis, beam_search
from tokenloom.eval.scoring import score_tokens
from tokenloom.outputs import CompletionOutput, RequestError, RequestOutput, StepDelta
from tokenloom.sampling_params import SamplingParams

Prompt = str | list[int]
Messages = list[dict[str, Any]]


@dataclass
class ScoreResult:
    """LLM.score's answer: the continuation's tokens, each one's log-probability, their sum."""

    token_ids: list[int]
    logprobs: list[float]  # natural log p(token | prompt and the continuation before it)
    total: float  # log p(continuation | prompt)


class LLM:
    """Batch generation over the engine. ``model`` is a folder, a .gguf path or a model's name (None: the
    default model); ``options`` are ``EngineArgs`` fields (tokenloom/engine/args.py, each with its default
    and what it does), e.g. ``device="cuda"``, ``max_model_len=4096``, ``speculative="ngram,k=4"``,
    ``quantization="int8"``, ``kv_cache_memory=2 << 30`` (bytes), ``tensor_parallel_size=2``. An unknown
    option is a TypeError, a bad value a ValueError naming it, both before any weights load."""

    def __init__(self, model: str | None = None, *, progress: bool = False, **options: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **options).create_engine_config(), progress=progress)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def default_sampling_params(self, **given: Any) -> SamplingParams:
        """SamplingParams of `given`, the settings left out as the model recommends (else llama.cpp's
        defaults; tokenloom/sampling/defaults.py): what generate() and stream() use without params."""
        return self.engine.sampling_defaults.params(**given)

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"a prompt is a str or a list of token ids, got {type(prompt).__name__}")

    def _add(self, prompt: Prompt, params: SamplingParams) -> tuple[str, str | None, list[int], list[str]]:
        """Queue `params.n` sequences for one prompt; returns (id, text, ids, child ids)."""
        text, ids = self._prompt_ids(prompt)
        rid = str(next(self._ids))
        children: list[str] = []
        for i in range(params.n):
            child_params = params if params.n == 1 else params.for_sample(i)
            child = f"{rid}-{i}"
            try:
                self.engine.add_request(child, ids, child_params)
            except Exception:
                for c in children:
                    self.engine.abort(c)
                raise
            children.append(child)
        return rid, text, ids, children

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt together (continuous batching); results in prompt order.
        `params` is one SamplingParams for all prompts or a list with one per prompt. `lora`: the
        name of a loaded LoRA adapter every prompt runs through (``LLM(model, lora={NAME: PATH})``;
        ``SamplingParams.lora`` picks one per prompt). A request that failed in the engine ends
        alone: finish_reason "error", the message in ``error``."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = cast("list[Prompt]", prompts)  # one prompt was wrapped above
        per_prompt = params if isinstance(params, list) else [params or self.default_sampling_params()] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        if lora is not None:
            per_prompt = [dataclasses.replace(p, lora=lora) for p in per_prompt]
        added = []
        try:
            for p, prompt_params in zip(prompts, per_prompt):
                added.append(self._add(p, prompt_params))
            done = self._run(sum(len(a[3]) for a in added), use_tqdm)
        except BaseException:
            for _, _, _, children in added:
                for c in children:
                    self.engine.abort(c)
            raise
        return [
            RequestOutput(rid, text, ids, [_indexed(done[c], i) for i, c in enumerate(children)])
            for rid, text, ids, children in added
        ]

    def add_lora(self, name: str, path: str) -> None:
        """Load a LoRA adapter (a PEFT folder) under `name` (the engine needs LoRA room: ``lora=`` or
        ``enable_lora=True``); ValueError if it does not fit the model or no slot is free."""
        self.engine.add_lora(name, path)

    def remove_lora(self, name: str) -> None:
        """Unload adapter `name`, freeing its slot."""
        self.engine.remove_lora(name)

    def score(self, prompt: Prompt, continuation: Prompt) -> ScoreResult:
        """log p(continuation | prompt) token by token, in one prefill pass; nothing is generated.

        Texts are tokenized separately (the continuation without special tokens), so the
        continuation's tokens are exactly ``ScoreResult.token_ids``; the total is their sum
        (the chain rule).
        """
        _, prompt_ids = self._prompt_ids(prompt)
        cont_ids = (
            self.tokenizer.encode(continuation, add_special_tokens=False)
            if isinstance(continuation, str)
            else self._prompt_ids(continuation)[1]
        )
        if not prompt_ids or not cont_ids:
            raise ValueError("score() needs at least one prompt token and one continuation token")
        logprobs = score_tokens(self.engine, prompt_ids + cont_ids, start=len(prompt_ids))
        return ScoreResult(cont_ids, logprobs, sum(logprobs))

    def beam_search(
        self,
        prompt: Prompt,
        beam_width: int,
        max_tokens: int = 16,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        n: int | None = None,
        lora: str | None = None,
    ) -> list[BeamHypothesis]:
        """The n (default beam_width) best continuations by beam search, best first, each with its
        tokens, text, cumulative logprob and length-penalized score (see tokenloom/entrypoints/beam_search.py);
        through LoRA adapter `lora` where named."""
        ids = self._prompt_ids(prompt)[1]
        return beam_search(self, ids, beam_width, max_tokens, length_penalty, early_stopping, n, lora)

    def chat(
        self, messages: Messages | list[Messages], params: SamplingParams | None = None, **template_kwargs: Any
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation and generate replies."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c, **template_kwargs) for c in conversations]
        return self.generate(prompts, params)

    def stream(self, prompt: Prompt | Messages, params: SamplingParams | None = None) -> Iterator[str]:
        """Text deltas of one sequence as they are decoded (a chat if given a list of messages)."""
        for delta in self.stream_deltas(prompt, params):
            if delta.text_delta:
                yield delta.text_delta

    def stream_deltas(self, prompt: Prompt | Messages, params: SamplingParams | None = None) -> Iterator[StepDelta]:
        """One sequence's StepDeltas as they come: tokens, text, logprobs and (with
        ``explain=N``) each token's StepRecord; the last one carries the CompletionOutput."""
        params = params or self.default_sampling_params()
        if params.n != 1:
            raise ValueError("stream() produces one sequence; use n=1")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = self.tokenizer.encode_chat(prompt)
        _, _, _, (child,) = self._add(cast(Prompt, prompt), params)  # chat messages encoded above
        try:
            finished = False
            while not finished:
                for delta in self.engine.step():
                    if delta.request_id == child:
                        finished = delta.finished
                        if delta.error is not None:
                            raise RequestError(delta.error)
                        yield delta
        finally:
            self.engine.abort(child)

    def _run(self, total: int, use_tqdm: bool) -> dict[str, CompletionOutput]:
        """Step until the engine is idle; the completions of requests that finished, by id."""
        done: dict[str, CompletionOutput] = {}
        with tqdm(total=total, desc="generating", unit="seq", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    if delta.finished:
                        assert delta.completion is not None  # a finished delta carries its completion
                        done[delta.request_id] = delta.completion
                        bar.update(1)
        return done


def _indexed(completion: CompletionOutput, index: int) -> CompletionOutput:
    completion.index = index
    return completion
