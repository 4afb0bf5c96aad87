"""One layer's paged KV storage: the data, optional scales, and the layout descriptor kernels read.

K and V are `[num_blocks, block_size, num_kv_heads, head_dim]` each; token t of a sequence lives
in slot `block_table[t // block_size] * block_size + t % block_size` of its layer's group table.
`KVLayout` is what a kernel needs to read a block in place (element type, block size, heads, head
dim); a quantized KV format extends it and fills `k_scale` / `v_scale` (none of today's formats
has scales: float32 and float16 store the values themselves).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class KVLayout:
    dtype: torch.dtype
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def itemsize(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return self.block_size, self.num_kv_heads, self.head_dim

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.itemsize


@dataclass
class LayerKVCache:
    """A layer's K/V blocks (and, for a quantized format, their scales), described by `layout`."""

    k: torch.Tensor
    v: torch.Tensor
    layout: KVLayout
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, layout: KVLayout, num_blocks: int) -> "LayerKVCache":
        shape = (num_blocks, *layout.block_shape)
        return cls(_lazy_zeros(shape, layout.dtype), _lazy_zeros(shape, layout.dtype), layout)

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor) -> "LayerKVCache":
        """Wrap K/V tensors `[num_blocks, block_size, heads, head_dim]` built elsewhere (tests, offline tools)."""
        return cls(k, v, KVLayout(k.dtype, *k.shape[1:]))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Block dst[i] becomes a copy of block src[i] (copy-on-write), scales included."""
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None:
                t.index_copy_(0, dst, t.index_select(0, src))


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zero-filled storage whose pages the OS commits on first touch.

    numpy's zeros uses calloc, which maps fresh zero pages for large sizes, whereas
    torch.zeros writes every byte: 4 GiB of KV cache would cost seconds at start-up.
    Zeros (not garbage) matter: masked slots are multiplied by zero probabilities.
    """
    if dtype in _NUMPY_DTYPES:
        return torch.from_numpy(np.zeros(shape, dtype=_NUMPY_DTYPES[dtype]))
    return torch.zeros(shape, dtype=dtype)
