"""What makes a folder a Hugging Face model besides its tensors: config.json and tokenizer files.

A source that is already a Hugging Face folder keeps its own ``config.json`` (we add the
``quantization_config``) and its tokenizer files are copied. A GGUF source gets both written:

- ``config.json`` from our `ModelConfig` (`hf_config_dict`), in the form `config_from_hf`
  reads back to the same `ModelConfig` (a test holds the two together);
- ``tokenizer.json``: the `tokenizers` object we build from the GGUF metadata, serialized as
  is (normalizer, pre-tokenizer regexes, BPE/Unigram model, added tokens, post-processor);
  ``tokenizer_config.json`` with the special tokens' text, ``add_bos_token`` /
  ``add_eos_token`` and the chat template; ``generation_config.json`` with every id that ends
  a generation. `Tokenizer.from_hf_folder` then rebuilds the same tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from turbollm.config import ModelConfig
from turbollm.errors import ModelFormatError

# our architecture key → (HF class, model_type)
HF_NAMES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json")


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """A transformers-style config.json for `cfg` (float32 weights)."""
    cls, model_type = HF_NAMES[cfg.arch]
    out: dict[str, Any] = {
        "architectures": [cls], "model_type": model_type, "torch_dtype": "float32",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    }
    if cfg.rope_freq_factors is not None:  # a config.json has no place for them: refuse, never drop them
        raise ModelFormatError("this model's RoPE frequency factors (a GGUF's rope_freqs.weight) cannot be written "
                               "to a config.json; quantize its Hugging Face folder (rope_scaling llama3) instead")
    if cfg.rope_local_scaling:
        raise ModelFormatError("RoPE scaling of the sliding-window layers cannot be written to this config.json yet")
    if cfg.rope_scaling:
        out["rope_scaling"] = cfg.rope_scaling
    if cfg.arch == "llama":
        out.update(hidden_act=cfg.hidden_act, attention_bias=cfg.attention_bias, mlp_bias=False)
    elif cfg.arch == "qwen2":
        out.update(hidden_act=cfg.hidden_act, use_sliding_window=False)
    elif cfg.arch == "gemma3":
        out.update(hidden_activation=cfg.hidden_act, sliding_window=cfg.sliding_window,
                   layer_types=list(cfg.layer_types), query_pre_attn_scalar=cfg.query_pre_attn_scalar,
                   rope_local_base_freq=cfg.rope_local_theta, final_logit_softcapping=cfg.final_logit_softcapping,
                   attn_logit_softcapping=cfg.attn_logit_softcapping)
    return out


def source_config_dict(source: Path | None, cfg: ModelConfig) -> dict[str, Any]:
    """The source folder's config.json (float32 now), or one written from `cfg` for a GGUF source."""
    if source is not None and (source / "config.json").is_file():
        raw = json.loads((source / "config.json").read_text())
        raw.pop("quantization_config", None)
        raw["torch_dtype"] = "float32"
        return raw
    return hf_config_dict(cfg)


def write_tokenizer(folder: Path, tokenizer, source: Path | None) -> None:
    """Tokenizer files into `folder`: copied from an HF source, written from a GGUF-built tokenizer."""
    if source is not None and (source / "tokenizer.json").is_file():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, folder / name)
        return
    tokenizer.backend.save(str(folder / "tokenizer.json"))

    def text(token_id: int | None) -> str | None:
        return tokenizer.backend.id_to_token(token_id) if token_id is not None else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text(tokenizer.bos_token_id), "eos_token": text(tokenizer.eos_token_id),
        "unk_token": text(tokenizer.unk_token_id), "pad_token": text(tokenizer.pad_token_id),
        "add_bos_token": bool(tokenizer.add_bos_token), "add_eos_token": bool(tokenizer.add_eos_token),
    }
    if tokenizer.has_own_chat_template:
        config["chat_template"] = tokenizer.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None},
                                                             indent=2, ensure_ascii=False))
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    eos += sorted(i for i in tokenizer.eos_token_ids if i not in eos)
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos if len(eos) != 1 else eos[0],
                  "pad_token_id": tokenizer.pad_token_id}
    (folder / "generation_config.json").write_text(json.dumps({k: v for k, v in generation.items()
                                                               if v not in (None, [])}, indent=2))
