"""Which GGML type each tensor gets in a GGUF file type ("mix") such as Q4_K_M.

Follows llama.cpp's mix rules as of ggml-org/llama.cpp commit 007dbbf (``src/llama-quant.cpp``:
``tensor_allows_quantization``, ``llama_tensor_get_type_impl``, ``tensor_type_fallback``,
``llama_ftype_get_default_type``), for the non-imatrix file types listed in
:data:`FILE_TYPES`, restated as tables:

- :data:`FILE_TYPES` - the file type's default tensor type and its ``general.file_type`` id;
- :func:`allows_quantization` - only 2-D+ tensors named ``*weight`` are quantized, minus the
  :data:`KEEP_SUBSTRINGS` / :data:`KEEP_NAMES` exceptions (norms, MoE routers, small
  convolutions...); the others keep their stored type;
- the output projection (and the token embedding when it is tied to it, i.e. the file has no
  ``output.weight``) gets Q6_K (Q8_0 when its row is not a whole block of the default type,
  or the default is Q8_0);
- :data:`RULES` - per tensor category and file type, a function of the tensor's position
  (``use_more_bits``: the first and last eighth of the layers and every third one between
  them) and of the model (grouped-query ratio, expert count, falcon) that returns a type, or
  None to keep the default;
- :data:`FALLBACK` - a tensor whose row length is not a multiple of the chosen type's block
  (e.g. 576-wide rows for a 256-weight k-quant) takes the fallback type (Q4_K -> Q5_0,
  Q6_K -> Q8_0...), and F16 if that does not fit either.

Layer positions are counted as llama.cpp counts them: per category, over the tensors sorted
by layer number and then by name. Not covered: importance-matrix and IQ/TQ/MXFP4 file types,
user overrides (``--tensor-type``, ``--pure``) and llama.cpp's error for legacy types without
a fallback (we use F16 there).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, LlamaFileType
from gguf import GGMLQuantizationType as T

__all__ = ["FILE_TYPES", "FileType", "TensorContext", "allows_quantization", "plan_tensor_types", "resolve_file_type"]


@dataclass(frozen=True)
class FileType:
    """A GGUF file type: its name, ``general.file_type`` id and default tensor type."""

    name: str
    ftype: LlamaFileType
    default: T

    @property
    def quantized(self) -> bool:
        return self.default not in (T.F32, T.F16, T.BF16)


def _ft(name: str, ftype: LlamaFileType, default: T) -> tuple[str, FileType]:
    return name, FileType(name, ftype, default)


#: The file types we can write, by name (upper case).
FILE_TYPES: dict[str, FileType] = dict([
    _ft("F32", LlamaFileType.ALL_F32, T.F32),
    _ft("F16", LlamaFileType.MOSTLY_F16, T.F16),
    _ft("BF16", LlamaFileType.MOSTLY_BF16, T.BF16),
    _ft("Q8_0", LlamaFileType.MOSTLY_Q8_0, T.Q8_0),
    _ft("Q6_K", LlamaFileType.MOSTLY_Q6_K, T.Q6_K),
    _ft("Q5_K_M", LlamaFileType.MOSTLY_Q5_K_M, T.Q5_K),
    _ft("Q5_K_S", LlamaFileType.MOSTLY_Q5_K_S, T.Q5_K),
    _ft("Q5_1", LlamaFileType.MOSTLY_Q5_1, T.Q5_1),
    _ft("Q5_0", LlamaFileType.MOSTLY_Q5_0, T.Q5_0),
    _ft("Q4_K_M", LlamaFileType.MOSTLY_Q4_K_M, T.Q4_K),
    _ft("Q4_K_S", LlamaFileType.MOSTLY_Q4_K_S, T.Q4_K),
    _ft("Q4_1", LlamaFileType.MOSTLY_Q4_1, T.Q4_1),
    _ft("Q4_0", LlamaFileType.MOSTLY_Q4_0, T.Q4_0),
    _ft("Q3_K_L", LlamaFileType.MOSTLY_Q3_K_L, T.Q3_K),
    _ft("Q3_K_M", LlamaFileType.MOSTLY_Q3_K_M, T.Q3_K),
    _ft("Q3_K_S", LlamaFileType.MOSTLY_Q3_K_S, T.Q3_K),
    _ft("Q2_K", LlamaFileType.MOSTLY_Q2_K, T.Q2_K),
])


def resolve_file_type(name: str) -> FileType:
    """The :class:`FileType` called ``name`` (any case); ValueError listing the choices if none."""
    try:
        return FILE_TYPES[str(name).upper()]
    except KeyError:
        raise ValueError(f"unknown GGUF file type {name!r}; choose one of {', '.join(FILE_TYPES)}") from None


# ---------------------------------------------------------------- which tensors are quantized

#: A tensor whose name contains one of these keeps its type.
KEEP_SUBSTRINGS: tuple[str, ...] = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
    "indexer.q_proj.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.",
    "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
    *(f"time_mix_{k}.weight" for k in ("first", "w0", "w1", "w2", "v0", "v1", "v2", "a0", "a1", "a2",
                                       "g1", "g2", "decay_w1", "decay_w2", "lerp_fused")),
)
#: Tensors with exactly these names keep their type (positional / token-type embeddings).
KEEP_NAMES: frozenset[str] = frozenset({"position_embd.weight", "token_types.weight"})


def ggml_n_dims(shape: Sequence[int]) -> int:
    """``ggml_n_dims``: dimensions up to the last one larger than 1 (PyTorch-order ``shape``)."""
    ne = list(reversed(shape))
    return max([i + 1 for i, n in enumerate(ne) if n > 1], default=1)


def allows_quantization(name: str, shape: Sequence[int]) -> bool:
    """llama.cpp's ``tensor_allows_quantization`` (with ``quantize_output_tensor`` on)."""
    if ggml_n_dims(shape) < 2 or not name.endswith("weight") or name in KEEP_NAMES:
        return False
    return not any(s in name for s in KEEP_SUBSTRINGS)


# ---------------------------------------------------------------- categories and rules

_CATEGORY_PATTERNS: tuple[tuple[str, str], ...] = (  # first match wins, as in tensor_get_category
    ("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"), ("attn_v.weight", "attn_v"),
    ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
    ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down"),
)


def category(name: str) -> str:
    """The tensor's category: output, token_embd, attn_v (incl. fused qkv / kv_b), attn_k, ...; other."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    return next((cat for pattern, cat in _CATEGORY_PATTERNS if pattern in name), "other")


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's ``use_more_bits``: first and last eighth of ``n``, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass(frozen=True)
class TensorContext:
    """What the rules look at: the tensor's position in its category and the model's shape."""

    index: int  # position among the tensors of its category (layer order)
    count: int  # attn_v: number of attn_v tensors; ffn_*: number of layers
    arch: str
    n_gqa: int  # attention heads per KV head
    n_expert: int
    is_70b: bool

    @property
    def more_bits(self) -> bool:
        return use_more_bits(self.index, self.count)

    @property
    def falcon(self) -> bool:
        return self.arch == "falcon"


Rule = Callable[[TensorContext], "T | None"]


def _always(t: T) -> Rule:
    return lambda c: t


def _if_more_bits(t: T) -> Rule:
    return lambda c: t if c.more_bits else None


def _q4_k_m_ffn_down(c: TensorContext) -> T | None:
    if c.falcon:
        return T.Q6_K if c.index < c.count // 16 else T.Q5_K if c.more_bits else T.Q4_K
    return T.Q6_K if c.more_bits else None


def _attn_output_moe(c: TensorContext) -> T | None:
    return T.Q5_K if c.n_expert == 8 and not c.falcon else None


#: category -> file type -> rule (the branches of ``llama_tensor_get_type_impl``).
RULES: dict[str, dict[str, Rule]] = {
    "attn_v": {
        "Q2_K": lambda c: T.Q4_K if c.n_gqa >= 4 else T.Q3_K,
        "Q3_K_M": lambda c: T.Q5_K if c.index < 2 else T.Q4_K,
        "Q3_K_L": _always(T.Q5_K),
        "Q4_K_M": _if_more_bits(T.Q6_K),
        "Q5_K_M": _if_more_bits(T.Q6_K),
        "Q4_K_S": lambda c: T.Q5_K if c.index < 4 else None,
    },
    "ffn_down": {
        "Q2_K": _always(T.Q3_K),
        "Q3_K_M": lambda c: (T.Q5_K if c.index < c.count // 16
                             else T.Q4_K if not c.falcon or c.more_bits else T.Q3_K),
        "Q3_K_L": lambda c: T.Q4_K if c.falcon else T.Q5_K,
        "Q4_K_M": _q4_k_m_ffn_down,
        "Q5_K_M": _if_more_bits(T.Q6_K),
        "Q4_K_S": lambda c: T.Q5_K if not c.falcon and c.index < c.count // 8 else None,
    },
    "attn_output": {
        "Q2_K": lambda c: None if c.falcon else T.Q5_K if c.n_expert == 8 else T.Q3_K,
        "Q3_K_S": _attn_output_moe,
        "Q3_K_M": lambda c: None if c.falcon else T.Q5_K if c.n_expert == 8 else T.Q4_K,
        "Q3_K_L": lambda c: T.Q4_K if c.falcon else None if c.n_expert == 8 else T.Q5_K,
        "Q4_K_S": _attn_output_moe,
        "Q4_K_M": _attn_output_moe,
    },
}

#: Type substituted when a tensor's rows are not whole blocks of the chosen type.
FALLBACK: dict[T, T] = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}


def _fits(t: T, ncols: int) -> bool:
    return ncols % GGML_QUANT_SIZES[t][0] == 0


def _tensor_type(ft: FileType, name: str, cat: str, ncols: int, ctx: TensorContext, tied: bool) -> T:
    """``llama_tensor_get_type`` for a quantizable tensor, fallback included."""
    new = ft.default
    if not ft.quantized:
        return new
    if cat == "output" or (tied and cat == "token_embd"):
        if ctx.falcon or not _fits(new, ncols):
            new = T.Q8_0
        elif new != T.Q8_0:
            new = T.Q6_K
    elif cat != "token_embd":
        rule = RULES.get(cat, {}).get(ft.name)
        chosen = rule(ctx) if rule else None
        if chosen is not None:
            new = chosen
        if cat == "attn_v":
            if ctx.is_70b and new in (T.Q3_K, T.Q4_K):
                new = T.Q5_K  # 8 heads share attn_v in the 70B: more bits for little size
            if ctx.n_expert == 8:
                new = T.Q8_0
        elif cat == "attn_k" and ctx.n_expert == 8:
            new = T.Q8_0
    if not _fits(new, ncols):
        new = FALLBACK.get(new, T.F16)
        if not _fits(new, ncols):
            new = T.F16
    return new


def _layer(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _first(v, default):
    if isinstance(v, list):
        return v[0] if v else default
    return default if v is None else v


def plan_tensor_types(tensors: Mapping[str, Sequence[int]], ftype: str | FileType,
                      metadata: Mapping[str, object]) -> dict[str, T | None]:
    """For each tensor (name -> PyTorch-order shape), its type in file type ``ftype``.

    None means "not quantized: keep the stored type". ``metadata`` is the GGUF metadata
    (architecture, ``block_count``, head counts, ``expert_count``).
    """
    ft = ftype if isinstance(ftype, FileType) else resolve_file_type(ftype)
    arch = str(metadata.get("general.architecture", ""))
    n_layer = int(_first(metadata.get(f"{arch}.block_count"), 0))
    n_head = int(_first(metadata.get(f"{arch}.attention.head_count"), 0))
    n_head_kv = int(_first(metadata.get(f"{arch}.attention.head_count_kv"), n_head))
    n_gqa = n_head // n_head_kv if n_head_kv else 0
    n_expert = int(_first(metadata.get(f"{arch}.expert_count"), 0))
    is_70b = arch == "llama" and n_layer == 80 and n_head != n_head_kv
    tied = "output.weight" not in tensors
    order = sorted(tensors, key=lambda n: (_layer(n), n))  # llama.cpp's weight_name_comparer
    cats = {n: category(n) for n in order}
    counts = {"attn_v": sum(c == "attn_v" for c in cats.values())}
    seen: dict[str, int] = {}
    plan: dict[str, T | None] = {}
    for name in order:
        shape = tensors[name]
        if not allows_quantization(name, shape):
            plan[name] = None
            continue
        cat = cats[name]
        index = seen.get(cat, 0)
        seen[cat] = index + 1
        if n_expert > 1 and cat.startswith("ffn_"):
            index = _layer(name)
        ctx = TensorContext(index, counts.get(cat, n_layer), arch, n_gqa, n_expert, is_70b)
        plan[name] = _tensor_type(ft, name, cat, int(shape[-1]), ctx, tied)
    return {name: plan[name] for name in tensors}
