"""The block store: K/V blocks in files named by their key, in a folder that outlives the process.

One file per block of one KV-cache group (every layer of the group, scales included), in the frame of
`framing.py` (magic b"TLKVBLK1"; header: the block's key and layout; CRC-32 over header and payload). A file
is written under a temporary name in its folder and renamed into place (`os.replace`: readers see a whole file
or none), so several instances may share one folder, and a write cut short by a crash leaves at worst a
temporary file (swept at start). `get` checks the magic, the lengths, the CRC, and that the key and layout
written inside are the ones asked for: a block that fails any of them is reported (`BlockStoreError`) and
never used.

The folder has a size cap: past it, the least recently used files (by modification time, which a read
refreshes) are deleted down to 90% of the cap, whichever instance wrote them. An in-memory tier of recently
written and read blocks (`ram_bytes`) sits in front of the files.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from pathlib import Path

from turbollm.kv_transfer.framing import KVFrameError, decode, encode

MAGIC = b"TLKVBLK1"
SUFFIX = ".kvb"
STALE_TMP_SECONDS = 3600
BlockStoreError = KVFrameError  # a stored block that cannot be used (short, corrupt, another key or layout)


class BlockStore:
    def __init__(self, path: str | os.PathLike, max_bytes: int, ram_bytes: int = 0, scan: bool = True):
        """`scan`: walk the folder now (sweeping a crash's temporary files, sizing it for the cap) — what a store
        that writes needs; one that only looks (`contains`) skips it."""
        self.root = Path(path).expanduser()
        self.max_bytes, self.ram_bytes = max_bytes, ram_bytes
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".probe.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise BlockStoreError(f"kv_store_path {str(self.root)!r} is not a writable folder: "
                                  f"{e.strerror or e}") from None
        self.ram: OrderedDict[bytes, bytes] = OrderedDict()  # key -> payload, least recently used first
        self.ram_used = 0
        self.disk_bytes = self._sweep() if scan else 0  # this instance's running estimate; `_enforce_cap` measures

    # ---------------------------------------------------------------- names
    def path_of(self, key: bytes) -> Path:
        h = key.hex()
        return self.root / h[-2:] / (h + SUFFIX)

    def contains(self, key: bytes) -> bool:
        return key in self.ram or self.path_of(key).is_file()

    # ---------------------------------------------------------------- write
    @staticmethod
    def encode(key: bytes, layout: list, payload: bytes | memoryview) -> bytes:
        return encode(MAGIC, {"key": key.hex(), "layout": layout}, payload)

    def put(self, key: bytes, layout: list, payload: bytes) -> int:
        """Store a block in memory and in its file; returns the bytes written."""
        self.remember(key, payload)
        return self.write(key, layout, payload)

    def write(self, key: bytes, layout: list, payload: bytes) -> int:
        """Write a block's file (atomically; a file already there is left alone); returns the bytes written. (The
        memory tier is the caller's thread's: a writer thread calls this alone.)"""
        path = self.path_of(key)
        if path.is_file():
            return 0
        data = self.encode(key, layout, payload)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        self.disk_bytes += len(data)
        if self.disk_bytes > self.max_bytes:
            self._enforce_cap()
        return len(data)

    # ---------------------------------------------------------------- read
    def get(self, key: bytes, layout: list) -> bytes | None:
        """The payload of block `key`, or None when the store has no such block; raises BlockStoreError for a
        block that is there but cannot be used (the caller recomputes it)."""
        payload = self.ram.get(key)
        if payload is not None:
            self.ram.move_to_end(key)
            return payload
        path = self.path_of(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise BlockStoreError(f"{path.name}: unreadable ({e.strerror or e})") from None
        payload = self.decode(data, key, layout, path.name)
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        self.remember(key, payload)
        return payload

    @staticmethod
    def decode(data: bytes, key: bytes, layout: list, name: str = "block") -> bytes:
        header, payload = decode(data, MAGIC, name)
        if header.get("key") != key.hex():
            raise BlockStoreError(f"{name}: written for another key")
        if header.get("layout") != layout:
            raise BlockStoreError(f"{name}: written for another layout {header.get('layout')} (this engine: {layout})")
        return bytes(payload)

    # ---------------------------------------------------------------- memory tier and cap
    def discard(self, key: bytes) -> None:
        """Forget a block that proved unusable (its file too, so that a producer writes it again)."""
        payload = self.ram.pop(key, None)
        if payload is not None:
            self.ram_used -= len(payload)
        self.path_of(key).unlink(missing_ok=True)

    def remember(self, key: bytes, payload: bytes) -> None:
        if self.ram_bytes < len(payload) or key in self.ram:
            return
        self.ram[key] = payload
        self.ram_used += len(payload)
        while self.ram_used > self.ram_bytes:
            _, old = self.ram.popitem(last=False)
            self.ram_used -= len(old)

    def _files(self) -> list[tuple[float, int, Path]]:
        out = []
        for sub in self.root.iterdir() if self.root.is_dir() else ():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                try:
                    st = entry.stat()
                except FileNotFoundError:  # another instance deleted it
                    continue
                out.append((st.st_mtime, st.st_size, Path(entry.path)))
        return out

    def _sweep(self) -> int:
        """Delete temporary files left by a crash (an hour old); return the bytes of the blocks stored."""
        total, now = 0, time.time()
        for mtime, size, path in self._files():
            if path.suffix == SUFFIX:
                total += size
            elif path.suffix == ".tmp" and now - mtime > STALE_TMP_SECONDS:
                path.unlink(missing_ok=True)
        return total

    def _enforce_cap(self) -> None:
        """Delete the least recently used blocks (every instance's) until the folder is at 90% of its cap."""
        files = sorted(f for f in self._files() if f[2].suffix == SUFFIX)
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total <= 0.9 * self.max_bytes:
                break
            path.unlink(missing_ok=True)
            total -= size
        self.disk_bytes = total
