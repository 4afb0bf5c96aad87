"""The "int4" linear methods: group-wise asymmetric 4-bit weights, and 3-bit (and 2-bit) codes.

Resident per layer (the layouts of `kernels.quant.int4_linear` and `int3_linear`):
- ``weight`` uint8: 4-bit and 2-bit codes in nibbles, ``[N, K/2]``, two codes per byte, low
  nibble = even column; 3-bit codes packed 12 bytes per block of 32 columns, ``[N, K/32*12]``
  (`packing.pack_3bit`; K a multiple of 32). ``layer.int4_storage_bits`` says which (4 or 3);
- ``weight_scales`` float16 and ``weight_zeros`` uint8 ``[N, K/g]``: ``W = (q - zero) * scale``
  per group (the quantizers round scales to float16 when they make them, so nothing is lost);
- ``weight_perm`` int64 ``[K]`` only for act-order GPTQ checkpoints: storage column j is input
  column ``perm[j]``, so ``y = x[:, perm] @ W_storage.T`` (the input is permuted before the
  kernel; the groups stay contiguous in storage order).

Storage per weight is 4 bits (3 bits for 3-bit codes) + 24 bits per group of g (g = 128: 4.19,
or 3.19 bits/weight). 2-bit codes (0..3) stay in the nibble container (4 bits each).

Names: "int4" (g = 128), "int4-g32", "int4-g64", "int4-g128", and "int3", "int3-g32", ...
quantize at load by round-to-nearest (`group_quant.rtn_quantize`), after the float32 weight is
loaded (peak memory while loading: the float32 model). GPTQ and AWQ checkpoints build the
layer in this layout directly (`Int4LinearMethod(prequantized=True, ...)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from gguf import GGMLQuantizationType
from torch import nn

from turbollm.errors import InvalidRequestError, WeightLoadError
from turbollm.formats.packing import pack_3bit, pack_nibbles, unpack_3bit, unpack_nibbles
from turbollm.kernels.quant import (INT3_GROUPWISE, INT4_GROUPWISE, groupwise_kernel_path, groupwise_meta, int3_linear,
                                   int4_linear)
from turbollm.quantization.base import DecodeParts, LinearMethod, qmatmul_of, register_linear_method
from turbollm.quantization.group_quant import QuantGrid, QuantizedWeight, rtn_quantize

GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 128


@dataclass(frozen=True)
class CodeStorage:
    """How codes sit in ``layer.weight``: their packing, its inverse, and the product kernel."""

    pack: Callable[[torch.Tensor], torch.Tensor]
    unpack: Callable[[torch.Tensor], torch.Tensor]
    linear: Callable[..., torch.Tensor]
    qtype: int  # the kernels' type id (kernels/quant.py)


#: Resident bits per code -> its storage (3-bit codes packed in 3 bits, the rest in nibbles).
CODE_STORAGE = {3: CodeStorage(pack_3bit, unpack_3bit, int3_linear, INT3_GROUPWISE),
                4: CodeStorage(pack_nibbles, unpack_nibbles, int4_linear, INT4_GROUPWISE)}


def storage_bits(bits: int) -> int:
    """Bits each code of a `bits`-bit weight occupies in memory: 3 for 3-bit codes, else 4 (nibbles)."""
    return 3 if bits == 3 else 4


def pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes ``[N, K]`` of `bits` bits → the resident ``weight`` (`pack_3bit` or `pack_nibbles`)."""
    return CODE_STORAGE[storage_bits(bits)].pack(q)


def layer_codes(layer: nn.Module) -> torch.Tensor:
    """The codes of a layer in this layout as uint8 ``[N, K]`` (storage column order)."""
    return CODE_STORAGE[layer.int4_storage_bits].unpack(layer.weight.data)


def set_int4_weight(layer: nn.Module, qw: QuantizedWeight) -> None:
    """Replace the layer's weight by the layout of `qw` (codes of at most 4 bits; 3-bit ones packed)."""
    if qw.bits > 4:
        raise ValueError(f"int4 layout holds codes of at most 4 bits, got {qw.bits}")
    layer.weight = nn.Parameter(pack_codes(qw.q, qw.bits), requires_grad=False)
    layer.weight_scales = nn.Parameter(qw.scales.to(torch.float16).contiguous(), requires_grad=False)
    layer.weight_zeros = nn.Parameter(qw.zeros.to(torch.uint8).contiguous(), requires_grad=False)
    if qw.perm is not None:
        layer.weight_perm = nn.Parameter(qw.perm.to(torch.int64).contiguous(), requires_grad=False)
    layer.int4_group_size = qw.group_size
    layer.int4_storage_bits = storage_bits(qw.bits)


class Int4LinearMethod(LinearMethod):
    """Group-wise int4 weights: quantized at load by round-to-nearest, or read from a checkpoint."""

    vocab_table_type = int(GGMLQuantizationType.Q8_0)

    bits = 4
    group_size = DEFAULT_GROUP_SIZE

    def __init__(self, bits: int | None = None, group_size: int | None = None, prequantized: bool = False,
                 act_order: bool = False):
        self.bits = bits or type(self).bits
        self.group_size = group_size or type(self).group_size
        self.prequantized, self.act_order = prequantized, act_order
        if self.bits not in (2, 3, 4):
            raise InvalidRequestError(f"int4 layout: bits must be 2, 3 or 4, got {self.bits}")

    def _group(self, in_features: int) -> int:
        g = self.group_size if self.group_size > 0 else in_features
        if in_features % g or g % 2:
            fits = [str(s) for s in GROUP_SIZES if in_features % s == 0]
            raise InvalidRequestError(f"int{self.bits}: group size {g} does not divide a layer's {in_features} "
                                      f"input features (group sizes that do: {', '.join(fits) or 'none'})")
        if storage_bits(self.bits) == 3 and in_features % 32:
            raise InvalidRequestError(f"int3: a layer's {in_features} input features are not a multiple of 32 "
                                      f"(3-bit codes are packed in blocks of 32)")
        return g

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        from turbollm.distributed import get_tp

        if get_tp().tp_size > 1 and (self.act_order or self.group_size <= 0):
            raise InvalidRequestError("tensor parallelism cannot split a GPTQ act-order checkpoint or one with a "
                                      "single group per row (their permutation or scale spans every input): "
                                      "load it with tensor_parallel_size 1")
        g = self._group(in_features)
        layer.int4_group_size = g
        layer.int4_storage_bits = storage_bits(self.bits)
        if not self.prequantized:
            layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
            return
        row_bytes = in_features * layer.int4_storage_bits // 8
        layer.weight = nn.Parameter(torch.zeros(out_features, row_bytes, dtype=torch.uint8), requires_grad=False)
        layer.weight_scales = nn.Parameter(torch.zeros(out_features, in_features // g, dtype=torch.float16),
                                           requires_grad=False)
        layer.weight_zeros = nn.Parameter(torch.zeros(out_features, in_features // g, dtype=torch.uint8),
                                          requires_grad=False)
        layer.weight_scales.weight_loader = layer.weight_loader
        layer.weight_zeros.weight_loader = layer.weight_loader
        if self.act_order:
            layer.weight_perm = nn.Parameter(torch.full((in_features,), -1, dtype=torch.int64), requires_grad=False)
            layer.weight_perm.weight_loader = _perm_loader

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.weight.dtype == torch.uint8:
            perm = getattr(layer, "weight_perm", None)
            if perm is not None and bool((perm < 0).any()):
                raise WeightLoadError("act-order permutation (g_idx) was not loaded")
            return
        qw = rtn_quantize(layer.weight.data, QuantGrid(self.bits), layer.int4_group_size)
        set_int4_weight(layer, qw)

    def format_bits(self, layer: nn.Module) -> float:
        """b-bit codes plus a float16 scale and a b-bit zero point per group (AutoGPTQ/AutoAWQ's layout).

        We hold the zero point in a byte, 4-bit codes in nibbles and 3-bit codes packed in 3 bits:
        4 + 24/g bits per weight against the format's 4 + 20/g, and 3 + 24/g against 3 + 19/g
        (1.04x at g = 32, 1.01x at g = 128). 2-bit codes stay in nibbles (4 + 24/g against 2 + 18/g).
        """
        return self.bits + (16.0 + self.bits) / layer.int4_group_size

    def decode_parts(self, layer: nn.Module) -> DecodeParts | None:
        if layer.weight.dtype != torch.uint8:
            return None
        storage, g = CODE_STORAGE[layer.int4_storage_bits], layer.int4_group_size
        if not groupwise_kernel_path(storage.qtype, layer.weight, layer.in_features, g):
            return None
        scales, zeros = groupwise_meta(layer.weight_scales, layer.weight_zeros)  # as `apply`'s product takes them
        return DecodeParts(((storage.qtype, layer.weight),), group_params=((scales, zeros, g),),
                           perm=getattr(layer, "weight_perm", None))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, layer.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        perm = getattr(layer, "weight_perm", None)
        if perm is not None:
            x2 = x2.index_select(1, perm)
        linear = CODE_STORAGE[layer.int4_storage_bits].linear
        y = linear(x2, layer.weight, layer.weight_scales, layer.weight_zeros, layer.int4_group_size,
                   path=qmatmul_of(layer))
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], layer.out_features)


def _perm_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    """Load the act-order permutation; the shards of a fused layer must all bring the same one."""
    loaded = loaded.to(torch.int64)
    if tuple(loaded.shape) != tuple(param.shape):
        raise WeightLoadError(f"act-order permutation: checkpoint shape {tuple(loaded.shape)} does not match the "
                              f"model's {tuple(param.shape)}")
    if bool((param.data < 0).all()):
        param.data.copy_(loaded)
    elif not torch.equal(param.data, loaded):
        raise WeightLoadError(f"shard {shard_id}: its act-order permutation (g_idx) differs from the other shards "
                              f"of the fused layer, which share one input; quantize them with one Hessian")


def _register_rtn_variants() -> None:
    """Register "int4", "int4-g32", ..., "int3", "int3-g32", ... (round-to-nearest at load)."""
    for bits in (4, 3):
        base = type(f"Int{bits}LinearMethod", (Int4LinearMethod,), {"bits": bits, "__doc__":
                    f"Group-wise {bits}-bit round-to-nearest at load (g = {DEFAULT_GROUP_SIZE})."})
        register_linear_method(f"int{bits}")(base)
        for g in GROUP_SIZES:
            cls = type(f"Int{bits}G{g}LinearMethod", (base,), {"group_size": g, "__doc__":
                       f"Group-wise {bits}-bit round-to-nearest at load, g = {g}."})
            register_linear_method(f"int{bits}-g{g}")(cls)


_register_rtn_variants()
