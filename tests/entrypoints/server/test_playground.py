"""The server's `explain` extension, and the web playground at / in a real headless browser
(Debian's Chromium driven by Playwright). Screenshots of each state go to
test-artifacts/playground/ (or $TOKENLOOM_ARTIFACTS/playground/)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.browser_harness import offline_page, run_and_wait, set_controls, shot, token_texts
from tests.helpers.server_harness import ThreadedServer

PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def engine(default_model_dir):
    from tokenloom import LLM

    return LLM(str(default_model_dir), max_model_len=512, kv_cache_memory=128 << 20).engine


@pytest.fixture(scope="module")
def base_url(engine):
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    with ThreadedServer(build_app(AsyncLLMEngine(engine), "smol")) as url:
        yield url


def sse_chunks(response: httpx.Response) -> list[dict]:
    return [
        json.loads(line[5:])
        for line in response.text.splitlines()
        if line.startswith("data:") and line.strip() != "data: [DONE]"
    ]


def completion(base_url: str, **body) -> dict:
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": PROMPT, "temperature": 0, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# ---- the API extension -------------------------------------------------------------------------
def test_streamed_chunks_carry_each_tokens_record_and_the_prompt_ids(base_url, engine):
    whole = completion(base_url, max_tokens=6, explain=4)["choices"][0]
    r = httpx.post(
        f"{base_url}/v1/completions",
        json={
            "prompt": PROMPT,
            "temperature": 0,
            "max_tokens": 6,
            "explain": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=60,
    )
    chunks = sse_chunks(r)
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    records = [rec for c in choices for rec in c.get("explain", [])]
    assert choices[0]["prompt_token_ids"] == whole["prompt_token_ids"] == engine.tokenizer.encode(PROMPT)
    assert sum("prompt_token_ids" in c for c in choices) == 1
    assert [x["token_id"] for x in records] == [x["token_id"] for x in whole["explain"]]
    assert "".join(x["text"] for x in records) == "".join(c["text"] for c in choices) == whole["text"]
    for got, want in zip(records, whole["explain"]):
        assert got["prob"] == pytest.approx(want["prob"], abs=1e-5) and len(got["candidates"]) == 4
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0


def test_chat_stream_explains_too(base_url):
    r = httpx.post(
        f"{base_url}/v1/chat/completions",
        timeout=60,
        json={
            "messages": [{"role": "user", "content": "Say hi"}],
            "temperature": 0,
            "max_tokens": 4,
            "explain": 3,
            "stream": True,
        },
    )
    choices = [c["choices"][0] for c in sse_chunks(r) if c["choices"]]
    records = [rec for c in choices for rec in c.get("explain", [])]
    assert len(records) == 4 or records[-1]["token_id"] in (1, 2)
    assert "".join(c["delta"].get("content", "") for c in choices).startswith(records[0]["text"].strip()[:1])


@pytest.mark.parametrize(
    "body,param",
    [
        ({"explain": 0}, "explain"),
        ({"explain": 101}, "explain"),
        ({"explain": 3, "use_beam_search": True, "best_of": 2}, "explain"),
    ],
)
def test_bad_explain_requests_are_400s(base_url, body, param):
    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_playground_page_is_self_contained(base_url):
    page = httpx.get(f"{base_url}/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "tokenloom playground" in page.text
    for outside in ('src="http', "src='http", 'href="http', "@import", "url(http"):
        assert outside not in page.text


# ---- the page in a browser -----------------------------------------------------------------------
def test_playground_streams_explains_branches_and_reports_errors(browser, base_url, engine):
    page = offline_page(browser, base_url, "smol", 1200, 900)
    shot(page, "1-loaded")

    # a prompt streams in, token by token, as the API would return it
    set_controls(page, temperature=0, max_tokens=10, top_k=0, top_p=1)
    page.fill("#prompt", PROMPT)
    run_and_wait(page)
    want = completion(base_url, max_tokens=10, explain=2)["choices"][0]
    assert "".join(token_texts(page)) == want["text"]
    assert len(token_texts(page)) == len(want["explain"])
    assert float(page.text_content("#stat-tps")) > 0 and int(page.text_content("#stat-ttft")) >= 0
    assert int(page.text_content("#stat-blocks")) >= 1
    shot(page, "2-streamed")

    # a token's distribution opens: 12 candidates, the picked one marked
    page.click('#output .tok[data-index="1"]')
    rows = page.locator("#dist-bars .cand")
    assert page.is_visible("#dist") and rows.count() == 12
    assert page.locator("#dist-bars .cand.chosen").count() == 1
    assert int(page.get_attribute("#dist-bars .cand.chosen", "data-token")) == want["explain"][1]["token_id"]
    shot(page, "3-distribution")

    # branch: continue from step 1 with the second candidate; the rest is the greedy continuation
    second = rows.nth(1)
    branch_token = int(second.get_attribute("data-token"))
    second.locator("button.pick").click()
    page.wait_for_function("/^(done|error)/.test(document.getElementById('status').textContent)", timeout=60_000)
    texts = token_texts(page)
    ids = want["prompt_token_ids"] + [want["explain"][0]["token_id"], branch_token]
    rest = completion(base_url, prompt=ids, max_tokens=8, explain=1)["choices"][0]
    assert texts[0] == want["explain"][0]["text"]
    assert page.get_attribute('#output .tok[data-index="1"]', "class").count("branched") == 1
    assert "".join(texts[2:]) == rest["text"]
    assert int(page.text_content("#stat-cached")) == len(ids) - 1  # all but the new token came from the cache
    shot(page, "4-branch")

    # sampling with top-k: the chart shows kept and cut candidates
    set_controls(page, temperature=0.9, top_k=4, seed=5, max_tokens=6)
    run_and_wait(page)
    page.click('#output .tok[data-index="0"]')
    assert page.locator("#dist-bars .cand.cut").count() >= 12 - 4
    assert 1 <= page.locator("#dist-bars .cand.kept").count() <= 4
    shot(page, "5-cuts")

    # a bad setting shows the server's error and the page keeps working
    set_controls(page, temperature=7)
    run_and_wait(page)
    assert page.is_visible("#error") and "temperature" in page.text_content("#error")
    shot(page, "6-error")
    set_controls(page, temperature=0, max_tokens=3)
    run_and_wait(page)
    assert not page.is_visible("#error") and len(token_texts(page)) >= 1
    assert page.outside == []


def test_playground_chat_on_a_phone_width_screen(browser, base_url):
    page = offline_page(browser, base_url, "smol", 390, 844)
    page.click("#mode-chat")
    set_controls(page, temperature=0, max_tokens=8)
    page.fill("#prompt", "What is the capital of France?")
    run_and_wait(page)
    assert page.text_content("#status").startswith("done") and token_texts(page)
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing sticks out sideways
    page.click('#output .tok[data-index="0"]')
    assert page.is_visible("#dist")
    shot(page, "7-phone-chat")
    assert page.outside == []


def _send_with_enter(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    page.wait_for_function("state.pending === null && !document.getElementById('generate').disabled", timeout=60_000)


def test_playground_chat_is_a_conversation_kept_across_a_reload(browser, base_url):
    system = "You are a helpful assistant."
    page = offline_page(browser, base_url, "smol", 1000, 800)
    page.click("#mode-chat")
    set_controls(page, temperature=0, max_tokens=12, system=system)
    _send_with_enter(page, "What is the capital of France?")
    assert page.input_value("#prompt") == ""  # Enter sent it
    asked = [{"role": "system", "content": system}, {"role": "user", "content": "What is the capital of France?"}]
    want = httpx.post(
        f"{base_url}/v1/chat/completions", timeout=60, json={"messages": asked, "temperature": 0, "max_tokens": 12}
    ).json()["choices"][0]["message"]["content"]
    assert page.eval_on_selector_all("#transcript .msg.user", "els => els.map(e => e.lastChild.textContent)") == [
        "What is the capital of France?"
    ]
    kept = page.eval_on_selector_all("#output .tok:not(.stopped)", "els => els.map(e => e.textContent)")
    assert "".join(kept) == want  # the reply, in the conversation
    assert page.evaluate("document.querySelector('#conversation #output').getBoundingClientRect().top") > page.evaluate(
        "document.querySelector('#transcript .msg.user').getBoundingClientRect().top"
    )

    page.fill("#prompt", "And of Italy?")
    page.press("#prompt", "Shift+Enter")  # a new line, not a send
    assert page.input_value("#prompt") == "And of Italy?\n" and not page.is_disabled("#generate")
    _send_with_enter(page, "And of Italy?")
    roles = page.eval_on_selector_all("#transcript .msg", "els => els.map(e => e.classList[1])")
    assert roles == ["user", "assistant", "user"]
    shot(page, "10-chat-bubbles")

    page.reload()  # the conversation is kept
    page.wait_for_function("document.querySelectorAll('#transcript .msg').length === 4")
    assert "active" in page.get_attribute("#mode-chat", "class") and page.input_value("#system") == system
    texts = page.eval_on_selector_all("#transcript .msg", "els => els.map(e => e.lastChild.textContent)")
    assert texts[:3] == ["What is the capital of France?", want, "And of Italy?"] and texts[3]
    assert page.text_content("#shade-legend").startswith("shading")
    shot(page, "11-chat-after-reload")
    page.click("#clear")  # Clear empties it for good
    page.reload()
    page.wait_for_function("document.getElementById('model').textContent.includes('smol')")
    page.wait_for_timeout(300)
    assert page.locator("#transcript .msg").count() == 0
    assert page.outside == []


def test_playground_loop_breakers_reach_the_server_and_show_their_cuts(browser, base_url):
    """The loop-breakers panel: DRY, n-gram blocking and a bad word, greedy; the text equals the API's
    with the same settings, and a step's distribution says what the processors banned and moved."""
    page = offline_page(browser, base_url, "smol", 1200, 1000)
    page.click("#more-samplers summary")
    set_controls(
        page,
        temperature=0,
        max_tokens=40,
        top_k=0,
        top_p=1,
        min_p=0,
        no_repeat_ngram_size=3,
        dry_multiplier=0.8,
        bad_words="hobby",
    )
    page.fill("#prompt", "My favorite things are")
    run_and_wait(page)
    want = completion(
        base_url,
        prompt="My favorite things are",
        max_tokens=40,
        top_k=0,
        top_p=1,
        min_p=0,
        no_repeat_ngram_size=3,
        dry_multiplier=0.8,
        bad_words=["hobby"],
        explain=2,
    )["choices"][0]
    assert "".join(token_texts(page)) == want["text"] and "hobby" not in want["text"]
    step = next(i for i, r in enumerate(want["explain"]) if r["num_cut"].get("no_repeat_ngram"))
    page.click(f'#output .tok[data-index="{step}"]')
    assert "no_repeat_ngram" in page.text_content("#dist-head")
    shot(page, "12-loop-breakers")
    set_controls(page, mirostat_tau=0)  # a bad setting: the server's 400 names it
    page.select_option("#mirostat", "2")
    set_controls(page, temperature=0.8)
    run_and_wait(page)
    assert page.is_visible("#error") and "mirostat_tau" in page.text_content("#error")
    assert page.outside == []
