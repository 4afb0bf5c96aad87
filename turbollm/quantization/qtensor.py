"""A weight matrix kept in its GGUF block type: raw GGML blocks, row after row.

`QuantizedTensor` is what the GGUF weight iterator yields for a block-quantized 2-D tensor
when the model keeps GGUF types (the "gguf" linear method): `data` is uint8
``[N, row_bytes]`` (the blocks of each of the N output rows, along K), `qtype` the GGML type
id, `shape` the logical ``(N, K)``. It quacks like a tensor where the layer loaders need it
(`shape`, `narrow`), so one loader serves dense and quantized checkpoints:

- rows are independent, so row slices (tensor-parallel column splits, Q/K/V shards) and row
  permutations (llama's Q/K un-permutation) move whole rows of bytes;
- a column slice (row-parallel split along K) must fall on block boundaries.

`data` may be a view into the memory-mapped file while loading; whoever keeps it makes an
owned copy (`owned()`), so the file can be closed once the model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from turbollm.errors import ModelFormatError, WeightLoadError
from turbollm.kernels.quant import ggml_base_type, is_repacked

#: GGML type id of float32 (a dense fp32 part of a layer is labelled with it).
GGML_F32 = 0


def ggml_type_name(qtype: int) -> str:
    """The GGML name of a type id (`Q8_0`; `Q8_0/r16` in the repacked layout), or the number for unknown ids."""
    from gguf import GGMLQuantizationType

    try:
        if is_repacked(qtype):
            return GGMLQuantizationType(ggml_base_type(qtype)).name + "/r16"
        return GGMLQuantizationType(int(qtype)).name
    except ValueError:
        return str(int(qtype))


@dataclass(frozen=True)
class QuantizedTensor:
    """Raw GGML blocks of an ``(N, K)`` weight: `data` uint8 ``[N, row_bytes]``, type `qtype`."""

    data: torch.Tensor
    qtype: int
    shape: tuple[int, int]
    name: str = "?"

    def __post_init__(self) -> None:
        from turbollm.formats.ggml_types import block_size_bytes

        n, k = self.shape
        block, nbytes = block_size_bytes(self.qtype)
        if k % block:
            raise ModelFormatError(f"tensor {self.name}: rows of {k} elements are not whole "
                                   f"{ggml_type_name(self.qtype)} blocks of {block}")
        expected = (n, k // block * nbytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise ModelFormatError(f"tensor {self.name}: {ggml_type_name(self.qtype)} {list(self.shape)} needs uint8 "
                                   f"blocks {list(expected)}, got {self.data.dtype} {list(self.data.shape)}")

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.qtype)

    @property
    def block_size(self) -> int:
        """Elements per GGML block (along K)."""
        from turbollm.formats.ggml_types import block_size_bytes

        return block_size_bytes(self.qtype)[0]

    def dim(self) -> int:
        return 2

    def _with(self, data: torch.Tensor, shape: tuple[int, int]) -> QuantizedTensor:
        return QuantizedTensor(data, self.qtype, shape, self.name)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedTensor:
        """Rows (dim 0: any range) or columns (dim 1: whole blocks only) ``[start, start + length)``."""
        n, k = self.shape
        if dim == 0:
            return self._with(self.data.narrow(0, start, length), (length, k))
        if dim != 1:
            raise IndexError(f"tensor {self.name}: a 2-D weight has no dimension {dim}")
        block = self.block_size
        if start % block or length % block:
            raise WeightLoadError(f"tensor {self.name}: cannot split {self.type_name} rows at columns "
                                  f"[{start}, {start + length}): not on {block}-element block boundaries")
        per_block = self.data.shape[1] // (k // block)
        return self._with(self.data.narrow(1, start // block * per_block, length // block * per_block), (n, length))

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedTensor:
        """Apply a row permutation/selection `fn` (written for any ``[N, ...]`` tensor) to the block rows."""
        data = fn(self.data)
        return self._with(data, (data.shape[0], self.shape[1]))

    def owned(self) -> torch.Tensor:
        """A contiguous copy of the blocks that owns its memory (never a view into the file)."""
        return self.data.clone(memory_format=torch.contiguous_format)

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 ``[N, K]`` (bit-exact with gguf-py)."""
        from turbollm.formats.ggml_types import dequantize

        return dequantize(self.data, self.qtype, self.shape, tensor_name=self.name)


def as_dense(t: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    """A float tensor for `t` (decoded if it is a QuantizedTensor)."""
    return t.dequantize() if isinstance(t, QuantizedTensor) else t


def copy_checked(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    """Copy `loaded` into `param`, or raise a WeightLoadError naming both shapes."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise WeightLoadError(f"{what}: checkpoint shape {tuple(loaded.shape)} does not match the model's {tuple(param.shape)}")
    param.data.copy_(loaded)


def mark_ggml(param: torch.Tensor, qtype: int) -> torch.Tensor:
    """Tag a parameter holding raw GGML blocks with its type (read by `storage_summary`)."""
    param.ggml_qtype = int(qtype)
    return param


def storage_summary(module: torch.nn.Module) -> dict[str, int]:
    """Resident bytes per storage kind (`Q8_0`, `float32`, ...) over parameters and buffers, shared once."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for t in [*module.parameters(), *module.buffers()]:
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        qtype = getattr(t, "ggml_qtype", None)
        label = ggml_type_name(qtype) if qtype is not None else str(t.dtype).removeprefix("torch.")
        out[label] = out.get(label, 0) + storage.nbytes()
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def resident_bytes(module: torch.nn.Module) -> int:
    """Resident bytes of every parameter and buffer of `module` (each storage once)."""
    return sum(storage_summary(module).values())
