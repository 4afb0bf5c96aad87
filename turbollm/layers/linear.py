"""Tensor-parallel-ready linear layers whose parameters load their own shard.

Column-parallel layers split the output dimension across ranks, row-parallel ones the
input dimension (and all-reduce their output). Merged layers (QKV, gate/up) hold several
logical weights in one matrix; `weight_loader(param, tensor, shard_id)` places each
checkpoint tensor in its slice. How the weight is stored and multiplied is the layer's
`LinearMethod` (quantization strategy): the loaders check shapes and cut this rank's part,
then hand the weight's rows to `method.load_weight` (biases are always dense float32). A
checkpoint tensor is a torch tensor or a `QuantizedTensor` (raw GGML blocks), which slices
the same way. The model files see only these classes.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from turbollm.distributed import divide, get_tp
from turbollm.errors import WeightLoadError
from turbollm.quantization import LinearMethod, QuantizedTensor, UnquantizedLinearMethod
from turbollm.quantization.qtensor import as_dense, copy_checked

Loaded = torch.Tensor | QuantizedTensor
logger = logging.getLogger("turbollm")


class LinearBase(nn.Module):
    """`y = x @ W.T + b` with W created and applied by a LinearMethod."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method: LinearMethod | None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        self.tp = get_tp()
        self.in_features, self.out_features = in_features, out_features  # local (per-rank) sizes
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self, in_features, out_features, dtype)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        raise NotImplementedError

    def store_rows(self, param: nn.Parameter, loaded: Loaded, row_offset: int, what: str) -> None:
        """Put `loaded` at output rows `row_offset...` of `param`: the weight through the method, a bias densely."""
        if param is self._parameters.get("weight"):
            self.method.load_weight(self, loaded, row_offset, what)
        else:
            loaded = as_dense(loaded)
            copy_checked(param.data.narrow(0, row_offset, loaded.shape[0]), loaded, what)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, method={type(self.method).__name__}"


class ColumnParallelLinear(LinearBase):
    """Output dimension split across tensor-parallel ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: LinearMethod | None = None):
        tp = get_tp()
        super().__init__(in_features, divide(out_features, tp.tp_size), bias, method)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        size = param.shape[0]
        if tuple(loaded.shape) != (size * self.tp.tp_size, *param.shape[1:]):
            raise WeightLoadError(f"column-parallel weight: checkpoint shape {tuple(loaded.shape)} does not match "
                                  f"the model's {(size * self.tp.tp_size, *param.shape[1:])}")
        self.store_rows(param, loaded.narrow(0, self.tp.tp_rank * size, size) if self.tp.tp_size > 1 else loaded,
                        0, "column-parallel weight")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel weights stacked on the output dimension (e.g. gate and up); each split in
    multiples of `align` (the MLP's: `ParallelState.mlp_align`), as the row-parallel layer after it."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, method: LinearMethod | None = None,
                 align: int = 1):
        self.output_sizes = output_sizes
        tp = get_tp()
        self.shards = [tp.shard(n, align) for n in output_sizes]  # this rank's (start, size) of each
        LinearBase.__init__(self, in_features, sum(size for _, size in self.shards), bias, method)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: int = 0) -> None:
        offset = sum(size for _, size in self.shards[:shard_id])
        start, size = self.shards[shard_id]
        expected = (self.output_sizes[shard_id], *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise WeightLoadError(f"merged shard {shard_id}: checkpoint shape {tuple(loaded.shape)} does not match "
                                  f"the model's {expected}")
        self.store_rows(param, loaded.narrow(0, start, size) if self.tp.tp_size > 1 else loaded, offset,
                        f"merged shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections in one matrix; heads are split across ranks (KV heads replicated if fewer)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 method: LinearMethod | None = None):
        tp = get_tp()
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = divide(num_heads, tp.tp_size)
        self.num_kv_heads = max(1, num_kv_heads // tp.tp_size)
        self.kv_replicas = max(1, tp.tp_size // num_kv_heads)
        out = (num_heads + 2 * self.num_kv_heads * tp.tp_size) * head_dim
        super().__init__(hidden_size, out, bias, method)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: str = "q") -> None:
        tp = self.tp
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, tp.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, rank = self.kv_size, tp.tp_rank // self.kv_replicas
        else:
            raise WeightLoadError(f"unknown QKV shard {shard_id!r}")
        # Check the whole checkpoint tensor before slicing: narrow() would silently drop extra
        # rows, or fail with a bare RuntimeError on too few.
        heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        expected = (heads * self.head_dim, *param.shape[1:])
        if tuple(loaded.shape) != expected:
            raise WeightLoadError(f"{shard_id}_proj: checkpoint shape {tuple(loaded.shape)} does not match "
                                  f"the model's {expected}")
        self.store_rows(param, loaded.narrow(0, rank * size, size), offset, f"{shard_id}_proj")


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks; each rank's output is a partial sum (the bias on rank 0 only),
    summed across ranks by the all-reduce the step's `LayerHooks` run after the layer's output
    (`distributed/tensor_parallel.py`), in the module path and the fused step alike."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, method: LinearMethod | None = None,
                 align: int = 1):
        tp = get_tp()
        self.total_in = in_features
        # this rank's columns: in multiples of `align` (an MLP's down projection), else an even split
        self.in_start, size = tp.shard(in_features, align) if align > 1 else (
            tp.tp_rank * divide(in_features, tp.tp_size), in_features // tp.tp_size)
        super().__init__(size, out_features, bias and tp.tp_rank == 0, method)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id=None) -> None:
        # the parameter's columns may be packed (GPTQ/AWQ codes, 3-bit ones too): scale the input range to them
        cols = param.shape[1] if param.dim() == 2 else 0
        expected = (param.shape[0], cols * self.total_in // self.in_features) if param.dim() == 2 else tuple(param.shape)
        if tuple(loaded.shape) != expected:
            raise WeightLoadError(f"row-parallel weight: checkpoint shape {tuple(loaded.shape)} does not match "
                                  f"the model's {expected}")
        if param.dim() == 2 and self.tp.tp_size > 1:
            size, start = cols, self.in_start * cols // self.in_features
            if isinstance(loaded, QuantizedTensor) and (start % loaded.block_size or size % loaded.block_size):
                loaded = reencode_columns(loaded, start, size)
            else:
                loaded = loaded.narrow(1, start, size)  # along K: whole GGML blocks
        self.store_rows(param, loaded, 0, "row-parallel weight")


#: What a GGML weight whose row-parallel shard would cut its blocks is re-encoded as: 32-element blocks
#: of 8-bit values (the finest GGML type; its rounding is ~0.4% of each block's largest weight).
REENCODE_QTYPE = 8  # Q8_0
_REENCODED: set[str] = set()


def reencode_columns(loaded: QuantizedTensor, start: int, size: int) -> QuantizedTensor:
    """Columns [start, start + size) of a GGML weight whose blocks they would cut (a k-quant's 256 weights
    when K / tensor_parallel_size is not a multiple of 256): decoded, then encoded as Q8_0 (logged)."""
    from turbollm.formats.ggml_quantizers import quantize
    from turbollm.quantization.qtensor import ggml_type_name

    if start % 32 or size % 32:
        raise WeightLoadError(f"tensor {loaded.name}: a row-parallel shard of columns [{start}, {start + size}) is not "
                              f"on 32-element boundaries: no GGML type can hold it; choose another "
                              "tensor_parallel_size")
    dense = as_dense(loaded)[:, start:start + size]
    blocks = torch.from_numpy(quantize(dense, REENCODE_QTYPE, tensor_name=loaded.name))
    if loaded.type_name not in _REENCODED:  # once per type and process
        _REENCODED.add(loaded.type_name)
        logger.info("tensor parallelism: row-parallel shards that cut %s blocks of %d (%s, columns [%d, %d), and any "
                    "other) are re-encoded as %s", loaded.type_name, loaded.block_size, loaded.name, start,
                    start + size, ggml_type_name(REENCODE_QTYPE))
    return QuantizedTensor(blocks, REENCODE_QTYPE, (dense.shape[0], size), loaded.name)
