"""The dense weights' compute dtypes by name (the engine argument `dtype`), and whether this CPU multiplies
bfloat16 in hardware: plain names and CPU flags, below both the engine's arguments (engine_config.py) and the
weights that take the dtype (quantization/dense_dtype.py), as the kernel forms are (forms.py)."""

from __future__ import annotations

from turbollm.errors import InvalidRequestError

#: dtype names -> the torch dtype (by name) of the dense weights; "auto" (None) depends on the CPU and the model
DENSE_DTYPES: dict[str, str | None] = {"auto": None, "float32": "float32", "float": "float32",
                                       "bfloat16": "bfloat16", "bf16": "bfloat16"}
#: CPU flags (/proc/cpuinfo) with which bfloat16 products run in hardware
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def check_dtype(name: str) -> str:
    """`name` if the engine takes it; else InvalidRequestError naming the choices (and why not float16)."""
    if name not in DENSE_DTYPES:
        why = (" (float16 compute has no fast path on a CPU: use bfloat16, or float16 K/V with "
               "--kv-cache-dtype float16)") if name in ("float16", "half", "fp16") else ""
        raise InvalidRequestError(f"dtype {name!r}: choose one of {', '.join(DENSE_DTYPES)}{why}")
    return name


def cpu_has_bf16(flags: str | None = None) -> bool:
    """Whether this CPU (or the flags given) multiplies bfloat16 in hardware."""
    from turbollm.kernels import cpu_flags

    have = set((flags if flags is not None else cpu_flags()).split())
    return any(f in have for f in BF16_FLAGS)


def dense_dtype_name(name: str, has_dense: bool = True, flags: str | None = None) -> str:
    """The torch dtype's name that dtype `name` means: "auto" is bfloat16 for a model with dense weights
    (`has_dense`) on a CPU that multiplies bfloat16 in hardware, float32 otherwise; other names as they say."""
    resolved = DENSE_DTYPES[check_dtype(name)]
    if resolved is not None:
        return resolved
    return "bfloat16" if has_dense and cpu_has_bf16(flags) else "float32"
