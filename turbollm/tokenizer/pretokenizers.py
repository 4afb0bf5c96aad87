"""How a byte-level (``tokenizer.ggml.model = "gpt2"``) vocabulary cuts text before BPE.

A GGUF names its pre-tokenizer with ``tokenizer.ggml.pre``; the regex itself is not stored.
llama.cpp keeps the table in ``llama-vocab.cpp``; transformers keeps its own copy in
``integrations/gguf/gguf_tokenizer_mapping.py`` (``GGUF_PRE_TOKENIZER_SPLITS``). Our reference
for token ids is transformers, so this table follows its choices, including its fallback to the
GPT-2 regex for every name it does not list.

Where the two tables disagree it is noted below. The one that matters for our catalog is
``smollm``: llama.cpp (and SmolLM's own ``tokenizer.json``) split every digit off first, then apply
the GPT-2 regex; transformers applies the GPT-2 regex alone. SmolLM's vocabulary has no token
with a digit next to anything, so the two only differ on a run of two or more spaces right
before a digit (``"a  1"``: llama.cpp gives ``a ĠĠ 1``, transformers ``a Ġ Ġ 1``).
"""

from __future__ import annotations

import logging

from tokenizers import Regex, pre_tokenizers

log = logging.getLogger(__name__)

# The GPT-2 regex, which `ByteLevel(use_regex=True)` applies by itself:
#   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
GPT2 = None  # marker: use ByteLevel's built-in regex

LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2's tokenizer.json regex. llama.cpp spells the contractions out case by case
# ('[sS]|'[tT]...) because its regex engine has no (?i:); the two agree on ASCII text.
QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> split regex (None: the GPT-2 regex built into ByteLevel).
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": GPT2,
    "gpt2": GPT2,
    # llama.cpp: "\p{N}" then the GPT-2 regex; transformers: GPT-2 alone (see the module docstring).
    "smollm": GPT2,
    "llama3": LLAMA3,
    "llama-v3": LLAMA3,
    "llama-bpe": LLAMA3,
    "falcon3": LLAMA3,
    "falcon-h1": LLAMA3,
    "pixtral": LLAMA3,
    "midm-2.0": LLAMA3,
    "lfm2": LLAMA3,
    "dbrx": LLAMA3,
    "smaug-bpe": LLAMA3,
    "qwen2": QWEN2,
    "deepseek-r1-qwen": QWEN2,
    "megrez": QWEN2,
    "qwen35": QWEN35,
    "tekken": TEKKEN,
    "gpt-4o": GPT4O,
    "llama4": GPT4O,
    "minimax-m2": GPT4O,
}


def split_regex(pre: str | None) -> str | None:
    """The split regex for `tokenizer.ggml.pre` = `pre`; None means the GPT-2 regex.

    A name missing from `PRE_TOKENIZER_SPLITS` gets the GPT-2 regex, as transformers does,
    with a warning: the token ids may then differ from llama.cpp's.
    """
    if pre is None or pre in PRE_TOKENIZER_SPLITS:
        return PRE_TOKENIZER_SPLITS.get(pre or "default")
    log.warning("unknown tokenizer.ggml.pre %r: splitting text with the GPT-2 regex", pre)
    return GPT2


def byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of a byte-level BPE vocabulary whose `tokenizer.ggml.pre` is `pre`."""
    regex = split_regex(pre)
    if regex is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
