"""The playground in a real headless browser (Debian's Chromium driven by Playwright), kept offline:
the page may only talk to the server under test. Screenshots go to test-artifacts/playground/
(or $TOKENLOOM_ARTIFACTS/playground/)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("TOKENLOOM_ARTIFACTS", "test-artifacts")) / "playground"


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not CHROMIUM.exists():
        pytest.skip("Debian's chromium is not installed (make setup installs it)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=str(CHROMIUM),
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--disable-quic",
            ],
        )
        yield b
        b.close()


def offline_page(browser, base_url: str, model_name: str, width: int, height: int):
    """The playground, once it shows `model_name`; any request off the server is recorded in
    ``page.outside`` and refused."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.outside = []

    def only_local(route):
        if route.request.url.startswith(base_url) or route.request.url.startswith("data:"):
            return route.continue_()
        page.outside.append(route.request.url)
        return route.abort()

    page.route("**/*", only_local)
    page.goto(f"{base_url}/")
    page.wait_for_function(f"document.getElementById('model').textContent.includes({model_name!r})")
    return page


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def set_controls(page, **values) -> None:
    for name, value in values.items():
        page.fill(f"#{name}", str(value))


def run_and_wait(page, button: str = "#generate") -> None:
    page.click(button)
    page.wait_for_function(
        "/^(done|error|stopped)/.test(document.getElementById('status').textContent)", timeout=60_000
    )


def token_texts(page) -> list[str]:
    return page.eval_on_selector_all("#output .tok", "els => els.map(e => e.textContent)")
