"""Tiny generated models and calibration text for the quantization tests.

transformers builds a small random checkpoint per architecture (weights re-drawn so logits are
far from uniform; a few input-norm channels made large, so activations have the outlier
channels that AWQ and GPTQ exist for) and saves it with a WordLevel tokenizer whose words are
``w4 .. w383``. Calibration text is random words of that vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

VOCAB = 384
SEED = 4321
HIDDEN, INTER = 64, 128
MODEL_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def _config(transformers, arch: str):
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=4,
                  max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "llama":  # GQA: 2 query heads per KV head
        return transformers.LlamaConfig(**common, num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=True)
    if arch == "qwen2":  # Q/K/V biases, untied head
        return transformers.Qwen2Config(**common, num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=False)
    if arch == "gemma3":  # x·(1+w) norms, post-branch norms, MQA, head_dim != hidden/heads
        return transformers.Gemma3TextConfig(**common, num_hidden_layers=2, num_key_value_heads=1, head_dim=32,
                                             sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                                             query_pre_attn_scalar=24, tie_word_embeddings=True)
    raise AssertionError(arch)


def _randomize(model: torch.nn.Module, gemma: bool) -> None:
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                w = 0.2 * noise + 1.0
                if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight",
                                  "pre_feedforward_layernorm.weight")) and p.numel() == HIDDEN:
                    w[:4] *= 8.0  # salient channels
                p.copy_(w - 1.0 if gemma else w)  # Gemma stores w of x*(1+w)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def save_tokenizer(transformers, folder: Path) -> None:
    """The tiny WordLevel tokenizer (``w4 .. w383``) every tiny test checkpoint uses."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, VOCAB)})
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                               unk_token="<unk>", pad_token="<pad>")
    tok.save_pretrained(str(folder))


def build_tiny(arch: str, folder: Path) -> Path:
    """Save a tiny random `arch` checkpoint with its tokenizer in `folder`."""
    import transformers

    torch.manual_seed(SEED)
    hf = getattr(transformers, MODEL_CLASSES[arch])(_config(transformers, arch))
    _randomize(hf, gemma=arch == "gemma3")
    hf.float().save_pretrained(str(folder))
    save_tokenizer(transformers, folder)
    return folder


def add_chat_template(folder: Path) -> Path:
    """Give a tiny checkpoint's tokenizer a plain chat template, so chat requests run on it."""
    import json

    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def calibration_text(path: Path, words: int = 4000, seed: int = 7) -> Path:
    """A .txt calibration corpus of `words` random vocabulary words (one token each)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (words,), generator=g).tolist()
    path.write_text(" ".join(f"w{i}" for i in ids))
    return path


def token_windows(samples: int, seq_len: int, seed: int = 11) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (samples, seq_len), generator=g)


@pytest.fixture(autouse=True)
def one_thread_exact_matmul(monkeypatch):
    """Autouse in every test module that imports it: one torch thread, and quantized matmuls on
    the exact dequantize + fp32 path (the q8 path rounds activations)."""
    from turbollm.kernels import quant

    torch.set_num_threads(1)
    monkeypatch.setattr(quant, "DEFAULT_PATH", "dequant")  # the models these tests build name no path
    yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``tiny(arch)``: the tiny checkpoint folder of `arch`, built once per test module (`build_tiny`)."""
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = build_tiny(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return cache[arch]
    return get


def random_ids(seed: int, n: int) -> list[int]:
    """n token ids drawn from the tiny vocabulary's words (ids 4 .. VOCAB-1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (n,), generator=g).tolist()


@torch.inference_mode()
def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits [len(ids), vocab] for one sequence."""
    return hf(input_ids=torch.tensor([ids])).logits[0].float()
