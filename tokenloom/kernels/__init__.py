"""Device kernels that are not CPU C++: the Triton kernels of the CUDA path (``kernels/triton``).

The CPU's own C++ kernels live in a ``csrc/`` beside the Python that calls them (models/,
attention/, quant/, sampling/); this package holds what runs on a GPU.
"""
