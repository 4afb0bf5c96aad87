"""Helpers of the bench tests (tests/test_bench.py, tests/test_bench_peers.py): the CLI's namespace for a command
line, and a tiny random Hugging Face qwen2 folder with a WordLevel tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

from turbollm.cli.main import build_parser


def bench_ns(*argv: str):
    return build_parser().parse_args(list(argv))


def build_tiny_qwen2(folder: Path) -> Path:
    """A tiny random Hugging Face qwen2 folder (untied embeddings) and a WordLevel tokenizer, in `folder`."""
    import transformers  # (a test extra: missing, the tests fail rather than skip)
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128,
                                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    transformers.Qwen2ForCausalLM(cfg).float().eval().save_pretrained(str(folder))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, 256)}}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>", pad_token="<pad>").save_pretrained(str(folder))
    return folder
