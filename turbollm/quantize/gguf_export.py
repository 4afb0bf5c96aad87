"""Export a model as a GGUF file of a llama.cpp file type (Q8_0, Q6_K, Q4_K_M, ...).

``export_gguf(model, out, ftype)`` is what ``turbollm quantize MODEL --method gguf --type T
--out FILE.gguf`` runs. The source is a catalog name or a GGUF file: every tensor the mix
(``gguf_mixes``) quantizes is decoded to float32 (``formats.ggml_types.dequantize``) and
encoded with our block encoders (``formats.ggml_quantizers``) - unless the mix picks the type it is
already stored in, which llama.cpp copies unchanged and so do we. Tensors the mix leaves
alone (norms, biases, any 1-D tensor) keep their stored bytes. Names, shapes and row order
stay as in the source (its Q/K rows are already in llama.cpp's RoPE order).

All metadata is carried over with its GGUF value types (tokenizer included), except the
split keys; ``general.file_type`` is set to the file type and ``general.quantization_version``
to 2, as ``llama-quantize`` does. The file is written tensor by tensor with ``gguf.GGUFWriter``
to ``FILE.gguf.partial`` and renamed at the end, so an interrupted run never leaves a file
that looks complete. Hugging Face safetensors folders are not supported as a source yet.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from turbollm.errors import TurboLLMError

from .gguf_mixes import FILE_TYPES, FileType, plan_tensor_types, resolve_file_type

log = logging.getLogger(__name__)

#: ``GGML_QNT_VERSION``: the block layout generation of the k-quants.
QUANTIZATION_VERSION = 2
#: Keys of split (sharded) files, dropped as llama-quantize drops them.
SPLIT_KEYS = frozenset({"split.no", "split.count", "split.tensors.count"})


class GGUFExportError(TurboLLMError, ValueError):
    """A GGUF export that cannot run as asked (unknown type, existing output, bad source)."""


class UnsupportedExportSourceError(TurboLLMError, NotImplementedError):
    """A source checkpoint format the GGUF export cannot read yet."""


@dataclass
class ExportReport:
    """What ``export_gguf`` wrote: per tensor ``(source type, written type)``, sizes, time."""

    path: Path
    file_type: str
    tensor_types: dict[str, tuple[str, str]] = field(default_factory=dict)
    n_params: int = 0
    tensor_bytes: int = 0
    seconds: float = 0.0

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.tensor_bytes / self.n_params if self.n_params else 0.0


class _Writer(gguf.GGUFWriter):
    """``GGUFWriter`` that also writes empty arrays (their item type is known from the source)."""

    def _pack_val(self, val, vtype, add_vtype, sub_type=None):  # type: ignore[override]
        if vtype == GGUFValueType.ARRAY and sub_type is not None and len(val) == 0:
            head = self._pack("I", vtype) if add_vtype else b""
            return head + self._pack("I", sub_type) + self._pack("Q", 0)
        return super()._pack_val(val, vtype, add_vtype, sub_type)


def _check_out(out: Path) -> Path:
    if out.exists():
        raise GGUFExportError(f"{out}: already exists; remove it or choose another --out")
    if not out.parent.is_dir():
        raise GGUFExportError(f"{out.parent}: no such folder for the output file")
    return out.with_name(out.name + ".partial")


def _open_source(model: str | Path):
    """The parsed GGUF file behind ``model`` (catalog name, GGUF path or folder)."""
    from turbollm.formats.gguf_file import read_gguf
    from turbollm.hub.resolve import CheckpointFormat, resolve_model

    resolved = resolve_model(str(model))
    if resolved.format is not CheckpointFormat.GGUF:
        raise UnsupportedExportSourceError(
            f"{resolved.path}: exporting GGUF from a Hugging Face safetensors folder is not supported "
            "yet; convert it with llama.cpp's convert_hf_to_gguf.py (F16 or F32) and export from "
            "that file, or pass a catalog name / GGUF file")
    return read_gguf(resolved.path)


def _copy_metadata(writer: _Writer, src, ft: FileType) -> None:
    """Every source key/value with its value type; file type and quantization version updated."""
    for key, value in src.metadata.items():
        if key == "general.architecture" or key in SPLIT_KEYS:
            continue  # the writer adds the architecture first
        if key in ("general.file_type", "general.quantization_version"):
            continue
        vtype, item_type = src.value_types.get(key, (None, None))
        if vtype is None:
            raise GGUFExportError(f"{src.path}: no value type recorded for metadata key {key!r}")
        if key == "general.alignment":
            writer.data_alignment = int(value)
        sub = GGUFValueType(item_type) if item_type is not None else None
        writer.add_key_value(key, value, GGUFValueType(vtype), sub_type=sub)
    writer.add_uint32("general.quantization_version", QUANTIZATION_VERSION)
    writer.add_uint32("general.file_type", int(ft.ftype))


def _raw_bytes(t) -> np.ndarray:
    """A source tensor's stored bytes, shaped ``(*shape[:-1], row_bytes)``."""
    shape = gguf.quant_shape_to_byte_shape(t.shape or (1,), GGMLQuantizationType(t.qtype))
    return np.ascontiguousarray(t.data).view(np.uint8).reshape(shape)


def _encode(t, qtype: GGMLQuantizationType) -> np.ndarray:
    """Decode source tensor ``t`` to float32 and encode it as ``qtype``."""
    from turbollm.formats.ggml_quantizers import quantize
    from turbollm.formats.ggml_types import dequantize

    weights = dequantize(t.data, t.qtype, t.shape, tensor_name=t.name)
    return quantize(weights, qtype, tensor_name=t.name)


def export_gguf(model: str | Path, out: str | Path, ftype: str, progress: bool = True) -> Path:
    """Write ``model`` as a GGUF file of file type ``ftype`` (e.g. ``"Q4_K_M"``) at ``out``.

    ``model`` is anything ``turbollm.hub.resolve.resolve_model`` accepts that is GGUF (a
    catalog name, a .gguf path). Raises GGUFExportError before any work for an unknown
    ``ftype`` (listing the choices) or an existing ``out``, and UnsupportedExportSourceError
    for a safetensors folder. Returns ``out``; see :func:`export_gguf_report` for details.
    """
    return export_gguf_report(model, out, ftype, progress=progress).path


def export_gguf_report(model: str | Path, out: str | Path, ftype: str, progress: bool = True) -> ExportReport:
    """:func:`export_gguf`, returning an :class:`ExportReport` (types chosen, size, time)."""
    try:
        ft = resolve_file_type(ftype)
    except ValueError:
        raise GGUFExportError(f"unknown GGUF type {ftype!r}; choose one of {', '.join(FILE_TYPES)}") from None
    out = Path(out)
    partial = _check_out(out)
    started = time.perf_counter()
    src = _open_source(model)
    plan = plan_tensor_types({n: t.shape for n, t in src.tensors.items()}, ft, src.metadata)
    report = ExportReport(out, ft.name)

    writer = _Writer(partial, src.arch)
    try:
        _copy_metadata(writer, src, ft)
        targets: dict[str, GGMLQuantizationType] = {}
        for name, t in src.tensors.items():
            qtype = plan[name] if plan[name] is not None else GGMLQuantizationType(t.qtype)
            targets[name] = qtype
            byte_shape = gguf.quant_shape_to_byte_shape(t.shape or (1,), qtype)
            nbytes = int(np.prod(byte_shape))
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
            report.tensor_types[name] = (GGMLQuantizationType(t.qtype).name, qtype.name)
            report.n_params += int(np.prod(t.shape or (1,)))
            report.tensor_bytes += nbytes
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        _write_tensors(writer, src, targets, ft, progress)
        writer.close()
        os.replace(partial, out)
    except BaseException:
        writer.close()
        partial.unlink(missing_ok=True)
        raise
    report.seconds = time.perf_counter() - started
    log.info("wrote %s (%s): %.1f MB, %.2f bits/weight in %.1f s", out, ft.name,
             report.tensor_bytes / 1e6, report.bits_per_weight, report.seconds)
    return report


def _write_tensors(writer: _Writer, src, targets: dict[str, GGMLQuantizationType], ft: FileType,
                   progress: bool) -> None:
    from tqdm import tqdm

    bar = tqdm(total=len(targets), desc=f"gguf {ft.name}", unit="tensor", disable=not progress)
    with bar:
        for name, t in src.tensors.items():
            qtype = targets[name]
            bar.set_postfix_str(f"{name} -> {qtype.name}", refresh=False)
            data = _raw_bytes(t) if qtype == t.qtype else _encode(t, qtype)
            writer.write_tensor_data(data)
            bar.update(1)
