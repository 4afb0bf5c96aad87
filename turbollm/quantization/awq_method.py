"""AWQ checkpoints in the AutoAWQ "gemm" tensor layout, and the "awq" method name.

Per linear (W is ``[N, K]``; G = K / group_size):
- ``qweight`` int32 ``[K, N / 8]``: for each input column k, eight 4-bit codes of outputs
  ``8c .. 8c+7`` per word, interleaved: nibble i holds output ``8c + AWQ_ORDER[i]``
  (``AWQ_ORDER = 0, 2, 4, 6, 1, 3, 5, 7``);
- ``qzeros`` int32 ``[G, N / 8]``: zero points, same packing, stored as is;
- ``scales`` float16 ``[G, N]``.

``W[n, k] = (q[k, n] - zero[k // g, n]) * scale[k // g, n]``. AWQ's activation scales are
already folded into the preceding norm / linear weights of the checkpoint, so loading needs
nothing beyond the int4 layout.
"""

from __future__ import annotations

from typing import Any

import torch

from turbollm.errors import ModelFormatError
from turbollm.formats.packing import pack_awq, pack_nibbles, unpack_awq
from turbollm.quantization.base import register_linear_method
from turbollm.quantization.checkpoint_layouts import (CheckpointOnlyMethod, LayoutConfig, QuantLayout, check_choice,
                                                      config_int, register_layout)
from turbollm.quantization.group_quant import QuantizedWeight
from turbollm.quantization.int4_method import Int4LinearMethod


class AWQLayout(QuantLayout):
    name = "awq"
    tensor_suffixes = ("qweight", "qzeros", "scales")

    def parse_config(self, qcfg: dict[str, Any], where: str) -> LayoutConfig:
        bits = config_int(qcfg, ("bits", "w_bit"), where)
        check_choice(bits, (4,), "bits", where)
        group = config_int(qcfg, ("group_size", "q_group_size"), where)
        if group <= 0:
            raise ModelFormatError(f"{where}: quantization_config.group_size must be positive, got {group}")
        check_choice(str(qcfg.get("version", "gemm")).lower(), ("gemm",), "version", where)
        check_choice(bool(qcfg.get("zero_point", True)), (True,), "zero_point", where)
        return LayoutConfig("awq", bits, group)

    def linear_method(self, cfg: LayoutConfig):
        return Int4LinearMethod(cfg.bits, cfg.group_size, prequantized=True)

    def to_internal(self, cfg: LayoutConfig, tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
        qweight, qzeros, scales = (tensors[s] for s in self.tensor_suffixes)
        if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
            raise ModelFormatError(f"{where}: qweight/qzeros must be int32, got {qweight.dtype}/{qzeros.dtype}")
        k, n = qweight.shape[0], qweight.shape[1] * 8
        g = cfg.group_size
        if k % g or tuple(scales.shape) != (k // g, n) or tuple(qzeros.shape) != (k // g, n // 8):
            raise ModelFormatError(f"{where}: inconsistent shapes qweight {list(qweight.shape)}, qzeros "
                                   f"{list(qzeros.shape)}, scales {list(scales.shape)} for group size {g}")
        return {"weight": pack_nibbles(unpack_awq(qweight).t()),
                "weight_scales": scales.to(torch.float16).t().contiguous(),
                "weight_zeros": unpack_awq(qzeros).t().to(torch.uint8).contiguous()}

    def from_quantized(self, cfg: LayoutConfig, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        if qw.perm is not None:
            raise ValueError("the AWQ layout has no column permutation")
        if qw.bits != 4:
            raise ValueError(f"the AWQ layout holds 4-bit codes, got {qw.bits}")
        return {"qweight": pack_awq(qw.q.to(torch.int64).t()),
                "qzeros": pack_awq(qw.zeros.to(torch.int64).t()),
                "scales": qw.scales.t().to(torch.float16).contiguous()}

    def quantization_config(self, cfg: LayoutConfig, **extra: Any) -> dict[str, Any]:
        return {"quant_method": "awq", "bits": cfg.bits, "group_size": cfg.group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None, **extra}


register_layout(AWQLayout())


@register_linear_method("awq")
class AWQLinearMethod(CheckpointOnlyMethod):
    """Name for AWQ checkpoints; an AWQ folder is detected from its config.json without it."""

    name = "awq"
