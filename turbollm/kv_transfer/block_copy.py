"""Copy K/V blocks between pools by block index: the C++ kernel (one memcpy per block and layer part,
csrc/kv_copy.cpp) and the plain PyTorch reference beside it (tests/test_kv_p2p.py holds them together)."""

from __future__ import annotations

import torch

from turbollm.kernels import cpu_kernels


def copy_blocks_reference(srcs: list[torch.Tensor], dsts: list[torch.Tensor], src_idx: torch.Tensor,
                          dst_idx: torch.Tensor) -> None:
    """Block dst_idx[i] of each dsts[p] := block src_idx[i] of srcs[p] (uint8 [blocks, bytes] views)."""
    for s, d in zip(srcs, dsts, strict=True):
        d.index_copy_(0, dst_idx, s.index_select(0, src_idx))


def copy_blocks(srcs: list[torch.Tensor], dsts: list[torch.Tensor], src_idx: torch.Tensor,
                dst_idx: torch.Tensor) -> None:
    """`copy_blocks_reference`, by the kernel when there is one."""
    k = cpu_kernels()
    if k is not None:
        k.copy_kv_blocks(srcs, dsts, src_idx, dst_idx)
    else:
        copy_blocks_reference(srcs, dsts, src_idx, dst_idx)


def as_blocks(t: torch.Tensor) -> torch.Tensor:
    """A contiguous pool tensor [blocks, ...] as uint8 [blocks, bytes per block]."""
    return t.view(-1).view(torch.uint8).view(t.shape[0], -1)
