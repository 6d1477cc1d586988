"""`tokenloom serve` as users run it: a subprocess that serves, then shuts down gracefully on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.server_harness import free_port


def test_serve_answers_then_finishes_inflight_stream_on_sigterm(default_model_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tokenloom.cli", "serve", "-m", str(default_model_dir),
                             "--port", str(port), "--max-model-len", "256", "--kv-cache-memory", "0.1",
                             "--served-model-name", "smol"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        body = {"model": "smol", "prompt": "Count:", "max_tokens": 24, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            os.kill(proc.pid, signal.SIGTERM)          # mid-stream: the request must still complete
            rest = [line for line in lines if line.startswith("data:")]
        assert first and rest[-1] == "data: [DONE]"
        assert '"finish_reason": "length"' in rest[-2]
        # uvicorn re-raises the signal once it has shut down, so the exit status is SIGTERM's.
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        log = proc.stdout.read()
        assert "Traceback" not in log and "Finished server process" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
