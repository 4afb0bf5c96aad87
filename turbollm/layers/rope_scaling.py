"""RoPE scaling: how a checkpoint stretches its rotary frequencies past its original context.

A scaling type maps the plain inverse frequencies `base ** (-2i/D)` to scaled ones and gives
an attention factor that multiplies the cos/sin tables (YaRN's mscale; 1 for the others).
Only `RotaryEmbedding`'s tables change, so the C++ `rope_` kernel and the fused decode step
read scaled tables without knowing. The formulas are transformers' (`modeling_rope_utils`);
tests/test_rope_scaling.py holds the two together on generated checkpoints.

- `linear`: every frequency divided by `factor` (position interpolation);
- `llama3`: wavelengths longer than `original_max_position_embeddings / low_freq_factor`
  divided by `factor`, shorter than `... / high_freq_factor` kept, a smooth blend between;
- `yarn`: per dimension, a ramp from the plain frequency (dimensions that turn more than
  `beta_fast` times over the original context) to the frequency divided by `factor` (fewer
  than `beta_slow` times), and cos/sin times `attention_factor` (default `0.1·ln(factor) + 1`).

A config's scaling is a dict in transformers' spelling (`{"rope_type": "yarn", "factor": 4.0,
...}`); `normalize_rope_scaling` checks it once and fills the defaults, so the math below
reads plain keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from turbollm.errors import ModelFormatError, UnsupportedArchitectureError

#: Names that mean "no scaling" (transformers' "default", llama.cpp's "none").
UNSCALED = frozenset({"default", "none"})


def _linear(inv_freq: torch.Tensor, p: dict[str, Any], base: float) -> tuple[torch.Tensor, float]:
    return inv_freq / p["factor"], 1.0


def _llama3(inv_freq: torch.Tensor, p: dict[str, Any], base: float) -> tuple[torch.Tensor, float]:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context stretched `scale` times: `0.1·mscale·ln(scale) + 1`."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(inv_freq: torch.Tensor, p: dict[str, Any], base: float) -> tuple[torch.Tensor, float]:
    factor, old_len = p["factor"], p["original_max_position_embeddings"]
    dim = 2 * inv_freq.numel()

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p["beta_fast"]), correction_dim(p["beta_slow"])
    if p["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # 1: interpolated
    scaled = inv_freq / factor * ramp + inv_freq * (1 - ramp)
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all \
            else yarn_mscale(factor)
    return scaled, float(attention)


@dataclass(frozen=True)
class RopeScalingKind:
    """One scaling type: its function, the keys it needs, and the optional keys with their defaults."""

    scale: Callable[[torch.Tensor, dict[str, Any], float], tuple[torch.Tensor, float]]  # (inv_freq, params, base)
    required: tuple[str, ...]
    optional: dict[str, Any] = field(default_factory=dict)
    factor_from_context: bool = False  # no factor given: max_position / original_max_position_embeddings


#: rope_type → how it scales. A type not here is refused when the config is read.
ROPE_SCALINGS: dict[str, RopeScalingKind] = {
    "linear": RopeScalingKind(_linear, ("factor",)),
    "llama3": RopeScalingKind(_llama3, ("factor", "low_freq_factor", "high_freq_factor",
                                        "original_max_position_embeddings")),
    "yarn": RopeScalingKind(_yarn, ("factor", "original_max_position_embeddings"),
                            {"attention_factor": None, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": None,
                             "mscale_all_dim": None, "truncate": True}, factor_from_context=True),
}


def normalize_rope_scaling(raw: dict[str, Any] | None, max_position: int, where: str) -> dict[str, Any] | None:
    """A checkpoint's RoPE scaling as `{"rope_type": ..., <its keys>}`, or None when it does not scale.

    `raw` is transformers' `rope_scaling` / `rope_parameters` dict (`type` is read as an older
    spelling of `rope_type`; `rope_theta` and other keys are dropped). As in transformers,
    `original_max_position_embeddings` defaults to `max_position` and YaRN's `factor` to
    `max_position / original_max_position_embeddings`. An unknown type raises
    UnsupportedArchitectureError, a missing or non-numeric key ModelFormatError, both naming `where`.
    """
    if not raw:
        return None
    rope_type = str(raw.get("rope_type") or raw.get("type") or "default")
    if rope_type in UNSCALED:
        return None
    kind = ROPE_SCALINGS.get(rope_type)
    if kind is None:
        raise UnsupportedArchitectureError(
            f"{where}: RoPE scaling type {rope_type!r} is not supported; supported: "
            f"{', '.join(sorted(ROPE_SCALINGS))} (or none)")
    original = raw.get("original_max_position_embeddings") or max_position
    fallback = {"original_max_position_embeddings": original,
                "factor": max_position / original if kind.factor_from_context else None}
    out: dict[str, Any] = {"rope_type": rope_type}
    for key in kind.required:
        value = raw.get(key)
        value = fallback.get(key) if value is None else value
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ModelFormatError(f"{where}: RoPE scaling {rope_type!r} needs a positive number for {key!r}, "
                                   f"got {value!r}")
        out[key] = value
    for key, default in kind.optional.items():
        value = raw.get(key)
        out[key] = default if value is None else value
    return {k: v for k, v in out.items() if v is not None}


def rope_frequencies(head_dim: int, base: float, scaling: dict[str, Any] | None = None,
                     freq_factors: Sequence[float] | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] and the factor on cos/sin, for a normalized `scaling`.

    `freq_factors` (a GGUF file's `rope_freqs.weight`) divides the frequencies after scaling,
    as llama.cpp does.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    attention = 1.0
    if scaling is not None:
        inv_freq, attention = ROPE_SCALINGS[scaling["rope_type"]].scale(inv_freq, scaling, base)
    if freq_factors is not None:
        inv_freq = inv_freq / torch.as_tensor(freq_factors, dtype=torch.float32)
    return inv_freq, attention
