"""Tokenizers: built from GGUF metadata or a Hugging Face folder, plus chat templates.

    from turbollm.tokenizer import load_tokenizer
    tok = load_tokenizer("model.gguf")          # or Tokenizer.from_gguf(read_gguf(path).metadata)
    ids = tok.encode("Hello")                   # BOS added iff the model wants it
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
"""

from turbollm.tokenizer.chat_template import ChatTemplateError
from turbollm.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["ChatTemplateError", "Tokenizer", "load_tokenizer"]
