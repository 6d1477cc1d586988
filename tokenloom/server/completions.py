"""POST /v1/completions: whole responses and SSE streams in OpenAI's text_completion shape."""

from __future__ import annotations

from collections.abc import AsyncIterator

from tokenloom.outputs import CompletionOutput
from tokenloom.server import responses as R
from tokenloom.server.protocol import CompletionRequest
from tokenloom.server.serving import OpenAIServing, Prepared, sse


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
            choices.append({"index": choice.index, "text": prefix + out.text,
                            "logprobs": self._logprobs(req, out.token_ids, out.logprobs, 0),
                            "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
        completion_tokens = sum(len(o.token_ids) for o in outs)
        return R.envelope("text_completion", prepared.response_id, prepared.created, self.serving.model_name,
                          choices, R.usage(prepared.prompt_tokens, completion_tokens))

    async def stream(self, req: CompletionRequest, prepared: Prepared) -> AsyncIterator[str]:
        """SSE events: one chunk per delta (echoed prompt first), a usage chunk if asked, then [DONE]."""
        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body = R.envelope("text_completion", prepared.response_id, prepared.created,
                              self.serving.model_name, choices)
            if req.include_usage:
                body["usage"] = usage
            return sse(body)

        offsets = [0] * len(prepared.choices)
        if req.echo:
            for c in prepared.choices:
                text = prepared.prompt_texts[c.prompt_index]
                offsets[c.index] = len(text)
                yield chunk([{"index": c.index, "text": text, "logprobs": None, "finish_reason": None}])
        completion_tokens = 0
        async for index, delta in self.serving.deltas(prepared):
            completion_tokens += len(delta.new_token_ids)
            if not (delta.text_delta or delta.finished or delta.logprobs is not None):
                continue
            logprobs = self._logprobs(req, delta.new_token_ids, delta.logprobs, offsets[index])
            offsets[index] += len(delta.text_delta)
            yield chunk([{"index": index, "text": delta.text_delta, "logprobs": logprobs,
                          "finish_reason": delta.finish_reason if delta.finished else None}])
        if req.include_usage:
            yield chunk([], R.usage(prepared.prompt_tokens, completion_tokens))
        yield sse("[DONE]")
