"""Model architectures, looked up by name in `MODEL_REGISTRY`."""

from __future__ import annotations

from turbollm.config import ModelConfig
from turbollm.errors import UnsupportedArchitectureError
from turbollm.models.common import CausalLM
from turbollm.models.gemma3 import Gemma3ForCausalLM
from turbollm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def build_model(cfg: ModelConfig, method=None) -> CausalLM:
    """Instantiate the architecture of `cfg` with uninitialized weights."""
    try:
        cls = MODEL_REGISTRY[cfg.arch]
    except KeyError:
        raise UnsupportedArchitectureError(f"no implementation of architecture {cfg.arch!r}") from None
    return cls(cfg, method)
