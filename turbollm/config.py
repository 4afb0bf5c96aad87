"""The model's shape and hyper-parameters, read from GGUF metadata or a HF `config.json`.

`ModelConfig` is the one description every model file, layer and the engine reads; the two
readers below translate each checkpoint format into it. Per-architecture defaults that the
files leave implicit (Gemma 3's local RoPE base, its 5-of-6 sliding layers) are set by the
architecture's entry in `ARCH_DEFAULTS`, so they are written down once. RoPE scaling is
read from either format into one normalized dict (`layers/rope_scaling.py`), and a type we do
not implement is refused here, naming the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turbollm.errors import ModelFormatError, UnsupportedArchitectureError
from turbollm.layers.rope_scaling import normalize_rope_scaling, yarn_mscale

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass
class ModelConfig:
    """Everything the model code needs to build and run one architecture."""

    arch: str  # registry key: "llama", "qwen2", "gemma3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    hidden_act: str = "silu"
    # Sliding-window attention: the window and which layers use it (FULL / SLIDING per layer).
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 when set
    embedding_multiplier: float = 1.0  # Gemma scales embeddings by sqrt(hidden_size)
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # RoPE scaling, normalized (`normalize_rope_scaling`): of every layer, or of the full-attention
    # layers where the sliding ones have their own RoPE (`rope_local_theta`, `rope_local_scaling`).
    rope_scaling: dict[str, Any] | None = None
    rope_local_scaling: dict[str, Any] | None = None
    rope_freq_factors: list[float] | None = None  # GGUF `rope_freqs.weight`: divisors of every layer's frequencies
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_layers
        if self.num_heads % self.num_kv_heads:
            raise ModelFormatError(f"{self.num_heads} query heads cannot be grouped over {self.num_kv_heads} KV heads")

    @property
    def attention_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return float(base) ** -0.5

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i, or None for full attention."""
        return self.sliding_window if self.layer_types[i] == SLIDING else None

    def layer_rope_theta(self, i: int) -> float:
        if self.layer_types[i] == SLIDING and self.rope_local_theta is not None:
            return self.rope_local_theta
        return self.rope_theta

    def layer_rope_scaling(self, i: int) -> dict[str, Any] | None:
        """The RoPE scaling of layer i (a sliding layer with its own RoPE base has its own scaling)."""
        if self.layer_types[i] == SLIDING and self.rope_local_theta is not None:
            return self.rope_local_scaling
        return self.rope_scaling


def _gemma3_defaults(cfg: dict[str, Any]) -> None:
    cfg.setdefault("hidden_act", "gelu_pytorch_tanh")
    cfg.setdefault("rope_local_theta", 10_000.0)
    cfg.setdefault("query_pre_attn_scalar", cfg["head_dim"])
    cfg["embedding_multiplier"] = cfg["hidden_size"] ** 0.5
    pattern = cfg.pop("sliding_window_pattern", 6)
    if not cfg.get("layer_types"):
        cfg["layer_types"] = [SLIDING if (i + 1) % pattern else FULL for i in range(cfg["num_layers"])]


ARCH_DEFAULTS = {
    "llama": lambda cfg: None,
    "qwen2": lambda cfg: cfg.setdefault("attention_bias", True),
    "gemma3": _gemma3_defaults,
}

# Hugging Face `architectures` / `model_type` names → our registry key.
HF_ARCH_NAMES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma3ForCausalLM": "gemma3",
    "llama": "llama",
    "qwen2": "qwen2",
    "gemma3_text": "gemma3",
}


def _check_arch(arch: str, where: str) -> None:
    if arch not in ARCH_DEFAULTS:
        raise UnsupportedArchitectureError(
            f"{where}: architecture {arch!r} is not supported; supported: {', '.join(sorted(ARCH_DEFAULTS))}"
        )


def config_from_gguf(gguf_file) -> ModelConfig:
    """Build a ModelConfig from a parsed GGUF file (`turbollm.formats.gguf_file.GGUFFile`)."""
    arch = gguf_file.arch
    _check_arch(arch, str(gguf_file.path))
    md = gguf_file.metadata

    def need(key: str) -> Any:
        value = gguf_file.arch_key(key)
        if value is None:
            raise ModelFormatError(f"{gguf_file.path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    max_position = int(gguf_file.arch_key("context_length", 2048))
    heads = int(need("attention.head_count"))
    kv_heads = gguf_file.arch_key("attention.head_count_kv", heads)
    head_dim = int(gguf_file.arch_key("attention.key_length", hidden // heads))
    embd = gguf_file.tensors.get("token_embd.weight")
    if embd is None:
        raise ModelFormatError(f"{gguf_file.path}: no token_embd.weight tensor")
    vocab = int(gguf_file.arch_key("vocab_size", embd.shape[0]))
    cfg: dict[str, Any] = dict(
        arch=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(gguf_file.arch_key("rope.freq_base", 10_000.0)),
        max_position_embeddings=max_position,
        rope_scaling=_gguf_rope_scaling(gguf_file, max_position),
        rope_freq_factors=_gguf_rope_freq_factors(gguf_file, head_dim),
        tie_word_embeddings="output.weight" not in gguf_file.tensors,
        attention_bias="blk.0.attn_q.bias" in gguf_file.tensors,
        sliding_window=gguf_file.arch_key("attention.sliding_window"),
        final_logit_softcapping=gguf_file.arch_key("final_logit_softcapping"),
        attn_logit_softcapping=gguf_file.arch_key("attn_logit_softcapping"),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
    )
    _check_against_tensors(gguf_file, cfg)
    ARCH_DEFAULTS[arch](cfg)
    if arch != "gemma3":
        cfg["sliding_window"] = None
    return ModelConfig(**cfg)


#: GGUF `{arch}.rope.scaling.*` keys → transformers' names (llama.cpp's converter writes them from those).
_GGUF_ROPE_KEYS = {"factor": "factor", "original_context_length": "original_max_position_embeddings",
                   "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}


def _gguf_rope_scaling(gguf_file, max_position: int) -> dict[str, Any] | None:
    """`rope.scaling.*` as llama.cpp reads them: a factor without a type is linear; `attn_factor`
    multiplies the cos/sin tables (for YaRN, on top of its own factor)."""
    where = str(gguf_file.path)
    raw = {hf: gguf_file.arch_key(f"rope.scaling.{key}") for key, hf in _GGUF_ROPE_KEYS.items()}
    raw["rope_type"] = gguf_file.arch_key("rope.scaling.type") or ("linear" if raw["factor"] else "none")
    if gguf_file.arch_key("rope.scaling.yarn_log_multiplier"):
        raise UnsupportedArchitectureError(f"{where}: RoPE scaling with rope.scaling.yarn_log_multiplier is not "
                                           f"supported")
    scaling = normalize_rope_scaling(raw, max_position, where)
    attn_factor = float(gguf_file.arch_key("rope.scaling.attn_factor", 1.0))
    if attn_factor != 1.0:
        if scaling is None or scaling["rope_type"] != "yarn":
            raise UnsupportedArchitectureError(f"{where}: rope.scaling.attn_factor {attn_factor} is supported with "
                                               f"YaRN scaling only")
        scaling["attention_factor"] = attn_factor * yarn_mscale(scaling["factor"])
    return scaling


def _gguf_rope_freq_factors(gguf_file, head_dim: int) -> list[float] | None:
    """The `rope_freqs.weight` tensor (Llama 3's scaling, precomputed by the converter) as a list."""
    t = gguf_file.tensors.get("rope_freqs.weight")
    if t is None:
        return None
    from turbollm.formats.ggml_types import dequantize

    values = dequantize(t.data, t.qtype, t.shape, tensor_name=f"{gguf_file.path}: {t.name}").flatten()
    if values.numel() != head_dim // 2 or not bool((values > 0).all()):
        raise ModelFormatError(f"{gguf_file.path}: rope_freqs.weight must hold {head_dim // 2} positive factors, "
                               f"got {values.numel()} values")
    return values.tolist()


def _check_against_tensors(gguf_file, cfg: dict[str, Any]) -> None:
    """Reject metadata that disagrees with the tensors (a corrupt block_count would build a billion layers)."""
    blocks = {int(n.split(".")[1]) for n in gguf_file.tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if blocks != set(range(cfg["num_layers"])):
        raise ModelFormatError(f"{gguf_file.path}: metadata says {cfg['num_layers']} blocks but the file has tensors "
                               f"for {len(blocks)} (blk.0 .. blk.{max(blocks, default=-1)})")
    width = gguf_file.tensors["token_embd.weight"].shape[-1]
    if width != cfg["hidden_size"]:
        raise ModelFormatError(f"{gguf_file.path}: metadata embedding_length {cfg['hidden_size']} does not match "
                               f"token_embd.weight width {width}")


def config_from_hf(folder: str | Path) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face folder's `config.json`."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: cannot read: {e}") from None
    names = list(raw.get("architectures") or []) + [raw.get("model_type", "")]
    arch = next((HF_ARCH_NAMES[n] for n in names if n in HF_ARCH_NAMES), None)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"{path}: architecture {names[0] if names else '?'} is not supported; "
            f"supported: {', '.join(sorted(k for k in HF_ARCH_NAMES if 'For' in k))}"
        )
    if "text_config" in raw:
        raw = {**raw, **raw["text_config"]}
    try:
        heads = int(raw["num_attention_heads"])
        max_position = int(raw.get("max_position_embeddings", 2048))
        cfg: dict[str, Any] = dict(
            arch=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_hf_rope_theta(raw, "full_attention", 10_000.0)),
            max_position_embeddings=max_position,
            rope_scaling=normalize_rope_scaling(_hf_rope_scaling(raw, FULL), max_position, str(path)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch == "gemma3")),
            hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        )
    except KeyError as e:
        raise ModelFormatError(f"{path}: missing key {e.args[0]!r}") from None
    if arch == "llama":
        cfg["attention_bias"] = bool(raw.get("attention_bias", False))
    if arch == "gemma3":
        cfg["sliding_window"] = raw.get("sliding_window")
        cfg["layer_types"] = list(raw.get("layer_types") or [])
        cfg["query_pre_attn_scalar"] = raw.get("query_pre_attn_scalar")
        cfg["rope_local_theta"] = _hf_rope_theta(raw, "sliding_attention", None) or raw.get("rope_local_base_freq")
        cfg["rope_local_scaling"] = normalize_rope_scaling(_hf_rope_scaling(raw, SLIDING), max_position, str(path))
        if raw.get("sliding_window_pattern"):
            cfg["sliding_window_pattern"] = raw["sliding_window_pattern"]
    if arch == "qwen2" and raw.get("use_sliding_window"):
        raise UnsupportedArchitectureError(f"{path}: qwen2 with use_sliding_window=true is not supported")
    ARCH_DEFAULTS[arch](cfg)
    cfg = {k: v for k, v in cfg.items() if v is not None or k in ("sliding_window",)}
    return ModelConfig(**cfg)


def _hf_rope_theta(raw: dict[str, Any], layer_type: str, default: float | None) -> float | None:
    """RoPE base from a HF config: `rope_theta`, or transformers 5's `rope_parameters`."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        if layer_type in params and isinstance(params[layer_type], dict):
            return params[layer_type].get("rope_theta", default)
        if "rope_theta" in params:
            return params["rope_theta"]
    if layer_type == "sliding_attention":
        return raw.get("rope_local_base_freq", default)
    return raw.get("rope_theta", default)


def _hf_rope_scaling(raw: dict[str, Any], layer_type: str) -> dict[str, Any] | None:
    """The RoPE scaling dict of `layer_type`'s layers, as transformers reads it.

    `rope_scaling` (transformers 4) wins over `rope_parameters` (transformers 5, flat or nested
    per layer type) and belongs to the full-attention layers; a top-level
    `original_max_position_embeddings` overrides the dict's, as transformers does at run time.
    """
    params = raw.get("rope_parameters")
    nested = isinstance(params, dict) and isinstance(params.get(layer_type), dict)
    if layer_type == SLIDING:
        scaling = params[layer_type] if nested else None
    elif raw.get("rope_scaling"):
        scaling = raw["rope_scaling"]
    elif nested:
        scaling = params[layer_type]
    else:
        scaling = params if isinstance(params, dict) and not any(isinstance(v, dict) for v in params.values()) \
            else None
    if isinstance(scaling, dict) and raw.get("original_max_position_embeddings"):
        scaling = {**scaling, "original_max_position_embeddings": raw["original_max_position_embeddings"]}
    return scaling if isinstance(scaling, dict) else None
