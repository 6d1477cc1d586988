"""Tests that take turns across pytest-xdist workers.

Under ``pytest -n N`` the workers share the machine's cores. Most tests do not care; a test marked
``serial`` (it asserts a latency, or counts what other processes do to the CPU) must run with the
machine to itself. Each test's whole run (setup, call, teardown) holds a turn:

- an ordinary test a shared turn, running beside other ordinary tests with its share of the cores
  as torch's thread count;
- a ``serial`` test an exclusive turn, with every core: it waits for the running tests to end,
  and no new test starts until it is done.

The turns are two ``flock`` files, a turnstile in front of a readers-writer lock, so a waiting
serial test is not starved by ordinary tests that keep starting. Without xdist nothing waits.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tokenloom.engine.cpu_share import _allowed_cpus

CORES = len(_allowed_cpus())  # the cores this process may run on, as the engine counts them


def _lock_folder() -> Path:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "solo")
    folder = Path(tempfile.gettempdir()) / f"tokenloom-test-turns-{run}"
    folder.mkdir(exist_ok=True)
    return folder


@contextlib.contextmanager
def _locked(path: Path, mode: int) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle, mode)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def turn(serial: bool, workers: int) -> Iterator[None]:
    """Hold a test's turn: exclusive with every core if `serial`, else shared with this worker's
    share of the cores."""
    folder = _lock_folder()
    turnstile, readers = folder / "turnstile", folder / "readers"
    if serial:
        with _locked(turnstile, fcntl.LOCK_EX), _locked(readers, fcntl.LOCK_EX):
            torch.set_num_threads(CORES)
            yield
        return
    with _locked(turnstile, fcntl.LOCK_EX):
        pass  # wait behind a serial test that is queued or running
    with _locked(readers, fcntl.LOCK_SH):
        torch.set_num_threads(max(1, CORES // workers))
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        yield
        return
    with turn(item.get_closest_marker("serial") is not None, workers):
        yield
