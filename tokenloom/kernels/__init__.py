"""Kernel plumbing shared by every package: the native C++ build (``native.py``: per-ISA builds cached
by source hash; ``setup.py`` builds them ahead of time), the headers the C++ kernels share
(``include/``), and the Triton kernels of the CUDA path (``triton/``).

Each C++ kernel's source lives in a ``csrc/`` beside the Python that calls it (layers/, attention/,
quant/int8/, quant/gguf/, sampling/).
"""
