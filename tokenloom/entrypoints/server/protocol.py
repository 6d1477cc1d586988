"""OpenAI request schemas (pydantic) and their translation into SamplingParams.

Field names, defaults and ranges follow OpenAI's API reference, plus vLLM's
extensions (top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
stop_token_ids). Unknown fields are ignored, as OpenAI's SDKs may send more
than a server knows, and named in a warning and the X-Tokenloom-Ignored-Fields
response header. Types are strict: "16", true or 1.5 for an integer and
"0.5" for a number are refused, not coerced. Anything the engine cannot honour
is an APIError naming the parameter, never a silent default.

The rest of the sampler chain takes vLLM's and llama-server's names: typical_p, top_n_sigma,
epsilon_cutoff, eta_cutoff, xtc_probability, xtc_threshold, mirostat (+ _tau, _eta),
no_repeat_ngram_size, bad_words, repetition_penalty_range (llama-server's repeat_last_n /
penalty_last_n: -1 all, 0 no penalties), dry_multiplier, dry_base, dry_allowed_length,
dry_penalty_last_n, dry_sequence_breakers, and samplers (the filters' order, a list or
"a;b;c").

Bounds on what one request may ask for (each a 400 naming the parameter beyond
it): its sequences (prompts x n x beams) the server's --max-seqs-per-request,
MAX_STOP_STRINGS stop strings of at most MAX_STOP_CHARS characters,
MAX_STOP_TOKEN_IDS stop token ids, MAX_LOGIT_BIAS logit_bias entries, MAX_WORDS
bad_words / dry_sequence_breakers of at most MAX_STOP_CHARS characters, seeds in
[0, 2**64), |length_penalty| <= 10, text free of lone UTF-16 surrogates.
"""

from __future__ import annotations

import json
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from tokenloom.entrypoints.server.errors import APIError
from tokenloom.sampling.defaults import FALLBACK, SamplingDefaults
from tokenloom.sampling_params import SEED_LIMIT, SamplingParams
from tokenloom.structured import StructuredOutput
from tokenloom.tool_calling.messages import function_of

MAX_STOP_STRINGS = 64  # each is matched against the text after every token
MAX_STOP_CHARS = 1000
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_WORDS = 64  # bad_words and dry_sequence_breakers, each
CHAIN_FIELDS = (
    "typical_p",
    "top_n_sigma",
    "epsilon_cutoff",
    "eta_cutoff",
    "xtc_probability",
    "xtc_threshold",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "no_repeat_ngram_size",
    "bad_words",
    "dry_multiplier",
    "dry_base",
    "dry_allowed_length",
    "dry_penalty_last_n",
    "dry_sequence_breakers",
    "samplers",
)
STRICT = ConfigDict(extra="ignore", strict=True)
# A request's own fields: unknown ones are kept aside (model_extra) so the server can name them.
REQUEST = ConfigDict(extra="allow", strict=True)


def unknown_fields(req: BaseModel) -> list[str]:
    """The top-level fields of a request that this server does not know (and so ignores)."""
    return sorted(req.model_extra or ())


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str


class _Sampling(BaseModel):
    """Parameters shared by completions and chat completions."""

    model_config = REQUEST

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    n: int = Field(default=1, ge=1)  # bounded by the server's --max-seqs-per-request (admission.py)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=0, lt=SEED_LIMIT)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's extensions
    guided_regex: str | None = None
    guided_grammar: str | None = None  # Lark syntax
    explain: int | None = Field(default=None, ge=1, le=100)  # tokenloom: per-token StepRecords, N candidates
    # the rest of the sampler chain (SamplingParams checks the ranges and names the field)
    typical_p: float | None = None
    top_n_sigma: float | None = None
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    mirostat: int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    no_repeat_ngram_size: int | None = None
    bad_words: list[str] | None = None
    repetition_penalty_range: int | None = None
    repeat_last_n: int | None = None  # llama-server's name (and penalty_last_n)
    penalty_last_n: int | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    samplers: list[str] | str | None = None

    def check_limits(self) -> None:
        """The request's size bounds (module doc), checked before anything else reads it."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        limits = [
            ("stop", len(stops) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings"),
            (
                "stop",
                all(len(s) <= MAX_STOP_CHARS for s in stops),
                f"stop strings of at most {MAX_STOP_CHARS} characters",
            ),
            (
                "stop_token_ids",
                len(self.stop_token_ids or ()) <= MAX_STOP_TOKEN_IDS,
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids",
            ),
            (
                "logit_bias",
                len(self.logit_bias or ()) <= MAX_LOGIT_BIAS,
                f"at most {MAX_LOGIT_BIAS} logit_bias entries",
            ),
        ]
        for name in ("bad_words", "dry_sequence_breakers"):
            words = getattr(self, name) or []
            limits.append(
                (
                    name,
                    len(words) <= MAX_WORDS and all(len(w) <= MAX_STOP_CHARS for w in words),
                    f"at most {MAX_WORDS} {name} of at most {MAX_STOP_CHARS} characters",
                )
            )
        for param, ok, rule in limits:
            if not ok:
                raise APIError(400, f"{param}: this server takes {rule}", param)
        where = lone_surrogate(self.model_dump(exclude_none=True))
        if where is not None:
            raise APIError(
                400,
                f"{where} holds a lone UTF-16 surrogate (e.g. \\ud800 without its pair): text must be valid Unicode",
                where.split(".")[0].split("[")[0],
            )

    def structured_output(self) -> tuple[StructuredOutput | None, str]:
        """The constraint asked for (at most one) and the parameter that asked."""
        asked = []
        rf = self.response_format
        if rf is not None and rf.type != "text":
            asked.append(("response_format", _from_response_format(rf)))
        if self.guided_json is not None:
            asked.append(("guided_json", lambda: StructuredOutput.json(self.guided_json)))
        if self.guided_regex is not None:
            asked.append(("guided_regex", lambda: StructuredOutput.regex(self.guided_regex)))
        if self.guided_grammar is not None:
            asked.append(("guided_grammar", lambda: StructuredOutput.grammar(self.guided_grammar)))
        if len(asked) > 1:
            raise APIError(400, f"give one of {', '.join(a for a, _ in asked)}, not several", asked[1][0])
        if not asked:
            return None, ""
        param, make = asked[0]
        try:
            return make(), param
        except ValueError as e:
            raise APIError(400, str(e), param) from None

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings)", "logit_bias") from None

    def _chain_settings(self) -> dict[str, Any]:
        """The chain's fields that were given, the penalty window under any of its three names."""
        given = {name: getattr(self, name) for name in CHAIN_FIELDS if getattr(self, name) is not None}
        windows = {
            name: value
            for name in ("repetition_penalty_range", "repeat_last_n", "penalty_last_n")
            if (value := getattr(self, name)) is not None
        }
        if len(windows) > 1:
            raise APIError(400, f"give one of {', '.join(windows)}, not several", list(windows)[1])
        for name, window in windows.items():
            if name != "repetition_penalty_range" and window < -1:
                raise APIError(400, f"{name} must be -1 (the whole context), 0 (no penalties) or a token count", name)
            if name == "repetition_penalty_range":
                given[name] = window
            elif window == 0:  # llama.cpp: 0 turns the penalties off
                given.update(repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
            else:
                given["repetition_penalty_range"] = 0 if window == -1 else window
        return given

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured_output: StructuredOutput | None = None,
        defaults: SamplingDefaults = FALLBACK,
    ) -> SamplingParams:
        """SamplingParams for one choice, constrained by `structured_output` (what structured_output()
        gave, or the tools' grammar), settings left out taken from `defaults` (the model's, else
        llama.cpp's); ValueError from SamplingParams becomes a 400 naming the field."""
        if isinstance(self.stop, list) and any(not s for s in self.stop):
            raise APIError(400, "stop strings must be non-empty", "stop")
        set_fields = defaults.fill(
            {
                name: getattr(self, name)
                for name in (
                    "temperature",
                    "top_p",
                    "top_k",
                    "min_p",
                    "presence_penalty",
                    "frequency_penalty",
                    "repetition_penalty",
                )
            }
        )
        set_fields.update(self._chain_settings())
        try:
            return SamplingParams(
                **set_fields,
                max_tokens=max_tokens,
                min_tokens=min(self.min_tokens, max_tokens),
                stop=self.stop,
                stop_token_ids=self.stop_token_ids or [],
                seed=self.seed,
                logit_bias=self._logit_bias(),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                explain=self.explain,
                structured_output=structured_output,
            )
        except ValueError as e:
            raise APIError(400, str(e), param_named_in(str(e))) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string in `value` holding a lone UTF-16
    surrogate, which JSON can carry but no tokenizer can encode; None if there is none.

    One C-speed pass over every string first: walking 10^5 stop strings or an anyOf of 5,000
    schemas in Python held the GIL for a noticeable time on every such request, surrogate or
    not (docs/BENCHMARKS.md, 'Measurements behind design choices')."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return None
    except (TypeError, ValueError):  # a surrogate (UnicodeEncodeError), or not plain JSON values
        return _surrogate_path(value, path)


def _surrogate_path(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")  # C speed, also for a 4 MB prompt
            return None
        except UnicodeEncodeError:
            return path
    if isinstance(value, dict):
        items = ((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    return next((found for p, v in items if (found := _surrogate_path(v, p)) is not None), None)


def param_named_in(message: str) -> str | None:
    """'SamplingParams.top_p must ...' -> 'top_p'."""
    if message.startswith("SamplingParams."):
        return message.split(".", 1)[1].split(" ", 1)[0]
    return None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # 0: score the prompt (with echo + logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)  # beams: bounded as n is
    use_beam_search: bool = False  # vLLM's extension: beam width = best_of (or n)
    length_penalty: float = Field(default=1.0, ge=-10, le=10)
    early_stopping: bool | Literal["never"] = False

    def check_supported(self) -> None:
        if self.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported", "suffix")
        if self.use_beam_search:
            self._check_beam_search()
        elif self.best_of is not None and self.best_of != self.n:
            raise APIError(
                400, "best_of other than n needs use_beam_search (sampled best_of is not supported)", "best_of"
            )
        if self.max_tokens == 0 and not self.scores_prompt:
            raise APIError(
                400, "max_tokens must be >= 1 (0 only with echo and logprobs: scoring the prompt)", "max_tokens"
            )
        if self.scores_prompt and self.stream:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported when streaming", "stream")

    def _check_beam_search(self) -> None:
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, f"best_of ({self.best_of}) must be >= n ({self.n})", "best_of")
        for name, bad in [
            ("stream", self.stream),
            ("logprobs", self.logprobs is not None),
            ("explain", self.explain is not None),
            ("max_tokens", self.max_tokens == 0),
        ]:
            if bad:
                raise APIError(400, f"{name} is not supported with use_beam_search", name)

    @property
    def beam_width(self) -> int:
        return self.best_of or self.n

    @property
    def scores_prompt(self) -> bool:
        """echo + logprobs: the prompt's own tokens come back with their logprobs."""
        return self.echo and self.logprobs is not None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        return prompt_list(self.prompt, "prompt")


def prompt_list(value: str | list[str] | list[int] | list[list[int]], param: str) -> list[str | list[int]]:
    """OpenAI's one-or-many input (a text, texts, token ids, lists of token ids) as one entry per
    input; APIError naming `param` if there is none."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(400, f"{param} is empty", param)
    if all(isinstance(x, int) for x in value):
        return [list(cast("list[int]", value))]
    return list(cast("list[str | list[int]]", value))


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = STRICT
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallMessage(BaseModel):
    """A call in an assistant message sent back in the history."""

    model_config = STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant: the calls it made
    tool_call_id: str | None = None  # tool: the call this is the result of
    reasoning_content: str | None = None  # assistant: its reasoning, for templates that render it (Qwen3, Command R7B)

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments always follow the schema here


class ToolDefinition(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


MAX_TOOLS = 128  # OpenAI's own bound
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    metadata: dict[str, str] | None = None  # accepted, stored nowhere
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension (e.g. enable_thinking)

    def check_supported(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        reserved = sorted(set(self.chat_template_kwargs or ()) & set(RESERVED_TEMPLATE_KWARGS))
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")

    @property
    def parallel_calls(self) -> bool:
        """Several calls in one reply: parallel_tool_calls, except under a named tool_choice (one call)."""
        return self.parallel_tool_calls and not isinstance(self.tool_choice, NamedToolChoice)

    def tool_mode(self) -> tuple[str, list[dict[str, Any]]]:
        """("none" | "auto" | "required", the functions the reply may call: all tools, or the one
        named by tool_choice); APIError for tools or a tool_choice that cannot be honoured."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise APIError(400, "tool_choice needs tools", "tool_choice")
            return "none", []
        if len(self.tools) > MAX_TOOLS:
            raise APIError(400, f"at most {MAX_TOOLS} tools", "tools")
        try:
            functions = [function_of(t.model_dump(exclude_none=True), i) for i, t in enumerate(self.tools)]
        except ValueError as e:
            raise APIError(400, str(e), "tools") from None
        if isinstance(choice, NamedToolChoice):
            named = [f for f in functions if f["name"] == choice.function.name]
            if not named:
                raise APIError(
                    400, f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice"
                )
            return "required", named
        return choice or "auto", functions

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _from_response_format(rf: ResponseFormat):
    """OpenAI's response_format -> a StructuredOutput factory (APIError for a bad shape)."""
    if rf.type == "json_object":
        return lambda: StructuredOutput.json()
    if rf.type != "json_schema":
        raise APIError(
            400, f"response_format type must be text, json_object or json_schema, got {rf.type!r}", "response_format"
        )
    spec = (rf.model_extra or {}).get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, str)):
        raise APIError(400, "response_format json_schema needs {'name': ..., 'schema': {...}}", "response_format")
    return lambda: StructuredOutput.json(spec["schema"])
