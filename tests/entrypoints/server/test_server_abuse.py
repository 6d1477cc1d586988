"""The server against hostile or careless clients (issue: server under abuse): every input is a
4xx in OpenAI's error JSON or works, slow and oversized bodies are cut off, and the server stays
healthy (/health within 100 ms) and leaks no KV block after each."""

from __future__ import annotations

import gc
import json
import os
import re
import socket
import time

import httpx
import pytest

from tests.helpers.server_harness import ThreadedServer, wait_until_idle

# the tests that assert a latency or a timeout (most check /health within 100 ms after their
# abuse): the machine to themselves under pytest -n (tests/helpers/turns.py)
SERIAL = pytest.mark.serial


@pytest.fixture(scope="module")
def base_url(default_model_dir):
    from tokenloom import LLM
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    engine = LLM(str(default_model_dir), max_model_len=256, kv_cache_memory=64 << 20).engine
    app = build_app(AsyncLLMEngine(engine), "smol", max_body_bytes=6 << 20, body_timeout_s=1.0)
    with ThreadedServer(app) as url:
        yield url


def assert_health_answers_quickly(base_url: str) -> None:
    """/health answers 200 within 100 ms. The client is made before the clock starts: building
    one (its TLS context) alone takes 30-120 ms on a busy 2-core machine, which is not the server's."""
    with httpx.Client() as client:
        started = time.perf_counter()
        assert client.get(f"{base_url}/health").status_code == 200
        took = time.perf_counter() - started
    assert took < 0.1, f"/health took {took * 1000:.0f} ms"


def assert_healthy(base_url: str) -> None:
    assert_health_answers_quickly(base_url)
    assert wait_until_idle(base_url) == 0


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def post_raw(base_url: str, path: str, body: bytes) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", content=body, headers={"content-type": "application/json"}, timeout=120)


@SERIAL
@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x\\udfffy"}], "max_tokens": 2}',
            "messages",
        ),
        ("/v1/completions", b'{"prompt": "Hi", "max_tokens": 2, "stop": ["\\ud800"]}', "stop"),
    ],
)
def test_lone_surrogates_are_400_naming_the_parameter(base_url, path, body, param):
    assert openai_error(post_raw(base_url, path, body), 400)["param"] == param
    assert_healthy(base_url)


@SERIAL
@pytest.mark.parametrize(
    "body",
    [
        b"\xff\xfe not utf-8",
        b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # nesting past the parser's depth
        b'{"prompt": "Hi", "max_tokens": 2',  # cut short
    ],
)
def test_unparsable_bodies_are_400_in_openai_json(base_url, body):
    openai_error(post_raw(base_url, "/v1/completions", body), 400)
    assert_healthy(base_url)


def test_unknown_routes_and_methods_answer_openai_json(base_url):
    assert httpx.get(f"{base_url}/docs").status_code == 404  # no page that loads a CDN
    assert httpx.get(f"{base_url}/openapi.json").json()["info"]["title"] == "tokenloom"
    assert openai_error(httpx.get(f"{base_url}/v1/nothing-here"), 404)["type"] == "not_found_error"
    openai_error(httpx.get(f"{base_url}/v1/completions"), 405)
    openai_error(httpx.post(f"{base_url}/v1/completions", json={"max_tokens": 2}), 400)  # no prompt


@SERIAL
def test_a_chunked_body_over_the_limit_is_413(base_url):
    def chunks():
        for _ in range(7):
            yield b" " * (1 << 20)  # 7 MiB > the 6 MiB limit, no length

    response = httpx.post(f"{base_url}/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert openai_error(response, 413)
    assert_healthy(base_url)


def raw_request(base_url: str, head: bytes, body: bytes, wait_s: float) -> bytes:
    """Send `head` + `body` on a raw socket, then read what the server answers within `wait_s`."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        sock.sendall(head + body)
        answer = b""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and b"\r\n\r\n" not in answer:
            try:
                part = sock.recv(4096)
            except TimeoutError:
                break
            if not part:
                break
            answer += part
        return answer


@SERIAL
def test_a_body_shorter_than_its_content_length_times_out_with_408(base_url):
    body = b'{"prompt": "Hi"'
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 500\r\n\r\n"
    )
    started = time.monotonic()
    answer = raw_request(base_url, head, body, wait_s=5)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert time.monotonic() - started < 3  # the 1 s body timeout, not forever
    assert_healthy(base_url)


def _read_whole_response(sock: socket.socket, answer: bytes) -> bytes:
    """Read on until the head and a Content-Length body are all in (a response may arrive in pieces)."""
    sock.settimeout(5)
    while True:
        head, sep, body = answer.partition(b"\r\n\r\n")
        length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
        if sep and length and len(body) >= int(length.group(1)):
            return answer
        try:
            chunk = sock.recv(4096)
        except (TimeoutError, OSError):
            return answer
        if not chunk:
            return answer
        answer += chunk


@SERIAL
def test_a_body_trickling_in_is_cut_at_its_deadline(tiny_engine):
    """A byte every 0.3 s never pauses for the 1 s body timeout; the whole-body deadline (2 s here)
    still answers 408, and the server goes on."""
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    app = build_app(AsyncLLMEngine(tiny_engine), "tiny", body_timeout_s=1.0, body_deadline_s=2.0)
    with ThreadedServer(app) as url:
        host, port = url.removeprefix("http://").split(":")
        body = b'{"prompt": "Hi", "max_tokens": 1}' + b" " * 40
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        started = time.monotonic()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head)
            answer = b""
            for byte in body:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:  # answered and closed meanwhile
                    break
                sock.settimeout(0.3)
                try:
                    answer += sock.recv(4096)
                except TimeoutError:
                    pass
                if answer:
                    break
            answer = _read_whole_response(sock, answer)
        assert answer.startswith(b"HTTP/1.1 408") and b"not all there within 2 s" in answer, answer[:300]
        assert 1.8 < time.monotonic() - started < 5
        assert_healthy(url)


def test_a_tiny_temperature_is_greedy_not_garbage(base_url):
    def text(temperature: float) -> str:
        body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": temperature}
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    assert text(1e-45) == text(0) == text(1e-30)


@SERIAL
def test_the_largest_seed_works_whole_and_streamed(base_url):
    body = {"prompt": "Once upon a time", "max_tokens": 5, "seed": 2**64 - 1, "n": 2}
    whole = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body | {"stream": True}, timeout=60) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and not any("error" in json.loads(e) for e in events[:-1])
    assert_healthy(base_url)


@pytest.fixture(scope="module")
def small_server(default_model_dir):
    """A server with small admission bounds: 6 pending sequences, 4 per request, 2 running per
    request, 5 new tokens by default; its engine runs 2 sequences at a time."""
    from tokenloom import LLM
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app
    from tokenloom.entrypoints.server.admission import AdmissionLimits

    engine = LLM(str(default_model_dir), max_model_len=256, kv_cache_memory=64 << 20, max_num_seqs=2).engine
    limits = AdmissionLimits(
        max_seqs_per_request=4, max_pending_seqs=6, max_running_per_request=2, default_max_tokens=5
    )
    with ThreadedServer(build_app(AsyncLLMEngine(engine), "smol", limits=limits)) as url:
        yield url


@SERIAL
def test_a_request_past_the_per_request_bound_is_400_naming_n(small_server):
    body = {"prompt": ["Hi", "there"], "n": 3, "max_tokens": 2}  # 6 sequences > 4
    assert openai_error(httpx.post(f"{small_server}/v1/completions", json=body), 400)["param"] == "n"
    beams = {"prompt": "Hi", "max_tokens": 2, "use_beam_search": True, "best_of": 5}
    assert openai_error(httpx.post(f"{small_server}/v1/completions", json=beams), 400)["param"] == "best_of"
    assert_healthy(small_server)


def test_a_burst_past_the_per_request_bound_is_refused_before_any_tokenizing(tiny_engine):
    """2,000 prompts x n=16 is a 400 naming n before one prompt is tokenized or one of its 32,000
    sequences' parameters is built (that work held the GIL ~0.5 s beside the engine's steps)."""
    from fastapi.testclient import TestClient

    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    app = build_app(AsyncLLMEngine(tiny_engine), "tiny")
    tokenized = []
    input_ids = app.state.models.serving_of(None).input_ids
    app.state.models.serving_of(None).input_ids = lambda *a: tokenized.append(a) or input_ids(*a)
    with TestClient(app) as tc:
        burst = tc.post("/v1/completions", json={"prompt": ["Hi there"] * 2000, "n": 16, "max_tokens": 1})
        many = tc.post("/v1/completions", json={"prompt": ["Hi there"] * 65, "max_tokens": 1})
    assert openai_error(burst, 400)["param"] == "n" and "32000 sequences" in burst.json()["error"]["message"]
    assert openai_error(many, 400)["param"] == "prompt"
    assert tokenized == []


@SERIAL
def test_a_full_server_answers_429_with_retry_after_then_recovers(small_server):
    long = {"prompt": "Once upon a time", "n": 4, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{small_server}/v1/completions", json=long, timeout=60) as stream:
        lines = stream.iter_lines()  # kept: dropping the iterator would close the connection
        next(lines)  # 4 of 6 pending, running
        more = httpx.post(f"{small_server}/v1/completions", json={"prompt": "Hi", "n": 3, "max_tokens": 2})
        error = openai_error(more, 429)
        assert error["type"] == "rate_limit_error" and more.headers["retry-after"] == "1"
        assert_health_answers_quickly(small_server)
    # the stream closed early: its sequences are released, the next request is admitted
    after = httpx.post(f"{small_server}/v1/completions", json={"prompt": "Hi", "n": 3, "max_tokens": 2}, timeout=60)
    assert after.status_code == 200, after.text
    assert_healthy(small_server)


def test_requests_without_max_tokens_get_the_server_default(small_server):
    models = httpx.get(f"{small_server}/v1/models").json()["data"][0]
    assert models["default_max_tokens"] == 5
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "ignore_eos": True}
    usage = httpx.post(f"{small_server}/v1/chat/completions", json=body, timeout=60).json()["usage"]
    assert usage["completion_tokens"] == 5


@SERIAL
def test_one_large_request_does_not_hold_every_slot(small_server):
    """4 long sequences of one request take their turns 2 at a time, so a later short request
    queues behind 2 of them, not all 4, and finishes before the long request (with every long
    sequence queued ahead of it, the engine's 2 slots would serve it last)."""
    import threading

    long = {"prompt": "Once upon a time", "n": 4, "max_tokens": 120, "ignore_eos": True}
    finished = {}

    def run_long():
        httpx.post(f"{small_server}/v1/completions", json=long, timeout=120)
        finished["long"] = time.monotonic()

    worker = threading.Thread(target=run_long)
    worker.start()
    time.sleep(0.5)
    short = httpx.post(f"{small_server}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=120)
    finished["short"] = time.monotonic()
    worker.join()
    assert short.status_code == 200
    assert finished["short"] < finished["long"]
    assert_healthy(small_server)


@pytest.fixture(scope="module")
def tiny_engine(tiny_model_dir):
    from tokenloom import LLM

    return LLM(str(tiny_model_dir("llama_gqa")), kv_cache_memory=8 << 20).engine


def test_only_allowed_hosts_are_answered(tiny_engine):
    from fastapi.testclient import TestClient

    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app
    from tokenloom.entrypoints.server.middleware import LOCAL_HOSTS

    with TestClient(build_app(AsyncLLMEngine(tiny_engine), "tiny", allowed_hosts=LOCAL_HOSTS)) as tc:
        rebound = tc.get("/v1/models", headers={"Host": "evil.example:8000"})
        error = openai_error(rebound, 421)
        assert error["param"] == "Host" and "evil.example" in error["message"]
        for host in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", "LOCALHOST"):
            assert tc.get("/v1/models", headers={"Host": host}).status_code == 200, host


@pytest.mark.parametrize("log_json", [False, True])
def test_one_log_line_per_request(tiny_engine, caplog, log_json):
    from fastapi.testclient import TestClient

    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    with (
        TestClient(build_app(AsyncLLMEngine(tiny_engine), "tiny", log_json=log_json)) as tc,
        caplog.at_level("INFO", logger="tokenloom.entrypoints.server"),
    ):
        ok = tc.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
        bad = tc.post("/v1/completions", json={"prompt": [5], "max_tokens": "4"})
    assert ok.status_code == 200 and bad.status_code == 400
    lines = [r.getMessage() for r in caplog.records if r.name == "tokenloom.entrypoints.server"]
    assert len(lines) == 2, lines
    if log_json:
        first, second = (json.loads(line) for line in lines)
        assert first["event"] == "request" and first["id"] == ok.json()["id"] and first["status"] == 200
        assert (first["prompt_tokens"], first["completion_tokens"]) == (3, 4)
        assert 0 < first["ttft_s"] <= first["total_s"]
        assert second["status"] == 400 and second["id"] is None
    else:
        assert f"id={ok.json()['id']}" in lines[0] and "status=200" in lines[0]
        assert "prompt_tokens=3" in lines[0] and "completion_tokens=4" in lines[0] and "ttft_s=" in lines[0]
        assert "status=400" in lines[1] and "path=/v1/completions" in lines[1]


def long_mixed_text() -> str:
    """A text over LONG_TEXT characters (the long-text path) with special tokens, tabs, double
    spaces, digits and non-ASCII."""
    from tokenloom.tokenizer import LONG_TEXT

    text = "Héllo wörld, <|im_start|>user\ttabs and  spaces 123456 ünïcode. " * (LONG_TEXT // 40)
    assert len(text) > LONG_TEXT
    return text


def test_long_texts_tokenize_to_the_same_ids_off_the_gil(default_model_dir):
    """Tokenizer.encode's long-text path (encode_batch_fast, releasing the GIL) against the plain
    encode, special tokens and non-ASCII included."""
    from tokenloom.tokenizer import Tokenizer, TooManyTokens

    tokenizer = Tokenizer.from_folder(default_model_dir)
    text = long_mixed_text()
    for special in (True, False):
        assert (
            tokenizer.encode(text, add_special_tokens=special)
            == tokenizer.backend.encode(text, add_special_tokens=special).ids
        )
    count = len(tokenizer.encode(text))
    assert tokenizer.encode(text, limit=count) == tokenizer.encode(text)
    for long_or_short in (text, "Hello there, world"):
        n = len(tokenizer.encode(long_or_short))
        with pytest.raises(TooManyTokens) as caught:
            tokenizer.encode(long_or_short, limit=n - 1)
        assert caught.value.count == n


def test_the_servers_long_texts_tokenize_in_a_child_process_to_the_same_ids(default_model_dir):
    """LongTexts (the server's tokenizing): a long text's ids and over-limit count come from a
    child process and equal the in-process tokenizer's; a short text never starts one; a child
    that died is replaced; close ends them all."""
    from tokenloom.entrypoints.server.long_texts import LongTexts
    from tokenloom.tokenizer import Tokenizer, TooManyTokens

    tokenizer = Tokenizer.from_folder(default_model_dir)
    texts = LongTexts(tokenizer)
    short = "Hello there, world"
    assert texts.encode(short) == tokenizer.encode(short) and texts.processes == []
    text = long_mixed_text()
    try:
        for special in (True, False):
            assert texts.encode(text, special) == tokenizer.backend.encode(text, add_special_tokens=special).ids
        (process,) = texts.processes
        child = process.child
        assert child.pid != os.getpid() and child.poll() is None
        count = len(tokenizer.encode(text))
        assert texts.encode(text, limit=count) == tokenizer.encode(text)
        with pytest.raises(TooManyTokens) as caught:
            texts.encode(text, limit=count - 1)
        assert caught.value.count == count
        child.kill()
        child.wait()
        assert texts.encode(text) == tokenizer.encode(text)  # a new child answers
        assert process.child is not child
    finally:
        texts.close()
    assert child.poll() is not None and process.child is None


@SERIAL
def test_a_prompt_past_the_context_is_refused_with_its_exact_token_count(base_url):
    """Told before its ids are listed (Tokenizer.encode's limit), with the same count and message."""
    from tokenloom.loader import hub
    from tokenloom.tokenizer import Tokenizer

    text = "Hello world, this is a test. " * 2_000  # 58k characters: the long-text path
    count = len(Tokenizer.from_folder(hub.float32_folder()).encode(text))
    for path, body in (
        ("/v1/completions", {"prompt": text, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 2}),
    ):
        error = openai_error(httpx.post(f"{base_url}{path}", json=body, timeout=60), 400)
        assert error["param"] == ("prompt" if path == "/v1/completions" else "messages")
        if path == "/v1/completions":
            assert f"the prompt has {count} tokens but this model's context length is 256" in error["message"]
    assert_healthy(base_url)


@SERIAL
def test_beam_search_stops_when_its_client_leaves(base_url):
    """A 200-step beam search whose client gives up after 1 s: the search stops (no step requests
    keep coming) and its blocks are freed."""
    from tests.helpers.server_harness import metric

    body = {"prompt": "Once upon a time", "max_tokens": 200, "use_beam_search": True, "best_of": 4, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=1.0)
    time.sleep(1.0)
    seen = []
    for _ in range(5):  # 1 s more of quiet: no new steps were queued
        seen.append(
            metric(base_url, "tokenloom_num_requests_running") + metric(base_url, "tokenloom_num_requests_waiting")
        )
        time.sleep(0.2)
    assert seen == [0] * 5, seen
    assert_healthy(base_url)


@SERIAL
def test_per_client_turns_bound_each_client_alone_and_are_forgotten_after():
    import asyncio

    from tokenloom.entrypoints.server.admission import PerClientTurns

    async def scenario():
        turns, order = PerClientTurns(1), []

        async def hold(client: str, name: str, seconds: float):
            async with turns.turn(client):
                order.append(f"{name} in")
                await asyncio.sleep(seconds)
                order.append(f"{name} out")

        await asyncio.gather(hold("a", "a1", 0.2), hold("a", "a2", 0.01), hold("b", "b1", 0.01))
        return order, len(turns)

    order, left = asyncio.run(scenario())
    assert order.index("b1 in") < order.index("a1 out")  # another client does not wait for a
    assert order.index("a2 in") > order.index("a1 out")  # a's second waits for its first
    assert left == 0


@SERIAL
def test_a_clients_requests_take_turns_with_each_other():
    """One client (one address behind a proxy, say), two turns: four requests of 6 sequences each
    arrive first, then a short one. A freed turn goes to the request holding fewest, so the short
    request runs after 2 sequences end, not after the others' whole fan-outs; a waiter cancelled
    (its client left) gives nothing away twice."""
    import asyncio

    from tokenloom.entrypoints.server.admission import PerClientTurns

    async def scenario():
        turns, order = PerClientTurns(2), []

        async def sequence(request: str, i: int):
            async with turns.turn("proxy", request):
                order.append(f"{request}{i}")
                await asyncio.sleep(0.01)

        fan_outs = [asyncio.create_task(sequence(r, i)) for r in "ABCD" for i in range(6)]
        await asyncio.sleep(0)
        short = asyncio.create_task(sequence("E", 0))
        leaving = asyncio.create_task(sequence("F", 0))
        await asyncio.sleep(0)
        leaving.cancel()
        await asyncio.gather(*fan_outs, short, return_exceptions=True)
        return order, len(turns)

    order, left = asyncio.run(scenario())
    assert order.index("E0") <= 6  # A0 A1 hold; B, A, C, D take one each, then E (FIFO: last, at 24)
    assert "F0" not in order and len(order) == 25 and left == 0


@SERIAL
def test_one_clients_slow_preparation_does_not_hold_every_worker(tiny_engine, monkeypatch):
    """Requests of a client whose preparation takes 1.5 s each (a 4 MB prompt, a huge schema) use
    one worker between them, so another client's request is prepared and answered at once, not
    after them; past its bound of requests in preparation (2 here) the client gets 429, not the
    others; each request runs as its client's (whose turns the engine's fair share counts)."""
    import threading

    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app
    from tokenloom.entrypoints.server import serving as serving_module

    monkeypatch.setattr(serving_module, "MAX_PREPARING_PER_CLIENT", 2)
    app = build_app(AsyncLLMEngine(tiny_engine), "tiny")
    serving = app.state.models.serving_of(None)
    prepare = serving.prepare_completion

    def slow_for_some(req):
        if req.user == "slow":
            time.sleep(1.5)
        return prepare(req)

    serving.prepare_completion = slow_for_some
    clients, enqueue = [], tiny_engine.enqueue
    tiny_engine.enqueue = lambda rid, ids, params, client=None: (
        clients.append(client) or enqueue(rid, ids, params, client)
    )
    codes = []
    try:
        with ThreadedServer(app) as url:
            body = {"prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}

            def post_slow():
                codes.append(httpx.post(f"{url}/v1/completions", json=body | {"user": "slow"}, timeout=60).status_code)

            slow = [threading.Thread(target=post_slow) for _ in range(3)]
            for t in slow:
                t.start()
                time.sleep(0.1)
            started = time.perf_counter()
            fast = httpx.post(f"{url}/v1/completions", json=body | {"user": "fast"}, timeout=60)
            took = time.perf_counter() - started
            for t in slow:
                t.join()
    finally:
        del tiny_engine.enqueue
    assert fast.status_code == 200 and took < 1.0, took
    assert sorted(codes) == [200, 200, 429]
    assert sorted(clients) == ["user:fast", "user:slow", "user:slow"]


def _encoded_abuses() -> dict[str, tuple[bytes, set[int]]]:
    """The issue's single-request abuses (scaled to seconds), encoded before they are sent (the
    client's JSON work is not the server's): name -> (body, the statuses it may get)."""
    schema = {
        "anyOf": [
            {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]} for i in range(2000)
        ]
    }
    bodies = {
        "burst 2000 prompts x n=16": ({"prompt": ["Hi there"] * 2000, "n": 16, "max_tokens": 1}, {400}),
        "4 MB prompt": ({"prompt": "Hello world, this is a test. " * 140_000, "max_tokens": 2}, {400}),
        "anyOf x 2000 schema": ({"prompt": "Hi", "max_tokens": 1, "guided_json": schema}, {200, 400}),
        "10^5 stop strings": ({"prompt": "Hi", "max_tokens": 1, "stop": [f"s{i}" for i in range(100_000)]}, {400}),
        "seed 2**64": ({"prompt": "Hi", "max_tokens": 1, "seed": 2**64}, {400}),
        "temperature 1e-45": ({"prompt": "Hi", "max_tokens": 4, "temperature": 1e-45}, {200}),
    }
    out = {name: (json.dumps({"model": "smol"} | body).encode(), codes) for name, (body, codes) in bodies.items()}
    out["lone surrogate"] = (b'{"model": "smol", "prompt": "a\\ud800b", "max_tokens": 2}', {400})
    return out


ABUSES = _encoded_abuses()


@pytest.fixture(scope="module")
def served_process(default_model_dir):
    from tests.helpers.server_harness import ServeProcess

    with ServeProcess(default_model_dir) as proc:
        yield proc.base


@SERIAL
@pytest.mark.parametrize("name", list(ABUSES))
def test_health_answers_within_100ms_while_an_abuse_is_in_flight(served_process, name):
    """`tokenloom serve` as users run it; /health timed every 10 ms from the moment the abuse is
    sent until it is answered (tokenizing 4 MB in a child process, compiling a schema, validating
    10^5 strings: off the event loop or quick on it). Not here: crowds (the probe would time this
    process's own threads; bench_abuse.py probes from a process of its own)."""
    import threading

    answers = []

    def post(body: bytes) -> None:
        r = httpx.post(
            f"{served_process}/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=120
        )
        answers.append(r.status_code)

    body, allowed = ABUSES[name]
    sender = threading.Thread(target=post, args=(body,))
    latencies = []
    gc.collect()
    gc.disable()  # a full collection of this test process (models loaded by earlier tests) is not the server's
    try:
        with httpx.Client(timeout=30) as probe:
            sender.start()
            while sender.is_alive() or len(latencies) < 5:
                started = time.perf_counter()
                assert probe.get(f"{served_process}/health").status_code == 200
                latencies.append(time.perf_counter() - started)
                time.sleep(0.01)
            sender.join()
    finally:
        gc.enable()
    assert set(answers) <= allowed, answers
    assert max(latencies) < 0.1, f"/health took {max(latencies):.3f} s while '{name}' was in flight"
    assert_healthy(served_process)


@SERIAL
def test_sigterm_mid_stream_ends_by_the_signal_and_logs_the_cut(default_model_dir):
    """A stream still running when the graceful shutdown's time is up ends with an error event and
    [DONE]; its log line says status 200 *and* that it was cut; the process ends by SIGTERM."""
    import signal
    import threading

    from tests.helpers.server_harness import ServeProcess

    lines: list[str] = []
    with ServeProcess(default_model_dir, "--shutdown-timeout", "1") as served:

        def stream():
            body = {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{served.base}/v1/completions", json=body, timeout=60) as response:
                lines.extend(response.iter_lines())

        reader = threading.Thread(target=stream)
        reader.start()
        deadline = time.monotonic() + 30
        while not any('"text"' in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        served.proc.send_signal(signal.SIGTERM)
        reader.join(30)
        log = served.output()
    assert served.proc.returncode == -signal.SIGTERM
    events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and "server_shutdown" in events[-2]
    assert re.search(r"path=/v1/completions status=200 .*outcome=cut_at_shutdown", log), log[-2000:]


def test_a_trusted_proxy_names_the_client(tiny_model_dir):
    """Behind a proxy on a trusted address, a request is the client X-Forwarded-For names (its turns,
    its log line); from an untrusted peer the header changes nothing."""
    from tests.helpers.server_harness import ServeProcess

    folder = tiny_model_dir("llama_gqa")
    body = {"prompt": "Hi", "max_tokens": 1}
    forwarded = {"X-Forwarded-For": "203.0.113.9"}
    for trusted, client in (("127.0.0.1", "203.0.113.9"), ("10.9.9.9", "127.0.0.1")):
        with ServeProcess(folder, "--forwarded-allow-ips", trusted) as served:
            assert (
                httpx.post(f"{served.base}/v1/completions", json=body, headers=forwarded, timeout=60).status_code == 200
            )
            served.proc.terminate()
            log = served.output()
        assert re.search(rf"path=/v1/completions status=200 .*client={re.escape(client)}\b", log), log[-1500:]


def test_n_is_bounded_by_the_servers_one_sequence_bound(tiny_engine):
    """n past 16 is fine up to --max-seqs-per-request (the one bound, in the README); past it, a 400
    naming n."""
    from fastapi.testclient import TestClient

    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app
    from tokenloom.entrypoints.server.admission import AdmissionLimits

    limits = AdmissionLimits(max_seqs_per_request=24, max_running_per_request=24, max_running_per_client=24)
    with TestClient(build_app(AsyncLLMEngine(tiny_engine), "tiny", limits=limits)) as tc:
        many = tc.post("/v1/completions", json={"prompt": "Hi", "n": 20, "max_tokens": 1})
        too_many = tc.post("/v1/completions", json={"prompt": "Hi", "n": 25, "max_tokens": 1})
    assert many.status_code == 200 and len(many.json()["choices"]) == 20
    assert openai_error(too_many, 400)["param"] == "n"
    assert "at most 24 per request" in too_many.json()["error"]["message"]
