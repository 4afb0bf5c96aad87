"""The linear-layer strategy interface and the unquantized (fp32) strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator

import torch
from torch import nn

from turbollm.errors import InvalidRequestError
from turbollm.kernels.dense import dense_linear
from turbollm.quantization.qtensor import QuantizedTensor, as_dense, copy_checked

LINEAR_METHODS: dict[str, type["LinearMethod"]] = {}

#: `DecodeParts` type of a dense float32 part (multiplied by kernels.dense.dense_linear).
DENSE_PART = -1


@dataclass(frozen=True)
class DecodeParts:
    """A linear layer as the fused decode step multiplies by it: output-row parts in order, each a
    (GGML type with C++ kernels, uint8 blocks) or (DENSE_PART, float32 [rows, K]) pair, their
    outputs concatenated, then the layer's bias added in place; with `bias_in_linear` (one dense
    part) the bias goes into the product itself, as ``dense_linear(x, w, b)``."""

    parts: tuple[tuple[int, torch.Tensor], ...]
    bias_in_linear: bool = False
    #: per part, the integer layouts' (scale, zero point, group size) as `linear_q8` takes them
    #: (None, None, 0 for GGML blocks and dense parts); None: no part has any
    group_params: tuple[tuple[torch.Tensor | None, torch.Tensor | None, int], ...] | None = None
    #: input-column order the product reads (GPTQ act-order: ``x[:, perm]``), or None
    perm: torch.Tensor | None = None


def register_linear_method(name: str) -> Callable[[type["LinearMethod"]], type["LinearMethod"]]:
    def deco(cls: type[LinearMethod]) -> type[LinearMethod]:
        LINEAR_METHODS[name] = cls
        return cls

    return deco


class LinearMethod:
    """How one linear layer stores its weight and multiplies by it.

    Life of a layer: `create_weights` at construction; the layer's shard loaders hand each
    checkpoint tensor (or row slice of one) to `load_weight`; after the whole checkpoint is
    loaded, `CausalLM.load_weights` calls `process_model_after_loading` once with the model, then
    `process_weights_after_loading` once per layer (repack, quantize, concatenate shards; must be
    safe to call again); then `apply`.
    """

    #: True: the GGUF loader hands this method `QuantizedTensor`s (raw GGML blocks) for
    #: block-quantized tensors. False: every tensor arrives dequantized to float32.
    accepts_ggml_blocks: ClassVar[bool] = False
    #: GGML type in which a *dense* vocabulary table (embedding, untied LM head) is stored once
    #: loaded, or None to keep float32. The quantizing methods say Q8_0 (8.5 bits/weight), so a
    #: model loaded from a float checkpoint holds no float32 table; a GGUF's table keeps its type.
    vocab_table_type: ClassVar[int | None] = None

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def load_weight(self, layer: nn.Module, loaded: torch.Tensor | QuantizedTensor, row_offset: int, what: str) -> None:
        """Place `loaded` (this rank's rows of one checkpoint tensor) at output rows `row_offset...`.

        Default: copy into the dense `layer.weight` (a QuantizedTensor is decoded first).
        """
        loaded = as_dense(loaded)
        copy_checked(layer.weight.data.narrow(0, row_offset, loaded.shape[0]), loaded, what)

    def process_model_after_loading(self, model: nn.Module) -> None:
        """Called once with the whole CausalLM after every tensor is loaded and before any layer's
        `process_weights_after_loading` (cross-layer transforms such as int8's equalization);
        must be safe to call again. Default: nothing to do."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once every tensor of the layer is loaded; default: nothing to do."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def set_form(self, layer: nn.Module, form: str | None) -> bool:
        """Hold the layer's weight in the layout kernel form `form` multiplies (kernels/forms.py: the
        avx512_vnni, avx2_tiles and amx forms repack GGML blocks into interleaved rows; any other form, or None, keeps
        or restores the GGML rows); whether anything changed. Default: one layout for every form."""
        return False

    def decode_parts(self, layer: nn.Module) -> DecodeParts | None:
        """How the fused decode step (worker/fused_step.py) multiplies by this layer, exactly as
        `apply` does for a few tokens on the q8 paths; None: the step is not available for it."""
        return None

    def weight_bytes(self, layer: nn.Module) -> int:
        """Resident bytes of this layer's weight storage."""
        return sum(p.numel() * p.element_size() for n, p in layer.named_parameters(recurse=False) if n != "bias")

    def format_bits(self, layer: nn.Module) -> float:
        """Bits per weight of this layer's format as its checkpoint layout defines it.

        Default: the resident storage is the format (float32, GGML blocks). Methods whose
        in-memory layout differs from the format they implement override it.
        """
        return 8.0 * self.weight_bytes(layer) / (layer.in_features * layer.out_features)


def linear_layers(model: nn.Module) -> Iterator[nn.Module]:
    """The modules of `model` whose weight a LinearMethod holds (`layers.linear.LinearBase` and its
    subclasses, known by their `method`: this package sits below `turbollm.layers` and does not
    import it), in `model.modules()` order."""
    return (m for m in model.modules() if isinstance(getattr(m, "method", None), LinearMethod))


@register_linear_method("none")
class UnquantizedLinearMethod(LinearMethod):
    """A dense weight `[out, in]`: float32, or bfloat16 after `dense_dtype.set_dtype` (engine argument `dtype`)."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_linear(x, layer.weight, bias)

    def decode_parts(self, layer: nn.Module) -> DecodeParts | None:
        if layer.weight.dtype not in (torch.float32, torch.bfloat16):
            return None
        return DecodeParts(((DENSE_PART, layer.weight),), bias_in_linear=True)


def get_linear_method(name: str | None) -> LinearMethod:
    key = name or "none"
    if key not in LINEAR_METHODS:
        raise InvalidRequestError(f"unknown quantization {name!r}; available: {', '.join(sorted(LINEAR_METHODS))}")
    return LINEAR_METHODS[key]()


def set_qmatmul(model: nn.Module, path: str | None) -> None:
    """Give every module of `model` the quantized-matmul path `path` (`kernels.quant`: auto, fast, q8,
    q8x2, q16, dequant; None: the kernels' default, auto). Linear methods, the LM head and the fused
    decode step read it from the module they run for (`qmatmul_of`), so two models in one process
    can run different numerics."""
    from turbollm.kernels.quant import check_path

    if path is not None:
        check_path(path)
    for m in model.modules():
        m.qmatmul = path


def set_kernel_form(model: nn.Module, form: str | None) -> bool:
    """Hold every quantized weight of `model` in the layout of kernel form `form` (kernels/forms.py; a
    repacking form repacks or relabels, a form that does not repack, or None, restores the GGML rows): each linear method's `set_form`, and
    the vocabulary tables (a tied LM head shares the embedding's parameter, repacked once). Bumps
    the model's `weights_version` when anything changed (a fused step built before holds the old
    tensors); whether anything did."""
    from turbollm.kernels.forms import REPACKING_FORMS
    from turbollm.kernels.quant import to_layout

    changed = False
    for layer in linear_layers(model):
        changed |= layer.method.set_form(layer, form)
    seen: set[int] = set()
    for m in model.modules():
        w = m.__dict__.get("_parameters", {}).get("weight")
        qtype = getattr(w, "ggml_qtype", None)
        if qtype is None or not getattr(m, "vocab_table", False) or id(w) in seen:
            continue
        seen.add(id(w))
        data, new = to_layout(w.data, qtype, m.dim, REPACKING_FORMS.get(form))
        if new != qtype:
            w.data, w.ggml_qtype, changed = data, new, True
    if changed and hasattr(model, "weights_version"):
        model.weights_version += 1
    return changed


def qmatmul_of(module: nn.Module) -> str | None:
    """The quantized-matmul path `set_qmatmul` gave `module` (None: the kernels' default)."""
    return module.__dict__.get("qmatmul")
