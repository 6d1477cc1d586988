"""Quantized weights: tokenloom's int8/int4 formats (``int8/``), GGUF blocks as stored (``gguf/``), which
layers get which format (``checkpoint.py``) and what a user may ask for (``scheme.py``)."""

from tokenloom.quant.int8.formats import QuantizedTensor, quantize, quantize_int4, quantize_int8
from tokenloom.quant.int8.modules import QuantizedEmbedding, QuantizedLinear, quantize_structure
from tokenloom.quant.scheme import CHOICES, WeightFormat, parse_quantization

__all__ = [
    "CHOICES",
    "QuantizedEmbedding",
    "QuantizedLinear",
    "QuantizedTensor",
    "WeightFormat",
    "parse_quantization",
    "quantize",
    "quantize_int4",
    "quantize_int8",
    "quantize_structure",
]
