"""Quantization as a strategy per linear layer: `create_weights`, `load_weight`, `apply`.

A `LinearMethod` owns how a linear layer stores its weight and computes `x @ W.T + b`.
Methods are looked up by name in `LINEAR_METHODS`; the model files never see them.
"none" keeps dense float32 weights; "gguf" keeps a GGUF file's own block types
(`gguf_method.py`, raw blocks carried by `qtensor.QuantizedTensor`).
"int8" and "int4"/"int3" (with "-g32"/"-g64"/"-g128") quantize at load (`int8_method.py`,
`int4_method.py`; "int8" equalizes input channels first, `equalize.py`, "int8-rtn" does not);
"gptq" and "awq" name checkpoints quantized offline, detected from their config.json
(`gptq_method.py`, `awq_method.py`, `checkpoint_layouts.py`).
"""

from turbollm.quantization.base import LINEAR_METHODS, LinearMethod, UnquantizedLinearMethod, get_linear_method
from turbollm.quantization.gguf_method import GGUFLinearMethod
from turbollm.quantization import awq_method, gptq_method, int4_method, int8_method  # noqa: F401  (registration)
from turbollm.quantization.qtensor import QuantizedTensor

__all__ = ["LINEAR_METHODS", "GGUFLinearMethod", "LinearMethod", "QuantizedTensor", "UnquantizedLinearMethod",
           "get_linear_method"]
