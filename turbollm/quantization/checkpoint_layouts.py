"""Quantized Hugging Face checkpoints (GPTQ, AWQ): detection, and conversion to our layouts.

A quantized folder says what it is in ``config.json``'s ``quantization_config``
(``quant_method``: "gptq" or "awq"). Each layout is a `QuantLayout` registered in
`QUANT_LAYOUTS` by that name; it knows

- how to read its ``quantization_config`` (`parse_config`, errors name the key),
- which linear method holds its weights in memory (`linear_method`: the int4 layout, or int8
  for 8-bit symmetric per-channel GPTQ),
- how one linear's tensors (``qweight``, ``qzeros``, ``scales``, ``g_idx``) become ours
  (`to_internal`), and how a `QuantizedWeight` becomes its tensors (`from_quantized`, export).

`convert_quantized_stream` sits between the safetensors iterator and `CausalLM.load_weights`:
it gathers each linear's tensors (they may arrive in any order, even from different shards),
converts them, and yields them under our parameter names (``.weight``, ``.weight_scales``,
...), so the ordinary loading loop fuses Q/K/V and gate/up as for dense checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from turbollm.errors import InvalidRequestError, ModelFormatError
from turbollm.quantization.base import LinearMethod
from turbollm.quantization.group_quant import QuantizedWeight

# Decoder linears of the architectures we run, by their Hugging Face names.
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LayoutConfig:
    """What a ``quantization_config`` says, normalized."""

    method: str  # "gptq" | "awq"
    bits: int
    group_size: int  # -1: one group per row
    act_order: bool = False
    symmetric: bool = False
    zero_offset: int = 0  # stored zero = zero - zero_offset (GPTQ v1: 1)


class QuantLayout:
    """One quantized checkpoint layout; subclasses register in `QUANT_LAYOUTS`."""

    name: str = ""
    tensor_suffixes: tuple[str, ...] = ()

    def parse_config(self, qcfg: dict[str, Any], where: str) -> LayoutConfig:
        raise NotImplementedError

    def linear_method(self, cfg: LayoutConfig) -> LinearMethod:
        raise NotImplementedError

    def to_internal(self, cfg: LayoutConfig, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
        """One linear's checkpoint tensors → our parameters (suffix → tensor)."""
        raise NotImplementedError

    def from_quantized(self, cfg: LayoutConfig, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        """Our quantized weight → this layout's tensors (suffix → tensor)."""
        raise NotImplementedError

    def quantization_config(self, cfg: LayoutConfig, **extra: Any) -> dict[str, Any]:
        raise NotImplementedError


QUANT_LAYOUTS: dict[str, QuantLayout] = {}


def register_layout(layout: QuantLayout) -> QuantLayout:
    QUANT_LAYOUTS[layout.name] = layout
    return layout


def get_layout(name: str) -> QuantLayout:
    if name not in QUANT_LAYOUTS:
        raise ModelFormatError(f"quantization_config.quant_method {name!r} is not supported; "
                               f"supported: {', '.join(sorted(QUANT_LAYOUTS))}")
    return QUANT_LAYOUTS[name]


def read_quantization_config(raw_config: dict[str, Any], where: str) -> tuple[QuantLayout, LayoutConfig] | None:
    """The layout and its settings named by a ``config.json`` (None: not a quantized checkpoint)."""
    qcfg = raw_config.get("quantization_config")
    if qcfg is None:
        return None
    if not isinstance(qcfg, dict) or not isinstance(qcfg.get("quant_method"), str):
        raise ModelFormatError(f"{where}: quantization_config must be an object with a quant_method string")
    layout = get_layout(qcfg["quant_method"].lower())
    return layout, layout.parse_config(qcfg, where)


def config_int(qcfg: dict[str, Any], keys: tuple[str, ...], where: str, default: int | None = None) -> int:
    """The first of `keys` present in `qcfg`, as an int (errors name the key)."""
    for key in keys:
        if key in qcfg:
            value = qcfg[key]
            if isinstance(value, bool) or not isinstance(value, int):
                raise ModelFormatError(f"{where}: quantization_config.{key} must be an integer, got {value!r}")
            return value
    if default is None:
        raise ModelFormatError(f"{where}: quantization_config lacks {keys[0]!r}")
    return default


def check_choice(value: Any, allowed: Iterable[Any], key: str, where: str) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ModelFormatError(f"{where}: quantization_config.{key} = {value!r} is not supported "
                               f"(supported: {', '.join(map(repr, allowed))})")


def _module_and_suffix(name: str, suffixes: tuple[str, ...]) -> tuple[str, str] | None:
    prefix, _, suffix = name.rpartition(".")
    return (prefix, suffix) if suffix in suffixes and prefix.rpartition(".")[2] in LINEAR_NAMES else None


def convert_quantized_stream(weights: Iterable[tuple[str, torch.Tensor]], layout: QuantLayout, cfg: LayoutConfig,
                             source: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, checkpoint tensor) → (name, tensor in our layout) for a quantized checkpoint."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    needed = set(layout.tensor_suffixes)
    for name, tensor in weights:
        hit = _module_and_suffix(name, layout.tensor_suffixes)
        if hit is None:
            prefix, _, suffix = name.rpartition(".")
            if suffix == "weight" and prefix.rpartition(".")[2] in LINEAR_NAMES:
                raise ModelFormatError(f"{source}: {name} is a dense weight in a {layout.name} checkpoint; "
                                       f"mixing dense and quantized decoder linears is not supported")
            yield name, tensor
            continue
        prefix, suffix = hit
        group = pending.setdefault(prefix, {})
        group[suffix] = tensor
        if needed <= group.keys():
            del pending[prefix]
            for our_suffix, t in layout.to_internal(cfg, group, f"{source}: {prefix}").items():
                yield f"{prefix}.{our_suffix}", t
    if pending:
        prefix, group = next(iter(pending.items()))
        missing = sorted(needed - group.keys())
        raise ModelFormatError(f"{source}: {prefix} lacks {', '.join(f'{prefix}.{m}' for m in missing)}"
                               + (f" (and {len(pending) - 1} more incomplete layers)" if len(pending) > 1 else ""))


class CheckpointOnlyMethod(LinearMethod):
    """Registry entry for a method that only describes checkpoints quantized offline ("gptq", "awq")."""

    name = ""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        raise InvalidRequestError(
            f"quantization {self.name!r} loads checkpoints quantized offline; this model is not one. Run "
            f"`turbollm quantize MODEL --method {self.name} --out DIR` and load DIR (the method is read from its "
            f"config.json), or use 'int8' / 'int4' to quantize at load")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise RuntimeError("unreachable: create_weights refuses")
