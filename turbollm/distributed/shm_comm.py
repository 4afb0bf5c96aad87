"""All-reduce and all-gather through shared memory, for tensor-parallel ranks on one host.

gloo's collectives go through TCP on loopback: ~0.8 ms each on the project machine, 50 of them per
decode step of a 24-layer model (docs/BENCHMARKS.md), most of the step. Ranks on one host can
instead meet in a shared mapping: the engine creates two files in /dev/shm before it spawns the
ranks (`ShmFiles`), every rank maps them (`ShmComm`), and each exchange is a copy into the rank's
slot, a flag, a wait for the other ranks' flags (the C++ `shm_exchange`, with a timeout that names
a missing rank), then a read of every slot: summed in rank order for an all-reduce (every rank gets
the same values), laid side by side for an all-gather. Tensors larger than a slot go through gloo.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

import torch

SLOT_FLOATS = 1 << 20  # float32 values per rank and exchange (4 MiB): a 2k-token chunk of a 512-wide model


@dataclass(frozen=True)
class ShmFiles:
    """The two shared files of a group: values [2, world, SLOT_FLOATS] float32, flags [world, 8] int64."""

    values: str
    flags: str
    world: int

    @classmethod
    def create(cls, world: int) -> "ShmFiles":
        paths = []
        for suffix, nbytes in ((".values", 2 * world * SLOT_FLOATS * 4), (".flags", world * 8 * 8)):
            fd, path = tempfile.mkstemp(prefix="turbollm-tp-", suffix=suffix, dir="/dev/shm")
            os.ftruncate(fd, nbytes)  # zero-filled
            os.close(fd)
            paths.append(path)
        return cls(paths[0], paths[1], world)

    def unlink(self) -> None:
        """Remove the names (the ranks' mappings stay valid)."""
        for path in (self.values, self.flags):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


class ShmComm:
    def __init__(self, files: ShmFiles, rank: int, kernels, timeout_s: float):
        self.rank, self.world, self.kernels, self.timeout_s = rank, files.world, kernels, timeout_s
        self.values = torch.from_file(files.values, shared=True, size=2 * files.world * SLOT_FLOATS,
                                      dtype=torch.float32).view(2, files.world, SLOT_FLOATS)
        self.flags = torch.from_file(files.flags, shared=True, size=files.world * 8, dtype=torch.int64).view(
            files.world, 8)
        self.seq = 0

    def fits(self, t: torch.Tensor) -> bool:
        return t.dtype == torch.float32 and t.numel() <= SLOT_FLOATS

    def _exchange(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t` (flattened), [world, n], valid until the exchange after next."""
        self.seq += 1
        flat = t.reshape(-1)
        self.kernels.shm_exchange(flat, self.values, self.flags, self.rank, self.seq, self.timeout_s)
        return self.values[self.seq % 2, :, :flat.numel()]

    def all_reduce(self, t: torch.Tensor) -> None:
        t.copy_(self._exchange(t.contiguous()).sum(0).view_as(t))

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t.contiguous()).view(self.world, *t.shape)
        return torch.cat(list(parts.unbind(0)), dim=-1)
