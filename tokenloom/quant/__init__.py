"""Weight-only int8/int4 quantization: formats, CPU kernels, quantized modules."""

from tokenloom.quant.formats import QuantizedTensor, quantize, quantize_int4, quantize_int8
from tokenloom.quant.modules import QuantizedEmbedding, QuantizedLinear, quantize_structure
from tokenloom.quant.scheme import CHOICES, WeightFormat, parse_quantization

__all__ = ["CHOICES", "QuantizedEmbedding", "QuantizedLinear", "QuantizedTensor", "WeightFormat",
           "parse_quantization", "quantize", "quantize_int4", "quantize_int8", "quantize_structure"]
