"""tokenloom's own weight-only formats, int8 and int4 in groups along the input dimension: the tensor format
(``formats.py``), its 16-row panel layout (``panels.py``), the compiled CPU kernels (``kernels.py``) and the
nn.Linear / nn.Embedding drop-ins with the module swap (``modules.py``)."""
