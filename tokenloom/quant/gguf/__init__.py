"""GGUF weight blocks kept as the file stores them: the tensor and its kernels (``tensor.py``), the
Linear/Embedding drop-ins (``modules.py``), exact conversions to the int8/int4 formats (``blocks.py``) and
the 16-row panel layouts of the other types (``panels.py``)."""
