"""`turbollm quantize` end to end: check everything, calibrate, quantize, write atomically.

Order (each step only once the previous ones passed, so bad input fails in seconds):
1. options alone (`methods.validate_options`: method/bits/group combinations, flags that do
   not apply, an existing ``--out``);
2. the model's config and tokenizer, without its weights (group sizes that divide every
   layer, layout packing; a source that is already a quantized checkpoint);
3. the calibration corpus (tokenized, too small → error) for GPTQ/AWQ;
4. the float32 model (a GGUF source is dequantized: the reference is the GGUF's own weights
   in float32), the layer-by-layer quantization, the atomic export.
``--method gguf`` goes to ``quantize.gguf_export.export_gguf`` after step 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from turbollm.errors import InvalidRequestError
from turbollm.quantize.methods import QuantizeOptions, validate_for_model, validate_options


@dataclass
class QuantizeSummary:
    method: str
    out: Path
    seconds: float
    quantize_seconds: float = 0.0
    layer_seconds: list[float] = field(default_factory=list)
    calibration_tokens: int = 0
    corpus_tokens: int = 0
    out_bytes: int = 0
    details: dict[str, Any] = field(default_factory=dict)


def peek_model(name: str):
    """(resolved, ModelConfig, Tokenizer) of a model without reading its weights."""
    from turbollm.config import config_from_gguf, config_from_hf
    from turbollm.hub.resolve import CheckpointFormat, resolve_model
    from turbollm.tokenizer import Tokenizer

    resolved = resolve_model(name)
    if resolved.format is CheckpointFormat.GGUF:
        from turbollm.formats.gguf_file import read_gguf

        gguf = read_gguf(resolved.path)
        return resolved, config_from_gguf(gguf), Tokenizer.from_gguf(gguf.metadata)
    from turbollm.loader.safetensors_weights import quantized_checkpoint

    if quantized_checkpoint(resolved.path) is not None:
        raise InvalidRequestError(f"{resolved.path} is already a quantized checkpoint; quantize its float source")
    return resolved, config_from_hf(resolved.path), Tokenizer.from_hf_folder(resolved.path)


def run_quantize(opts: QuantizeOptions, log: Callable[[str], None] = print) -> QuantizeSummary:
    """Quantize `opts.model` with `opts.method` into `opts.out` (see the module docstring)."""
    t0 = time.perf_counter()
    spec = validate_options(opts)
    if spec is None:
        from turbollm.quantize.gguf_export import export_gguf

        export_gguf(opts.model, opts.out, opts.gguf_type, progress=opts.progress)
        seconds = time.perf_counter() - t0
        return QuantizeSummary("gguf", opts.out, seconds, quantize_seconds=seconds,
                               out_bytes=opts.out.stat().st_size if opts.out.exists() else 0)
    resolved, cfg, tokenizer = peek_model(opts.model)
    validate_for_model(spec, opts, cfg)
    bits, group = opts.resolved_bits, opts.resolved_group
    calib = None
    if spec.calibrates:
        from turbollm.quantize.calibration import build_calibration

        calib = build_calibration(tokenizer, opts.samples, opts.seq_len, opts.calib_data)
        log(f"calibration: {calib.windows.shape[0]} × {calib.windows.shape[1]} tokens from a "
            f"{calib.corpus_tokens:,}-token corpus (each token in {calib.reuse:.2f} windows on average)")

    from turbollm.loader import load_model

    loaded = load_model(opts.model, quantization="none")
    grid = spec.grid(bits)
    t1 = time.perf_counter()
    summary = QuantizeSummary(spec.name, opts.out, 0.0)
    extra: dict[str, Any] = {"quantizer": "turbollm"}
    if spec.name in ("gptq", "awq"):
        from turbollm.quantize.logit_scale import (apply_logit_scale, final_hidden, fit_logit_scale,
                                                   fit_windows)
        from turbollm.quantize.pipeline import quantize_decoder

        if opts.fit_logit_scale:  # the float model's outputs, before the decoder is quantized in place
            scale_windows = fit_windows(calib.windows)
            ref_hidden = final_hidden(loaded.model, scale_windows)

        if spec.name == "gptq":
            from turbollm.quantize.gptq import GPTQAlgorithm

            alg = GPTQAlgorithm(grid, group, opts.act_order, opts.damp)
            extra["damp_percent"] = opts.damp
        else:
            from turbollm.quantize.awq import AWQAlgorithm

            alg = AWQAlgorithm(grid, group, opts.awq_search_tokens, clip=opts.clip)
            extra["clip"] = opts.clip
        report = quantize_decoder(loaded.model, calib.windows, alg, progress=opts.progress,
                                  desc=f"{spec.name} {bits}-bit")
        results = alg.results
        if opts.fit_logit_scale:
            fit = fit_logit_scale(loaded.model, ref_hidden, scale_windows, progress=opts.progress)
            apply_logit_scale(loaded.model, fit.beta)
            log(f"logit scale: {fit.summary()}")
            extra["logit_scale"] = fit.as_dict()
            summary.details["logit_scale"] = fit.as_dict()
        summary.layer_seconds = report.layer_seconds
        summary.calibration_tokens, summary.corpus_tokens = calib.num_tokens, calib.corpus_tokens
        extra["calibration"] = {"data": str(opts.calib_data or "sharegpt"), "samples": opts.samples,
                                "seq_len": opts.seq_len}
        if spec.name == "awq":
            summary.details["alphas"] = alg.alphas
    else:
        from turbollm.quantize.rtn import rtn_decoder

        if spec.name == "int8":
            extra["equalize"] = opts.equalize is not False
            if extra["equalize"]:
                from turbollm.quantization.equalize import equalize_decoder

                log(f"int8: channel equalization before rounding: {equalize_decoder(loaded.model).summary()}")
        with torch.no_grad():
            results = rtn_decoder(loaded.model, grid, group)
    summary.quantize_seconds = time.perf_counter() - t1

    from turbollm.quantization.checkpoint_layouts import get_layout
    from turbollm.quantize.export_safetensors import write_quantized_folder

    layout = get_layout(spec.layout)
    out = write_quantized_folder(loaded, results, layout, spec.layout_config(bits, group, opts.act_order), opts.out,
                                 extra)
    summary.out = out
    summary.out_bytes = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    summary.seconds = time.perf_counter() - t0
    return summary
