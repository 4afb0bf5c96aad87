"""Tests of turbollm.tokenizer: GGUF tokenizers against transformers' own, chat templates.

The oracle for token ids, decoding and chat templates is transformers' tokenizer for the same
GGUF (`AutoTokenizer.from_pretrained(folder, gguf_file=name)`), loaded once per module per model.
Catalog models are pulled on first use (TURBOLLM_TEST_OFFLINE=1 skips instead); the 1.5b check
runs only when that model is already cached.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import catalog_model_path
from turbollm.errors import InvalidRequestError, ModelDownloadError, ModelFormatError, UnknownModelError
from turbollm.formats.gguf_file import read_gguf
from turbollm.tokenizer import ChatTemplateError, Tokenizer, load_tokenizer
from turbollm.tokenizer.chat_template import GEMMA_TEMPLATE, render_chat_template
from turbollm.tokenizer.gguf_vocab import merges_from_vocab
from turbollm.tokenizer.pretokenizers import QWEN2, split_regex

WIKITEXT = Path(__file__).parents[2] / "shared/data/wikitext-2-raw/wiki.test.raw"

MODELS = ["smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"]

MIXED = [
    "Hello 世界! 你好，我是一个程序员。今天天气很好，我们去公园散步吧。",
    "def fib(n: int) -> int:\n    \"\"\"斐波那契\"\"\"\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 🚀\n",
    "Emoji: 😀🎉👨‍👩‍👧‍👦 🇫🇷 ❤️ and flags, café naïve Ångström ﬁ ½ ① ²",
    "\tTabs\tand  double  spaces,   triple   spaces\r\nand CRLF\n\n\nblank lines  \n",
    "x = [1,  2,   3]; a  1; 2024-01-01 3.14159 1,234,567 ৩৪ ٣٤",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<start_of_turn>model <bos><eos><|endoftext|>",
    "<tool_call>{\"name\": \"f\"}</tool_call> <think>x</think> <0x0A> [multimodal]",
    "It's we'll they'RE I'M don't O'Neil 'quoted' ''",
    "   leading and trailing spaces   ",
    " ",
    "",
    "日本語のテキストと한국어 텍스트, Ελληνικά, русский текст, עברית, العربية",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\n\t\treturn sum;\n",
]

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And times 3?"},
]


def model_path(name: str, download: bool | None = None) -> Path:
    """The GGUF of catalog model `name` (pulled if missing; see conftest)."""
    return catalog_model_path(name, download)


def _load_reference(name: str):
    transformers = pytest.importorskip("transformers")
    path = model_path(name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def reference():
    """reference(name): transformers' tokenizer for a catalog model, loaded once per module."""
    cache = {}

    def get(name: str):
        if name not in cache:
            cache[name] = _load_reference(name)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def ours():
    """ours(name): our tokenizer for a catalog model, built once per module."""
    cache = {}

    def get(name: str) -> Tokenizer:
        if name not in cache:
            cache[name] = Tokenizer.from_gguf_file(model_path(name))
        return cache[name]

    return get


@pytest.fixture(scope="module", params=MODELS)
def pair(request, ours, reference):
    """(name, ours, reference) for each model."""
    return request.param, ours(request.param), reference(request.param)


@pytest.fixture(scope="module")
def wikitext() -> str:
    if not WIKITEXT.is_file():
        pytest.skip(f"{WIKITEXT} is missing")
    return WIKITEXT.read_text(encoding="utf-8")


def _first_difference(a: list[int], b: list[int], tok: Tokenizer) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return (f"lengths {len(a)} vs {len(b)}; first difference at {i}: ours {tok.convert_ids_to_tokens(a[i:i + 5])} "
            f"reference {tok.convert_ids_to_tokens(b[i:i + 5])} after {tok.decode(a[max(0, i - 10):i])!r}")


# -- token ids and decoding against transformers ----------------------------------------------


@pytest.mark.model
def test_wikitext_ids_match_reference(pair, wikitext):
    name, ours, ref = pair
    mine, theirs = ours.encode(wikitext), ref.encode(wikitext, add_special_tokens=True)
    assert mine == theirs, f"{name}: " + _first_difference(mine, theirs, ours)
    assert ours.decode(mine) == ref.decode(theirs)
    body = mine[1:] if ours.add_bos_token else mine
    assert ours.decode(body) == wikitext


@pytest.mark.model
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_mixed_text_ids_match_reference(pair, add_special_tokens):
    name, ours, ref = pair
    for text in MIXED:
        mine = ours.encode(text, add_special_tokens=add_special_tokens)
        theirs = ref.encode(text, add_special_tokens=add_special_tokens)
        assert mine == theirs, f"{name} on {text!r}: " + _first_difference(mine, theirs, ours)


@pytest.mark.model
def test_decode_round_trips_like_reference(pair):
    name, ours, ref = pair
    for text in MIXED:
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == text, f"{name} on {text!r}"
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
        with_specials = ours.encode(text)
        assert ours.decode(with_specials) == ref.decode(with_specials)


@pytest.mark.model
def test_special_ids_and_pieces_match_reference(pair):
    name, ours, ref = pair
    assert ours.vocab_size == len(ref)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (ref.bos_token_id, ref.eos_token_id,
                                                                         ref.pad_token_id)
    assert (ours.bos_token, ours.eos_token) == (ref.bos_token, ref.eos_token)
    assert ours.add_bos_token == ref.add_bos_token
    ids = ours.encode(MIXED[1] + MIXED[2], add_special_tokens=True)
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    for i in ids:  # one token's text, as the reference decodes it alone
        assert ours.decode_token(i) == ref.decode([i]), f"{name}: id {i} ({ours.id_to_piece(i)!r})"
    text_ids = [i for i in ids if i not in ours.special_token_ids]
    assert b"".join(map(ours.token_bytes, text_ids)) == (MIXED[1] + MIXED[2]).encode()


@pytest.mark.model
def test_special_tokens_in_text_encode_to_one_id(pair):
    name, ours, _ = pair
    specials = {"smollm2-135m": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
                "qwen2.5-coder-0.5b": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>"],
                "gemma3-270m": ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>"]}[name]
    for text in specials:
        token_id = ours.token_to_id(text)
        assert token_id is not None
        assert ours.encode(f"a{text}b", add_special_tokens=False)[1:2] == [token_id]
        assert ours.encode(text, add_special_tokens=False) == [token_id]


@pytest.mark.model
def test_eos_token_ids(pair):
    name, ours, _ = pair
    expected = {"smollm2-135m": {"<|im_end|>", "<|endoftext|>"},
                "qwen2.5-coder-0.5b": {"<|im_end|>", "<|endoftext|>"},
                "gemma3-270m": {"<eos>", "<end_of_turn>"}}[name]
    assert {ours.id_to_piece(i) for i in ours.eos_token_ids} == expected
    assert ours.eos_token_id in ours.eos_token_ids


# -- chat templates ---------------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_reference(pair, add_generation_prompt):
    name, ours, ref = pair
    if not ours.has_own_chat_template:
        pytest.skip(f"{name}'s GGUF has no chat template (see test_gemma_fallback_template)")
    text = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert text == ref.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids = ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True)
    assert ids == ref.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True,
                                          return_dict=False)


@pytest.mark.model
def test_gemma_fallback_template(ours):
    tok = ours("gemma3-270m")
    assert not tok.has_own_chat_template and tok.chat_template == GEMMA_TEMPLATE
    assert tok.apply_chat_template(MESSAGES) == (
        "<bos><start_of_turn>user\nYou are a helpful assistant.\n\nWhat is 2 + 2?<end_of_turn>\n"
        "<start_of_turn>model\n2 + 2 = 4.<end_of_turn>\n"
        "<start_of_turn>user\nAnd times 3?<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    ids = tok.apply_chat_template(MESSAGES[1:2], tokenize=True)
    assert ids[:3] == [tok.bos_token_id, tok.token_to_id("<start_of_turn>"), tok.token_to_id("user")]
    assert ids.count(tok.bos_token_id) == 1  # the template writes BOS; encoding adds none
    with pytest.raises(ChatTemplateError, match="alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_gemma_template_edge_cases():
    special = {"bos_token": "<bos>"}
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief. "}]},
             {"role": "user", "content": [{"type": "text", "text": " Hi "}, {"type": "image"}]}]
    assert render_chat_template(GEMMA_TEMPLATE, parts, add_generation_prompt=False, special_tokens=special) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n")
    alone = render_chat_template(GEMMA_TEMPLATE, parts[:1], special_tokens=special)
    assert alone == "<bos><start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n"


@pytest.mark.model
def test_qwen_1_5b_shares_the_0_5b_tokenizer():
    """The 1.5b's vocabulary is the 0.5b's, so the reference comparisons above cover it too.

    (Only the chat templates differ, by one pair of braces in the tool-call example.)
    """
    small = read_gguf(model_path("qwen2.5-coder-0.5b")).metadata
    large = read_gguf(model_path("qwen2.5-coder-1.5b", download=False)).metadata
    keys = sorted(k for k in small if k.startswith("tokenizer.ggml."))
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"} <= set(keys)
    assert keys == sorted(k for k in large if k.startswith("tokenizer.ggml."))
    for key in keys:
        assert small[key] == large[key], key


# -- Hugging Face folders ---------------------------------------------------------------------


@pytest.mark.model
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_from_hf_folder_matches_reference(name, reference, tmp_path):
    ref = reference(name)
    ref.save_pretrained(tmp_path)
    ours = Tokenizer.from_hf_folder(tmp_path)
    assert (ours.bos_token_id, ours.eos_token_id, ours.add_bos_token) == (ref.bos_token_id, ref.eos_token_id,
                                                                           ref.add_bos_token)
    for text in MIXED:
        assert ours.encode(text) == ref.encode(text)
    if ref.chat_template:
        assert ours.apply_chat_template(MESSAGES) == ref.apply_chat_template(MESSAGES, tokenize=False,
                                                                             add_generation_prompt=True)


# -- without catalog models ---------------------------------------------------------------------


def _tiny_sentencepiece_gguf(path: Path) -> Path:
    """A tiny llama-type (SentencePiece) GGUF: specials, 256 byte tokens, a few scored words."""
    import numpy as np
    from gguf import GGUFWriter

    words = ["▁", "▁t", "he", "▁the", "▁a", "h", "e", "t", "a", "n", "d", "▁an", "▁and", "o", "▁o", "l", "lo",
             "▁he", "llo", "▁hello", "w", "▁w", "▁wor", "ld", "▁world", "▁▁", "▁▁▁", "<|user|>", "<think>"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    types[tokens.index("<|user|>")], types[tokens.index("<think>")] = 3, 4
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(64), w.add_embedding_length(8), w.add_block_count(1), w.add_feed_forward_length(16)
    w.add_head_count(2), w.add_head_count_kv(2), w.add_layer_norm_rms_eps(1e-5), w.add_rope_dimension_count(4)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(words))])
    w.add_token_types(types)
    w.add_bos_token_id(1), w.add_eos_token_id(2), w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return path


def test_sentencepiece_gguf_matches_reference(tmp_path):
    """The generic llama-type builder (merges from scores, byte fallback, prefix space) on a tiny vocabulary."""
    transformers = pytest.importorskip("transformers")
    path = _tiny_sentencepiece_gguf(tmp_path / "tiny.gguf")
    ours = load_tokenizer(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert ours.add_bos_token and ours.bos_token_id == 1  # no add_bos_token key: llama vocabularies add BOS
    for text in ["hello world", "  the cat and   a dog\n", "Hello World é 😀", "<|user|>hello<think>the", " ", ""]:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.decode(ids) == ref.decode(ids)
    newline = ours.encode("\n", add_special_tokens=False)  # "▁" (the prefix space), then the byte token
    assert newline == [ours.token_to_id("▁"), ours.token_to_id("<0x0A>")]
    assert newline == ref.encode("\n", add_special_tokens=False)
    assert ours.decode_token(ours.token_to_id("▁world")) == " world"


def _metadata(**extra):
    tokens = ["<|endoftext|>", "a", "b", "ab", "Ġ", "Ġab"]
    meta = {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [3, 1, 1, 1, 1, 1],
            "tokenizer.ggml.merges": ["a b", "Ġ ab"], "tokenizer.ggml.eos_token_id": 0}
    meta.update(extra)
    return meta


def test_tiny_byte_level_vocabulary():
    tok = Tokenizer.from_gguf(_metadata())
    assert tok.encode("ab ab<|endoftext|>") == [3, 5, 0]
    assert not tok.add_bos_token and tok.eos_token_ids == {0}
    assert tok.decode([3, 5, 0]) == "ab ab<|endoftext|>" and tok.decode([3, 5, 0], skip_special_tokens=True) == "ab ab"
    assert Tokenizer.from_gguf(_metadata(**{"tokenizer.ggml.add_eos_token": True})).encode("ab") == [3, 0]
    with pytest.raises(InvalidRequestError):
        tok.decode([99])


@pytest.mark.parametrize("bad, message", [
    ({"tokenizer.ggml.model": "rwkv"}, "unsupported tokenizer model 'rwkv'"),
    ({"tokenizer.ggml.model": None}, "no tokenizer.ggml.model"),
    ({"tokenizer.ggml.tokens": []}, "tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "one value per token"),
    ({"tokenizer.ggml.merges": ["a b c"]}, "merges"),
    ({"tokenizer.ggml.merges": None}, "needs tokenizer.ggml.merges"),
    ({"tokenizer.ggml.add_bos_token": "yes"}, "boolean"),
])
def test_bad_metadata_raises_model_format_error(bad, message):
    meta = {k: v for k, v in _metadata(**bad).items() if v is not None}
    with pytest.raises(ModelFormatError, match=message):
        Tokenizer.from_gguf(meta)


def test_merges_from_vocab_matches_transformers():
    generate_merges = pytest.importorskip("transformers.tokenization_utils_base").generate_merges
    tokens = ["a", "b", "c", "ab", "bc", "abc", "ca", "cab", "bca", "aa", "aaa", "abca"]
    for scores in ([0.0] * len(tokens), [-float(i) for i in range(len(tokens))], [1, 2, 1, 3, 3, 0, 1, 2, 2, 0, 3, 1]):
        by_token = dict(zip(tokens, map(float, scores)))
        assert merges_from_vocab(tokens, by_token) == generate_merges({t: i for i, t in enumerate(tokens)}, by_token)


def test_pre_tokenizer_registry():
    assert split_regex("qwen2") == QWEN2
    assert split_regex("smollm") is None and split_regex("default") is None and split_regex("gpt2") is None
    assert "{1,3}" in split_regex("llama-bpe")
    assert split_regex("no-such-pre") is None  # the GPT-2 regex, with a warning


def test_chat_template_sandbox_and_errors():
    with pytest.raises(ChatTemplateError, match="nope"):
        render_chat_template("{{ raise_exception('nope') }}", [])
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute escapes
        render_chat_template("{{ messages.__class__.__mro__ }}", [])
    with pytest.raises(ModelFormatError, match="does not compile"):
        render_chat_template("{% for %}", [])
    tok = Tokenizer.from_gguf(_metadata())
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    template = "{% for m in messages %}{{ m.role }}:{{ m.content | tojson }}{% if m.x is defined %}!{% endif %}{% endfor %}"
    rendered = tok.apply_chat_template([{"role": "user", "content": "<é>", "x": None}], chat_template=template)
    assert rendered == 'user:"<é>"'  # no HTML escaping, None-valued keys dropped
