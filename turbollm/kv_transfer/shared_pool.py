"""A prefill instance's K/V pool in shared memory, and another process's read-only view of it.

On one host the decode instance copies a finished prompt's blocks straight out of the prefill instance's pool:
one copy, no bundle written or read (worker/kv_p2p.py `P2PWorker`). For that the producer's worker
allocates its whole pool — every layer part of every group — in one anonymous shared-memory file
(`memfd_create`, `SharedArena`): its pages are zero and committed on first touch like the private mapping it
replaces, it needs no space under /dev/shm, and it disappears when the producer exits, however it exits (nothing
to leak). Another process of the same user opens it through `/proc/PID/fd/FD` (`open_pool`) and checks the
file's device and inode against the ones the producer named, so a pid reused by another process is never
read. The producer keeps the blocks of a hand-off referenced until the consumer has copied them
(core/kv_connector.py `P2PScheduler`); the claim protocol on the hand-off's file (`claim`, `finish`) keeps the
producer from freeing them while a copy runs.

The hand-off's file (`.kvs` under `kv_buffer_path`) names the pool and the blocks; it is small (a JSON header,
and a quantized format's float16 ring of recent tokens) and framed with a CRC like every KV file
(kv_transfer/framing.py). Its life: the producer writes NAME.kvs; a consumer renames it NAME.kvs.taking (the
claim: rename is atomic, one claimer wins), copies, checks the claim still stands and deletes it; the
producer's scheduler frees the blocks once neither name exists, and at its deadline renames an unclaimed file
NAME.kvs.expired (so no consumer claims it after) and frees them — a claim older than twice the timeout (a
consumer that died copying) is deleted and its blocks freed too, which the consumer, if alive after all,
notices before using what it copied.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import warnings

import torch

PAGE = 4096
TAKING, EXPIRED = ".taking", ".expired"


class PoolError(Exception):
    """The producer's pool cannot be read (the producer is gone, on another host, or not the one named)."""


def _round(n: int) -> int:
    return -(-n // PAGE) * PAGE


def tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes of a contiguous tensor of `shape` and `dtype` (what `SharedArena.tensor` takes of the file)."""
    return math.prod(shape) * dtype.itemsize


class SharedArena:
    """One shared-memory file holding tensors at page-aligned offsets (a worker's K/V pool)."""

    def __init__(self, sizes: list[int]):
        self.size = max(PAGE, sum(_round(s) for s in sizes))
        self.fd = os.memfd_create("turbollm-kv-pool", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self.map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED)
        st = os.fstat(self.fd)
        self.dev, self.ino = st.st_dev, st.st_ino
        self.base = torch.frombuffer(self.map, dtype=torch.uint8)
        self.at = 0

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next zeroed tensor of `shape` in the file."""
        count, nbytes = math.prod(shape), tensor_bytes(shape, dtype)
        assert self.at + nbytes <= self.size, "shared arena: more tensors than reserved"
        t = self.base[self.at:self.at + nbytes].view(dtype).view(shape) if count else torch.zeros(shape, dtype=dtype)
        self.at += _round(nbytes)
        return t

    def offset(self, t: torch.Tensor) -> int:
        """Where tensor `t` (a view into this file) starts in it."""
        off = t.data_ptr() - self.base.data_ptr()
        assert 0 <= off < self.size, "not a tensor of this arena"
        return off

    def ref(self) -> dict:
        """What another process needs to open the file (plain data, for a hand-off's header)."""
        return {"pid": os.getpid(), "fd": self.fd, "dev": self.dev, "ino": self.ino, "size": self.size}


class PoolMapping:
    """A producer's pool mapped read-only in this process: `tensor` (uint8, the whole file) and `views`, a cache
    its users fill (views of its parts) that lives and dies with the mapping."""

    def __init__(self, mm: mmap.mmap, size: int):
        self.map = mm
        with warnings.catch_warnings():  # (read-only memory: this view is only read)
            warnings.simplefilter("ignore", UserWarning)
            self.tensor = torch.frombuffer(mm, dtype=torch.uint8, count=size)
        self.views: dict = {}

    def close(self) -> None:
        self.views.clear()
        self.tensor = None
        try:
            self.map.close()
        except BufferError:  # a view still in use somewhere: the mapping goes when it does
            pass


_maps: dict[tuple, PoolMapping] = {}
_maps_lock = threading.Lock()


def _alive(key: tuple) -> bool:
    pid, fd, dev, ino = key
    try:
        st = os.stat(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (dev, ino)


def open_pool(ref: dict) -> PoolMapping:
    """The producer's pool named by `ref` (`SharedArena.ref`), mapped read-only once per pool and kept (its pages
    stay mapped from hand-off to hand-off). Every call checks the producer is still the one named; mappings of
    producers that are gone are dropped here, so a dead producer's memory is not kept alive. Raises PoolError."""
    try:
        key = (int(ref["pid"]), int(ref["fd"]), int(ref["dev"]), int(ref["ino"]))
        size = int(ref["size"])
    except (KeyError, TypeError, ValueError):
        raise PoolError("the hand-off names no pool") from None
    with _maps_lock:
        for k in [k for k in _maps if not _alive(k)]:
            _maps.pop(k).close()
        pm = _maps.get(key)
        if pm is None:
            path = f"/proc/{key[0]}/fd/{key[1]}"
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise PoolError(f"the producer's pool {path} cannot be opened ({e.strerror}): gone, or on "
                                "another host") from None
            try:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) != key[2:] or st.st_size < size:
                    raise PoolError(f"{path} is not the producer's pool (pid reused?)")
                pm = PoolMapping(mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ), size)
            finally:
                os.close(fd)
            _maps[key] = pm
    if pm.tensor.numel() < size:
        raise PoolError("the producer's pool is smaller than its hand-off says")
    return pm


def part_view(pool: torch.Tensor, offset: int, num_blocks: int, block_bytes: int) -> torch.Tensor:
    """Blocks [num_blocks, block_bytes] of one layer part at `offset` in a pool; PoolError when outside it."""
    end = offset + num_blocks * block_bytes
    if offset < 0 or block_bytes <= 0 or end > pool.numel():
        raise PoolError(f"a layer part at {offset}..{end} lies outside the producer's pool ({pool.numel()} bytes)")
    return pool[offset:end].view(num_blocks, block_bytes)


def claim(path: str) -> str | None:
    """Take the hand-off file `path` (rename it to NAME.taking); the claimed name, or None when it is not there
    (not written yet, taken by another, expired, or on another host)."""
    taking = path + TAKING
    try:
        os.rename(path, taking)
    except FileNotFoundError:
        return None
    return taking


def finish(taking: str) -> bool:
    """Release a claim after copying: True when it still stood (the producer kept the blocks all along)."""
    try:
        os.unlink(taking)
    except FileNotFoundError:
        return False
    return True


def unclaim(taking: str) -> None:
    """Give a claimed hand-off back (this process cannot read the pool: another process may fetch it)."""
    try:
        os.rename(taking, taking[:-len(TAKING)])
    except FileNotFoundError:
        pass
