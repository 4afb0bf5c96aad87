"""Token embedding and LM head, vocabulary-parallel: with tensor parallelism each rank keeps the rows
of its slice of the vocabulary (`vocab_start` ..), looks up the ids that fall in it (zeros for the
others, summed across ranks by an all-reduce) and computes its slice of the logits (all-gathered).

The table is dense float32 ``[vocab, dim]`` (bfloat16 with the engine's `dtype` "bfloat16": rows are
widened to float32 when looked up, the LM head multiplies through `dense_linear`), or, when the checkpoint's table is
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

from turbollm.distributed import divide, get_tp
from turbollm.errors import WeightLoadError
from turbollm.formats.ggml_quantizers import get_quantizer, quantize
from turbollm.kernels.dense import dense_linear
from turbollm.kernels.quant import ggml_embedding, ggml_linear
from turbollm.quantization.base import qmatmul_of
from turbollm.quantization.qtensor import QuantizedTensor, copy_checked, mark_ggml


class VocabEmbedding(nn.Module):
    """Rows of a ``[vocab, dim]`` table by token id (dense float32 or raw GGML blocks)."""

    #: `quantization.base.set_kernel_form` holds a GGML table in a kernel form's layout (lookups decode
    #: a repacked row from its GGML bytes: `ggml_embedding` through the kernels' `deq`)
    vocab_table = True

    def __init__(self, vocab_size: int, dim: int):
        super().__init__()
        tp = get_tp()
        self.tp_size = tp.tp_size
        self.vocab_size, self.dim = vocab_size, dim  # the whole vocabulary
        self.local_vocab = divide(vocab_size, tp.tp_size)  # the rows this rank keeps
        self.vocab_start = tp.tp_rank * self.local_vocab
        self.weight = nn.Parameter(torch.empty(self.local_vocab, dim), requires_grad=False)  # untouched: no memory yet
        self.weight.weight_loader = self.load_table

    @property
    def qtype(self) -> int | None:
        """GGML type of the table's blocks, or None for a dense float32 table."""
        return getattr(self.weight, "ggml_qtype", None)

    def load_table(self, param: nn.Parameter, loaded: torch.Tensor | QuantizedTensor, shard_id=None) -> None:
        """Weight loader: keep a QuantizedTensor's blocks (an owned copy), copy a dense tensor."""
        what = type(self).__name__.lower()
        if tuple(loaded.shape) != (self.vocab_size, self.dim):
            raise WeightLoadError(f"{what}: checkpoint shape {tuple(loaded.shape)} does not match the model's "
                                  f"{(self.vocab_size, self.dim)}")
        if self.tp_size > 1:  # this rank's slice of the vocabulary
            loaded = loaded.narrow(0, self.vocab_start, self.local_vocab)
        if isinstance(loaded, QuantizedTensor):
            self.weight = mark_ggml(nn.Parameter(loaded.owned(), requires_grad=False), loaded.qtype)
        else:
            if self.qtype is not None:  # blocks loaded before: back to a dense table
                self.weight = nn.Parameter(torch.empty(self.local_vocab, self.dim), requires_grad=False)
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

    def forward(self, ids: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """The rows of `ids`; under tensor parallelism with `reduce=False`, this rank's share of them (its
        vocabulary's rows, zeros elsewhere) for a summing elsewhere."""
        if self.tp_size == 1:
            return self._rows(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.local_vocab)
        out = self._rows(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        if reduce:
            from turbollm.distributed.tensor_parallel import all_reduce

            all_reduce(out)  # each id's row comes from the one rank that holds it
        return out

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        qtype = self.qtype
        if qtype is None:
            rows = F.embedding(ids, self.weight)
            return rows if rows.dtype == torch.float32 else rows.float()
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
            logits = dense_linear(hidden, self.weight)
        else:
            flat = hidden.reshape(-1, self.dim)
            logits = ggml_linear(flat, self.weight, qtype, self.dim, path=qmatmul_of(self)).reshape(
                *hidden.shape[:-1], self.local_vocab)
        if self.tp_size > 1:  # every rank gets the whole vocabulary's logits, in rank order
            from turbollm.distributed.tensor_parallel import all_gather_last

            logits = all_gather_last(logits)
        return logits
