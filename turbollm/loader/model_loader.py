"""Load a model by name: resolve files, read the config, build the architecture, load weights, tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from turbollm.config import ModelConfig, config_from_gguf, config_from_hf
from turbollm.errors import ModelFormatError
from turbollm.hub.resolve import CheckpointFormat, ResolvedModel, resolve_model
from turbollm.models import build_model
from turbollm.models.common import CausalLM
from turbollm.quantization import get_linear_method


@dataclass
class LoadedModel:
    """A ready model with everything the engine needs to know about it."""

    resolved: ResolvedModel
    config: ModelConfig
    model: CausalLM
    tokenizer: Any  # turbollm.tokenizer.Tokenizer
    load_seconds: float
    file_tensor_bytes: int  # bytes of tensor data in the checkpoint file(s)

    @property
    def weight_bytes(self) -> int:
        """Resident bytes of the model's parameters (shared tensors counted once)."""
        seen, total = set(), 0
        for p in self.model.parameters():
            if p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total


def load_model(name: str, *, quantization: str | None = None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Resolve `name` (catalog name, GGUF file, HF folder or hub id) and load it on the CPU."""
    from turbollm.tokenizer import Tokenizer

    t0 = time.perf_counter()
    resolved = resolve_model(name)
    method = get_linear_method(quantization)
    if resolved.format is CheckpointFormat.GGUF:
        from turbollm.formats.gguf_file import read_gguf
        from turbollm.loader.gguf_weights import iter_gguf_weights

        gguf = read_gguf(resolved.path)
        cfg = config_from_gguf(gguf)
        try:
            tokenizer = Tokenizer.from_gguf(gguf.metadata)
        except ModelFormatError as e:  # the tokenizer sees only the metadata: name the file here
            raise ModelFormatError(f"{gguf.path}: {e}") from None
        weights, hf_layout, file_bytes = iter_gguf_weights(gguf, cfg), False, gguf.tensor_bytes
    else:
        from turbollm.loader.safetensors_weights import iter_safetensors_weights, safetensors_files

        cfg = config_from_hf(resolved.path)
        tokenizer = Tokenizer.from_hf_folder(resolved.path)
        weights, hf_layout = iter_safetensors_weights(resolved.path), True
        file_bytes = sum(f.stat().st_size for f in safetensors_files(resolved.path))
    with torch.no_grad():
        model = build_model(cfg, method)
        model.load_weights(weights, hf_layout=hf_layout, source=str(resolved.path))
    model.eval()
    return LoadedModel(resolved, cfg, model, tokenizer, time.perf_counter() - t0, file_bytes)
