"""tokenloom's C++ CPU kernels, compiled on first use with torch.utils.cpp_extension.

A source compiles once (~15 s with gcc) into torch's extension cache, named by a hash of
its text, and registers its ``torch.ops.<library>.*``. Where that cannot happen (no
AVX2/FMA, no compiler, ``TOKENLOOM_NO_KERNELS=1``), ``load`` returns False and callers
fall back to plain torch: correct, slower.
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@lru_cache(maxsize=None)
def load(source: Path, what: str) -> bool:
    """Compile and register `source` (once per process); False, with one warning, if it cannot."""
    if os.environ.get("TOKENLOOM_NO_KERNELS") == "1" or not cpu_has_avx2():
        return False
    from torch.utils.cpp_extension import load as build
    digest = hashlib.sha1(source.read_bytes()).hexdigest()[:10]
    try:
        log.info("compiling tokenloom's %s (once, ~15 s)", what)
        build(name=f"tokenloom_{source.stem}_{digest}", sources=[str(source)], is_python_module=False,
              extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no ninja, a toolchain error: fall back, say why once
        log.warning("tokenloom's %s could not be built (%s); using the slower torch fallback", what, e)
        return False
    return True
