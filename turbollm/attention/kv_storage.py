"""One layer's paged KV storage: the data, optional scales, and the layout descriptor kernels read.

K and V are `[num_blocks, block_size, num_kv_heads, head_dim]` each; token t of a sequence lives
in slot `block_table[t // block_size] * block_size + t % block_size` of its layer's group table.
`KVLayout` is what a kernel needs to read a block in place (element type, block size, heads, head
dim, and for a quantized format its recent window).

Each storage dtype is a registered format (`attention/kv_formats.py`: float32, float16, int8, int4) that
says what a block holds and its bytes. Quantized formats (`kv_cache_dtype` int8 / int4; the reference of
the store and the read is `attention/kv_quant.py`): a block holds its tokens as integers with float16
scales, K per channel over the block's tokens and V per token. A block is quantized once it is complete and older
than the sequence's last `recent_window` tokens; until then its tokens live in float16 in the
sequence's ring of recent blocks (`k_recent`, `v_recent`: `ring_blocks` blocks per ring slot). The rings
are drawn from the pool itself: `k_recent` is a float16 view of the pool's K storage, so ring slot s is
pool blocks `ring_pool_blocks * s ..` (`ring_factor` quantized blocks hold one float16 ring block), which
the scheduler side takes out of the pool while a sequence holds that slot (core/kv_cache_manager.py):
memory goes to rings only for the sequences running, not to every sequence slot up front.
A decode (and each row of a step of a few tokens) reads its last `recent_window` tokens or more in
float16; a longer run of new tokens (a prefill chunk) is quantized as it is written, so its own
attention reads its older part quantized.
"""

from __future__ import annotations

import functools
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from turbollm.attention.kv_formats import KV_FORMATS, KVFormat, kv_format

# storage element type of each quantized format -> its kv_cache_dtype name
QUANT_FORMATS = {f.dtype: f.name for f in KV_FORMATS.values() if f.quantized}


@dataclass(frozen=True)
class KVLayout:
    dtype: torch.dtype
    block_size: int
    num_kv_heads: int
    head_dim: int
    recent_window: int = 0  # quantized formats: the newest tokens kept in float16

    @functools.cached_property
    def format(self) -> KVFormat:
        """The registered storage format of `dtype` (attention/kv_formats.py)."""
        return kv_format(self.dtype)

    @property
    def quant(self) -> str | None:
        """The format's name for a quantized format ("int8" / "int4"), None for float32 / float16."""
        return self.format.name if self.format.quantized else None

    @property
    def quant_bits(self) -> int:
        """Bits per stored value of a quantized format (8 or 4); 0 for float32 / float16."""
        return self.format.bits

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return self.block_size, self.num_kv_heads, self.head_dim

    @property
    def block_bytes(self) -> int:
        """K and V of one block in one layer, scales included (a ring slot is `ring_pool_blocks` of them)."""
        return self.format.block_bytes(*self.block_shape)

    @property
    def bytes_per_token(self) -> float:
        """K and V of one token in one layer (a quantized format: averaged over its block)."""
        return self.block_bytes / self.block_size

    @property
    def ring_blocks(self) -> int:
        """Float16 blocks of a ring slot: the window, the block being filled, one so that a step's
        newest tokens never overwrite what is still to be quantized, and one for up to a block of
        speculative drafts (a verification row reads the ring from its own position's bound)."""
        return -(-self.recent_window // self.block_size) + 3 if self.quant else 0

    @property
    def ring_factor(self) -> int:
        """Quantized pool blocks whose K (or V) storage holds one float16 ring block (int8: 2, int4: 4)."""
        return self.format.ring_factor if self.format.quantized else 0

    @property
    def ring_pool_blocks(self) -> int:
        """Pool blocks one ring slot occupies (ring slot s: blocks s * this .. (s + 1) * this - 1)."""
        return self.ring_blocks * self.ring_factor

    def ring_slots(self, num_blocks: int) -> int:
        """Ring slots a pool of `num_blocks` blocks can hold at most (each taken only while a sequence runs)."""
        return num_blocks // self.ring_pool_blocks if self.quant else 0


@dataclass
class LayerKVCache:
    """A layer's K/V blocks (and, for a quantized format, their scales and the float16 rings of recent
    blocks, a view of the blocks' storage), described by `layout`."""

    k: torch.Tensor
    v: torch.Tensor
    layout: KVLayout
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_recent: torch.Tensor | None = None
    v_recent: torch.Tensor | None = None

    @classmethod
    def allocate(cls, layout: KVLayout, num_blocks: int, alloc=None) -> "LayerKVCache":
        """Zeroed storage of `num_blocks` blocks, each tensor as the layout's format describes it (from `alloc(shape,
        dtype)` when given: a shared-memory pool, kv_transfer/shared_pool.py); a quantized format's rings are a
        float16 view of its K and V blocks."""
        alloc = alloc or _lazy_zeros
        t = {name: alloc(shape, dtype)
             for name, (shape, dtype) in layout.format.storage_shapes(num_blocks, *layout.block_shape).items()}
        if layout.format.quantized:
            t["k_recent"], t["v_recent"] = _ring_view(t["k"], layout, num_blocks), _ring_view(t["v"], layout, num_blocks)
        return cls(layout=layout, **t)

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor) -> "LayerKVCache":
        """Wrap K/V tensors `[num_blocks, block_size, heads, head_dim]` built elsewhere (tests, offline tools)."""
        return cls(k, v, KVLayout(k.dtype, *k.shape[1:]))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Block dst[i] becomes a copy of block src[i] (copy-on-write), scales included (the rings belong to
        sequences, not blocks: a fork copies its parent's, `copy_ring`)."""
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None:
                t.index_copy_(0, dst, t.index_select(0, src))

    def copy_ring(self, src_slot: int, dst_slot: int) -> None:
        m = self.layout.ring_blocks
        for t in (self.k_recent, self.v_recent):
            if t is not None:
                t[dst_slot * m:(dst_slot + 1) * m] = t[src_slot * m:(src_slot + 1) * m]


def _ring_view(t: torch.Tensor, layout: KVLayout, num_blocks: int) -> torch.Tensor:
    """The float16 rings [slots * ring_blocks, bs, H, D] over the first `ring_slots(num_blocks) *
    ring_pool_blocks` blocks of quantized storage `t` (one byte an element, contiguous)."""
    bs, H, D = layout.block_shape
    ring_blocks = layout.ring_slots(num_blocks) * layout.ring_blocks
    return t.view(-1)[:ring_blocks * bs * H * D * 2].view(torch.float16).view(ring_blocks, bs, H, D)


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int8: np.int8, torch.uint8: np.uint8}


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zero-filled storage whose pages the OS commits on first touch.

    An anonymous mapping of its own: its pages are zero and cost nothing until written, whereas
    torch.zeros writes every byte (4 GiB of KV cache would cost seconds at start-up) and numpy's
    calloc maps fresh pages only above glibc's mmap threshold, which the engine raises to 1 GiB
    (worker/malloc_tuning.py): below it, calloc takes heap memory the process freed before (a
    model load's buffers), clears it and keeps it resident, so the pool's cost would depend on what
    loading left behind (measured: 200 MiB more at 32 than at 8 sequences, qwen2.5-coder-0.5b).
    Zeros (not garbage) matter: masked slots are multiplied by zero probabilities.
    """
    if dtype not in _NUMPY_DTYPES:
        return torch.zeros(shape, dtype=dtype)
    np_dtype = np.dtype(_NUMPY_DTYPES[dtype])
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return torch.from_numpy(np.zeros(shape, dtype=np_dtype))
    buf = mmap.mmap(-1, count * np_dtype.itemsize, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.from_numpy(np.frombuffer(buf, dtype=np_dtype, count=count).reshape(shape))
