"""POST /v1/chat/completions: whole responses and SSE streams in OpenAI's chat.completion shape."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from tokenloom.entrypoints.server import responses as R
from tokenloom.entrypoints.server.chat_tools import ReplyStream, finish_reason, read_reply
from tokenloom.entrypoints.server.protocol import ChatCompletionRequest
from tokenloom.entrypoints.server.serving import OpenAIServing, Prepared
from tokenloom.outputs import CompletionOutput, StepDelta


class ChatCompletions:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def _logprobs(self, req: ChatCompletionRequest, token_ids: list[int], logprobs) -> dict | None:
        if not req.logprobs:
            return None
        return self.serving.fmt.chat(token_ids, logprobs or [], req.top_logprobs or 0)

    def response(self, req: ChatCompletionRequest, prepared: Prepared, outs: list[CompletionOutput]) -> dict:
        """The whole chat.completion: each reply read into content, reasoning_content and tool_calls."""
        choices = []
        features = self.serving.chat_features
        for c, out in zip(prepared.choices, outs):
            reply = read_reply(
                out.text,
                prepared.prompt_texts[0],
                prepared.tool_mode,
                features,
                out.finish_reason == "length",
                prepared.tool_functions,
            )
            body = {
                "index": c.index,
                "message": reply.message(),
                "logprobs": self._logprobs(req, out.token_ids, out.logprobs),
                "finish_reason": finish_reason(out.finish_reason, bool(reply.tool_calls)),
                "stop_reason": out.stop_reason,
            }
            choices.append(R.with_explanation(body, out.explanation, c.prompt_ids) if req.explain else body)
        completion_tokens = sum(len(o.token_ids) for o in outs)
        return R.envelope(
            "chat.completion",
            prepared.response_id,
            prepared.created,
            prepared.model_name,
            choices,
            R.usage(prepared.prompt_tokens, completion_tokens, R.cached_tokens(outs)),
        )

    def stream(self, req: ChatCompletionRequest, prepared: Prepared) -> AsyncGenerator[str, None]:
        """SSE events: a role chunk per choice, one chunk per delta (content, reasoning_content and
        tool_calls deltas as OpenAI streams them), usage if asked, [DONE]."""
        opening = [
            {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for c in prepared.choices
        ]
        readers = [
            ReplyStream(
                prepared.prompt_texts[0], prepared.tool_mode, self.serving.chat_features, prepared.tool_functions
            )
            for _ in prepared.choices
        ]

        def choice_of(index: int, delta: StepDelta) -> dict:
            reader = readers[index]
            cut = delta.finished and delta.finish_reason == "length"
            return {
                "index": index,
                "delta": reader.feed(delta.text_delta, delta.finished, cut),
                "logprobs": self._logprobs(req, delta.new_token_ids, delta.logprobs),
                "finish_reason": finish_reason(delta.finish_reason, reader.has_calls) if delta.finished else None,
            }

        return self.serving.stream_events(prepared, "chat.completion.chunk", req.include_usage, opening, choice_of)
