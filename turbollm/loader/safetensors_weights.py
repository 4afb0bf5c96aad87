"""Hugging Face safetensors folders → (name, fp32 tensor) pairs, memory-mapped, one tensor at a time.

Floating tensors arrive as float32 and integer tensors as they are. A folder whose
``config.json`` has a ``quantization_config`` (GPTQ, AWQ) is read through its layout's
converter (`quantization.checkpoint_layouts`): `quantized_checkpoint` says which, and
`iter_checkpoint_weights` yields every tensor already in our parameter layout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from turbollm.errors import ModelFormatError


def safetensors_files(folder: Path) -> list[Path]:
    """The shard files of a folder, from its index when there is one."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelFormatError(f"{index}: malformed index: {e}") from None
        files = [folder / n for n in names]
        for f in files:
            if not f.is_file():
                raise ModelFormatError(f"{index}: names shard {f.name}, which is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{folder}: no *.safetensors files")
    return files


def quantized_checkpoint(folder: Path):
    """(layout, settings) of a GPTQ/AWQ folder, from its config.json; None for a dense one."""
    from turbollm.quantization.checkpoint_layouts import read_quantization_config

    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: cannot read: {e}") from None
    return read_quantization_config(raw, str(path))


def iter_checkpoint_weights(folder: Path, quantized=None, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder, converted to our layout when the folder is quantized; with `keep`
    (a predicate on the tensor's name), only those it keeps are read."""
    from turbollm.quantization.checkpoint_layouts import convert_quantized_stream

    weights = iter_safetensors_weights(folder, keep)
    if quantized is None:
        return weights
    layout, cfg = quantized
    return convert_quantized_stream(weights, layout, cfg, str(folder))


def iter_safetensors_weights(folder: Path, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt") as f:
                for stored in f.keys():
                    name = stored
                    if name.startswith("model.language_model."):  # multimodal wrappers
                        name = "model." + name[len("model.language_model."):]
                    if keep is not None and not keep(name):
                        continue
                    t = f.get_tensor(stored)
                    yield name, t.float() if t.is_floating_point() else t
        except ModelFormatError:
            raise
        except Exception as e:  # safetensors raises SafetensorError for truncated/corrupt headers
            raise ModelFormatError(f"{path}: cannot read safetensors file: {e}") from None
