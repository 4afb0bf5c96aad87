"""Matrix products with weights that stay quantized in memory.

The one interface the quantized linear methods call. Each function has a plain PyTorch
reference (decode the weight with the bit-exact ``formats.ggml_types`` decoders, then an fp32
``F.linear``); the C++ kernels (``csrc/quant_*.cpp``, in the module ``get_quant_kernels`` returns) replace it
where they exist for the type, and tests (tests/test_quant_kernels.py) hold the two together.

Conventions
- A GGML-typed weight is ``w``: a uint8 tensor ``[N, row_bytes]`` holding the raw GGUF
  blocks of N rows (output features) of K columns (input features) each, row after row.
  ``qtype`` is the GGML type id (``gguf.GGMLQuantizationType`` value).
- ``x`` is float32 ``[M, K]`` (M tokens; leading dims are flattened); results are float32 ``[M, N]``.
- int8 weight-only: ``w`` int8 ``[N, K]``, ``scale`` float32 ``[N]``; W = w * scale[:, None].
- int4 group-wise: ``packed`` uint8 ``[N, K // 2]`` (low nibble = even column), ``scales``
  float16 and ``zeros`` uint8 ``[N, K // group]`` (other dtypes are converted per call);
  W[n, k] = (q[n, k] - zeros[n, k // g]) * scales[n, k // g].
- int3 group-wise: the same with 3-bit codes packed 12 bytes per 32 (``packed`` uint8
  ``[N, K // 32 * 12]``, ``formats.packing.pack_3bit``; K a multiple of 32).

Four kernel paths compute a product:
- ``q8``: x is quantized to int8 with an fp32 scale per block of 32 values (legacy types, int8,
  int4, int3) or 256 (k-quants, as ggml's Q8_K; ``activation_block``), ``quantize_activations_ref``
  (in ``kernels.quant_activations``) being the bit-exact reference, and multiplied with the weight
  blocks in integer arithmetic, reading each weight byte once per call. Fast for few tokens
  (decode); not exact: its reference is ``F.linear(dequantized x, W)`` (``q8_linear_ref``, beside it).
- ``q8x2``: as q8 with a second int8 level, the residual x - d q quantized again (x ~ d1 q1 +
  d2 q2, ~15 bits: the activation error shrinks ~100x); both levels go through the kernels as
  two "tokens" of one call, so the weights are still read once (costs ~1.5x q8's arithmetic).
- ``q16``: one 16-bit level (d = amax / 32767 per block of 32, or of 256 for the k-quants as q8's;
  the error of q8x2) multiplied with ``madd_epi16`` (VNNI's dpwssd where the CPU has it), for the
  types with such kernels (``kernel_supported16``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K
  and the int8 / int4 / int3 layouts); Q2_K and Q3_K take q8x2. Q8_0 weights run at q8's speed this
  way (the gemma3-270m / qwen2.5-coder-0.5b output matrices: 7.3 vs 8.7 and 5.8 vs 9.2 ms per token);
  the k-quants' integer work per token is half q8x2's (each sub-block's codes are widened to int16
  and scaled once per call, then one multiply-add per 16 values and token).
- ``dequant``: rows of W are decoded to fp32 in chunks and multiplied with torch's sgemm: exact
  fp32 math, the faster path for many tokens (prefill).
The default, ``auto``, takes q16 (q8x2 for types without 16-bit kernels) up to
``Q8X2_MAX_TOKENS`` tokens and dequant above; ``fast`` takes q8 up to ``Q8_MAX_TOKENS`` and
dequant above (llama.cpp's accuracy, faster decode). A repacked weight (the avx512_vnni, avx2_tiles and
amx kernel forms, `kernels/forms.py`; type ids from ``REPACKED_BASE``) has one tile kernel for every
row count: ``auto`` is q8x2 and ``fast`` q8 at any M (q16 has no tile form: q8x2), so a row's
product never depends on the rows beside it.
Measured mean KL of the logits against the fp32 model on 3 parity prompts (~550 positions):
q8 3.9e-3 (smollm2-135m Q4_1) and 9.1e-3 (gemma3-270m Q4_K_M); q8x2 4.9e-8 and 1.1e-7;
dequant 0. ``path=`` picks the path (a call that names none takes ``DEFAULT_PATH``, "auto");
q8, q8x2, q16 and dequant force it for every M, so the accuracy of each can be measured on its
own. An engine chooses per model (`EngineArgs.qmatmul`, applied to its layers by
`quantization.base.set_qmatmul`): no environment variable or process-wide switch decides it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from turbollm.formats.ggml_types import dequantize, dequantize_rows
from turbollm.formats.packing import unpack_3bit
from turbollm.kernels import get_quant_kernels
from turbollm.kernels.limits import ROW_INVARIANT_ROWS

#: Type ids of the non-GGML formats in the C++ kernel table.
INT8_PER_CHANNEL = 1000
INT4_GROUPWISE = 1001
INT3_GROUPWISE = 1002

#: "auto": the q16 / q8x2 kernels up to this many tokens, dequantize + sgemm above. Within it a row's
#: product does not depend on the other rows of the call (row invariance up to a batch-16 decode).
#: Measured (2 threads, cold weights, scripts/bench_qmatmul.py --q8x2 --q16, 2026-12-03, Xeon): at
#: M = 16 q16 beats dequant + sgemm on the legacy types (Q4_0 1536->8960 3.6 vs 4.5 ms, Q8_0 3.4 vs
#: 4.9, 576->1536 0.28-0.30 vs 0.31-0.33) and the k-quants' q8x2 ties it (Q4_K 4.70 vs 4.44, Q6_K
#: 4.24 vs 4.45); q8x2 stays at a flat ~90-100 GOP/s whatever M, dequant + sgemm climbs with M.
Q8X2_MAX_TOKENS = ROW_INVARIANT_ROWS  # (16: kernels/limits.py)

#: "fast": the q8 kernels up to this many tokens, dequantize + sgemm above. Measured (1 thread,
#: K=1536 N=1024 and 8960): q8 runs at a flat ~55-95 GOP/s whatever M, dequant + sgemm climbs
#: from ~22 GOP/s at M=4 to ~50 at M=16, ~60-67 at M=32 and ~75-90 (sgemm's peak) at M=64: they
#: cross near M=32 (k-quants' q8 stays ~10-25% ahead even at M=512, but the exact path is taken).
Q8_MAX_TOKENS = 31

#: Most weight rows per chunk on the dequant path: each thread decodes a chunk into its own fp32
#: scratch and runs a single-threaded sgemm on it; `dequant_chunk_rows` cuts N into a multiple of
#: the thread count of chunks of at most this many rows (equal shares per thread). Measured at
#: M = 512, 2 threads, Q4_K/Q6_K (2026-11-30): 256 rows 80-82 ms on 8960 -> 1536 against 85 ms
#: at 128 and 96-136 ms at 16-64; 1536 -> 8960 80-82 ms at 256 and 128; fp32 F.linear 77-88 ms.
DEQUANT_CHUNK_ROWS = 256


def dequant_chunk_rows(n: int, threads: int | None = None) -> int:
    """Rows per chunk for an N-row weight: ``threads * c`` chunks of at most DEQUANT_CHUNK_ROWS rows."""
    threads = max(1, threads or torch.get_num_threads())
    chunks = threads * -(-n // (threads * DEQUANT_CHUNK_ROWS))
    return max(1, -(-n // chunks))


_PATHS = ("auto", "fast", "q8", "q8x2", "q16", "dequant")
#: activation levels the C++ linear_q8 takes for each integer path (16: one 16-bit level)
_LEVELS = {"q8": 1, "q8x2": 2, "q16": 16}


_cache: dict = {}  # "mod": the loaded module (or None); "types": qtype -> bool


def _kernel_module():
    """The compiled module or None, looked up once (decode calls this hundreds of times a token)."""
    if "mod" not in _cache:
        _cache["mod"] = get_quant_kernels()
        _cache["types"] = {}
    return _cache["mod"]


def _kernels(qtype: int):
    """The kernel module when it has kernels for ``qtype``, else None."""
    mod = _kernel_module()
    if mod is None:
        return None
    types = _cache["types"]
    ok = types.get(qtype)
    if ok is None:
        ok = types[qtype] = bool(mod.supported(int(qtype)))
    return mod if ok else None


def kernel_supported16(qtype: int) -> bool:
    """Whether ``qtype`` has 16-bit activation (q16) kernels; the q16 path takes q8x2 for the others."""
    mod = _kernels(qtype)
    if mod is None:
        return False
    types16 = _cache.setdefault("types16", {})
    ok = types16.get(qtype)
    if ok is None:
        ok = types16[qtype] = bool(mod.supported16(int(qtype)))
    return ok


def kernel_supported(qtype: int) -> bool:
    """Whether ``qtype`` (a GGML id, or INT8_PER_CHANNEL / INT4_GROUPWISE / INT3_GROUPWISE) runs on C++ kernels."""
    return _kernels(qtype) is not None


#: The path of a call that names none. Engines name theirs per model (`set_qmatmul`); tests of the
#: exact numerics swap this default for the models they build directly.
DEFAULT_PATH = "auto"


def check_path(path: str) -> str:
    if path not in _PATHS:
        raise ValueError(f"unknown quantized-matmul path {path!r}; expected one of {_PATHS}")
    return path


#: Type ids of the repacked layouts (kernels/forms.py, csrc/repacked.h): REPACKED_BASE + the GGML id (the
#: avx512_vnni form), REPACKED_AMX_BASE + the GGML id (the amx form: the same bytes, AMX tiles for whole
#: tiles of 16 rows).
REPACKED_BASE = 2000
REPACKED_AMX_BASE = 3000
#: REPACKED_AVX2_BASE + the GGML id: the avx2_tiles form (the same bytes, AVX2 tile kernels)
REPACKED_AVX2_BASE = 4000


def is_repacked(qtype: int) -> bool:
    """Whether ``qtype`` names a repacked layout (the avx512_vnni, avx2_tiles or amx form's interleaved rows)."""
    return int(qtype) >= REPACKED_BASE


def ggml_base_type(qtype: int) -> int:
    """The GGML type of a repacked layout (other ids unchanged)."""
    return int(qtype) % 1000 if is_repacked(qtype) else int(qtype)


def _resolve_path(m: int, path: str | None, any_rows: bool = False) -> str:
    """The path ("q8", "q8x2", "q16" or "dequant") a call of m tokens takes (q16: q8x2 for the types
    without 16-bit kernels). ``any_rows``: a repacked weight, whose tile kernels take any number of
    rows at one numerics: "auto" is q8x2 and "fast" q8 whatever m (q16 has no tile form: q8x2)."""
    path = path or DEFAULT_PATH
    if any_rows:
        return {"auto": "q8x2", "fast": "q8", "q16": "q8x2"}.get(path, path)
    if path == "auto":
        return "q16" if m <= Q8X2_MAX_TOKENS else "dequant"
    if path == "fast":
        return "q8" if m <= Q8_MAX_TOKENS else "dequant"
    if path not in _PATHS:
        raise ValueError(f"unknown quantized-matmul path {path!r}; expected one of {_PATHS}")
    return path


def q8_levels(m: int, path: str | None = None, any_rows: bool = False) -> int | None:
    """The C++ ``levels`` of the path a call of m tokens takes: 1 (q8), 2 (q8x2), 16 (q16: 2 for a
    type without 16-bit kernels, as ``levels_for`` says), None (dequant). ``any_rows``: every
    quantized weight is repacked (`_resolve_path`)."""
    return _LEVELS.get(_resolve_path(m, path, any_rows))


def repack(w: torch.Tensor, qtype: int, k: int, base: int = REPACKED_BASE) -> tuple[torch.Tensor, int]:
    """A GGML weight in the repacked layout, as type ``base`` + its GGML id (REPACKED_BASE: the avx512_vnni
    form, REPACKED_AMX_BASE: the amx form, REPACKED_AVX2_BASE: the avx2_tiles form), when this CPU runs that
    form's kernels for the type and the rows come in whole groups of 16; else unchanged."""
    mod = _kernel_module()
    if mod is None or is_repacked(qtype) or not hasattr(mod, "repackable") \
            or not mod.repackable(int(qtype), int(base)) or w.shape[0] % 16:
        return w, int(qtype)
    return mod.repack(w.contiguous(), int(qtype), k), int(base) + int(qtype)


def unrepack(w: torch.Tensor, qtype: int, k: int) -> tuple[torch.Tensor, int]:
    """A weight back in its GGML rows (repacked layouts only; others unchanged), with its GGML type."""
    if not is_repacked(qtype):
        return w, int(qtype)
    base = ggml_base_type(qtype)
    return _kernel_module().unrepack(w, base, k), base


def to_layout(w: torch.Tensor, qtype: int, k: int, base: int | None) -> tuple[torch.Tensor, int]:
    """A GGML or repacked weight in the layout of repacked base ``base`` (None: the GGML rows): repacked,
    unpacked, or only relabelled between two repacked forms (same bytes); unchanged where the type or the
    rows do not allow it."""
    if base is None:
        return unrepack(w, qtype, k)
    if is_repacked(qtype):
        relabelled = int(base) + ggml_base_type(qtype)
        mod = _kernel_module()
        if relabelled == int(qtype) or not mod.repackable(ggml_base_type(qtype), int(base)):
            return w, int(qtype)
        return w, relabelled
    return repack(w, qtype, k, base)


def call_path(m: int, qtype: int, path: str | None = None) -> str:
    """The path ("q8", "q8x2", "q16" or "dequant") a call of m tokens takes for a weight of ``qtype``: the
    path `_resolve_path` picks, with q16 named q8x2 for the types without 16-bit kernels (`levels_for`)."""
    chosen = _resolve_path(m, path, is_repacked(qtype))
    return "q8x2" if chosen == "q16" and levels_for(qtype, 16) == 2 else chosen


def levels_for(qtype: int, levels: int) -> int:
    """``levels`` as a weight of ``qtype`` takes them (the same rule as decode_step.cpp's)."""
    return 2 if levels == 16 and not kernel_supported16(qtype) else levels


def _run_linear(mod, x: torch.Tensor, w: torch.Tensor, qtype: int, k: int, scale, zero, group: int,
                out: torch.Tensor | None, path: str | None) -> torch.Tensor:
    """Run the chosen kernel path on x flattened to [M, K]; the result keeps x's leading dims."""
    n = w.shape[0]
    x2 = x if x.dim() == 2 else x.reshape(-1, k)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    out2 = out if out is None or out.dim() == 2 else out.view(-1, n)
    chosen = _resolve_path(x2.shape[0], path, is_repacked(qtype))
    if chosen == "dequant":
        y = mod.linear_dequant(x2, w, qtype, k, scale, zero, group, out2, dequant_chunk_rows(n))
    else:
        y = mod.linear_q8(x2, w, qtype, k, scale, zero, group, out2, levels_for(qtype, _LEVELS[chosen]))
    if out is not None:
        return out
    return y if x.dim() == 2 else y.view(*x.shape[:-1], n)


def _result(y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return y
    out.copy_(y)
    return out


# ---------------------------------------------------------------------------------------------
# GGML block types


def ggml_dequantize(w: torch.Tensor, qtype: int, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """All rows of a GGML-typed weight (or a repacked one) as float32 ``[N, K]``."""
    mod = _kernels(qtype)
    if mod is not None and (out is None or out.dtype == torch.float32):
        return mod.dequant(w, int(qtype), k, None, None, 0, out)
    w, qtype = unrepack(w, qtype, k)
    return dequantize(w, qtype, (w.shape[0], k), out=out)


def ggml_embedding(w: torch.Tensor, qtype: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of a GGML-typed table as float32 ``[*ids.shape, K]``."""
    mod = _kernels(qtype)
    if mod is not None:
        return mod.embedding(w, int(qtype), k, ids.reshape(-1)).view(*ids.shape, k)
    rows = dequantize_rows(w, qtype, (w.shape[0], k), ids.reshape(-1))
    return rows.view(*ids.shape, k)


def ggml_linear(x: torch.Tensor, w: torch.Tensor, qtype: int, k: int, *, out: torch.Tensor | None = None,
                path: str | None = None) -> torch.Tensor:
    """``x @ W.T`` for a GGML-typed weight (kernels when the type has them, else the reference).

    ``out`` (float32, contiguous, ``[*x.shape[:-1], N]``) receives the result; ``path`` forces
    "q8" or "dequant" (default: ``DEFAULT_PATH``, auto by token count).
    """
    mod = _kernels(qtype)
    if mod is None:
        return _result(ggml_linear_ref(x, w, qtype, k), out)
    return _run_linear(mod, x, w, int(qtype), k, None, None, 0, out, path)


def ggml_linear_ref(x: torch.Tensor, w: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """Reference of ``ggml_linear``: decode (a repacked weight from its GGML rows), then fp32 matmul."""
    w, qtype = unrepack(w, qtype, k)
    return F.linear(x.float(), dequantize(w, qtype, (w.shape[0], k)))


# ---------------------------------------------------------------------------------------------
# int8 per-channel, int4 and int3 group-wise


def _int8_module(w: torch.Tensor):
    """The kernel module when ``int8_linear`` multiplies by ``w`` on the C++ kernels, else None."""
    mod = _kernels(INT8_PER_CHANNEL)
    return mod if mod is not None and w.shape[1] % 32 == 0 and w.is_contiguous() else None


def int8_kernel_path(w: torch.Tensor) -> bool:
    """Whether ``int8_linear`` multiplies by ``w`` on the C++ kernels (else the reference)."""
    return _int8_module(w) is not None


def int8_scale(scale: torch.Tensor) -> torch.Tensor:
    """The kernels' int8 row scales: float32, contiguous (no copy when already so)."""
    return scale.float().contiguous()


def int8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, *, out: torch.Tensor | None = None,
                path: str | None = None) -> torch.Tensor:
    """``x @ W.T`` for an int8 per-output-channel weight."""
    mod = _int8_module(w)
    if mod is None:
        return _result(int8_linear_ref(x, w, scale), out)
    return _run_linear(mod, x, w, INT8_PER_CHANNEL, w.shape[1], int8_scale(scale), None, 0, out, path)


def int8_linear_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference of ``int8_linear``."""
    return F.linear(x.float(), w.float() * scale[:, None])


def int4_dequantize(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """A group-wise int4 weight as float32 ``[N, K]``."""
    return _groupwise_dequantize(INT4_GROUPWISE, packed, packed.shape[1] * 2, scales, zeros, group)


def int4_dequantize_ref(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """Reference of ``int4_dequantize``."""
    n = packed.shape[0]
    return _apply_groups(torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(n, -1), scales, zeros, group)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group: int, *, out: torch.Tensor | None = None, path: str | None = None) -> torch.Tensor:
    """``x @ W.T`` for a group-wise int4 weight."""
    return _groupwise_linear(INT4_GROUPWISE, x, packed, packed.shape[1] * 2, scales, zeros, group, out, path)


def int4_linear_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group: int) -> torch.Tensor:
    """Reference of ``int4_linear``."""
    return F.linear(x.float(), int4_dequantize_ref(packed, scales, zeros, group))


def int3_dequantize(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """A group-wise int3 weight (``pack_3bit`` layout) as float32 ``[N, K]``."""
    return _groupwise_dequantize(INT3_GROUPWISE, packed, packed.shape[1] // 12 * 32, scales, zeros, group)


def int3_dequantize_ref(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """Reference of ``int3_dequantize``."""
    return _apply_groups(unpack_3bit(packed), scales, zeros, group)


def int3_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group: int, *, out: torch.Tensor | None = None, path: str | None = None) -> torch.Tensor:
    """``x @ W.T`` for a group-wise int3 weight (``pack_3bit`` layout)."""
    return _groupwise_linear(INT3_GROUPWISE, x, packed, packed.shape[1] // 12 * 32, scales, zeros, group, out, path)


def int3_linear_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group: int) -> torch.Tensor:
    """Reference of ``int3_linear``."""
    return F.linear(x.float(), int3_dequantize_ref(packed, scales, zeros, group))


_GROUPWISE_REFS = {INT4_GROUPWISE: (int4_dequantize_ref, int4_linear_ref),
                   INT3_GROUPWISE: (int3_dequantize_ref, int3_linear_ref)}


def groupwise_meta(scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' group-wise metadata: float16 scales and uint8 zero points (no copy when already so)."""
    return scales.to(torch.float16).contiguous(), zeros.to(torch.uint8).contiguous()


def _apply_groups(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """Codes ``[N, K]`` → float32 ``(q - zero) * scale`` per group of ``group`` columns."""
    n = q.shape[0]
    q = q.float().view(n, -1, group)
    return ((q - zeros.float()[:, :, None]) * scales.float()[:, :, None]).reshape(n, -1)


def _groupwise_dequantize(qtype: int, packed: torch.Tensor, k: int, scales: torch.Tensor, zeros: torch.Tensor,
                          group: int) -> torch.Tensor:
    mod = _kernels(qtype)
    if mod is not None and group % 32 == 0 and packed.is_contiguous():
        return mod.dequant(packed, qtype, k, *groupwise_meta(scales, zeros), group, None)
    return _GROUPWISE_REFS[qtype][0](packed, scales, zeros, group)


def _groupwise_module(qtype: int, packed: torch.Tensor, k: int, group: int):
    """The kernel module when the int4 / int3 products multiply by ``packed`` on the C++ kernels, else None."""
    mod = _kernels(qtype)
    return mod if mod is not None and group % 32 == 0 and k % group == 0 and packed.is_contiguous() else None


def groupwise_kernel_path(qtype: int, packed: torch.Tensor, k: int, group: int) -> bool:
    """Whether the int4 / int3 products multiply by ``packed`` on the C++ kernels (else the reference)."""
    return _groupwise_module(qtype, packed, k, group) is not None


def _groupwise_linear(qtype: int, x: torch.Tensor, packed: torch.Tensor, k: int, scales: torch.Tensor,
                      zeros: torch.Tensor, group: int, out: torch.Tensor | None, path: str | None) -> torch.Tensor:
    mod = _groupwise_module(qtype, packed, k, group)
    if mod is None:
        return _result(_GROUPWISE_REFS[qtype][1](x, packed, scales, zeros, group), out)
    return _run_linear(mod, x, packed, qtype, k, *groupwise_meta(scales, zeros), group, out, path)


def activation_block(qtype: int) -> int:
    """Block size (32 or 256) in which the q8 path quantizes activations for ``qtype``."""
    mod = _kernels(qtype)
    return int(mod.act_block(int(qtype))) if mod is not None else 32
