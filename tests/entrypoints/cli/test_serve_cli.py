"""`tokenloom serve` as users run it: a subprocess that serves, then shuts down gracefully on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import httpx
import pytest

from tests.helpers.server_harness import ServeProcess


def test_serve_answers_then_finishes_inflight_stream_on_sigterm(default_model_dir, tmp_path):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "description": "The time",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    (tmp_path / "tools.json").write_text(json.dumps(tools))
    with ServeProcess(default_model_dir, "--tools", str(tmp_path / "tools.json")) as served:
        proc, base = served.proc, served.base
        settings = httpx.get(f"{base}/playground/settings").json()
        assert settings["tools"] == tools  # the playground offers them
        assert settings["sampling"]["temperature"] == 0.8 and settings["sampling_source"] == "llama.cpp's defaults"
        body = {"model": "smol", "prompt": "Count:", "max_tokens": 24, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            os.kill(proc.pid, signal.SIGTERM)  # mid-stream: the request must still complete
            rest = [line for line in lines if line.startswith("data:")]
        assert first and rest[-1] == "data: [DONE]"
        assert '"finish_reason": "length"' in rest[-2]
        # uvicorn re-raises the signal once it has shut down, so the exit status is SIGTERM's.
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        log = served.output()
        assert "Traceback" not in log and "Finished server process" in log
        assert f"playground: {base}/" in log  # the start-up line names it
        assert "method=POST path=/v1/completions status=200" in log  # one line per request


def test_requests_cut_at_shutdown_end_with_an_error_not_a_dropped_connection(default_model_dir):
    import threading

    with ServeProcess(default_model_dir, "--shutdown-timeout", "1") as served:
        body = {"model": "smol", "prompt": "Count:", "max_tokens": 200, "ignore_eos": True}
        whole = {}
        worker = threading.Thread(
            target=lambda: whole.setdefault(
                "response", httpx.post(f"{served.base}/v1/completions", json=body, timeout=60)
            )
        )
        worker.start()
        with httpx.stream(
            "POST", f"{served.base}/v1/completions", json=body | {"stream": True}, timeout=60
        ) as response:
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            os.kill(served.proc.pid, signal.SIGTERM)  # 200 tokens take longer than the 1 s grace
            rest = [line for line in lines if line.startswith("data:")]
        worker.join()
        assert whole["response"].status_code == 503
        assert whole["response"].json()["error"]["code"] == "server_shutdown"
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: ") :])["error"]
        assert error["code"] == "server_shutdown" and "shutting down" in error["message"]
        assert not any('"finish_reason": "length"' in line for line in rest)  # it was cut, not finished
        served.proc.wait(timeout=60)


_PROBE = """
import json, pathlib, sys, time, httpx
base, stop = sys.argv[1], pathlib.Path(sys.argv[2])
latencies = []
with httpx.Client() as probe:                 # one kept-alive connection, as a monitor would
    print("ready", flush=True)
    while not stop.exists():
        started = time.perf_counter()
        assert probe.get(base + "/health").status_code == 200
        latencies.append(time.perf_counter() - started)
        time.sleep(0.05)
print(json.dumps(latencies))
"""


@pytest.mark.serial  # times /health beside the tokenizing: the machine to itself under pytest -n
def test_tokenizing_a_huge_prompt_does_not_block_the_server(default_model_dir, tmp_path):
    """A 4 MB prompt takes seconds to tokenize (then a 400: longer than the context); /health keeps
    answering within 100 ms meanwhile. (With the tokenizing in a nice-10 thread of the server, a
    shared 2-core CI machine showed 91, 174 and 289 ms among 38: freeing the tokens held the GIL;
    server/long_texts.py now tokenizes in a child process.) The server and the /health monitor
    each run in their own process, as deployed: the test process's own threads and collections
    are not the server's."""
    import subprocess

    with ServeProcess(default_model_dir) as served:
        body = json.dumps({"prompt": "Hello world, this is a test. " * 140_000, "max_tokens": 2}).encode()
        stop = tmp_path / "stop"
        probe = subprocess.Popen(
            [sys.executable, "-c", _PROBE, served.base, str(stop)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert probe.stdout.readline().strip() == "ready"
            response = httpx.post(
                f"{served.base}/v1/completions", content=body, timeout=120, headers={"content-type": "application/json"}
            )
        finally:
            stop.touch()
            latencies = json.loads(probe.communicate(timeout=30)[0])
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"
        # Before: one 2.3 s freeze.
        shown = " ".join(str(round(x * 1000)) for x in latencies)
        assert len(latencies) >= 5 and max(latencies) < 0.1, shown


def _raw(base: str, data: bytes, wait_s: float) -> tuple[bytes, float]:
    """Send `data` on a new connection, then read until the server closes it or `wait_s` passes:
    (what came back, seconds until then)."""
    import socket

    host, port = base.removeprefix("http://").split(":")
    started = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        sock.sendall(data)
        answer = b""
        try:
            while part := sock.recv(4096):
                answer += part
        except TimeoutError:
            pass
    return answer, time.monotonic() - started


def test_slow_headers_are_cut_with_408_and_connections_are_capped(default_model_dir):
    with ServeProcess(default_model_dir, "--body-timeout", "1", "--max-connections", "3") as served:
        answer, seconds = _raw(served.base, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n", wait_s=10)
        assert answer.startswith(b"HTTP/1.1 408") and b"headers did not arrive" in answer and seconds < 5
        # a kept-alive connection's second request gets the same deadline
        import socket

        host, port = served.base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            first = b""
            while not first.endswith(b'{"status":"ok"}'):
                first += sock.recv(4096)
            assert first.startswith(b"HTTP/1.1 200")
            started = time.monotonic()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 1")
            assert sock.recv(4096).startswith(b"HTTP/1.1 408") and time.monotonic() - started < 5
        # three connections open (idle, within their header deadline): a request on a fourth is
        # answered 503 at once, not queued
        held = [socket.create_connection((host, int(port))) for _ in range(3)]
        try:
            time.sleep(0.3)
            assert httpx.get(f"{served.base}/health", timeout=5).status_code == 503
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.3)
        assert httpx.get(f"{served.base}/health", timeout=5).status_code == 200
