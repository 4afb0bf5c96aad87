"""Incremental detokenization that never emits half a UTF-8 character.

Byte-level vocabularies split one character (a CJK ideograph, an emoji) over several
tokens; decoding them one by one would yield U+FFFD. We keep a window of recent tokens:
text is released only once the window decodes to something that does not end in a
replacement character, and decoding the window with a few tokens of left context keeps
leading spaces right for SentencePiece vocabularies. `flush()` releases what is held back when
the sequence ends, so the final text is the streamed text plus that tail, never a different decode.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"
_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith(_REPLACEMENT):
            new = full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new
        return ""

    def flush(self) -> str:
        """The text still held back (a character cut by the end of the sequence), released as it decodes."""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=self.skip)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=self.skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""
