"""Each family's tool-call format checked against the chat template its release ships
(tests/tool_calling/templates): the format detected from the template is the one the template
writes calls in, a call the template renders into the conversation reads back as the same call,
and a conversation with tools, calls and results renders (tokenloom's messages, as the server
hands them to the template)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.real_templates import real_template, render
from tokenloom.tool_calling import detect_format, parse_tool_calls
from tokenloom.tool_calling.harmony import read_harmony
from tokenloom.tool_calling.messages import function_of, template_messages
from tokenloom.tool_calling.reasoning import PLAN_TAGS, reasoning_enabled, reasoning_tags, split_reasoning

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now", "parameters": {}}}
FUNCTIONS = [function_of(t, i) for i, t in enumerate([WEATHER, TIME])]
CALLS = [("get_weather", {"city": "Paris"}), ("get_time", {})]

# (template, the format it teaches, what ends the assistant's turn, whether it renders parallel calls)
TEMPLATES = [
    ("Mistral-Small-3.2-24B-Instruct-2506", "mistral_v11", "</s>", True),
    ("unsloth-mistral-Devstral-Small-2507", "mistral_v11", "</s>", True),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "deepseek_v3", "<｜end▁of▁sentence｜>", True),
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "deepseek_v3", "<｜end▁of▁sentence｜>", True),
    ("Qwen-Qwen2.5-7B-Instruct", "hermes", "<|im_end|>", True),
    ("Qwen-Qwen3-0.6B", "hermes", "<|im_end|>", True),
    ("Qwen3-Coder", "qwen3_coder", "<|im_end|>", True),
    ("ibm-granite-granite-4.0", "hermes", "<|end_of_text|>", True),
    ("HuggingFaceTB-SmolLM3-3B", "generic", "<|im_end|>", True),
    ("meta-llama-Llama-3.1-8B-Instruct", "llama3_json", "<|eot_id|>", False),
    ("mistralai-Mistral-Nemo-Instruct-2407", "mistral", "</s>", True),
    ("deepseek-ai-DeepSeek-V3.1", "deepseek_v31", "<｜end▁of▁sentence｜>", True),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", "command_r7b", "<|END_OF_TURN_TOKEN|>", True),
    ("openai-gpt-oss-120b", "harmony", "<|call|>", False),
]


# templates whose generation prompt ends by opening a think block: that text is not in a rendered turn
THINKING_PROMPTS = {
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "<think>\n",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": "<think>\n",
}


def _history(calls: list[tuple[str, dict]], with_results: bool) -> list[dict]:
    """A user's question, the assistant's `calls` (OpenAI-shaped: ids, arguments as JSON text) and,
    if `with_results`, each call's result: as the server hands them to the template."""
    from tokenloom.entrypoints.server.protocol import ChatMessage

    messages: list[dict] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris, and the time?"},
        {
            "role": "assistant",
            "content": None,  # as OpenAI clients send a turn of calls only
            "tool_calls": [
                {
                    "id": f"call_{i}abcdefgh",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)},
                }
                for i, (name, args) in enumerate(calls)
            ],
        },
    ]
    if with_results:
        messages += [
            {"role": "tool", "tool_call_id": f"call_{i}abcdefgh", "content": f"result {i}"} for i in range(len(calls))
        ]
    return [ChatMessage.model_validate(m).as_template_input() for m in messages]


def _rendered(name: str, messages: list[dict], add_generation_prompt: bool) -> str:
    fmt = detect_format(real_template(name))
    template_input = template_messages(messages, FUNCTIONS, fmt)
    tools = [WEATHER, TIME] if fmt.renders_tools and fmt.lists_tools else None
    return render(name, template_input, add_generation_prompt=add_generation_prompt, tools=tools)


@pytest.mark.parametrize("name,fmt,end,parallel", TEMPLATES)
def test_the_format_detected_is_the_templates(name, fmt, end, parallel):
    assert detect_format(real_template(name)).name == fmt


@pytest.mark.parametrize("name,fmt,end,parallel", TEMPLATES)
def test_calls_the_template_renders_read_back_as_the_same_calls(name, fmt, end, parallel):
    calls = CALLS if parallel else CALLS[:1]
    history = _history(calls, with_results=False)[1:]  # (Mistral's puts a system prompt in the last user turn)
    prompt = _rendered(name, history[:1], add_generation_prompt=True)
    whole = _rendered(name, history, add_generation_prompt=False)
    if name in THINKING_PROMPTS:  # the generation prompt opens a think block a rendered turn does not hold
        prompt = prompt[: prompt.rindex(THINKING_PROMPTS[name])]
    assert whole.startswith(prompt), "the generation prompt is not where the assistant's turn begins"
    reply = whole[len(prompt) :]
    assert end in reply
    reply = reply[: reply.index(end)]  # (Command R7B's template writes the next generation prompt after it)
    if fmt == "harmony":  # the call ends with <|call|>, a stop token
        read = read_harmony(reply)
        got = [(c.name, json.loads(c.arguments)) for c in read.calls]
        content = read.content
    else:
        content, found = parse_tool_calls(reply, detect_format(real_template(name)))
        got = [(c.name, json.loads(c.arguments)) for c in found]
        if reasoning_enabled(None, real_template(name)):  # an empty think block before the calls
            tags = reasoning_tags(real_template(name))
            content = split_reasoning(content, False, tags)[1]
    assert got == calls
    assert not (content or "").strip()


@pytest.mark.parametrize("name,fmt,end,parallel", TEMPLATES)
def test_tools_calls_and_results_render(name, fmt, end, parallel):
    calls = CALLS if parallel else CALLS[:1]
    text = _rendered(name, _history(calls, with_results=True), add_generation_prompt=True)
    assert "get_weather" in text and "Weather in a city" in text  # the tools are offered
    assert all(f"result {i}" in text for i in range(len(calls)))


def test_mistral_call_ids_are_made_nine_letters_or_digits_the_same_in_call_and_result():
    from tokenloom.tool_calling.formats import MISTRAL

    messages = template_messages(_history(CALLS, with_results=True), FUNCTIONS, MISTRAL)
    ids = [c["id"] for c in messages[2]["tool_calls"]]
    assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 2
    assert [m["tool_call_id"] for m in messages[3:]] == ids
    kept = template_messages([{**messages[2], "role": "assistant"}], None, MISTRAL)[0]["tool_calls"]
    assert [c["id"] for c in kept] == ids  # ids already in Mistral's form are kept


def test_command_r7bs_plan_is_reasoning():
    source = real_template("CohereForAI-c4ai-command-r7b-12-2024-tool_use")
    assert reasoning_enabled(None, source) and reasoning_tags(source) == PLAN_TAGS
    reply = "<|START_THINKING|>I will look up the weather.<|END_THINKING|><|START_ACTION|>[\n    {}\n]<|END_ACTION|>"
    assert split_reasoning(reply, False, PLAN_TAGS) == (
        "I will look up the weather.",
        reply[reply.index("<|START_A") :],
    )


@pytest.mark.parametrize(
    "name,rendered",
    [
        (
            "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
            "<|START_THINKING|>Look it up.<|END_THINKING|><|START_ACTION|>",
        ),
        ("Qwen-Qwen3-0.6B", "<think>\nLook it up.\n</think>\n\n<tool_call>"),
    ],
)
def test_an_assistants_reasoning_sent_back_reaches_the_templates_that_render_it(name, rendered):
    from tokenloom.entrypoints.server.protocol import ChatMessage

    history = _history(CALLS[:1], with_results=True)
    history[2] = ChatMessage.model_validate({**history[2], "reasoning_content": "Look it up."}).as_template_input()
    assert rendered in _rendered(name, history, add_generation_prompt=True)


def test_a_template_without_a_system_role_gets_the_system_text_in_the_first_user_turn():
    """Gemma 2's template raises on a system message: the client's system text and the tools'
    prompt (the generic format's, a system message of tokenloom's) go at the head of the first
    user turn instead, as llama.cpp and ollama render them."""
    from tokenloom.entrypoints.server.chat_tools import ChatFeatures, make_turn
    from tokenloom.tokenizer import template_takes_system

    gemma = real_template("google-gemma-2-2b-it")
    assert not template_takes_system(gemma) and template_takes_system(real_template("Qwen-Qwen3-0.6B"))
    features = ChatFeatures.for_template(gemma)
    assert features.tool_format.name == "generic" and not features.system_role
    history = _history(CALLS[:1], with_results=True)
    turn = make_turn(history, "auto", FUNCTIONS, features)
    text = render("google-gemma-2-2b-it", turn.messages)
    first_user = text[text.index("<start_of_turn>user\n") : text.index("<end_of_turn>")]
    assert first_user.index("Be brief.") < first_user.index("get_weather") < first_user.index("Weather in Paris")
    assert "<start_of_turn>system" not in text and text.endswith("<start_of_turn>model\n")
    plain = make_turn(history[:2], "none", [], features)
    assert render("google-gemma-2-2b-it", plain.messages).startswith("<s><start_of_turn>user\nBe brief.\n\nWeather")
