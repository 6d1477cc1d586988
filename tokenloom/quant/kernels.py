"""The compiled CPU kernels (``csrc/quant_cpu.cpp``), built on first use.

``torch.utils.cpp_extension`` compiles the C++ source once (about 15 s with gcc)
into torch's extension cache and registers ``torch.ops.tokenloom_quant.*``.
Where that cannot happen (no AVX2/FMA, no compiler, not on CPU), ``available()``
is False and QuantizedLinear falls back to dequantize + matmul: correct, slower.
"""

from __future__ import annotations

import hashlib
import logging
import os
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "quant_cpu.cpp"


def _cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@lru_cache(maxsize=1)
def available() -> bool:
    """True once the kernels are compiled and registered (compiles on the first call)."""
    if os.environ.get("TOKENLOOM_NO_KERNELS") == "1" or not _cpu_has_avx2():
        return False
    try:
        _build()
    except Exception as e:  # no compiler, no ninja, a toolchain error: fall back, say why once
        log.warning("int8/int4 CPU kernels could not be built (%s); quantized layers will "
                    "dequantize per call, which is slow", e)
        return False
    return True


def _build() -> None:
    from torch.utils.cpp_extension import load
    digest = hashlib.sha1(_SOURCE.read_bytes()).hexdigest()[:10]
    log.info("compiling tokenloom's int8/int4 CPU kernels (once, ~15 s)")
    load(name=f"tokenloom_quant_{digest}", sources=[str(_SOURCE)], is_python_module=False,
         extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)


def linear_int8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) float32 contiguous -> (M, N); w = q * scales (see formats.py)."""
    return torch.ops.tokenloom_quant.linear_int8(x, q, scales, group, bias)


def linear_int4(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) float32 contiguous -> (M, N); w = q * scales + offsets (see formats.py)."""
    return torch.ops.tokenloom_quant.linear_int4(x, q, scales, offsets, group, bias)
