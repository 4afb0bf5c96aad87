"""Quantization as a strategy per linear layer: `create_weights`, `load`, `apply`.

A `LinearMethod` owns how a linear layer stores its weight and computes `x @ W.T + b`.
Methods are looked up by name in `LINEAR_METHODS`; the model files never see them.
"""

from turbollm.quantization.base import LINEAR_METHODS, LinearMethod, UnquantizedLinearMethod, get_linear_method

__all__ = ["LINEAR_METHODS", "LinearMethod", "UnquantizedLinearMethod", "get_linear_method"]
