"""ollama's API requests (github.com/ollama/ollama, docs/api.md) read into the OpenAI requests the
server already prepares: /api/chat becomes a ChatCompletionRequest, /api/generate a chat turn (or,
with ``raw``, a CompletionRequest); ``options`` map onto the sampling fields, ``format`` onto
response_format, ``think`` onto the template's enable_thinking. What ollama accepts but tokenloom
does not do is an error naming it; load-time options (num_ctx, num_thread, ...) are the server's
to set and are named back as ignored (ollama ignores options a runner does not use too).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tokenloom.entrypoints.server.load_policy import duration_seconds
from tokenloom.entrypoints.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

REQUEST = ConfigDict(extra="allow")  # ollama clients send fields of newer versions: kept aside and named

# ollama option -> the OpenAI request field it sets
SAMPLING_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "typical_p": "typical_p",
    "seed": "seed",
    "stop": "stop",
    "num_predict": "max_tokens",
    "repeat_penalty": "repetition_penalty",
    "repeat_last_n": "repeat_last_n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "mirostat": "mirostat",
    "mirostat_tau": "mirostat_tau",
    "mirostat_eta": "mirostat_eta",
}
# options that choose how a model is loaded and run: the server's command line sets those
LOAD_OPTIONS = frozenset(
    {
        "num_ctx",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "num_thread",
        "use_mmap",
        "use_mlock",
        "numa",
        "low_vram",
        "vocab_only",
        "num_keep",
        "f16_kv",
        "logits_all",
    }
)


class OllamaToolCall(BaseModel):
    model_config = REQUEST
    function: dict[str, Any]  # {"name": ..., "arguments": {...}}


class OllamaMessage(BaseModel):
    model_config = REQUEST
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None  # a tool message: the function whose result it is
    thinking: str | None = None  # an assistant message: its reasoning


class _Common(BaseModel):
    model_config = REQUEST
    model: str
    format: Literal["json", ""] | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: str | int | float | None = None
    think: bool | Literal["low", "medium", "high"] | None = None


class OllamaChatRequest(_Common):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


class OllamaGenerateRequest(_Common):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class OllamaEmbedRequest(BaseModel):
    model_config = REQUEST
    model: str
    input: str | list[str]
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: str | int | float | None = None
    dimensions: int | None = None


def keep_alive_seconds(value: str | int | float | None) -> float | None:
    """ollama's keep_alive in seconds (load_policy.duration_seconds); None: the server's default.
    APIError 400 for what is not a duration."""
    if value is None:
        return None
    try:
        return duration_seconds(value)
    except ValueError as e:
        raise APIError(400, f"keep_alive: {e}", "keep_alive") from None


def no_images(images: list[str] | None, param: str) -> None:
    if images:
        raise APIError(400, "images are not supported: tokenloom serves text models (vision is not implemented)", param)


def sampling_fields(req: _Common) -> tuple[dict[str, Any], list[str]]:
    """The OpenAI fields `req`'s options and format set, and the load-time options it named (ignored
    here). APIError for an option ollama does not have."""
    fields: dict[str, Any] = {"stream": req.stream}
    ignored: list[str] = []
    for name, value in (req.options or {}).items():
        if name in LOAD_OPTIONS:
            ignored.append(f"options.{name}")
        elif name not in SAMPLING_OPTIONS:
            raise APIError(400, f"options.{name} is not an option this server knows", f"options.{name}")
        elif name == "num_predict" and isinstance(value, int) and value < 0:
            pass  # -1 (until a stop) and -2 (fill the context): the server's default length
        else:
            fields[SAMPLING_OPTIONS[name]] = value
    if req.format == "json":
        fields["response_format"] = {"type": "json_object"}
    elif isinstance(req.format, dict):
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": req.format}}
    if req.think is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": bool(req.think)}
    return fields, ignored


def _openai_message(m: OllamaMessage, index: int) -> dict[str, Any]:
    """One ollama message as OpenAI's: tool calls with JSON-text arguments and ids, tool results
    named by their function."""
    no_images(m.images, f"messages[{index}].images")
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        calls = []
        for j, call in enumerate(m.tool_calls):
            fn = call.function
            if not isinstance(fn.get("name"), str):
                raise APIError(400, "a tool call needs function.name", f"messages[{index}].tool_calls")
            arguments = fn.get("arguments", {})
            text = arguments if isinstance(arguments, str) else json.dumps(arguments)
            calls.append(
                {"id": f"call_{index}_{j}", "type": "function", "function": {"name": fn["name"], "arguments": text}}
            )
        out["tool_calls"] = calls
    if m.role == "tool" and m.tool_name:
        out["name"] = m.tool_name
    if m.thinking:
        out["reasoning_content"] = m.thinking
    return out


def _validated(cls, body: dict[str, Any], renames: dict[str, str]):
    """`cls` validated from `body`; a bad value is an APIError naming the ollama field."""
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        param = renames.get(loc[0], loc[0]) if loc else None
        raise APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param) from None


def _renames() -> dict[str, str]:
    return {field: f"options.{option}" for option, field in SAMPLING_OPTIONS.items()} | {"response_format": "format"}


def chat_request(req: OllamaChatRequest) -> tuple[ChatCompletionRequest, list[str]]:
    """/api/chat as a chat completion request, and the options it ignores."""
    if not req.messages:
        raise APIError(400, "messages is empty", "messages")
    fields, ignored = sampling_fields(req)
    body = fields | {"model": req.model, "messages": [_openai_message(m, i) for i, m in enumerate(req.messages)]}
    if req.tools:
        body["tools"] = req.tools
    return _validated(ChatCompletionRequest, body, _renames()), ignored


def generate_request(req: OllamaGenerateRequest) -> tuple[ChatCompletionRequest | CompletionRequest, list[str]]:
    """/api/generate as a chat turn (system, then the prompt as the user's message) or, with raw, a
    plain completion of the prompt; and the options it ignores."""
    no_images(req.images, "images")
    for name, value in (("suffix", req.suffix), ("template", req.template), ("context", req.context)):
        if value:
            what = {
                "suffix": "fill-in-the-middle (suffix) is not implemented",
                "template": "a per-request template is not implemented: the model's chat template is used",
                "context": "context (the token list of an earlier reply) is not supported: send the turns to /api/chat",
            }[name]
            raise APIError(400, what, name)
    fields, ignored = sampling_fields(req)
    if req.raw:
        fields.pop("chat_template_kwargs", None)
        if req.system:
            raise APIError(400, "system is not used with raw (the prompt is sent as it is)", "system")
        return _validated(CompletionRequest, fields | {"model": req.model, "prompt": req.prompt}, _renames()), ignored
    messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
        {"role": "user", "content": req.prompt}
    ]
    return _validated(ChatCompletionRequest, fields | {"model": req.model, "messages": messages}, _renames()), ignored


def unknown(req: BaseModel) -> list[str]:
    """Top-level fields of an ollama request this server does not know."""
    return sorted(req.model_extra or ())
