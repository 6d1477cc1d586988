"""The OpenAI endpoints' logic on AsyncLLMEngine: requests in, response dicts / SSE chunks out.

A request with P prompts and n samples becomes P x n engine requests ("choices",
indexed prompt-major like OpenAI), each with its own request id and seed
(seed + sample index). All validation happens before anything is queued or any
byte is streamed, so a bad request is always a clean 4xx. Preparing a request
(tokenizing, chat templating, compiling a grammar) runs on a small worker pool,
never on the event loop, bounded in how many wait (then 429) and how long one
may take (then 408).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, nullcontext
from dataclasses import dataclass, field
from typing import TypeVar

import jinja2

from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.entrypoints.server import responses as R
from tokenloom.entrypoints.server.admission import Admission, AdmissionLimits, PerClientTurns, Ticket, server_busy
from tokenloom.entrypoints.server.chat_tools import ChatFeatures, ChatTurn, chat_turn, tool_constraint
from tokenloom.entrypoints.server.long_texts import LongTexts
from tokenloom.entrypoints.server.metrics import ServerMetrics
from tokenloom.entrypoints.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, param_named_in
from tokenloom.entrypoints.server.streams import ClientDisconnected, ShuttingDown, merge, unless_disconnected
from tokenloom.outputs import CompletionOutput, RequestError, StepDelta
from tokenloom.sampling_params import SamplingParams
from tokenloom.structured import StructuredOutput
from tokenloom.tokenizer import ChatTemplateError, TooManyTokens


@dataclass(slots=True)
class Choice:
    """One engine request behind one OpenAI choice."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class Prepared:
    """A validated request, ready to run."""

    response_id: str
    created: int
    prompt_texts: list[str]
    prompt_ids: list[list[int]]
    choices: list[Choice]
    ticket: Ticket | None = None  # its admission (serving.admit); released when it ends
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None  # for the request log (middleware.AccessLog)
    completion_tokens: int = 0
    tool_mode: str = "none"  # chat: none | auto | required (server/chat_tools.py)
    tool_functions: list[dict] = field(default_factory=list)  # chat: the tools the reply may call
    outcome: str | None = None  # how a stream that began ended short: cut_at_shutdown | failed | client_left
    model_name: str = ""  # the name replies give: the model's, or the LoRA adapter's the request named

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompt_ids)

    @property
    def client(self) -> str | None:
        """The client it runs for (its turns in the engine's steps: engine/fair_share.py)."""
        return None if self.ticket is None else self.ticket.client

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started

    def count(self, delta: StepDelta) -> None:
        """Note a delta's new tokens (and when the first came)."""
        if delta.new_token_ids:
            self.completion_tokens += len(delta.new_token_ids)
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter()


PREPARE_WORKERS = 2  # threads that tokenize, template and compile grammars
PREPARE_WORKERS_PER_CLIENT = 1  # of those, what one client's requests use at once (the rest wait)
MAX_PREPARING = 64  # requests being prepared or waiting for a worker, at most
MAX_PREPARING_PER_CLIENT = 32  # of those, one client's: its burst leaves the others room
PREPARE_TIMEOUT_S = 30.0

_Req = TypeVar("_Req")
_Result = TypeVar("_Result")


def _lower_priority() -> None:
    """Run this worker thread at nice 10 (Linux: a thread is a task with its own nice value): a
    client's 4 MB prompt then tokenizes on the cores the engine leaves, instead of taking one
    from the running batch (at normal priority it slowed the batch's decode several-fold:
    docs/BENCHMARKS.md, 'Measurements behind design choices')."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):  # not Linux, or not permitted: normal priority
        pass


def prepare_workers() -> ThreadPoolExecutor:
    """The threads that prepare requests (tokenizing, templating, compiling grammars), at nice 10."""
    return ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="tokenloom-prepare", initializer=_lower_priority)


IGNORED_FIELDS_HEADER = "X-Tokenloom-Ignored-Fields"
log = logging.getLogger("tokenloom.entrypoints.server")


def client_of(user: str | None, request) -> str:
    """Who a request is from, for turns between clients: its ``user`` field, else its address."""
    if user:
        return f"user:{user}"
    return f"addr:{request.client.host if request.client else ''}"


def ignored_fields_header(names: list[str], path: str) -> dict[str, str]:
    """Request fields (or options) this server does not use, named in a warning and in a response
    header, not silently dropped; {} when there are none."""
    if not names:
        return {}
    log.warning("%s: ignored the request fields this server does not know: %s", path, ", ".join(names))
    return {IGNORED_FIELDS_HEADER: ", ".join(names)}


def size_param(n: int, num_prompts: int, prompt_param: str = "prompt") -> str:
    """The parameter a too-large request is named by: n, unless it is 1 and there are many prompts."""
    return "n" if n > 1 or num_prompts == 1 else prompt_param


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class OpenAIServing:
    """Shared by /v1/completions and /v1/chat/completions."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        model_name: str,
        metrics: ServerMetrics,
        limits: AdmissionLimits | None = None,
        chat_features: ChatFeatures | None = None,
        workers: ThreadPoolExecutor | None = None,
    ) -> None:
        """`workers`: the pool that prepares requests, shared with the server's other models
        (None: a pool of its own, shut down by close())."""
        self.engine = engine
        self.chat_features = chat_features or ChatFeatures.for_template(engine.tokenizer.chat_template)
        self.admission = Admission(limits or AdmissionLimits())
        self.own_workers = workers is None
        self.workers = workers or prepare_workers()
        self.cut = asyncio.Event()  # set when a graceful shutdown's time is up (begin_shutdown)
        self.preparing = 0
        self.preparing_turns = PerClientTurns(PREPARE_WORKERS_PER_CLIENT)
        self.tokenizer = engine.tokenizer
        self.long_texts = LongTexts(self.tokenizer)  # closed with the workers (app.py's lifespan)
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.context_shift = engine.context_shift  # max_tokens may run past the context
        self.metrics = metrics
        self.fmt = R.LogprobFormatter(self.tokenizer)

    def busy(self) -> bool:
        """Whether a request of this model is being prepared, admitted or in its engine."""
        return self.preparing > 0 or self.admission.pending_seqs > 0 or self.engine.has_requests()

    def close(self) -> None:
        """Stop its tokenizer processes and (its own) prepare workers; after its engine's close."""
        self.long_texts.close()
        if self.own_workers:
            self.workers.shutdown(wait=False, cancel_futures=True)

    # ---- validation --------------------------------------------------------------------------
    def _max_tokens(
        self, requested: int | None, prompt_len: int, prompt_param: str, max_tokens_param: str = "max_tokens"
    ) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise self.prompt_too_long(prompt_len, prompt_param)
        if self.context_shift:  # a full context shifts: the reply is not bounded by it
            room = max(room, self.admission.limits.default_max_tokens, requested or 0)
        if requested is None:  # the server's default, within the room
            return min(room, self.admission.limits.default_max_tokens)
        if requested > room:
            raise APIError(
                400,
                f"this model's context length is {self.max_model_len} tokens: {prompt_len} in the "
                f"prompt leave room for {room}, but {max_tokens_param} is {requested}",
                max_tokens_param,
            )
        return requested

    def model_card(self) -> dict:
        """The model as /v1/models lists it."""
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tokenloom",
            "max_model_len": self.max_model_len,
            "default_max_tokens": self.admission.limits.default_max_tokens,
        }

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.engine.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary (size {vocab})", param)

    def prompt_too_long(self, prompt_len: int, param: str) -> APIError:
        return APIError(
            400,
            f"the prompt has {prompt_len} tokens but this model's context length is {self.max_model_len}; shorten it",
            param,
        )

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids; APIError where they cannot leave room for one new token (told before
        the ids are listed: Tokenizer.encode's limit). Long texts tokenize in a child process
        (long_texts.py: freeing one holds the GIL)."""
        try:
            return self.long_texts.encode(text, add_special_tokens, limit=self.max_model_len - 1)
        except TooManyTokens as e:
            raise self.prompt_too_long(e.count, param) from None

    def input_ids(self, prompt: str | list[int], param: str) -> list[int]:
        """A prompt's token ids (text is tokenized, ids checked); APIError if it is empty."""
        if isinstance(prompt, str):
            ids = self.encode(prompt, param)
        else:
            self.check_token_ids(prompt, param)
            ids = list(prompt)
        if not ids:
            raise APIError(400, "the prompt is empty", param)
        return ids

    def _prepare(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        prefix: str,
        prompts: list[str | list[int]],
        prompt_param: str,
        max_tokens: int | None,
        logprobs: int | None,
        max_tokens_param: str = "max_tokens",
        constraint: tuple[StructuredOutput | None, str] | None = None,
    ) -> Prepared:
        """Validate `req` and make its choices; `constraint`: (structured output, the parameter it
        comes from) in place of the request's own (the tools' grammar)."""
        structured, constraint_param = constraint or req.structured_output()
        adapter = self.adapter_named(req.model)
        if structured is not None:
            try:
                self.engine.check_constraint(structured)
            except ValueError as e:
                raise APIError(400, str(e), constraint_param) from None
        texts: list[str] = []
        all_ids: list[list[int]] = []
        choices: list[Choice] = []
        for p_index, prompt in enumerate(prompts):
            ids = self.input_ids(prompt, prompt_param)
            base = req.sampling_params(
                self._max_tokens(max_tokens, len(ids), prompt_param, max_tokens_param),
                logprobs,
                req.logprobs if getattr(req, "scores_prompt", False) else None,
                structured,
                self.engine.sampling_defaults,
            )
            if adapter is not None:
                base = dataclasses.replace(base, lora=adapter)
            for sample in range(req.n):
                params = base.for_sample(sample)
                try:
                    self.engine.validate_request(ids, params)
                except ValueError as e:  # the params' own field when it names one (logit_bias ids)
                    raise APIError(400, str(e), param_named_in(str(e)) or prompt_param) from None
                choices.append(Choice(len(choices), p_index, ids, params))
            texts.append(prompt if isinstance(prompt, str) else self.tokenizer.decode(ids, skip_special_tokens=False))
            all_ids.append(ids)
        name = adapter or self.model_name
        return Prepared(f"{prefix}-{uuid.uuid4().hex}", R.now(), texts, all_ids, choices, model_name=name)

    def adapter_named(self, name: str | None) -> str | None:
        """`name` where it is one of this engine's LoRA adapters (a request's `model`), else None."""
        if not name or not self.engine.lora_enabled:
            return None
        return name if any(ref.name == name for ref in self.engine.loras()) else None

    def prepare_completion(self, req: CompletionRequest) -> Prepared:
        req.check_limits()
        prompts = req.prompts()
        self._check_request(req, len(prompts), "prompt")
        return self._prepare(req, "cmpl", prompts, "prompt", req.max_tokens, req.logprobs)

    def _check_request(
        self, req: CompletionRequest | ChatCompletionRequest, num_prompts: int, prompt_param: str
    ) -> None:
        """What can be refused before any tokenizing or templating."""
        req.check_supported()
        self.admission.check_size(num_prompts * req.n, size_param(req.n, num_prompts, prompt_param))

    def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        req.check_limits()
        self._check_request(req, 1, "messages")
        turn = chat_turn(req, self.chat_features)
        constraint = req.structured_output()
        if constraint[0] is None:
            tools_grammar = tool_constraint(
                turn.mode, turn.functions, self.chat_features, self.engine, req.parallel_calls
            )
            constraint = (tools_grammar, "tools") if tools_grammar is not None else constraint
        elif turn.mode != "none":
            raise APIError(
                400,
                "tools with response_format or guided_* are not supported together: the "
                "tools' grammar already constrains the reply (or set tool_choice none)",
                "tools",
            )
        if (turn.mode != "none" or self.chat_features.reasoning) and self.chat_features.decode_with_markers(
            self.tokenizer
        ):
            req = req.model_copy(update={"skip_special_tokens": False})
        prompt = self.chat_prompt(req, turn=turn)
        ids = self.encode(prompt, "messages", add_special_tokens=False)
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        prepared = self._prepare(
            req, "chatcmpl", [ids], "messages", req.requested_max_tokens(), req.num_logprobs(), max_param, constraint
        )
        prepared.prompt_texts = [prompt]
        prepared.tool_mode = turn.mode
        prepared.tool_functions = turn.functions
        return prepared

    def chat_prompt(
        self, req: ChatCompletionRequest, add_generation_prompt: bool = True, turn: ChatTurn | None = None
    ) -> str:
        """The request's conversation (and tools) rendered by the model's chat template."""
        turn = turn or chat_turn(req, self.chat_features)
        try:
            return self.tokenizer.apply_chat_template(
                turn.messages,
                add_generation_prompt=add_generation_prompt,
                tools=turn.template_tools,
                **(req.chat_template_kwargs or {}),
            )
        except (ChatTemplateError, jinja2.TemplateError, TypeError) as e:
            raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from None

    async def off_loop(self, prepare: Callable[[_Req], _Result], req: _Req, client: str = "") -> _Result:
        """``prepare(req)`` on the worker pool: the event loop keeps serving others meanwhile.
        A client's requests take PREPARE_WORKERS_PER_CLIENT workers at most (one client's 4 MB
        prompts or huge schemas wait for each other, not every other client behind them). 429
        when MAX_PREPARING requests are already being prepared or waiting, 408 past
        PREPARE_TIMEOUT_S, waiting included (a worker finishes that one and drops it).
        429 also when the client has MAX_PREPARING_PER_CLIENT requests there already."""
        if self.preparing >= MAX_PREPARING:
            raise server_busy(
                f"{self.preparing} requests are being prepared (tokenized, templated)",
                self.admission.limits.retry_after_s,
            )
        if self.preparing_turns.users(client) >= MAX_PREPARING_PER_CLIENT:
            raise server_busy(
                f"this client has {MAX_PREPARING_PER_CLIENT} requests being prepared already",
                self.admission.limits.retry_after_s,
            )
        self.preparing += 1

        async def prepare_in_turn() -> _Result:
            async with self.preparing_turns.turn(client):
                return await asyncio.get_running_loop().run_in_executor(self.workers, prepare, req)

        try:  # wait_for, not asyncio.timeout (3.11+): the turn's wait counts too
            return await asyncio.wait_for(prepare_in_turn(), PREPARE_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise APIError(
                408,
                f"preparing the request (tokenizing, chat template, grammar) took over {PREPARE_TIMEOUT_S:g} s",
                type="timeout_error",
            ) from None
        finally:
            self.preparing -= 1

    def admit(self, prepared: Prepared, client: str, sequences: int | None = None, param: str = "n") -> Prepared:
        """Count the request's sequences (its choices, or `sequences`) against the admission limits
        (admission.py), as `client`'s: APIError 400/429 if it may not run. The caller releases
        prepared.ticket."""
        seqs = sequences or len(prepared.choices)
        tokens = prepared.prompt_tokens * seqs // max(1, len(prepared.prompt_ids))
        prepared.ticket = self.admission.admit(seqs, tokens, param, client)
        return prepared

    # ---- running -----------------------------------------------------------------------------
    async def _tracked(self, prepared: Prepared, choice: Choice) -> AsyncGenerator[StepDelta, None]:
        """One choice's engine stream, once one of its request's turns is free (admission.py);
        records its metrics when it ends (aborted: 'abort')."""
        ticket = prepared.ticket
        async with (
            ticket.turns if ticket is not None else nullcontext(),  # the request's turn, then
            ticket.client_turn() if ticket is not None else nullcontext(),  # the client's,
            aclosing(self._run_choice(prepared, choice)) as stream,
        ):  # then it runs
            async for delta in stream:
                yield delta

    async def _run_choice(self, prepared: Prepared, choice: Choice) -> AsyncGenerator[StepDelta, None]:
        finished = False
        try:
            stream = self.engine.generate(
                choice.prompt_ids,
                choice.params,
                validated=True,  # in _prepare
                request_id=f"{prepared.response_id}-{choice.index}",
                client=prepared.client,
            )
            async with aclosing(stream):
                async for delta in stream:
                    prepared.count(delta)
                    if delta.finished:
                        finished = True
                        assert delta.completion is not None  # a finished delta carries its completion
                        self.metrics.record_finished(delta.finish_reason, delta.completion.metrics)
                    yield delta
        except RequestError:
            finished = True
            self.metrics.record_finished("error", None)
            raise
        finally:
            if not finished:
                self.metrics.record_finished("abort", None)

    def deltas(self, prepared: Prepared) -> AsyncGenerator[tuple[int, StepDelta], None]:
        """Every choice's deltas as (choice index, delta), interleaved as they come; ShuttingDown
        if the server's shutdown cuts them."""
        return merge([self._tracked(prepared, c) for c in prepared.choices], self.cut)

    def begin_shutdown(self, grace_s: float) -> None:
        """The server stops taking connections and gives those in flight `grace_s`: cut the
        requests still running just before that (they end with an error, streams with an error
        event and [DONE]) instead of having their connections dropped mid-response."""
        asyncio.get_running_loop().call_later(max(0.0, grace_s - 0.5), self.cut.set)

    async def run(self, prepared: Prepared) -> list[CompletionOutput]:
        """Run every choice to the end; the completions in choice order."""
        outs: list[CompletionOutput | None] = [None] * len(prepared.choices)
        async with aclosing(self.deltas(prepared)) as stream:
            async for index, delta in stream:
                if delta.finished:
                    outs[index] = delta.completion
        return outs  # type: ignore[return-value]

    async def run_admitted(self, prepared: Prepared, request) -> list[CompletionOutput] | None:
        """Run an admitted request whole unless its client leaves (None then); its admission ticket
        is released however it ends."""
        assert prepared.ticket is not None
        try:
            return await unless_disconnected(self.run(prepared), request)
        except ClientDisconnected:
            return None
        finally:
            prepared.ticket.release()

    async def stream_events(
        self,
        prepared: Prepared,
        kind: str,
        include_usage: bool,
        opening: list[dict],
        choice_of: Callable[[int, StepDelta], dict],
    ) -> AsyncGenerator[str, None]:
        """The SSE stream of one response: a chunk per opening choice dict, then one per delta
        that carries text, logprobs or the finish (``choice_of(index, delta)`` shapes it), a
        usage chunk if asked, and ``data: [DONE]``. Should the request fail in the engine, or the
        server cut it at shutdown, an error event (OpenAI's error shape) and ``data: [DONE]`` end
        the stream instead."""

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            body = R.envelope(kind, prepared.response_id, prepared.created, prepared.model_name, choices)
            if include_usage:
                body["usage"] = usage
            return sse(body)

        for choice in opening:
            yield chunk([choice])
        completion_tokens = cached = 0
        explained = bool(prepared.choices[0].params.explain)
        unseen = {c.index for c in prepared.choices}  # choices yet to receive their prompt ids
        try:
            async with aclosing(self.deltas(prepared)) as stream:
                async for index, delta in stream:
                    completion_tokens += len(delta.new_token_ids)
                    if delta.finished and delta.completion is not None:
                        cached += R.cached_tokens([delta.completion])
                    if delta.text_delta or delta.finished or delta.logprobs is not None or delta.explanation:
                        choice = choice_of(index, delta)
                        if explained:
                            first = index in unseen
                            unseen.discard(index)
                            R.with_explanation(
                                choice, delta.explanation, prepared.choices[index].prompt_ids if first else None
                            )
                        yield chunk([choice])
        except (RequestError, ShuttingDown) as e:  # failed in the engine, or cut at shutdown: say so, then end
            prepared.outcome = "cut_at_shutdown" if isinstance(e, ShuttingDown) else "failed"
            yield sse((shutting_down(e) if isinstance(e, ShuttingDown) else request_failed(e)).body())
            yield sse("[DONE]")
            return
        except GeneratorExit:  # the client left mid-stream (the log says so: status 200)
            prepared.outcome = "client_left"
            raise
        if include_usage:
            yield chunk([], R.usage(prepared.prompt_tokens, completion_tokens, cached))
        yield sse("[DONE]")


def shutting_down(error: ShuttingDown) -> APIError:
    return APIError(503, str(error), type="server_error", code="server_shutdown")


def request_failed(error: RequestError) -> APIError:
    """The answer to a request that failed inside the engine (nobody else's request did)."""
    return APIError(500, f"the request failed in the engine: {error}", type="server_error", code="request_failed")
