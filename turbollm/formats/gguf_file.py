"""Open a GGUF file: its metadata as plain Python values and its tensors as raw views.

We parse the header ourselves (it is a simple little-endian layout: magic, version,
counts, key/value pairs, tensor descriptors, aligned data) because `gguf.GGUFReader`
builds one numpy object per vocabulary string and takes ~10 s on a 150k-token vocabulary.
Tensor data is memory-mapped; nothing is copied here. Any failure to parse — a truncated
file, a corrupt header, a tensor whose bytes run past the end of the file — becomes one
`ModelFormatError` naming the file.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from turbollm.errors import ModelFormatError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value type id -> (struct format, size) for scalars
_SCALARS: dict[int, tuple[str, int]] = {
    0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
    6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8),
}
_NUMPY: dict[int, str] = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4",
                          6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file, not decoded yet.

    `shape` is in PyTorch order (rows first), i.e. GGUF's `ne` reversed. `data` is a
    memory-mapped numpy view: uint8 rows of blocks `[rows, row_bytes]` for quantized
    types, the typed array for F32/F16/BF16 (and the integer types).
    """

    name: str
    qtype: int  # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def type_name(self) -> str:
        import gguf

        return gguf.GGMLQuantizationType(self.qtype).name

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass
class GGUFFile:
    """A parsed GGUF file: path, version, metadata and tensors by name (in file order).

    `value_types` keeps, per metadata key, the GGUF value type id it was stored with and,
    for arrays, the item type id (else None), so the metadata can be written back unchanged.
    """

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    value_types: dict[str, tuple[int, int | None]] = field(default_factory=dict)

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_key(self, key: str, default: Any = None) -> Any:
        """Metadata `<arch>.<key>`, e.g. `arch_key("block_count")`."""
        return self.metadata.get(f"{self.arch}.{key}", default)

    @property
    def tensor_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class _Cursor:
    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ModelFormatError(f"{self.path}: header runs past the end of the file (truncated?)")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, vtype: int) -> Any:
        fmt, size = _SCALARS[vtype]
        return struct.unpack(fmt, self.take(size))[0]

    def string(self) -> str:
        n = self.scalar(10)
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.scalar(4), self.scalar(10)
            if itype == _STRING:
                return [self.string() for _ in range(count)]
            if itype == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            if itype not in _NUMPY:
                raise ModelFormatError(f"{self.path}: unknown GGUF array item type {itype}")
            arr = np.frombuffer(self.take(count * _SCALARS[itype][1]), dtype=_NUMPY[itype])
            return arr.tolist()
        if vtype not in _SCALARS:
            raise ModelFormatError(f"{self.path}: unknown GGUF value type {vtype}")
        return self.scalar(vtype)


def _tensor_nbytes(qtype: int, ne: list[int], name: str, path: Path) -> tuple[int, int, int]:
    """(bytes, block elements, block bytes) of a tensor of type `qtype` and GGUF shape `ne`."""
    import gguf

    try:
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        raise ModelFormatError(f"{path}: tensor {name!r} has unknown GGML type id {qtype}") from None
    n = math.prod(int(x) for x in ne)  # Python ints: a corrupt shape must not wrap around to a small size
    if ne and ne[0] % block_elems:
        raise ModelFormatError(f"{path}: tensor {name!r} row length {ne[0]} is not a multiple of "
                               f"its block size {block_elems}")
    return n // block_elems * block_bytes, block_elems, block_bytes


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the GGUF file at `path` (tensor data memory-mapped) or raise `ModelFormatError`."""
    import gguf

    path = Path(path)
    try:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
    except FileNotFoundError:
        raise ModelFormatError(f"{path}: no such file") from None
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{path}: cannot open: {e}") from None
    cur = _Cursor(memoryview(mm), path)
    try:
        if bytes(cur.take(4)) != GGUF_MAGIC:
            raise ModelFormatError(f"{path}: not a GGUF file (the first bytes are not 'GGUF')")
        version = cur.scalar(4)
        if version not in (2, 3):
            raise ModelFormatError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
        metadata: dict[str, Any] = {}
        value_types: dict[str, tuple[int, int | None]] = {}
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.scalar(4)
            item_type = None
            if vtype == _ARRAY and cur.pos + 4 <= len(cur.buf):  # peek at the item type
                item_type = struct.unpack_from("<I", cur.buf, cur.pos)[0]
            value_types[key] = (vtype, item_type)
            metadata[key] = cur.value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar(4)
            ne = [cur.scalar(10) for _ in range(n_dims)]
            qtype, offset = cur.scalar(4), cur.scalar(10)
            infos.append((name, ne, qtype, offset))
    except (struct.error, UnicodeDecodeError, MemoryError, OverflowError) as e:
        raise ModelFormatError(f"{path}: corrupt GGUF header: {e}") from None
    if "general.architecture" not in metadata:
        raise ModelFormatError(f"{path}: GGUF metadata has no general.architecture")
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ModelFormatError(f"{path}: general.alignment must be a positive power of two, got {align!r}")
    data_start = (cur.pos + align - 1) // align * align
    size = len(mm)
    tensors: dict[str, GGUFTensor] = {}
    for name, ne, qtype, offset in infos:
        nbytes, block_elems, block_bytes = _tensor_nbytes(qtype, ne, name, path)
        start = data_start + offset
        if start + nbytes > size:
            raise ModelFormatError(
                f"{path}: tensor {name!r} needs bytes up to offset {start + nbytes}, but the file "
                f"has {size} bytes (truncated?)"
            )
        raw = mm[start:start + nbytes]
        shape = tuple(int(n) for n in reversed(ne))
        qt = gguf.GGMLQuantizationType(qtype)
        try:
            if block_elems == 1:  # plain element types: give the typed view
                data = raw.view(np.dtype(_PLAIN_DTYPES.get(qt, "<u1"))).reshape(shape)
            else:
                rows = math.prod(shape[:-1])
                data = raw.reshape(rows, -1) if rows else raw.reshape(0, 0)
        except ValueError as e:
            raise ModelFormatError(f"{path}: tensor {name!r} has an invalid shape {shape}: {e}") from None
        tensors[name] = GGUFTensor(name, qtype, shape, data)
    return GGUFFile(path, version, metadata, tensors, value_types)


def _plain_dtypes() -> dict:
    import gguf

    T = gguf.GGMLQuantizationType
    return {T.F32: "<f4", T.F16: "<f2", T.BF16: "<u2", T.F64: "<f8", T.I8: "<i1",
            T.I16: "<i2", T.I32: "<i4", T.I64: "<i8"}


_PLAIN_DTYPES = _plain_dtypes()
