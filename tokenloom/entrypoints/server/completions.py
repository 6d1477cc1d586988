"""POST /v1/completions: whole responses and SSE streams in OpenAI's text_completion shape."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from tokenloom.entrypoints.beam_search import beam_search_async
from tokenloom.entrypoints.server import responses as R
from tokenloom.entrypoints.server.protocol import CompletionRequest
from tokenloom.entrypoints.server.serving import OpenAIServing, Prepared
from tokenloom.outputs import CompletionOutput, StepDelta


class Completions:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def _logprobs(self, req: CompletionRequest, token_ids: list[int], logprobs, offset: int) -> dict | None:
        if req.logprobs is None:
            return None
        return self.serving.fmt.completion(token_ids, logprobs or [], req.logprobs, offset)

    def response(self, req: CompletionRequest, prepared: Prepared, outs: list[CompletionOutput]) -> dict:
        choices = []
        for choice, out in zip(prepared.choices, outs):
            prefix = prepared.prompt_texts[choice.prompt_index] if req.echo else ""
            if req.scores_prompt:  # the prompt's tokens and logprobs first, then the generated ones
                ids = prepared.prompt_ids[choice.prompt_index] + out.token_ids
                logprobs = self._logprobs(req, ids, (out.prompt_logprobs or []) + (out.logprobs or []), 0)
            else:
                logprobs = self._logprobs(req, out.token_ids, out.logprobs, 0)
            body = {
                "index": choice.index,
                "text": prefix + out.text,
                "logprobs": logprobs,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            choices.append(R.with_explanation(body, out.explanation, choice.prompt_ids) if req.explain else body)
        completion_tokens = sum(len(o.token_ids) for o in outs)
        return R.envelope(
            "text_completion",
            prepared.response_id,
            prepared.created,
            prepared.model_name,
            choices,
            R.usage(prepared.prompt_tokens, completion_tokens, R.cached_tokens(outs)),
        )

    async def beam_response(self, req: CompletionRequest, prepared: Prepared) -> dict:
        """use_beam_search: the n best beams of each prompt (beam width best_of or n), best first."""
        engine = self.serving.engine
        max_tokens = prepared.choices[0].params.max_tokens
        choices: list[dict] = []
        completion_tokens = 0
        for p_index, ids in enumerate(prepared.prompt_ids):
            beams = await beam_search_async(
                engine,
                ids,
                req.beam_width,
                max_tokens,
                req.length_penalty,
                req.early_stopping,
                req.n,
                prepared.client,
                prepared.choices[0].params.lora,
            )
            prefix = prepared.prompt_texts[p_index] if req.echo else ""
            for beam in beams:
                ended = beam.token_ids[-1] in engine.eos_token_ids
                choices.append(
                    {
                        "index": len(choices),
                        "text": prefix + beam.text,
                        "logprobs": None,
                        "finish_reason": "stop" if ended else "length",
                        "stop_reason": None,
                        "cumulative_logprob": beam.cumulative_logprob,
                        "score": beam.score,
                    }
                )
                completion_tokens += len(beam.token_ids)
        return R.envelope(
            "text_completion",
            prepared.response_id,
            prepared.created,
            prepared.model_name,
            choices,
            R.usage(prepared.prompt_tokens, completion_tokens),
        )

    def stream(self, req: CompletionRequest, prepared: Prepared) -> AsyncGenerator[str, None]:
        """SSE events: the echoed prompts (if asked), one chunk per delta, usage if asked, [DONE]."""
        offsets = [0] * len(prepared.choices)
        opening = []
        if req.echo:
            for c in prepared.choices:
                text = prepared.prompt_texts[c.prompt_index]
                offsets[c.index] = len(text)
                opening.append({"index": c.index, "text": text, "logprobs": None, "finish_reason": None})

        def choice_of(index: int, delta: StepDelta) -> dict:
            logprobs = self._logprobs(req, delta.new_token_ids, delta.logprobs, offsets[index])
            offsets[index] += len(delta.text_delta)
            return {
                "index": index,
                "text": delta.text_delta,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason if delta.finished else None,
            }

        return self.serving.stream_events(prepared, "text_completion", req.include_usage, opening, choice_of)
