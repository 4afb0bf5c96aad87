"""Load a model by name: resolve files, read the config, build the architecture, load weights, tokenizer."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from turbollm.config import ModelConfig, config_from_gguf, config_from_hf
from turbollm.errors import InvalidRequestError, ModelFormatError
from turbollm.hub.resolve import CheckpointFormat, ResolvedModel, resolve_model
from turbollm.models import build_model
from turbollm.models.common import CausalLM
from turbollm.quantization import LinearMethod, get_linear_method
from turbollm.quantization.qtensor import resident_bytes, storage_summary

#: The linear method a checkpoint gets when none is asked for: GGUF weights stay in their
#: own block types (as in llama.cpp); other formats load as dense float32.
DEFAULT_QUANTIZATION = {CheckpointFormat.GGUF: "gguf"}


@dataclass
class LoadedModel:
    """A ready model with everything the engine needs to know about it."""

    resolved: ResolvedModel
    config: ModelConfig
    model: CausalLM
    tokenizer: Any  # turbollm.tokenizer.Tokenizer
    load_seconds: float
    file_tensor_bytes: int  # bytes of tensor data in the checkpoint file(s)
    quantization: str = "none"  # the linear method's registry name

    @property
    def weight_bytes(self) -> int:
        """Resident bytes of every parameter and buffer (raw GGML blocks included; shared storage once)."""
        return resident_bytes(self.model)

    @property
    def weights_storage(self) -> str:
        """How the weights are held, e.g. `gguf: Q4_1 85.9 MB, Q8_0 29.9 MB, float32 0.2 MB`."""
        parts = ", ".join(f"{kind} {nbytes / 1e6:.1f} MB" for kind, nbytes in storage_summary(self.model).items())
        return f"{self.quantization}: {parts}"


def pick_linear_method(quantization: str | None, fmt: CheckpointFormat, path) -> tuple[str, LinearMethod]:
    """The method's name and instance for `quantization` (None: the format's default) on a checkpoint."""
    name = quantization or DEFAULT_QUANTIZATION.get(fmt, "none")
    method = get_linear_method(name)
    if method.accepts_ggml_blocks and fmt is not CheckpointFormat.GGUF:
        raise InvalidRequestError(f"quantization {name!r} keeps a GGUF file's own block types, but {path} is a "
                                  f"{fmt.value} checkpoint; use 'none' or a method that quantizes at load")
    return name, method


@dataclass
class ModelDescription:
    """What the engine needs to know of a model without its weights (an engine whose workers load them)."""

    resolved: ResolvedModel
    config: ModelConfig
    tokenizer: Any  # turbollm.tokenizer.Tokenizer
    quantization: str  # the linear method's registry name


def describe_model(name: str, *, quantization: str | None = None) -> ModelDescription:
    """Resolve `name` and read its config, tokenizer and linear method, loading no weights."""
    opened = _open(name, quantization)
    return ModelDescription(opened.resolved, opened.config, opened.tokenizer, opened.qname)


@dataclass
class _Opened:
    resolved: ResolvedModel
    config: ModelConfig
    tokenizer: Any
    qname: str
    method: LinearMethod
    source: Any  # the parsed GGUF file, or the HF folder's quantized layout (None for plain safetensors)


def _open(name: str, quantization: str | None) -> _Opened:
    from turbollm.tokenizer import Tokenizer

    resolved = resolve_model(name)
    qname, method = pick_linear_method(quantization, resolved.format, resolved.path)
    if resolved.format is CheckpointFormat.GGUF:
        from turbollm.formats.gguf_file import read_gguf

        gguf = read_gguf(resolved.path)
        cfg = config_from_gguf(gguf)
        try:
            tokenizer = Tokenizer.from_gguf(gguf.metadata)
        except ModelFormatError as e:  # the tokenizer sees only the metadata: name the file here
            raise ModelFormatError(f"{gguf.path}: {e}") from None
        return _Opened(resolved, cfg, tokenizer, qname, method, gguf)
    from turbollm.loader.safetensors_weights import quantized_checkpoint

    cfg = config_from_hf(resolved.path)
    quantized = quantized_checkpoint(resolved.path)
    if quantized is not None:  # GPTQ/AWQ folder: its config.json decides the method
        layout, layout_cfg = quantized
        if quantization not in (None, layout.name):
            raise InvalidRequestError(f"{resolved.path} is a {layout.name} checkpoint; load it without "
                                      f"quantization={quantization!r} (its method is read from config.json)")
        qname, method = layout.name, layout.linear_method(layout_cfg)
    return _Opened(resolved, cfg, Tokenizer.from_hf_folder(resolved.path), qname, method, quantized)


def _align_mlp_shards(gguf) -> None:
    """Tensor parallelism over GGML blocks: split the MLP width on the down projections' largest block
    (a k-quant's 256), so every rank's share of them is whole blocks (`ParallelState.mlp_align`)."""
    import dataclasses

    from turbollm.distributed import get_tp, set_tp
    from turbollm.formats.ggml_types import block_size_bytes

    tp = get_tp()
    if tp.tp_size == 1:
        return
    blocks = [block_size_bytes(t.qtype)[0] for name, t in gguf.tensors.items() if name.endswith("ffn_down.weight")]
    set_tp(dataclasses.replace(tp, mlp_align=max(blocks, default=1)))


def load_model(name: str, *, quantization: str | None = None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Resolve `name` (catalog name, GGUF file, HF folder or hub id) and load it on the CPU.

    `quantization` names a linear method (`turbollm.quantization.LINEAR_METHODS`); None: "gguf"
    for a GGUF file (weights stay in its block types), "none" (float32) otherwise.
    """
    from turbollm.distributed import get_tp

    t0 = time.perf_counter()
    o = _open(name, quantization)
    cfg, resolved = o.config, o.resolved
    stage = get_tp()  # a pipeline stage reads only its layers' tensors
    keep = None if stage.pp_size == 1 else (lambda n: stage.holds_weight(n, cfg.tie_word_embeddings))
    if resolved.format is CheckpointFormat.GGUF:
        from turbollm.loader.gguf_weights import iter_gguf_weights

        weights = iter_gguf_weights(o.source, cfg, keep_quantized=o.method.accepts_ggml_blocks, keep=keep)
        hf_layout, file_bytes = False, o.source.tensor_bytes
        if o.method.accepts_ggml_blocks:
            _align_mlp_shards(o.source)
    else:
        from turbollm.loader.safetensors_weights import iter_checkpoint_weights, safetensors_files

        weights, hf_layout = iter_checkpoint_weights(resolved.path, o.source, keep), True
        file_bytes = sum(f.stat().st_size for f in safetensors_files(resolved.path))
    with torch.no_grad():
        model = build_model(cfg, o.method)
        model.load_weights(weights, hf_layout=hf_layout, source=str(resolved.path))
    model.eval()
    return LoadedModel(resolved, cfg, model, o.tokenizer, time.perf_counter() - t0, file_bytes, o.qname)
