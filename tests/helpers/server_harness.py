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
