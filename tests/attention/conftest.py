"""Fixtures of the attention tests."""

from __future__ import annotations

import pytest

from tokenloom.attention import cpu_prefill


@pytest.fixture(params=cpu_prefill._BUILDS, ids=lambda build: build[0])
def prefill_build(request, monkeypatch):
    """A test taking this runs against each build of the prefill kernel this CPU runs (AVX-512, AVX2)."""
    monkeypatch.setattr(cpu_prefill, "_BUILDS", (request.param,))
    if cpu_prefill.ops() is None:
        pytest.skip(f"the {request.param[0]} build of the kernel does not run here")
    return request.param
