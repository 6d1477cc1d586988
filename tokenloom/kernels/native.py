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
import re
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)


_ISA_FLAGS = {"avx2": ["-mavx2", "-mfma", "-mf16c"]}
_ISA_FLAGS["avx512"] = _ISA_FLAGS["avx2"] + ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
_ISA_FLAGS["avx512vnni"] = _ISA_FLAGS["avx512"] + ["-mavx512vnni"]


def cpu_has_avx2() -> bool:
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def cpu_has_avx512() -> bool:
    """AVX-512 F/BW/DQ/VL, as torch detects it (its "AVX512" capability)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


def cpu_has_avx512_vnni() -> bool:
    is_vnni = getattr(torch.cpu, "_is_vnni_supported", None)
    return cpu_has_avx512() and bool(is_vnni and is_vnni())


_HAS_ISA = {"avx2": cpu_has_avx2, "avx512": cpu_has_avx512, "avx512vnni": cpu_has_avx512_vnni}


_loaded: dict[tuple[Path, str], bool] = {}


def load(source: Path, what: str, isa: str = "avx2") -> bool:
    """Compile and register `source` for `isa` ("avx2", "avx512", "avx512vnni") once per process.

    False, with one warning where a build fails, if it cannot: kernels disabled, the CPU
    lacks the instruction set, or no toolchain. `what` only names the kernel in messages:
    the outcome is remembered per (source, isa), so a library is never registered twice.
    """
    key = (source, isa)
    if key not in _loaded:
        _loaded[key] = _build(source, what, isa)
    return _loaded[key]


_fastest: dict[tuple[tuple[str, str], ...], object] = {}


def fastest(source: Path, what: str, builds: tuple[tuple[str, str], ...]):
    """The torch.ops namespace of the first (isa, library) in `builds` that `source` loads for,
    fastest first (the source names its TORCH_LIBRARY per ISA); None if none does.
    Remembered per `builds` (library names are unique to their source): callers sit on
    every layer's forward."""
    if builds not in _fastest:
        _fastest[builds] = next(
            (getattr(torch.ops, library) for isa, library in builds if load(source, what, isa)), None
        )
    return _fastest[builds]


def _text_with_headers(source: Path) -> bytes:
    """The source's bytes and those of the headers it includes by a quoted relative path, so
    editing a shared header rebuilds every kernel that uses it."""
    text = source.read_bytes()
    headers = re.findall(rb'^#include "([^"]+)"', text, flags=re.MULTILINE)
    return text + b"".join((source.parent / h.decode()).read_bytes() for h in headers)


_modules: dict[Path, object] = {}


def load_module(source: Path, what: str):
    """Compile `source` as a Python extension module (pybind11, AVX2 flags) once per process and
    return it; None, with one warning where a build fails, if it cannot be (as ``load``)."""
    if source not in _modules:
        _modules[source] = _build(source, what, "avx2", python_module=True) or None
    return _modules[source]


def library_name(source: Path, isa: str) -> str:
    """The name `source` builds under for `isa`: it carries a hash of the source and its headers,
    so an edit builds anew and a built library is never stale."""
    return f"tokenloom_{source.stem}_{isa}_{hashlib.sha1(_text_with_headers(source)).hexdigest()[:10]}"


STALE_LOCK_S = 300  # a build holds its folder's lock for ~15-30 s; one this old was left by a killed process


def _build(source: Path, what: str, isa: str, python_module: bool = False):
    """Compile `source` for `isa` into torch's extension cache: True (or the module, where
    `python_module`), False where it cannot be. A library already built (its name carries the
    source's hash) is loaded straight from its .so, without torch's build lock."""
    if os.environ.get("TOKENLOOM_NO_KERNELS") == "1" or not _HAS_ISA[isa]():
        return False
    name = library_name(source, isa)
    built = os.path.join(build_folder(name), f"{name}.so")
    if os.path.exists(built) and (module := _load_built(built, name, python_module)) is not None:
        return module  # without importing cpp_extension (and setuptools, a heavy import)
    from torch.utils.cpp_extension import _get_build_directory
    from torch.utils.cpp_extension import load as build

    try:
        # torch builds under <root>/py311_cpu/<name>/ (its private helper names the folder)
        folder = _get_build_directory(name, verbose=False)
        log.info("compiling tokenloom's %s for %s (once, ~15 s)", what, isa)
        clear_stale_lock(folder)
        module = build(
            name=name,
            sources=[str(source)],
            is_python_module=python_module,
            extra_cflags=["-O3", *_ISA_FLAGS[isa], "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, a toolchain error: fall back, say why once
        log.warning("tokenloom's %s (%s) could not be built (%s); using the slower torch fallback", what, isa, e)
        return False
    return module if python_module else True


def build_folder(name: str) -> str:
    """Where torch's cpp_extension builds library `name` (as its private ``_get_build_directory``
    names it, without creating it): $TORCH_EXTENSIONS_DIR/<name>, else
    <user cache>/torch_extensions/py<version>_<cpu|cuXY|rocmXY>/<name>."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch import _appdirs

        hip, cuda = torch.version.hip, torch.version.cuda
        accelerator = (
            f"rocm{hip.replace('.', '')}"
            if hip is not None
            else f"cu{cuda.replace('.', '')}"
            if cuda is not None
            else "cpu"
        )
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(
            os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions")), f"{python}_{accelerator}"
        )
    return os.path.join(root, name)


def _load_built(path: str, name: str, python_module: bool):
    """The library at `path` loaded (its module, or True for an ops library); None if it does not load."""
    try:
        if not python_module:
            torch.ops.load_library(path)
            return True
        import importlib.util

        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None  # a file path always gets a spec with a loader
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (OSError, ImportError, RuntimeError) as e:
        log.info("rebuilding %s: the built library does not load (%s)", name, e)
        return None


def clear_stale_lock(folder: str) -> bool:
    """Remove torch's build lock in `folder` if older than STALE_LOCK_S (a build killed while it held
    the lock leaves it, and every later build would wait on it forever); True if removed."""
    lock = os.path.join(folder, "lock")
    try:
        if time.time() - os.path.getmtime(lock) > STALE_LOCK_S:
            os.remove(lock)
            log.warning("removed a stale build lock left by an interrupted build: %s", lock)
            return True
    except FileNotFoundError:
        pass
    return False
