"""Turn whatever names a model (catalog name, GGUF file, HF folder, hub id) into files on disk."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path

from turbollm.errors import ModelDownloadError, ModelFormatError, UnknownModelError
from turbollm.hub.catalog import CATALOG, get_entry

GGUF_MAGIC = b"GGUF"


class CheckpointFormat(enum.Enum):
    GGUF = "gguf"
    SAFETENSORS = "safetensors"  # a Hugging Face folder: config.json + *.safetensors


@dataclass(frozen=True)
class ResolvedModel:
    """A model located on disk: the format, the path, and the name the user gave."""

    name: str
    format: CheckpointFormat
    path: Path  # the .gguf file, or the folder holding config.json


def _is_gguf_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _resolve_local(name: str, path: Path) -> ResolvedModel:
    if path.is_file():
        if not _is_gguf_file(path):
            raise ModelFormatError(f"{path}: not a GGUF file (the first bytes are not 'GGUF')")
        return ResolvedModel(name, CheckpointFormat.GGUF, path)
    if (path / "config.json").is_file():
        if not any(path.glob("*.safetensors")):
            raise ModelFormatError(f"{path}: has config.json but no *.safetensors files")
        return ResolvedModel(name, CheckpointFormat.SAFETENSORS, path)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return _resolve_local(name, ggufs[0])
    if len(ggufs) > 1:
        raise ModelFormatError(f"{path}: holds several .gguf files; name one of them: "
                               + ", ".join(p.name for p in ggufs))
    raise ModelFormatError(f"{path}: neither a GGUF file nor a folder with config.json + *.safetensors")


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _resolve_hub(name: str) -> ResolvedModel:
    try:
        from huggingface_hub import snapshot_download
    except ImportError:  # pragma: no cover - huggingface_hub is a dependency
        raise UnknownModelError(f"{name!r} looks like a hub id, but huggingface_hub is not installed") from None
    try:
        folder = snapshot_download(name, allow_patterns=["config.json", "*.safetensors", "*.json", "tokenizer*"])
    except Exception as e:  # network errors come in many types
        raise ModelDownloadError(f"could not fetch {name!r} from the Hugging Face hub: {e}") from None
    return _resolve_local(name, Path(folder))


def resolve_model(name: str, *, download: bool = True) -> ResolvedModel:
    """Locate `name`: a local path, a catalog name (pulled if needed), or a hub id."""
    path = Path(name).expanduser()
    if path.exists():
        return _resolve_local(name, path)
    if name in CATALOG:
        from turbollm.hub.pull import is_cached, pull
        from turbollm.hub.catalog import cached_path

        entry = get_entry(name)
        if not is_cached(entry) and not download:
            raise UnknownModelError(f"{name!r} is not cached; run `turbollm pull {name}`")
        return ResolvedModel(name, CheckpointFormat.GGUF, pull(name) if not is_cached(entry) else cached_path(entry))
    if _HUB_ID.match(name) and not name.endswith((".gguf", ".json")):
        return _resolve_hub(name)
    get_entry(name)  # raises UnknownModelError listing the catalog
    raise AssertionError("unreachable")
