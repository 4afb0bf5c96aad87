"""What an engine will hold in memory, predicted from the model's shapes and the engine's arguments.

- **weights**: from the checkpoint's tensor table (a GGUF header or safetensors headers; no weight is
  read): each decoder layer's linear weight at its linear method's resident size (`LINEAR_BYTES`), the
  vocabulary tables as the engine holds them (`vocab_bytes`: a GGUF's blocks under a method that takes
  them, else the method's `vocab_table_type`), norms and biases as the file stores them;
- **KV cache**: the engine's own sizing (`core/kv_sizing.size_kv_cache`: blocks per KV group, the
  quantized formats' scales and float16 rings) — exact, not estimated;
- **activations**: the largest step's tokens (the simulated run's, else `max_num_batched_tokens`) times the
  bytes a token needs as the profile measured them (its tensors and what the heap keeps of them; before a
  profile, the float32 tensors alone: residual stream, QKV, attention output, the MLP's gate/up/activation),
  plus the sampled rows' logits three times over (logits, probabilities, the sampler's sort);
- **runtime**: the interpreter, torch and the kernels (`base`, the machine's, measured once), and what the
  model adds beyond its weights (tokenizers, the fused step's buffers, allocator slack): measured once per
  model by its profile (`planner/profile.py`), or estimated from the vocabulary before one exists.

`MemoryPlan.total` is the serving peak with the KV pool in use to its last block; its pages are committed as
they are first written, so a simulated run's peak counts the pages it writes (`workload_total`). Loading
adds a transient: the file's mapped pages beside the resident weights (`load_peak`).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from turbollm.errors import InvalidRequestError

MiB = 1 << 20
# before a profile has measured it: the model's own runtime, a fixed part (kernels, buffers) and bytes per
# vocabulary entry (the tokenizers' tables), fitted to smollm2-135m (49k entries: 187 MiB measured) and
# qwen2.5-coder-0.5b (152k: 254 MiB) on the Intel Xeon of 2026-12-06
VOCAB_ENTRY_BYTES = 700
MODEL_RUNTIME_FIXED = 150 * MiB

_VOCAB = re.compile(r"^(token_embd|output|model\.embed_tokens|lm_head)\.weight$")
_LAYER_LINEAR = re.compile(r"^(blk\.\d+\.(attn_(q|k|v|output)|ffn_(gate|up|down))\.weight"
                           r"|model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight)$")


@dataclass(frozen=True)
class LinearShape:
    out_features: int
    in_features: int
    file_bytes: int


@dataclass(frozen=True)
class VocabTable:
    rows: int
    dim: int
    file_bytes: int
    dense: bool  # stored as floats in the file (else GGML blocks, kept as they are)


@dataclass(frozen=True)
class TensorTable:
    """A checkpoint's tensors as the planner needs them: the decoder layers' linear weights, the vocabulary
    tables, and the rest."""

    linears: tuple[LinearShape, ...]
    other_bytes: int  # norms, biases: as the file stores them
    file_bytes: int
    vocab: tuple[VocabTable, ...] = ()

    @property
    def linear_params(self) -> int:
        return sum(s.out_features * s.in_features for s in self.linears)


def tensor_table(resolved) -> TensorTable:
    """Read a GGUF file's or an HF folder's tensor headers (no tensor data)."""
    from turbollm.hub.resolve import CheckpointFormat

    rows: list[tuple[str, tuple[int, ...], int]] = []
    dense: set[str] = set()
    if resolved.format is CheckpointFormat.GGUF:
        from turbollm.formats.gguf_file import read_gguf

        gguf = read_gguf(resolved.path)
        rows = [(n, t.shape, t.nbytes) for n, t in gguf.tensors.items()]
        dense = {n for n, t in gguf.tensors.items() if t.qtype in (0, 1, 30)}  # F32, F16, BF16
    else:
        from safetensors import safe_open

        from turbollm.loader.safetensors_weights import safetensors_files

        for f in safetensors_files(resolved.path):
            with safe_open(str(f), "pt") as st:
                for name in st.keys():
                    sl = st.get_slice(name)
                    shape = tuple(sl.get_shape())
                    rows.append((name, shape, math.prod(shape) * _ST_BYTES.get(sl.get_dtype(), 4)))
                    dense.add(name)
    linears = tuple(LinearShape(shape[0], shape[1] if len(shape) > 1 else 1, nbytes)
                    for name, shape, nbytes in rows if _LAYER_LINEAR.match(name))
    vocab = tuple(VocabTable(shape[0], shape[1], nbytes, name in dense)
                  for name, shape, nbytes in rows if _VOCAB.match(name) and len(shape) == 2)
    total = sum(b for _, _, b in rows)
    return TensorTable(linears, total - sum(s.file_bytes for s in linears) - sum(v.file_bytes for v in vocab), total,
                       vocab)


_ST_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "U8": 1, "I32": 4, "I64": 8, "I16": 2}


def _file(s: LinearShape, **_) -> int:
    return s.file_bytes


def _dense(s: LinearShape, dense_bytes: int = 4, **_) -> int:
    return s.out_features * s.in_features * dense_bytes


def _int8(s: LinearShape, **_) -> int:  # int8 codes, a float32 scale per output row
    return s.out_features * s.in_features + 4 * s.out_features


def _int4(s: LinearShape, group_size: int = 128, **_) -> int:  # nibbles, float16 scale + uint8 zero per group
    g = group_size if group_size > 0 else s.in_features
    if s.in_features % g:  # the loader refuses it so (int4_method.py)
        raise InvalidRequestError(f"int4: group size {g} does not divide a layer's {s.in_features} input features")
    return s.out_features * s.in_features // 2 + 3 * s.out_features * (s.in_features // g)


# a linear method's resident bytes for one decoder-layer weight (methods not named keep the file's layout:
# gguf blocks, GPTQ / AWQ checkpoints)
LINEAR_BYTES = {"gguf": _file, "none": _dense, "int8": _int8, "int4": _int4}


def vocab_bytes(v: VocabTable, method: str, dense_bytes: int = 4) -> int:
    """A vocabulary table as the engine holds it: a GGUF's blocks as they are under a method that takes GGML
    blocks; otherwise (a dense table, or blocks the loader dequantizes for the method) in the linear method's
    `vocab_table_type` (the quantizing methods: Q8_0), else in the dense dtype."""
    from turbollm.formats.ggml_types import block_size_bytes
    from turbollm.quantization import get_linear_method

    lm = get_linear_method(method)
    if not v.dense and lm.accepts_ggml_blocks:
        return v.file_bytes
    qtype = lm.vocab_table_type
    if qtype is None:
        return v.rows * v.dim * dense_bytes
    elems, nbytes = block_size_bytes(qtype)
    return v.rows * (-(-v.dim // elems)) * nbytes


def weight_bytes(table: TensorTable, method: str, dense_bytes: int = 4, group_size: int = 128) -> int:
    size = LINEAR_BYTES.get(method, _file)
    return (table.other_bytes + sum(vocab_bytes(v, method, dense_bytes) for v in table.vocab)
            + sum(size(s, dense_bytes=dense_bytes, group_size=group_size) for s in table.linears))


def tensor_bytes_per_token(cfg) -> int:
    """A token's float32 tensors in a step (see the module's docstring)."""
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    return 4 * (2 * cfg.hidden_size + qkv + cfg.num_heads * cfg.head_dim + 3 * cfg.intermediate_size)


def logits_bytes(cfg, sampled_rows: int) -> int:
    return 4 * 3 * sampled_rows * cfg.vocab_size


def activation_bytes(cfg, max_tokens: int, sampled_rows: int, per_token: float | None = None) -> int:
    """The largest step's tensors: `per_token` bytes a token (a profile's measure; default: the float32 tensors
    alone) and the sampled rows' logits."""
    per_token = tensor_bytes_per_token(cfg) if per_token is None else per_token
    return int(max_tokens * per_token) + logits_bytes(cfg, sampled_rows)


def estimated_model_runtime(cfg) -> int:
    return MODEL_RUNTIME_FIXED + VOCAB_ENTRY_BYTES * cfg.vocab_size


@dataclass(frozen=True)
class MemoryPlan:
    base: int  # the interpreter, torch, turbollm and its kernels (the machine's)
    model_runtime: int  # what the model adds beyond its weights
    weights: int
    kv_cache: int
    activations: int
    model_runtime_measured: bool
    kv_touched: int | None = None  # the pool's bytes a workload writes (its pages committed), when simulated

    @property
    def total(self) -> int:
        return self.base + self.model_runtime + self.weights + self.kv_cache + self.activations

    @property
    def workload_total(self) -> int | None:
        """The serving peak of the simulated workload: the KV pool's pages it writes, not the whole pool."""
        if self.kv_touched is None:
            return None
        return self.total - self.kv_cache + min(self.kv_cache, self.kv_touched)

    @property
    def load_peak(self) -> int:
        """While loading: the mapped file's pages beside the weights already built."""
        return self.base + self.model_runtime + 2 * self.weights

    @property
    def peak(self) -> int:
        return max(self.total, self.load_peak)

    def to_dict(self) -> dict:
        d = {k: round(v / MiB, 1) if isinstance(v, int) and not isinstance(v, bool) else v
             for k, v in asdict(self).items()}
        d.update(total=round(self.total / MiB, 1), load_peak=round(self.load_peak / MiB, 1),
                 workload_total=None if self.workload_total is None else round(self.workload_total / MiB, 1),
                 peak=round(self.peak / MiB, 1))
        return d
