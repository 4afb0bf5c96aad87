"""RoPE scaling (linear, llama3, YaRN) against transformers, from HF folders and from GGUF files.

For each scaling transformers builds a tiny random model with that `rope_scaling` (original
context 32 of 256 positions), saves it, and turbollm must give its logits at every position of
a 96-token sequence, well past the original context where llama3 and YaRN bend the most. Each
case first checks that the scaled cos/sin tables differ from plain RoPE, so ignoring the
scaling fails the comparison. The same weights written as GGUF, with llama.cpp's
`rope.scaling.*` keys or (Llama 3) the `rope_freqs.weight` factors its converter precomputes,
must load to the same logits. A type we do not implement, or a scaling without its factor, is
refused with an error naming the type.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from turbollm import LLM, SamplingParams  # noqa: E402
from turbollm.config import config_from_hf  # noqa: E402
from turbollm.errors import ModelFormatError, UnsupportedArchitectureError  # noqa: E402
from turbollm.eval.parity import score  # noqa: E402
from turbollm.layers.rope_scaling import rope_frequencies, yarn_mscale  # noqa: E402
from turbollm.loader import load_model  # noqa: E402
from quant_tiny import MODEL_CLASSES, VOCAB, _randomize, hf_logits, random_ids, save_tokenizer  # noqa: E402

ORIGINAL, MAX_POS, SEQ_LEN = 32, 256, 96
LOGPROB_TOL = 1e-4  # fp32 on both sides
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIGINAL}
# case → (architecture, rope_scaling given to transformers)
CASES = {
    "linear": ("llama", {"rope_type": "linear", "factor": 4.0}),
    "llama3": ("llama", LLAMA3),
    "yarn": ("llama", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL}),
    "yarn-attention-factor": ("qwen2", {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL,
                                        "attention_factor": 1.3, "beta_fast": 16.0, "beta_slow": 2.0}),
    "gemma3-linear": ("gemma3", {"rope_type": "linear", "factor": 8.0}),  # the global layers only
}


def _config(arch: str, rope_scaling: dict):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  max_position_embeddings=MAX_POS, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, num_hidden_layers=2, rope_scaling=dict(rope_scaling))
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(**common, num_key_value_heads=1, head_dim=32, sliding_window=16,
                                             layer_types=["sliding_attention", "full_attention"],
                                             query_pre_attn_scalar=24, tie_word_embeddings=True)
    cls = transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config
    return cls(**common, num_key_value_heads=2, tie_word_embeddings=arch == "llama", rope_theta=10_000.0)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``built(case)``: (folder, transformers model) of the case's tiny checkpoint, built once per module."""
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(case: str):
        if case not in cache:
            arch, rope_scaling = CASES[case]
            folder = tmp_path_factory.mktemp(f"rope-{case}")
            torch.manual_seed(0)
            hf = getattr(transformers, MODEL_CLASSES[arch])(_config(arch, rope_scaling))
            _randomize(hf, gemma=arch == "gemma3")
            hf = hf.float().eval()
            hf.save_pretrained(str(folder))
            save_tokenizer(transformers, folder)
            cache[case] = folder, hf
        return cache[case]
    return get


def _ids(seed: int, n: int = SEQ_LEN) -> list[int]:
    return random_ids(seed, n)


_hf_logits = hf_logits


def _max_logprob_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().log_softmax(-1) - b.float().log_softmax(-1)).abs().max())


def _assert_scaled(loaded, layer: int = -1) -> None:
    """The layer's tables are not plain RoPE's (so a dropped scaling would fail the logits check)."""
    rotary = loaded.model.model.layers[layer].self_attn.rotary
    plain, _ = rope_frequencies(rotary.head_dim, rotary.base)
    plain_cos = torch.outer(torch.arange(SEQ_LEN).float(), plain).cos()
    assert not torch.allclose(rotary.cos[:SEQ_LEN], plain_cos, atol=1e-3)


def _assert_matches(loaded, hf, what: str) -> None:
    ids = _ids(0)
    ours, ref = score(loaded, [ids])[0], _hf_logits(hf, ids)
    diff = _max_logprob_diff(ours, ref)
    assert diff < LOGPROB_TOL, f"{what}: max |log_softmax diff| {diff:.2e} over {SEQ_LEN} positions"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


# --------------------------------------------------------------------------- frequencies

FREQUENCY_CASES = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": LLAMA3,
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-no-factor": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": False},
}


@pytest.mark.parametrize("case", list(FREQUENCY_CASES))
def test_frequencies_match_transformers(case):
    """The inverse frequencies and cos/sin factor of every option, against transformers' own functions."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from turbollm.layers.rope_scaling import normalize_rope_scaling

    raw = FREQUENCY_CASES[case]
    hf_cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=MAX_POS,
                                      rope_theta=500_000.0, rope_scaling=dict(raw))
    ref, ref_attention = ROPE_INIT_FUNCTIONS[raw["rope_type"]](hf_cfg, None)
    ours, attention = rope_frequencies(32, 500_000.0, normalize_rope_scaling(dict(raw), MAX_POS, "test"))
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    assert attention == pytest.approx(ref_attention, rel=1e-12)
    assert not torch.allclose(ours, rope_frequencies(32, 500_000.0)[0])


# --------------------------------------------------------------------------- HF folders


@pytest.mark.parametrize("case", list(CASES))
def test_scaled_logits_match_transformers(built, case):
    folder, hf = built(case)
    loaded = load_model(str(folder))
    expected = CASES[case][1].get("rope_type") or CASES[case][1]["type"]
    assert loaded.config.rope_scaling["rope_type"] == expected
    _assert_scaled(loaded)
    _assert_matches(loaded, hf, case)


def test_gemma3_scales_only_the_global_layers(built):
    """As in transformers (and llama.cpp), Gemma 3's sliding layers keep their plain local RoPE."""
    loaded = load_model(str(built("gemma3-linear")[0]))
    sliding, full = (layer.self_attn.rotary for layer in loaded.model.model.layers)
    assert loaded.config.rope_local_scaling is None
    assert torch.equal(sliding.inv_freq, rope_frequencies(32, 10_000.0)[0])
    assert torch.allclose(full.inv_freq, rope_frequencies(32, full.base)[0] / 8.0)


def test_yarn_greedy_generate_matches_transformers(built):
    """Decode steps (the fused C++ step reads the same scaled tables) past the original context."""
    folder, hf = built("yarn-attention-factor")
    llm = LLM(str(folder), kv_cache_memory=8 << 20, max_num_batched_tokens=64)
    prompt, n = _ids(5, n=40), 8
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    seq, ref = list(prompt), []
    for _ in range(n):
        top2 = _hf_logits(hf, seq)[-1].log_softmax(-1).topk(2)
        assert float(top2.values[0] - top2.values[1]) > 1e-3, "near-tie: pick another prompt"
        ref.append(int(top2.indices[0]))
        seq.append(ref[-1])
    assert out == ref


def test_legacy_rope_scaling_spelling(built, tmp_path):
    """`rope_scaling` with `type` (transformers 4) reads the same as transformers 5's `rope_parameters`."""
    folder = shutil.copytree(built("yarn-attention-factor")[0], tmp_path / "legacy")
    raw = json.loads((folder / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    raw["rope_scaling"] = params
    (folder / "config.json").write_text(json.dumps(raw))
    assert config_from_hf(folder) == config_from_hf(built("yarn-attention-factor")[0])
    assert config_from_hf(folder).rope_scaling["attention_factor"] == 1.3


def test_top_level_original_context_wins(built, tmp_path):
    """A top-level `original_max_position_embeddings` (Phi-3 style) overrides the scaling dict's, as in transformers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    folder = shutil.copytree(built("yarn")[0], tmp_path / "top-level")
    raw = json.loads((folder / "config.json").read_text())
    raw["original_max_position_embeddings"] = 2 * ORIGINAL
    (folder / "config.json").write_text(json.dumps(raw))
    cfg = config_from_hf(folder)
    assert cfg.rope_scaling["original_max_position_embeddings"] == 2 * ORIGINAL
    ref, _ = ROPE_INIT_FUNCTIONS["yarn"](transformers.AutoConfig.from_pretrained(str(folder)), None)
    torch.testing.assert_close(rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)[0], ref)


def _edit_rope(folder: Path, params: dict) -> None:
    raw = json.loads((folder / "config.json").read_text())
    raw["rope_parameters"] = {"rope_theta": 10_000.0, **params}
    (folder / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "su"])
def test_unknown_type_is_refused(built, tmp_path, rope_type):
    folder = shutil.copytree(built("linear")[0], tmp_path / rope_type)
    _edit_rope(folder, {"rope_type": rope_type, "factor": 2.0})
    with pytest.raises(UnsupportedArchitectureError, match=rf"RoPE scaling type '{rope_type}' is not supported; "
                                                           r"supported: linear, llama3, yarn"):
        load_model(str(folder))


def test_scaling_without_factor_is_refused(built, tmp_path):
    folder = shutil.copytree(built("linear")[0], tmp_path / "no-factor")
    _edit_rope(folder, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0})
    with pytest.raises(ModelFormatError, match="'llama3' needs a positive number for 'high_freq_factor'"):
        load_model(str(folder))


# --------------------------------------------------------------------------- GGUF files


def _llama3_freq_factors(head_dim: int, base: float) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf: Llama 3's per-frequency divisors, for `rope_freqs.weight`."""
    factor, low, high, old = (LLAMA3[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings"))
    out = []
    for freq in 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for its interleaved RoPE (what the loader undoes)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf(hf, path: Path, arch: str, rope_keys: dict, freq_factors: np.ndarray | None = None) -> Path:
    """The transformers model `hf` as an F32 GGUF with the `rope.scaling.*` keys `rope_keys`."""
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    for key, value in rope_keys.items():
        getattr(w, f"add_rope_scaling_{key}")(value)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, VOCAB)])
    w.add_token_scores([0.0] * VOCAB)
    w.add_token_types([3, 3, 3, 2] + [1] * (VOCAB - 4))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(3)
    if freq_factors is not None:
        w.add_tensor("rope_freqs.weight", freq_factors)
    for name, p in hf.state_dict().items():
        t = p.detach().float().numpy()
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", t)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", t)
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                w.add_tensor("output.weight", t)
        else:
            _, _, layer, *part, kind = name.split(".")
            if arch == "llama" and part[-1] in ("q_proj", "k_proj"):
                t = _permute(t, cfg.num_attention_heads if part[-1] == "q_proj" else cfg.num_key_value_heads)
            w.add_tensor(f"blk.{layer}.{_GGUF_NAMES['.'.join(part)]}.{kind}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# case → GGUF rope.scaling.* keys, as llama.cpp's converter writes them
GGUF_KEYS = {
    "linear": {"type": gguf.RopeScalingType.LINEAR, "factor": 4.0},
    "yarn": {"type": gguf.RopeScalingType.YARN, "factor": 8.0, "orig_ctx_len": ORIGINAL},
    # llama.cpp multiplies YaRN's own 0.1·ln(factor)+1 by attn_factor
    "yarn-attention-factor": {"type": gguf.RopeScalingType.YARN, "factor": 8.0, "orig_ctx_len": ORIGINAL,
                              "attn_factors": 1.3 / yarn_mscale(8.0), "yarn_beta_fast": 16.0,
                              "yarn_beta_slow": 2.0},
    "llama3": {},  # the factors travel as the rope_freqs.weight tensor instead
}


@pytest.mark.parametrize("case", list(GGUF_KEYS))
def test_gguf_scaling_matches_transformers(built, tmp_path, case):
    _, hf = built(case)
    arch = CASES[case][0]
    head_dim = hf.config.hidden_size // hf.config.num_attention_heads
    factors = _llama3_freq_factors(head_dim, 10_000.0) if case == "llama3" else None
    path = write_gguf(hf, tmp_path / f"{case}.gguf", arch, GGUF_KEYS[case], factors)
    loaded = load_model(str(path), quantization="none")
    assert (loaded.config.rope_freq_factors is not None) == (case == "llama3")
    _assert_scaled(loaded)
    _assert_matches(loaded, hf, f"{case} (GGUF)")


@pytest.mark.parametrize("rope_keys", [{"type": gguf.RopeScalingType.LONGROPE, "factor": 4.0},
                                       {"type": gguf.RopeScalingType.LINEAR, "factor": 4.0, "attn_factors": 1.2}],
                         ids=["longrope", "attn-factor-without-yarn"])
def test_gguf_unsupported_scaling_is_refused(built, tmp_path, rope_keys):
    path = write_gguf(built("linear")[1], tmp_path / "bad.gguf", "llama", rope_keys)
    with pytest.raises(UnsupportedArchitectureError, match="not supported|YaRN scaling only"):
        load_model(str(path), quantization="none")


def test_hf_export_refuses_what_config_json_cannot_hold():
    """A Llama 3 GGUF's rope_freqs.weight factors have no config.json spelling: exporting an HF folder
    from such a model is refused, never written without them (which would compute wrong positions)."""
    from turbollm.config import ModelConfig
    from turbollm.errors import ModelFormatError
    from turbollm.quantize.hf_folder import hf_config_dict

    cfg = ModelConfig(arch="llama", vocab_size=8, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                      num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
                      tie_word_embeddings=True, rope_freq_factors=[1.0, 4.0])
    with pytest.raises(ModelFormatError, match="rope_freqs"):
        hf_config_dict(cfg)
    cfg.rope_freq_factors = None
    assert "rope_scaling" not in hf_config_dict(cfg)
