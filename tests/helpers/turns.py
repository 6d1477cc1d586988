"""Tests that take turns across pytest-xdist workers.

Under ``pytest -n N`` the workers share the machine's cores. Most tests do not care; a test marked
``serial`` (it asserts a latency, or counts what other processes do to the CPU) must run with the
machine to itself. Each test's whole run (setup, call, teardown) holds a turn:

- an ordinary test a shared turn, running beside other ordinary tests with its share of the cores
  as torch's thread count;
- a ``serial`` test an exclusive turn, with every core: it waits for the running tests to end,
  and no new test starts until it is done (nor until the serial tests that follow it are).

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
def _exclusive() -> Iterator[None]:
    folder = _lock_folder()
    with _locked(folder / "turnstile", fcntl.LOCK_EX), _locked(folder / "readers", fcntl.LOCK_EX):
        torch.set_num_threads(CORES)
        yield


@contextlib.contextmanager
def _shared(workers: int) -> Iterator[None]:
    folder = _lock_folder()
    with _locked(folder / "turnstile", fcntl.LOCK_EX):
        pass  # wait behind a serial test that is queued or running
    with _locked(folder / "readers", fcntl.LOCK_SH):
        torch.set_num_threads(max(1, CORES // workers))
        yield


_held: contextlib.ExitStack | None = None  # this worker's exclusive turn, kept from one serial test to the next


def _release_exclusive() -> None:
    global _held
    if _held is not None:
        _held.close()
        _held = None


def _is_serial(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("serial") is not None


def serial_tests_last_in_their_file(items: list[pytest.Item]) -> None:
    """Reorder `items` in place: within each file, its serial tests after the others (each group
    in its own order), so that they run back to back in one exclusive turn."""
    files: dict[str, int] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], len(files))
    items.sort(key=lambda item: (files[item.nodeid.split("::")[0]], _is_serial(item)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Each test's run in its turn: a serial test's exclusive turn is kept while the next test is
    serial too (else each would wait again for the other workers' running tests to end)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        yield
        return
    global _held
    if not _is_serial(item):
        _release_exclusive()  # held where a serial test expected this one to be serial too (another dist mode)
        with _shared(workers):
            yield
        return
    if _held is None:
        _held = contextlib.ExitStack()
        _held.enter_context(_exclusive())
    try:
        yield
    finally:
        if not _is_serial(nextitem):
            _release_exclusive()
