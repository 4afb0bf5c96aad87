"""The tokenizer of a model: text to token ids and back, its special tokens, its chat prompts.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust library does the encoding) built either
from a GGUF file's metadata (`from_gguf`, see `gguf_vocab`) or from a Hugging Face folder's
``tokenizer.json`` (`from_hf_folder`), and adds what an inference engine needs on top: the
BOS/EOS/PAD ids, the set of ids that end a generation, the bytes and text of a single token
(for logprobs and streaming), and the chat template (see `chat_template`).
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import tokenizers

from turbollm.errors import InvalidRequestError, ModelFormatError
from turbollm.tokenizer.chat_template import FALLBACK_TEMPLATES, render_chat_template, resolve_chat_template
from turbollm.tokenizer.gguf_vocab import bos_eos_post_processor, bytes_to_unicode, tokenizer_from_gguf_metadata

# Tokens that end a turn, by their text: llama.cpp's end-of-generation list (llama-vocab.cpp).
END_OF_TURN_TOKENS = frozenset({
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
    "<|endoftext|>", "<|end_of_text|>", "<EOT>", "_<EOT>", "<end_of_utterance>",
})

_GIL_FREE_CHARS = 2048  # longer texts are encoded with the GIL released (see `Tokenizer.encode`)
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat template.

    Build one with `from_gguf`, `from_gguf_file`, `from_hf_folder` or `load_tokenizer`.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, pad_token_id: int | None = None,
                 unk_token_id: int | None = None, extra_eos_token_ids: Iterable[int] = (),
                 add_bos_token: bool | None = None, add_eos_token: bool | None = None,
                 chat_template: str | None = None, architecture: str | None = None,
                 vocab_size: int | None = None) -> None:
        """Wrap `backend`. BOS/EOS handling is the backend's post-processor; `add_bos_token` and
        `add_eos_token` only describe it (probed from the backend when not given)."""
        self.backend = backend
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.pad_token_id, self.unk_token_id = pad_token_id, unk_token_id
        self.architecture = architecture
        self._own_chat_template = chat_template
        self._vocab_size = max(vocab_size or 0, backend.get_vocab_size(with_added_tokens=True))
        self._extra_eos = frozenset(extra_eos_token_ids)
        if add_bos_token is None or add_eos_token is None:
            probe_bos, probe_eos = self._probe_bos_eos()
            add_bos_token = probe_bos if add_bos_token is None else add_bos_token
            add_eos_token = probe_eos if add_eos_token is None else add_eos_token
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> "Tokenizer":
        """The tokenizer a GGUF's metadata describes (`read_gguf(path).metadata`)."""
        backend, spec = tokenizer_from_gguf_metadata(dict(metadata))
        extra = [spec.eot_token_id, spec.eom_token_id]
        return cls(backend, bos_token_id=spec.bos_token_id, eos_token_id=spec.eos_token_id,
                   pad_token_id=spec.pad_token_id, unk_token_id=spec.unk_token_id,
                   extra_eos_token_ids=[i for i in extra if i is not None],
                   add_bos_token=spec.add_bos_token and spec.bos_token_id is not None,
                   add_eos_token=spec.add_eos_token and spec.eos_token_id is not None,
                   chat_template=spec.chat_template, architecture=spec.architecture, vocab_size=len(spec.tokens))

    @classmethod
    def from_gguf_file(cls, path: str | Path) -> "Tokenizer":
        """The tokenizer stored in the GGUF file at `path`."""
        from turbollm.formats.gguf_file import read_gguf

        return cls.from_gguf(read_gguf(path).metadata)

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> "Tokenizer":
        """The tokenizer of a Hugging Face model folder.

        Reads ``tokenizer.json`` and, when present, ``tokenizer_config.json`` (special tokens,
        ``add_bos_token`` / ``add_eos_token``, ``chat_template``), ``chat_template.jinja``,
        ``special_tokens_map.json``, ``generation_config.json`` (more EOS ids) and
        ``config.json`` (the architecture, for a fallback chat template). As transformers does,
        an explicit ``add_bos_token`` / ``add_eos_token`` replaces tokenizer.json's post-processor.
        """
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ModelFormatError(f"{folder}: no tokenizer.json (only the `tokenizers` format is supported)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises plain Exceptions
            raise ModelFormatError(f"{file}: not a valid tokenizer.json: {e}") from None
        config = _read_json(folder / "tokenizer_config.json")
        token_map = _read_json(folder / "special_tokens_map.json")
        generation = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")

        def special(name: str) -> int | None:
            value = config.get(name, token_map.get(name))
            text = value.get("content") if isinstance(value, dict) else value
            return backend.token_to_id(text) if isinstance(text, str) else None

        def ids(value: Any) -> list[int]:
            values = value if isinstance(value, list) else [value]
            return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]

        gen_eos = ids(generation.get("eos_token_id", model_config.get("eos_token_id")))
        bos = special("bos_token")
        bos = bos if bos is not None else next(iter(ids(generation.get("bos_token_id"))), None)
        eos = special("eos_token")
        eos = eos if eos is not None else next(iter(gen_eos), None)
        pad = special("pad_token")
        pad = pad if pad is not None else next(iter(ids(generation.get("pad_token_id"))), None)
        add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
        if isinstance(add_bos, bool) or isinstance(add_eos, bool):
            add_bos, add_eos = bool(add_bos) and bos is not None, bool(add_eos) and eos is not None
            backend.post_processor = bos_eos_post_processor((backend.id_to_token(bos), bos) if add_bos else None,
                                                            (backend.id_to_token(eos), eos) if add_eos else None)
        else:
            add_bos = add_eos = None
        return cls(backend, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, unk_token_id=special("unk_token"),
                   extra_eos_token_ids=gen_eos, add_bos_token=add_bos, add_eos_token=add_eos,
                   chat_template=_hf_chat_template(folder, config), architecture=model_config.get("model_type"))

    # -- encoding and decoding -----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With `add_special_tokens`, BOS is prepended iff `add_bos_token` and
        EOS appended iff `add_eos_token`. Special tokens written in the text (``<|im_start|>``)
        always encode to their single id."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"can only encode a str, got {type(text).__name__}")
        if len(text) > _GIL_FREE_CHARS:
            # The Rust library's `encode` holds the GIL for its whole run (1.5 s for a 3 MiB text here,
            # every other thread stopped); `encode_batch` releases it and gives the same ids.
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` for several texts at once (in parallel in the Rust library)."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; with `skip_special_tokens`, special tokens (BOS, ``<|im_end|>``...) are left out."""
        return self.backend.decode(self._checked(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """The vocabulary pieces of `ids`, as the vocabulary spells them (``Ġthe``, ``▁the``, ``<0x0A>``)."""
        return [self.id_to_piece(i) for i in ids]

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary piece of one id (see `convert_ids_to_tokens`)."""
        piece = self.backend.id_to_token(self._checked([token_id])[0])
        if piece is None:  # an id inside vocab_size the vocabulary has no entry for (padded embeddings)
            return ""
        return piece

    def token_to_id(self, piece: str) -> int | None:
        """The id of a vocabulary piece or added token, or None."""
        return self.backend.token_to_id(piece)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for in the text (``b" the"``, ``b"\\n"``, or a lone UTF-8 byte)."""
        piece = self.id_to_piece(token_id)
        if token_id in self._added_tokens:
            return piece.encode("utf-8")
        if self._style == "byte_level":
            decoder = self._byte_decoder
            return b"".join(bytes([decoder[c]]) if c in decoder else c.encode("utf-8") for c in piece)
        if self._style == "sentencepiece":
            match = _BYTE_TOKEN.match(piece)
            return bytes([int(match.group(1), 16)]) if match else piece.replace("▁", " ").encode("utf-8")
        return self.backend.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def decode_token(self, token_id: int) -> str:
        """The text of one token on its own, for a logprob's ``decoded_token`` (a token holding part
        of a UTF-8 character decodes to U+FFFD, as Hugging Face's decode does)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    # -- special tokens ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """How many token ids there are (ids run from 0 to vocab_size - 1), added tokens included."""
        return self._vocab_size

    @property
    def bos_token(self) -> str | None:
        """The text of the BOS token, or None."""
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        """The text of the EOS token, or None."""
        return None if self.eos_token_id is None else self.backend.id_to_token(self.eos_token_id)

    @property
    def pad_token(self) -> str | None:
        """The text of the PAD token, or None."""
        return self._text(self.pad_token_id)

    @property
    def unk_token(self) -> str | None:
        """The text of the UNK token, or None."""
        return self._text(self.unk_token_id)

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end a generation.

        The rule (llama.cpp's end-of-generation set): the EOS id; the end-of-turn / end-of-message
        ids the file names (GGUF ``tokenizer.ggml.eot_token_id`` / ``eom_token_id``, the
        ``eos_token_id`` list of a Hugging Face ``generation_config.json``); and every token whose
        text is one of `END_OF_TURN_TOKENS` (``<|im_end|>``, ``<end_of_turn>``, ``<|endoftext|>``,
        ``<|eot_id|>``...). So SmolLM2 stops on ``<|im_end|>`` and ``<|endoftext|>``, Qwen2.5 on
        ``<|im_end|>`` and ``<|endoftext|>``, Gemma 3 on ``<eos>`` and ``<end_of_turn>``.
        """
        found = set(self._extra_eos)
        if self.eos_token_id is not None:
            found.add(self.eos_token_id)
        for text in END_OF_TURN_TOKENS:
            token_id = self.backend.token_to_id(text)
            if token_id is not None:
                found.add(token_id)
        return frozenset(i for i in found if 0 <= i < self.vocab_size)

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        """The ids of the special added tokens (what `decode(skip_special_tokens=True)` leaves out)."""
        return frozenset(i for i, t in self.backend.get_added_tokens_decoder().items() if t.special)

    # -- chat ----------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The chat template in use: the model's own, else the built-in one for its architecture, else None."""
        if self._own_chat_template:
            return self._own_chat_template
        return FALLBACK_TEMPLATES.get(self.architecture or "")

    @property
    def has_own_chat_template(self) -> bool:
        """Whether the model files carry a chat template (False when `chat_template` is a fallback)."""
        return bool(self._own_chat_template)

    def apply_chat_template(self, messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        """Render `messages` (dicts with ``role`` and ``content``) as the model's prompt.

        Keyword arguments (``tools=``, ``documents=``, ``chat_template=`` to override the
        template, anything else the template reads) are passed on to it. With `tokenize`,
        returns the token ids, encoded without adding BOS/EOS: the template writes its own.
        Raises ChatTemplateError when there is no template or it rejects the messages.
        """
        template = resolve_chat_template(kwargs.pop("chat_template", None) or self._own_chat_template,
                                         self.architecture)
        special = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                   "unk_token": self.unk_token, "pad_token": self.pad_token}
        text = render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=special, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # -- internals -------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r}, "
                f"add_bos={self.add_bos_token}, architecture={self.architecture!r})")

    def _text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)

    def _checked(self, ids: Iterable[int]) -> list[int]:
        ids = list(ids)
        for i in ids:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self._vocab_size:
                raise InvalidRequestError(f"token id {i!r} is not in the vocabulary (0..{self._vocab_size - 1})")
        return ids

    def _probe_bos_eos(self) -> tuple[bool, bool]:
        """Whether the backend's post-processor adds BOS / EOS, found by encoding a probe text."""
        bare = self.backend.encode("a", add_special_tokens=False).ids
        full = self.backend.encode("a", add_special_tokens=True).ids
        start = next((i for i in range(len(full) - len(bare) + 1) if full[i:i + len(bare)] == bare), 0)
        head, tail = full[:start], full[start + len(bare):]
        return (self.bos_token_id is not None and self.bos_token_id in head,
                self.eos_token_id is not None and self.eos_token_id in tail)

    @cached_property
    def _added_tokens(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    @cached_property
    def _style(self) -> str:
        """How vocabulary pieces spell bytes: "byte_level" (GPT-2), "sentencepiece" (▁ and <0xNN>), or "other"."""
        decoder = self.backend.decoder
        described = decoder.__getstate__().decode("utf-8", errors="replace") if decoder is not None else ""
        if '"ByteLevel"' in described:
            return "byte_level"
        if '"ByteFallback"' in described or "▁" in described:
            return "sentencepiece"
        return "other"

    @cached_property
    def _byte_decoder(self) -> dict[str, int]:
        return {c: b for b, c in bytes_to_unicode().items()}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{path}: not valid JSON: {e}") from None
    return value if isinstance(value, dict) else {}


def _hf_chat_template(folder: Path, config: dict) -> str | None:
    """The chat template of a Hugging Face folder: chat_template.jinja, else tokenizer_config.json's
    ``chat_template`` (a string, or a list of named templates of which we take "default")."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template") or _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a model on disk: a GGUF file, or a Hugging Face folder with tokenizer.json."""
    path = Path(path)
    if path.is_file():
        return Tokenizer.from_gguf_file(path)
    if path.is_dir():
        return Tokenizer.from_hf_folder(path)
    raise ModelFormatError(f"{path}: no such file or folder")
