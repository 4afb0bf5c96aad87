"""The "gguf" linear method: weights stay in the GGUF file's own block types (as llama.cpp does).

A linear layer's weight is only known once the checkpoint is read, and a merged layer may
get shards of different types (gemma3-270m's QKV: q and k Q5_0, v Q8_0). So:

1. `create_weights` makes a shape-only placeholder (`device="meta"`, no memory) that the
   layer loaders check shapes against;
2. `load_weight` records each shard as it arrives: its first output row and its rows, a
   `QuantizedTensor` (raw blocks, possibly a view into the mapped file) or a float tensor
   (F32/F16/BF16 tensors of the file arrive as float32);
3. `process_weights_after_loading` sorts the shards by row, joins neighbours of the same type
   into one owned buffer (rows are independent, so stacking blocks by rows is exact) and
   keeps one *part* per run of equal type: `layer.weight_parts` (parameters: uint8
   ``[rows, row_bytes]`` GGML blocks, or float32 ``[rows, K]``) with `layer.weight_layout`
   (a `WeightPart` per parameter: output rows and GGML type);
4. `apply` multiplies through `kernels.quant.ggml_linear` per part and concatenates the parts'
   output columns (one part, the usual case, needs no copy). Biases stay float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from turbollm.errors import WeightLoadError
from turbollm.kernels.dense import dense_linear
from turbollm.kernels.quant import ggml_linear, kernel_supported, to_layout
from turbollm.quantization.base import DENSE_PART, DecodeParts, LinearMethod, qmatmul_of, register_linear_method
from turbollm.quantization.qtensor import GGML_F32, QuantizedTensor, ggml_type_name, mark_ggml


@dataclass(frozen=True)
class WeightPart:
    """Output rows ``[start, stop)`` of a layer, stored as GGML type `qtype` (GGML_F32: dense float32)."""

    start: int
    stop: int
    qtype: int

    @property
    def type_name(self) -> str:
        return ggml_type_name(self.qtype)


def _kind(t: torch.Tensor | QuantizedTensor) -> int:
    return t.qtype if isinstance(t, QuantizedTensor) else GGML_F32


def _join(shards: list[torch.Tensor | QuantizedTensor]) -> torch.Tensor:
    """One owned, contiguous buffer of the shards' rows (never a view into the file)."""
    if isinstance(shards[0], QuantizedTensor):
        if len(shards) == 1:
            return shards[0].owned()
        return torch.cat([s.data for s in shards], dim=0)
    if len(shards) == 1:
        return shards[0].to(torch.float32).clone(memory_format=torch.contiguous_format)
    return torch.cat([s.to(torch.float32) for s in shards], dim=0)


def _matmul(x: torch.Tensor, w: torch.Tensor, qtype: int, k: int, path: str | None) -> torch.Tensor:
    return dense_linear(x, w) if qtype == GGML_F32 else ggml_linear(x, w, qtype, k, path=path)


@register_linear_method("gguf")
class GGUFLinearMethod(LinearMethod):
    """Raw GGML blocks per layer (one part per run of equal type), multiplied by `ggml_linear`."""

    accepts_ggml_blocks = True

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device="meta"),
                                    requires_grad=False)
        layer.weight_parts = nn.ParameterList()
        layer.weight_layout = ()
        layer.weight_run = ()
        layer.pending_shards = []

    def load_weight(self, layer: nn.Module, loaded: torch.Tensor | QuantizedTensor, row_offset: int, what: str) -> None:
        rows, cols = (tuple(loaded.shape) + (None,))[:2]
        if loaded.dim() != 2 or cols != layer.in_features or row_offset < 0 or row_offset + rows > layer.out_features:
            raise WeightLoadError(f"{what}: checkpoint shape {tuple(loaded.shape)} does not fit rows "
                                  f"[{row_offset}, {row_offset + (rows or 0)}) of the model's "
                                  f"({layer.out_features}, {layer.in_features})")
        layer.pending_shards.append((row_offset, loaded))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        shards = sorted(layer.pending_shards, key=lambda s: s[0])
        if not shards:
            return  # nothing new (already processed)
        runs: list[tuple[int, int, int, list]] = []  # start, stop, qtype, shards
        for offset, t in shards:
            expected = runs[-1][1] if runs else 0
            if offset != expected:
                raise WeightLoadError(f"{type(layer).__name__}: shards cover output rows up to {expected} "
                                      f"but the next one starts at {offset}")
            if runs and runs[-1][2] == _kind(t):
                start, stop, kind, items = runs[-1]
                runs[-1] = (start, stop + t.shape[0], kind, items + [t])
            else:
                runs.append((offset, offset + t.shape[0], _kind(t), [t]))
        if runs[-1][1] != layer.out_features:
            raise WeightLoadError(f"{type(layer).__name__}: shards cover {runs[-1][1]} of "
                                  f"{layer.out_features} output rows")
        params = []
        for _, _, kind, items in runs:
            p = nn.Parameter(_join(items), requires_grad=False)
            params.append(mark_ggml(p, kind) if kind != GGML_F32 else p)
        if "weight" in layer._parameters:
            del layer.weight  # the shape-only placeholder
        layer.weight_parts = nn.ParameterList(params)
        layer.weight_layout = tuple(WeightPart(start, stop, kind) for start, stop, kind, _ in runs)
        # the hot path's view of the same parameters: (qtype, tensor) per part (indexing a
        # ParameterList costs microseconds per call)
        layer.weight_run = tuple((kind, p) for (_, _, kind, _), p in zip(runs, params))
        layer.pending_shards = []

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        run, k = layer.weight_run, layer.in_features
        if not run:
            raise RuntimeError(f"{type(layer).__name__}: weights not loaded (process_weights_after_loading not run)")
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        path = qmatmul_of(layer)
        if len(run) == 1:
            y = _matmul(x2, run[0][1], run[0][0], k, path)
        else:  # each part yields its own output columns, in row order
            y = torch.cat([_matmul(x2, w, qtype, k, path) for qtype, w in run], dim=-1)
        if bias is not None:
            y += bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], layer.out_features)

    def set_form(self, layer: nn.Module, form: str | None) -> bool:
        """Repack each GGML part for a repacking form (avx512_vnni, avx2_tiles, amx: `kernels.quant.to_layout`, the types it
        covers, rows in groups of 16), or restore the GGML rows for any other; the parameters keep their
        identity."""
        from turbollm.kernels.forms import REPACKING_FORMS

        base = REPACKING_FORMS.get(form)
        run, changed = [], False
        for (qtype, p), part in zip(layer.weight_run, layer.weight_layout):
            if qtype != GGML_F32:
                data, new = to_layout(p.data, qtype, layer.in_features, base)
                if new != qtype:
                    p.data, p.ggml_qtype, qtype, changed = data, new, new, True
            run.append((qtype, p))
        if changed:
            layer.weight_run = tuple(run)
            layer.weight_layout = tuple(WeightPart(part.start, part.stop, qtype)
                                        for part, (qtype, _) in zip(layer.weight_layout, run))
        return changed

    def decode_parts(self, layer: nn.Module) -> DecodeParts | None:
        parts = tuple((DENSE_PART if qtype == GGML_F32 else qtype, w) for qtype, w in layer.weight_run)
        if not parts or not all(qtype == DENSE_PART or kernel_supported(qtype) for qtype, _ in parts):
            return None
        return DecodeParts(parts)

    def weight_bytes(self, layer: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in layer.weight_parts)
