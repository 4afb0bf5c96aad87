"""Token embedding and LM head, vocabulary-parallel ready (tp size 1 today).

The table is dense float32 ``[vocab, dim]``, or, when the checkpoint's table is
block-quantized and the model keeps GGUF types (the loader then hands a `QuantizedTensor`),
the raw GGML blocks ``uint8 [vocab, row_bytes]`` tagged with their type (`ggml_qtype` on the
parameter). Lookups then decode only the rows asked for (`ggml_embedding`), and the LM head
multiplies by the blocks (`ggml_linear`). A tied LM head shares the embedding's parameter
object, so it shares the blocks and their type: no float32 copy of the table exists. A dense
table loaded for a quantized model is re-encoded once loaded (`compress`, to the linear
method's `vocab_table_type`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from turbollm.errors import WeightLoadError
from turbollm.formats.ggml_quantizers import get_quantizer, quantize
from turbollm.kernels.dense import dense_linear
from turbollm.kernels.quant import ggml_embedding, ggml_linear
from turbollm.quantization.base import qmatmul_of
from turbollm.quantization.qtensor import QuantizedTensor, copy_checked, mark_ggml


class VocabEmbedding(nn.Module):
    """Rows of a ``[vocab, dim]`` table by token id (dense float32 or raw GGML blocks)."""

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        self.vocab_size, self.dim = vocab_size, dim
        self.weight = nn.Parameter(torch.empty(vocab_size, dim), requires_grad=False)  # not touched: no memory yet
        self.weight.weight_loader = self.load_table

    @property
    def qtype(self) -> int | None:
        """GGML type of the table's blocks, or None for a dense float32 table."""
        return getattr(self.weight, "ggml_qtype", None)

    def load_table(self, param: nn.Parameter, loaded: torch.Tensor | QuantizedTensor, shard_id=None) -> None:
        """Weight loader: keep a QuantizedTensor's blocks (an owned copy), copy a dense tensor."""
        what = type(self).__name__.lower()
        if isinstance(loaded, QuantizedTensor):
            if tuple(loaded.shape) != (self.vocab_size, self.dim):
                raise WeightLoadError(f"{what}: checkpoint shape {tuple(loaded.shape)} does not match the model's "
                                      f"{(self.vocab_size, self.dim)}")
            self.weight = mark_ggml(nn.Parameter(loaded.owned(), requires_grad=False), loaded.qtype)
        else:
            if self.qtype is not None:  # blocks loaded before: back to a dense table
                self.weight = nn.Parameter(torch.empty(self.vocab_size, self.dim), requires_grad=False)
            copy_checked(self.weight, loaded, what)
        self.weight.weight_loader = self.load_table

    def compress(self, qtype: int) -> bool:
        """Re-encode a dense table as GGML blocks of `qtype` (our encoder); False if the rows don't fit its blocks."""
        if self.qtype is not None or self.dim % get_quantizer(qtype).block_size:
            return False
        blocks = torch.from_numpy(quantize(self.weight.data, qtype, tensor_name=type(self).__name__.lower()))
        self.weight = mark_ggml(nn.Parameter(blocks.contiguous(), requires_grad=False), qtype)
        self.weight.weight_loader = self.load_table
        return True

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        qtype = self.qtype
        if qtype is None:
            return F.embedding(ids, self.weight)
        return ggml_embedding(self.weight, qtype, self.dim, ids)

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, dim={self.dim}, ggml_qtype={self.qtype}"


class LMHead(VocabEmbedding):
    """Projects hidden states to vocabulary logits; may share its weight with the embedding."""

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Use the embedding's table (the same parameter: same storage, same GGML type)."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        qtype = self.qtype
        if qtype is None:
            return dense_linear(hidden, self.weight)
        flat = hidden.reshape(-1, self.dim)
        return ggml_linear(flat, self.weight, qtype, self.dim, path=qmatmul_of(self)).reshape(
            *hidden.shape[:-1], self.vocab_size)
