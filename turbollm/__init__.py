"""turbollm: an LLM inference engine and server in PyTorch.

    from turbollm import LLM, SamplingParams
    llm = LLM(model="smollm2-135m")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].outputs[0].text)

Names are imported on first use, so `turbollm models` starts without loading torch.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "turbollm.entrypoints.llm",
    "SamplingParams": "turbollm.sampling_params",
    "RequestOutput": "turbollm.outputs",
    "CompletionOutput": "turbollm.outputs",
    "Logprob": "turbollm.outputs",
    "EngineArgs": "turbollm.engine_args",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'turbollm' has no attribute {name!r}")
