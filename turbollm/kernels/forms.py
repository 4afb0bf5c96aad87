"""Kernel forms: one family of CPU kernels per instruction set, in one build, chosen at run time.

- ``avx2``: the kernels every x86-64 machine of ours runs (AVX2 + FMA + F16C; the module is
  compiled for x86-64-v3). Quantized weights stay in their GGML rows; the q16 / q8x2 row kernels
  take up to 16 rows (`kernels.quant.Q8X2_MAX_TOKENS`), dequantize + sgemm more.
- ``avx2_tiles``: the avx512_vnni form's repacked layout multiplied with AVX2 instructions
  (``csrc/qmm_avx2.cpp``: maddubs + madd on two 8-row halves of each group, integer sums exact, the same
  float steps lane for lane, so its rows are the avx512_vnni form's bits). Runs wherever the avx2 form
  does; a batched integer GEMM and row invariance at every batch size for AVX2-only CPUs (AMD Zen 3).
  Only when asked: on a Zen 3 with qmatmul "fast" its batch-16 decode is 2.5x the avx2 form's and its batch-1
  decode 1.0-1.4x on Q4_1 / Q5_0 / Q8_0 models, but under the default "auto" its two int8 levels make prefill
  ~0.55x the avx2 form's dequantize + sgemm, and under "fast" its one-row Q6_K and long-K Q4_K products run
  0.6-0.85x the avx2 row kernels (qwen2.5-coder-1.5b batch-1 decode 0.94x; docs/BENCHMARKS.md, 2026-12-07).
- ``avx512_vnni``: AVX-512 F/BW/VL/DQ + VNNI (Intel Xeon since Ice Lake, AMD Zen 4). GGML weights
  of the types it covers (`REPACKED_TYPES`) are repacked at load into groups of 16 interleaved
  rows (``csrc/repacked.h``: the same bytes, another order) and multiplied by one tile kernel
  (``csrc/qmm_vnni512.cpp``) for any number of rows: a decode's single row, a batch, a prefill
  chunk. The integer block sums are exact and every row runs the same operations whatever the
  others, so a row's result is the same alone or among any number (row invariance at every size).
- ``amx``: the avx512_vnni form, with each whole tile of 16 activation rows multiplied by AMX tiles
  (``csrc/qmm_amx.cpp``: one tile multiply per 32-block instead of 128 vpdpbusd; Intel Xeon since
  Sapphire Rapids, where the kernel grants the tile state). Same layout, same integer sums and the same
  float steps, lane for lane: the bits of the avx512_vnni form. Only when asked: with a scale per
  32-block every tile product makes a round trip through memory before its float steps, and it
  measured within +/-20% of avx512_vnni (docs/BENCHMARKS.md, 2026-12-06).

The dense GEMV (`kernels/dense.py`) has an avx2 and an AVX-512 pass too, and so has the tiled attention's
key step (``csrc/attention_tile.h``, ``csrc/flash_attention512.cpp``: each row in a vector lane, one chain of
fused multiply-adds per output); each gives the same bits in every width, so they follow the CPU rather than
the engine's form.

The form is a property of the loaded weights: `set_kernel_form` (quantization/base.py) repacks or
unpacks a model's weights for one, so that two engines in one process may run different forms. The
default is avx512_vnni where the CPU runs it, else avx2; ``TURBOLLM_KERNEL_FORM`` or the engine
argument ``kernel_form`` force one (an unknown form, or one this CPU cannot run, is refused with the
reason).
"""

from __future__ import annotations

import os

from turbollm.errors import InvalidRequestError
from turbollm.kernels.quant import REPACKED_AMX_BASE, REPACKED_AVX2_BASE, REPACKED_BASE

#: the forms
FORMS = ("avx2", "avx2_tiles", "avx512_vnni", "amx")
#: the default: the first of these this CPU runs (amx and avx2_tiles only when asked: docs/BENCHMARKS.md)
PREFERRED = ("avx512_vnni", "avx2")
#: environment variable that forces a form for every engine of the process that names none
FORM_ENV = "TURBOLLM_KERNEL_FORM"
#: GGML types the repacking forms repack (ids of gguf.GGMLQuantizationType)
REPACKED_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
#: forms whose GGML weights are repacked, and the type-id base of their layouts
REPACKING_FORMS = {"avx2_tiles": REPACKED_AVX2_BASE, "avx512_vnni": REPACKED_BASE, "amx": REPACKED_AMX_BASE}


def runnable_forms() -> tuple[str, ...]:
    """The forms this build of the kernels runs on this CPU, in `FORMS` order (empty without kernels)."""
    from turbollm.kernels import cpu_kernels

    mod = cpu_kernels()
    if mod is None or not hasattr(mod, "kernel_forms"):
        return ()
    return tuple(f for f in FORMS if f in set(mod.kernel_forms()))


def check_form(form: str | None) -> str | None:
    """`form` if it names a form (None stays None); else InvalidRequestError listing them."""
    if form is not None and form not in FORMS:
        raise InvalidRequestError(f"kernel_form {form!r}: choose one of {', '.join(FORMS)}")
    return form


def resolve_form(requested: str | None = None) -> str | None:
    """The form an engine runs: `requested`, else ``TURBOLLM_KERNEL_FORM``, else the first of `PREFERRED` this
    CPU runs.
    None when no kernels are built (the PyTorch references run). A form the CPU cannot run is refused."""
    form = check_form(requested or os.environ.get(FORM_ENV) or None)
    forms = runnable_forms()
    if not forms:
        return None
    if form is None:
        return next(f for f in PREFERRED if f in forms)
    if form not in forms:
        raise InvalidRequestError(f"kernel_form {form!r} cannot run here: this CPU and build run "
                                  f"{', '.join(forms)} (the forms need: avx2 = AVX2 + FMA + F16C, "
                                  f"avx2_tiles = the same as avx2, avx512_vnni = AVX-512 F/BW/VL/DQ + VNNI, "
                                  f"amx = that + AMX-INT8 tiles the kernel grants)")
    return form
