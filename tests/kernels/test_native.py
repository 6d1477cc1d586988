"""Loading tokenloom's compiled kernels: a library already built loads from its .so, and a build
lock left by a killed build does not make every later start wait forever."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from tokenloom.kernels import native


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("")
    assert not native.clear_stale_lock(str(tmp_path)) and lock.exists()  # a build may hold it now
    old = time.time() - native.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert native.clear_stale_lock(str(tmp_path)) and not lock.exists()
    assert not native.clear_stale_lock(str(tmp_path))  # no lock: nothing to do


@pytest.mark.serial  # times a load, and puts a lock in the shared build folder
def test_a_built_library_loads_though_its_folder_holds_a_lock(monkeypatch):
    """The fused decoder ops are built by now (the suite builds them); with a lock in their build
    folder, as a killed build leaves it, loading them again returns at once instead of waiting."""
    from torch.utils.cpp_extension import _get_build_directory

    from tokenloom.layers import fused

    assert fused.build()
    source = fused._SOURCE
    folder = _get_build_directory(native.library_name(source, "avx2"), verbose=False)
    lock = os.path.join(folder, "lock")
    fresh = not os.path.exists(lock)
    open(lock, "a").close()
    try:
        start = time.monotonic()
        assert native._build(source, "fused decoder ops", "avx2") is True
        assert time.monotonic() - start < 10
        assert torch.ops.tokenloom_fused.row_argmax(torch.tensor([[1.0, 3.0, 2.0]])).tolist() == [1]
    finally:
        if fresh:
            os.remove(lock)


def test_the_build_folder_is_where_torch_builds(monkeypatch, tmp_path):
    """native.build_folder mirrors torch's private _get_build_directory (a built library is loaded
    without importing cpp_extension): the same path by default and under TORCH_EXTENSIONS_DIR."""
    from torch.utils.cpp_extension import _get_build_directory

    name = "tokenloom_probe_avx2_0123456789"
    expected = _get_build_directory(name, verbose=False)  # torch's helper makes the folder
    os.rmdir(expected)
    assert native.build_folder(name) == expected
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert native.build_folder(name) == _get_build_directory(name, verbose=False) == str(tmp_path / name)


def test_a_built_library_loads_without_cpp_extension():
    """In a fresh process whose kernels are built (the suite builds them), loading them does not
    import torch.utils.cpp_extension (nor setuptools with it)."""
    import subprocess
    import sys

    from tokenloom.layers import fused

    assert fused.build()
    code = (
        "import sys; from tokenloom.layers import fused; assert fused.build(); "
        "print('torch.utils.cpp_extension' in sys.modules, 'setuptools' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_setup_builds_every_cpp_kernel_the_package_has():
    """`make setup` (tokenloom.kernels.setup) leaves no C++ source for a first run to compile: each
    csrc/*.cpp is built or loaded by one of its entries."""
    from tokenloom.kernels import setup

    if not native.cpu_has_avx2() or os.environ.get("TOKENLOOM_NO_KERNELS") == "1":
        pytest.skip("no kernels build here")
    package = Path(native.__file__).parent.parent
    for _, build in setup.kernels():
        build()
    sources = set(package.rglob("csrc/*.cpp"))
    loaded = {source for source, _ in native._loaded} | set(native._modules)
    assert sources and sources <= loaded, sorted(str(s.relative_to(package)) for s in sources - loaded)
