"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest

from tokenloom.attention import cpu_decode


@pytest.fixture(params=cpu_decode.BUILDS, ids=[isa for isa, _ in cpu_decode.BUILDS])
def kernel_build(request, monkeypatch):
    """A test taking this runs against each build of the decode kernel this CPU runs (AVX-512, AVX2)."""
    monkeypatch.setattr(cpu_decode, "BUILDS", (request.param,))
    if not cpu_decode.build():
        pytest.skip(f"the {request.param[0]} build of the kernel does not run here")
    return request.param
