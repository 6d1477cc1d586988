"""Run a tokenloom server in a background thread (real uvicorn, real sockets) for tests."""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx
import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadedServer:
    """``with ThreadedServer(app) as base_url:`` serves `app` on 127.0.0.1 until the block ends."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.05)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def metric(base_url: str, name: str, labels: str = "", text: str | None = None) -> float:
    """One sample's value from GET /metrics (e.g. name='tokenloom_kv_cache_blocks_used'), or from
    `text`, a /metrics page already fetched."""
    text = httpx.get(f"{base_url}/metrics").text if text is None else text
    pattern = rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$"
    match = re.search(pattern, text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_until_idle(base_url: str, timeout: float = 15.0) -> float:
    """Poll /metrics until no request runs or waits; returns the KV blocks still in use. One client
    for every poll: building an httpx client costs more than the request it sends."""
    deadline = time.monotonic() + timeout
    with httpx.Client() as client:
        while True:
            page = client.get(f"{base_url}/metrics").text
            busy = sum(metric(base_url, f"tokenloom_num_requests_{s}", text=page) for s in ("running", "waiting"))
            if busy == 0 or time.monotonic() > deadline:
                return metric(base_url, "tokenloom_kv_cache_blocks_used", text=page)
            time.sleep(0.02)


class ServeProcess:
    """``with ServeProcess(model_dir, *flags) as proc:`` runs `tokenloom serve` as users run it (a
    subprocess on a free port, model served as 'smol') until it answers /health; ``proc.base``
    is its URL, ``proc.proc`` the Popen, killed on exit if still alive. What it prints (stdout and
    stderr, a line per request among it) is read as it comes, so that a full pipe never blocks
    the server (64 KiB: ~1,000 request lines); ``output()`` gives it once the server has ended."""

    def __init__(self, model_dir, *flags: str) -> None:
        import subprocess
        import sys

        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tokenloom",
                "serve",
                "-m",
                str(model_dir),
                "--port",
                str(self.port),
                "--max-model-len",
                "256",
                "--kv-cache-memory",
                "0.1",
                "--served-model-name",
                "smol",
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.printed: list[str] = []
        self.reader = threading.Thread(target=lambda: self.printed.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    def output(self, timeout: float = 60) -> str:
        """Everything the server printed, once it has ended (waits up to `timeout` s for that)."""
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=timeout)
        return "".join(self.printed)

    def __enter__(self) -> ServeProcess:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"tokenloom serve did not start: {self.output()}")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
