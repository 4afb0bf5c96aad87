"""Hugging Face safetensors folders: loaded by turbollm, checked against transformers itself.

For each architecture (llama, qwen2, gemma3) transformers builds a tiny random model (fixed
seed, weights re-drawn large enough that the logits are far from uniform) and saves it with
`save_pretrained`, next to a tiny WordLevel tokenizer. turbollm loads the folder and must
give transformers' logits (fp32) at every position of a 40-token sequence (longer than the
Gemma 3 sliding window, so the window matters), the same logits when that sequence shares a
flat batch with another, and the same greedy tokens through `LLM.generate` up to the first
near-tie of the reference. Broken folders (a missing, extra or mis-shaped tensor, a
truncated file, an unknown architecture) must each end in one turbollm error naming the
tensor or file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from turbollm import LLM, SamplingParams  # noqa: E402
from turbollm.errors import ModelFormatError, UnsupportedArchitectureError, WeightLoadError  # noqa: E402
from turbollm.eval.parity import score  # noqa: E402
from turbollm.loader import load_model  # noqa: E402
from quant_tiny import hf_logits, random_ids, save_tokenizer  # noqa: E402

VOCAB = 384
SEQ_LEN = 40
LOGPROB_TOL = 1e-4  # fp32 on both sides; observed diffs are ~1e-6
TIE_MARGIN = 1e-3  # past a reference top1-top2 margin this small, fp32 rounding may pick either token
GEN_TOKENS = 8
SEED = 1234


def _config(arch: str):
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":
        return transformers.LlamaConfig(**common, num_hidden_layers=3, num_key_value_heads=2,
                                        tie_word_embeddings=True, rope_theta=10_000.0)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, num_hidden_layers=2, num_key_value_heads=2,
                                        tie_word_embeddings=False, rope_theta=1_000_000.0)
    if arch == "gemma3":
        # 1 KV head (MQA), head_dim 32 != hidden/heads, window 8 < SEQ_LEN, both layer kinds present,
        # query_pre_attn_scalar != head_dim so a wrong attention scale would show.
        return transformers.Gemma3TextConfig(
            **common, num_hidden_layers=4, num_key_value_heads=1, head_dim=32, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24, tie_word_embeddings=True)
    raise AssertionError(arch)


MODEL_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def _randomize(model: torch.nn.Module, gemma: bool) -> None:
    """Re-draw every weight: HF's init (std 0.02, norms at 1) gives near-uniform logits and ties everywhere."""
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(0.2 * noise + (0.0 if gemma else 1.0))  # Gemma stores w of x*(1+w)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def _build(arch: str, folder: Path):
    torch.manual_seed(SEED)
    hf = getattr(transformers, MODEL_CLASSES[arch])(_config(arch))
    _randomize(hf, gemma=arch == "gemma3")
    hf = hf.float().eval()
    hf.save_pretrained(str(folder))
    save_tokenizer(transformers, folder)
    assert (folder / "tokenizer.json").is_file() and any(folder.glob("*.safetensors"))
    return hf


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def tiny(request, tmp_path_factory):
    """(arch, folder, transformers model) of one tiny random checkpoint, built once per module."""
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf = _build(request.param, folder)
    return request.param, folder, hf


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """The llama checkpoint for the error cases (each test corrupts its own copy)."""
    folder = tmp_path_factory.mktemp("tiny-llama-src")
    _build("llama", folder)
    return folder


def _ids(seed: int, n: int = SEQ_LEN) -> list[int]:
    return random_ids(seed, n)


_hf_logits = hf_logits


def _hf_greedy(hf, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens (full recompute each step) and the top1-top2 logprob margin of each."""
    seq, tokens, margins = list(ids), [], []
    for _ in range(n):
        top2 = _hf_logits(hf, seq)[-1].log_softmax(-1).topk(2)
        tokens.append(int(top2.indices[0]))
        margins.append(float(top2.values[0] - top2.values[1]))
        seq.append(tokens[-1])
    return tokens, margins


def _max_logprob_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float().log_softmax(-1) - b.float().log_softmax(-1)).abs().max())


# --------------------------------------------------------------------------- parity


def test_config_read_from_folder(tiny):
    arch, folder, hf = tiny
    loaded = load_model(str(folder))
    cfg, ref = loaded.config, hf.config
    assert cfg.arch == arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers) == (ref.vocab_size, ref.hidden_size, ref.num_hidden_layers)
    assert (cfg.num_heads, cfg.num_kv_heads) == (ref.num_attention_heads, ref.num_key_value_heads)
    assert cfg.tie_word_embeddings == (arch != "qwen2")
    assert cfg.attention_bias == (arch == "qwen2")
    if arch == "gemma3":
        assert cfg.head_dim == 32 and cfg.sliding_window == 8 and cfg.query_pre_attn_scalar == 24
        assert cfg.layer_types == list(ref.layer_types)
        assert cfg.rope_local_theta == 10_000.0 and cfg.rope_theta == 1_000_000.0
    else:
        assert cfg.sliding_window is None
    assert loaded.tokenizer.vocab_size == VOCAB


def test_logits_match_transformers(tiny):
    arch, folder, hf = tiny
    loaded = load_model(str(folder))
    ids = _ids(0)
    ours = score(loaded, [ids])[0]
    ref = _hf_logits(hf, ids)
    assert ours.shape == ref.shape == (SEQ_LEN, VOCAB)
    diff = _max_logprob_diff(ours, ref)
    assert diff < LOGPROB_TOL, f"{arch}: max |log_softmax diff| {diff:.2e} over {SEQ_LEN} positions"
    # The comparison has teeth: the distributions are far from uniform and differ between positions.
    assert float(ref.log_softmax(-1).max(-1).values.mean()) > -4.0
    assert (ref.argmax(-1) == ours.argmax(-1)).all()


def test_flat_batch_equals_alone(tiny):
    arch, folder, hf = tiny
    loaded = load_model(str(folder))
    a, b = _ids(1), _ids(2, n=23)  # different lengths: block boundaries fall differently
    alone_a, alone_b = score(loaded, [a])[0], score(loaded, [b])[0]
    batch_a, batch_b = score(loaded, [a, b])
    assert _max_logprob_diff(batch_a, alone_a) < 1e-5
    assert _max_logprob_diff(batch_b, alone_b) < 1e-5
    assert _max_logprob_diff(batch_b, _hf_logits(hf, b)) < LOGPROB_TOL


def test_greedy_generate_matches_transformers(tiny):
    arch, folder, hf = tiny
    llm = LLM(str(folder), kv_cache_memory=8 << 20, max_num_batched_tokens=64)
    prompts = [_ids(3, n=12), _ids(4, n=30)]
    params = SamplingParams(temperature=0, max_tokens=GEN_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    checked = 0
    for prompt, out in zip(prompts, outs):
        ours = out.outputs[0].token_ids
        assert len(ours) == GEN_TOKENS and out.outputs[0].finish_reason == "length"
        ref, margins = _hf_greedy(hf, prompt, GEN_TOKENS)
        first_tie = next((i for i, m in enumerate(margins) if m < TIE_MARGIN), GEN_TOKENS)
        assert ours[:first_tie] == ref[:first_tie], f"{arch}: ours {ours} vs transformers {ref} (margins {margins})"
        checked += first_tie
    assert checked >= GEN_TOKENS, f"{arch}: too many near-ties to check greedy decoding ({checked} tokens)"


# ----------------------------------------------------------------------- bad folders


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("name", [
    "model.layers.1.self_attn.k_proj.weight",  # one shard of the fused QKV projection
    "model.layers.0.mlp.up_proj.weight",  # one shard of the fused gate/up projection
    "model.layers.2.post_attention_layernorm.weight",
    "model.norm.weight",
])
def test_missing_tensor(tiny_llama, tmp_path, name):
    folder = _copy(tiny_llama, tmp_path / "m")
    _edit_tensors(folder, lambda t: t.pop(name))
    with pytest.raises(WeightLoadError, match="missing") as e:
        load_model(str(folder))
    assert name in str(e.value)


def test_unexpected_tensor(tiny_llama, tmp_path):
    folder = _copy(tiny_llama, tmp_path / "m")
    extra = "model.layers.0.self_attn.extra_proj.weight"
    _edit_tensors(folder, lambda t: t.__setitem__(extra, torch.zeros(4, 4)))
    with pytest.raises(WeightLoadError, match="unexpected") as e:
        load_model(str(folder))
    assert extra in str(e.value)


@pytest.mark.parametrize("name,shape", [
    ("model.layers.0.mlp.down_proj.weight", (128, 64)),  # transposed
    ("model.layers.0.mlp.gate_proj.weight", (96, 64)),  # fused gate/up shard, wrong rows
    ("model.layers.0.mlp.up_proj.weight", (128, 65)),  # fused gate/up shard, wrong columns
    ("model.layers.1.self_attn.q_proj.weight", (32, 64)),  # fused QKV shard, too few rows
    ("model.layers.1.self_attn.k_proj.weight", (48, 64)),  # fused QKV shard, too many rows
    ("model.layers.1.self_attn.v_proj.weight", (32, 60)),  # fused QKV shard, wrong columns
    ("model.layers.1.input_layernorm.weight", (65,)),
    ("model.embed_tokens.weight", (VOCAB + 1, 64)),
])
def test_wrong_shape(tiny_llama, tmp_path, name, shape):
    folder = _copy(tiny_llama, tmp_path / "m")
    original = {}

    def edit(t):
        original["shape"] = tuple(t[name].shape)
        t[name] = torch.zeros(shape)

    _edit_tensors(folder, edit)
    with pytest.raises(WeightLoadError) as e:
        load_model(str(folder))
    msg = str(e.value)
    assert name in msg and str(tuple(shape)) in msg and str(original["shape"]) in msg, msg


@pytest.mark.parametrize("keep", [0.5, 0.999, 8, 40])
def test_truncated_safetensors(tiny_llama, tmp_path, keep):
    folder = _copy(tiny_llama, tmp_path / "m")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep) if isinstance(keep, float) else keep])
    with pytest.raises(ModelFormatError) as e:
        load_model(str(folder))
    assert str(path) in str(e.value)


def test_unsupported_architecture(tiny_llama, tmp_path):
    folder = _copy(tiny_llama, tmp_path / "m")
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel") as e:
        load_model(str(folder))
    assert "LlamaForCausalLM" in str(e.value)  # lists what is supported


def test_sharded_checkpoint(tmp_path):
    """A checkpoint split into shards with model.safetensors.index.json loads like one file;
    a shard the index names but the folder lacks is a ModelFormatError naming it."""
    folder = tmp_path / "sharded"
    hf = _build("llama", folder)
    hf.save_pretrained(str(folder), max_shard_size="100KB")
    (folder / "model.safetensors").unlink(missing_ok=True)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    ids = _ids(5)
    assert _max_logprob_diff(score(load_model(str(folder)), [ids])[0], _hf_logits(hf, ids)) < LOGPROB_TOL
    shards[-1].unlink()
    with pytest.raises(ModelFormatError, match=shards[-1].name):
        load_model(str(folder))
