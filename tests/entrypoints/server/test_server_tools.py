"""Tool calling through the real server with the real openai client, on Qwen2.5-Coder-0.5B-Instruct
(its chat template speaks the hermes format) and on the default model (SmolLM2, whose template has no
tools: the generic format): calls come back valid against their schemas, and replies end after them."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.helpers.browser_harness import offline_page, run_and_wait, set_controls, shot
from tests.helpers.server_harness import ThreadedServer
from tokenloom.loader import hub

QWEN = "qwen2.5-coder-0.5b"

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": WEATHER_SCHEMA,
    },
}
TIME_SCHEMA = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Za-z_]+$"}},
    "required": ["timezone"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "description": "The local time in an IANA time zone", "parameters": TIME_SCHEMA},
}
# WEATHER_SCHEMA (the README's) has no additionalProperties: like llama.cpp, the grammar takes that as false
SCHEMAS = {"get_weather": {**WEATHER_SCHEMA, "additionalProperties": False}, "get_time": TIME_SCHEMA}
ASK = [{"role": "user", "content": "What's the weather like in Paris today?"}]
LISBON = [{"role": "user", "content": "What's the weather like in Lisbon right now?"}]
TWO_CITIES = [{"role": "user", "content": "What is the weather in Paris and in Tokyo?"}]


@pytest.fixture(scope="module")
def base_url():
    if not hub.is_pulled(QWEN):
        pytest.skip(f"`tokenloom pull {QWEN}` has not run")
    from tokenloom import LLM
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    engine = LLM(str(hub.gguf_path(QWEN)), max_model_len=2048, kv_cache_memory=256 << 20).engine
    offered = [WEATHER["function"]]  # as `serve --tools FILE.json` offers them in the playground
    with ThreadedServer(build_app(AsyncLLMEngine(engine), "qwen", playground_tools=offered)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def smol(smol_llm):
    """A client of the server over the default model (its name: "smol")."""
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    with ThreadedServer(build_app(AsyncLLMEngine(smol_llm.engine), "smol")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def chat(client, **kwargs):
    return client.chat.completions.create(**{"model": "qwen", "messages": ASK, "max_tokens": 64, **kwargs})


def streamed(client, **kwargs) -> tuple[str, list[tuple[str, str]], str | None]:
    """The streamed reply as a client reassembles it: (content, [(name, arguments)], finish_reason)."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in chat(client, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            call["name"] += (tc.function.name or "") if tc.function else ""
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert all(c["id"].startswith("call_") for c in calls.values())
    return content, [(c["name"], c["arguments"]) for c in calls.values()], finish


def whole(choice) -> tuple[str, list[tuple[str, str]], str | None]:
    """A whole response's choice in streamed()'s terms."""
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content or "", calls, choice.finish_reason


def valid_calls(message) -> list[tuple[str, dict]]:
    """The message's calls as (name, arguments), each checked against its tool's schema."""
    calls = []
    for call in message.tool_calls or []:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_weather_round_trip(client):
    first = chat(client, tools=[WEATHER], temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [(name, arguments)] = valid_calls(choice.message)
    assert name == "get_weather" and arguments["city"] == "Paris"
    call = choice.message.tool_calls[0]
    history = ASK + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees Celsius and sunny"},
    ]
    final = chat(client, messages=history, tools=[WEATHER], tool_choice="none", temperature=0).choices[0]
    assert final.finish_reason == "stop" and not final.message.tool_calls
    assert "18" in final.message.content  # the answer carries the tool's result


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_choice_always_give_schema_valid_arguments(client, tool_choice):
    runs = []
    for seed in (1, 2):  # 12 sampled replies at temperature 1
        runs += chat(client, tools=[WEATHER, CLOCK], tool_choice=tool_choice, temperature=1.0, n=6, seed=seed).choices
    for choice in runs:
        calls = valid_calls(choice.message)
        assert calls, choice.message
        if isinstance(tool_choice, dict):
            assert [name for name, _ in calls] == ["get_time"]  # a named choice: exactly that one call


@pytest.fixture(scope="module")
def more_calls(base_url) -> dict[str, float]:
    """A logit_bias that pushes Qwen to open another call whenever the grammar lets it: by itself it
    writes one call and ends (a second <tool_call> after the first is about e^-23 to it)."""
    [tool_call] = httpx.post(
        f"{base_url}/tokenize", json={"prompt": "<tool_call>", "add_special_tokens": False}
    ).json()["tokens"]
    return {str(tool_call): 30.0}


def test_parallel_calls_come_back_as_several_tool_calls_whole_and_streamed(client, more_calls):
    """Calls after calls until max_tokens: the complete ones come back, the one cut short is dropped."""
    kwargs = dict(
        messages=TWO_CITIES,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=120,
        logit_bias=more_calls,
    )
    many = chat(client, **kwargs).choices[0]
    assert len(valid_calls(many.message)) >= 2 and many.finish_reason == "length"
    assert many.message.content is None
    assert streamed(client, **kwargs) == whole(many)


@pytest.mark.parametrize("model,tool_choice", [("qwen", "auto"), ("qwen", "required"), ("smol", "required")])
def test_parallel_off_allows_exactly_one_call_whole_and_streamed(request, model, tool_choice):
    """parallel_tool_calls false: one call, then the end, even with Qwen pushed to call again."""
    client = request.getfixturevalue("client" if model == "qwen" else "smol")
    bias = request.getfixturevalue("more_calls") if model == "qwen" else None
    kwargs = dict(
        model=model,
        messages=TWO_CITIES,
        tools=[WEATHER, CLOCK],
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=120,
        parallel_tool_calls=False,
        logit_bias=bias,
    )
    one = chat(client, **kwargs).choices[0]
    assert len(valid_calls(one.message)) == 1 and one.finish_reason == "tool_calls"
    assert streamed(client, **kwargs) == whole(one)


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_streamed_deltas_reassemble_to_the_same_calls(client, tool_choice):
    kwargs = dict(tools=[WEATHER, CLOCK], tool_choice=tool_choice, temperature=0, max_tokens=120)
    assert streamed(client, **kwargs) == whole(chat(client, **kwargs).choices[0])


def test_required_ends_after_its_call_whole_and_streamed(client):
    """Greedy, the model ends after one call (it writes a newline after </tool_call>, then its end of
    turn), instead of calling the two tools by turns until max_tokens."""
    kwargs = dict(messages=LISBON, tools=[WEATHER, CLOCK], tool_choice="required", temperature=0, max_tokens=300)
    choice = chat(client, **kwargs).choices[0]
    assert len(valid_calls(choice.message)) == 1 and choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert streamed(client, **kwargs) == whole(choice)


@pytest.mark.parametrize("model", ["qwen", "smol"])
def test_a_call_cut_by_max_tokens_never_reaches_content_whole_or_streamed(request, model):
    """The partial call is dropped: finish_reason "length", no tool_calls, the content is the text
    before the call (none here), never the call's markup."""
    client = request.getfixturevalue("client" if model == "qwen" else "smol")
    kwargs = dict(model=model, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=8)
    choice = chat(client, **kwargs).choices[0]
    assert whole(choice) == ("", [], "length")
    assert streamed(client, **kwargs) == ("", [], "length")


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0), dict(temperature=1.0, seed=1), dict(temperature=1.0, seed=2)],
    ids=["greedy", "seed1", "seed2"],
)
def test_default_model_required_calls_follow_the_readme_schema_whole_and_streamed(smol, sampling):
    """The README's weather tool (no additionalProperties) on the default model: a call with only the
    declared keys, then the end of the reply."""
    kwargs = dict(model="smol", tools=[WEATHER], tool_choice="required", max_tokens=128, **sampling)
    choice = chat(smol, **kwargs).choices[0]
    assert valid_calls(choice.message) and choice.finish_reason == "tool_calls"
    assert "<tool_call>" not in (choice.message.content or "")
    assert streamed(smol, **kwargs) == whole(choice)


def test_tool_choice_none_never_calls(client):
    replies = chat(client, tools=[WEATHER], tool_choice="none", temperature=1.0, n=8, seed=3).choices
    for choice in replies:
        assert not choice.message.tool_calls and choice.finish_reason != "tool_calls"
        assert "<tool_call>" not in choice.message.content
        assert not choice.message.content.lstrip().startswith('{"name": "')


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
        (dict(tools=[{"type": "retrieval"}]), "tools"),
        (dict(tools=[WEATHER], response_format={"type": "json_object"}), "tools"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]), "tools"),
    ],
)
def test_bad_tool_requests_are_400_naming_the_parameter(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **kwargs)
    assert info.value.body["param"] == param


def test_langchain_bind_tools(base_url):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "18 degrees Celsius and sunny"

    model = langchain_openai.ChatOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", model="qwen", temperature=0, max_tokens=64, max_retries=0
    )
    reply = model.bind_tools([get_weather], tool_choice="any").invoke("What's the weather like in Paris today?")
    assert reply.tool_calls and {c["name"] for c in reply.tool_calls} == {"get_weather"}
    assert not reply.invalid_tool_calls and all(isinstance(c["args"]["city"], str) for c in reply.tool_calls)


def test_litellm_tool_call(base_url, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at import
    litellm = pytest.importorskip("litellm")
    reply = litellm.completion(
        model="openai/qwen",
        api_base=f"{base_url}/v1",
        api_key="unused",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=64,
    )
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)


def test_playground_shows_the_call_and_sends_the_typed_result_back(browser, base_url):
    page = offline_page(browser, base_url, "qwen", 1200, 900)
    page.wait_for_function("document.getElementById('tools').value.includes('get_weather')")
    assert "active" in page.get_attribute("#mode-chat", "class")  # tools given: the chat opens first
    set_controls(page, temperature=0, max_tokens=64)
    page.fill("#prompt", ASK[0]["content"])
    run_and_wait(page)
    assert page.text_content("#status").endswith("waiting for tool results")
    [call] = page.eval_on_selector_all("#call-list .call .sig", "els => els.map(e => e.textContent)")
    name, arguments = call.removeprefix("→ ").split("(", 1)
    assert name == "get_weather" and json.loads(arguments.removesuffix(")"))["city"] == "Paris"
    assert page.text_content("#call-list .call .id").startswith("call_")
    shot(page, "8-tool-call")

    page.fill("#call-list .call input", "18 degrees Celsius and sunny")
    page.select_option("#tool_choice", "none")
    run_and_wait(page, "#send-results")
    assert not page.is_visible("#error") and not page.is_visible("#calls")
    assert "18" in "".join(page.eval_on_selector_all("#output .tok", "els => els.map(e => e.textContent)"))
    transcript = page.text_content("#transcript")
    assert "get_weather(" in transcript and "get_weather returned: 18 degrees Celsius and sunny" in transcript
    shot(page, "9-tool-result")
    assert page.outside == []
