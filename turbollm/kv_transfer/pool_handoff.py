"""The p2p hand-off's files: the small one a prefill instance leaves for each finished prompt, naming its pool and
blocks (`HANDOFF_MAGIC`), and the bundle that carries the blocks themselves to a decode instance on another host
(`BUNDLE_MAGIC`, built from the pool by the prefill instance's server: `bundle_of`).

Both are frames of kv_transfer/framing.py (magic, JSON header, payload, CRC-32). A hand-off's header: the model's
group keys, the tokens' count and digest, each group's table positions ("groups"), the producer's block at each
("blocks"), each layer part's layout ("layout", as the consumer's own is written), the pool ("pool": what
`shared_pool.open_pool` needs, and per group each part's offset and block bytes and the group's block count);
with a quantized format, "ring" (the ring's layout, `kv_qlo`, `ring_floor`) and the float16 ring as its payload.
A bundle's header has the same fields less "blocks" and "pool"; its payload is, group by group and part by part,
that part's blocks in position order, then the ring.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from turbollm.kv_transfer.framing import KVFrameError, decode, encode_parts
from turbollm.kv_transfer.shared_pool import PoolError, claim, finish, open_pool, part_view

HANDOFF_MAGIC = b"TLKVREF1"
BUNDLE_MAGIC = b"TLKVSEQ1"
_BUNDLE_FIELDS = ("model", "num_tokens", "tokens", "groups", "layout", "ring")


def write_frame(path: str | Path, magic: bytes, header: dict, payload) -> int:
    """Write a frame under a temporary name and rename it into place (a reader sees all of it or nothing); the
    bytes written. Raises OSError."""
    path = Path(path)
    parts = encode_parts(magic, header, memoryview(payload))
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return sum(len(p) for p in parts)


def read_handoff(path: str, name: str) -> tuple[dict, memoryview]:
    """A hand-off file's (header, ring payload); KVFrameError when it is short, corrupt or not one."""
    with open(path, "rb") as f:  # (into a writable buffer: the ring is copied from views of it)
        data = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(data)
    return decode(data, HANDOFF_MAGIC, name)


def pool_sources(header: dict) -> list[tuple[list[torch.Tensor], list[int]]]:
    """Per group: each layer part's blocks in the producer's pool (read-only uint8 [blocks, bytes] views, made once
    per pool), and the producer's block at each of the group's positions. Raises PoolError, KVFrameError."""
    try:
        ref = header["pool"]
        pool = open_pool(ref)  # (checks the producer is the one named, every time)
        key = json.dumps([ref["parts"], ref["num_blocks"]])
        views = pool.views.get(key)
        if views is None:
            views = pool.views[key] = [[part_view(pool.tensor, int(off), int(nb), int(bb)) for off, bb in parts]
                                       for parts, nb in zip(ref["parts"], ref["num_blocks"], strict=True)]
        out = []
        for g, nb in enumerate(ref["num_blocks"]):
            blocks = [int(b) for b in header["blocks"][g]]
            if len(blocks) != len(header["groups"][g]) or any(not 0 <= b < nb for b in blocks):
                raise KVFrameError(f"group {g}: its blocks do not match its positions or the pool")
            out.append((views[g], blocks))
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise KVFrameError(f"a malformed hand-off header ({type(e).__name__}: {e})") from None
    if len(out) != len(header["groups"]):
        raise KVFrameError("the hand-off's pool and positions name different groups")
    return out


def bundle_of(path: str) -> bytes | None:
    """The bundle of the hand-off at `path` (this host's prefill instance's), for a decode instance on another
    host: claimed, its blocks gathered from the pool, released. None when it is not there (not written yet, taken,
    expired) or the producer freed the blocks meanwhile; KVFrameError / PoolError when it cannot be used (the
    claim is released, so the producer frees the blocks)."""
    taking = claim(path)
    if taking is None:
        return None
    try:
        header, ring = read_handoff(taking, Path(path).name)
        pieces = []
        for parts, blocks in pool_sources(header):
            idx = torch.tensor(blocks, dtype=torch.int64)
            pieces += [p.index_select(0, idx).view(-1) for p in parts]
        pieces.append(torch.from_numpy(np.frombuffer(ring, np.uint8).copy()))
        payload = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
        bundle_header = {k: header[k] for k in _BUNDLE_FIELDS if k in header}
        data = b"".join(encode_parts(BUNDLE_MAGIC, bundle_header, memoryview(payload.numpy())))
    except BaseException:
        finish(taking)
        raise
    return data if finish(taking) else None


__all__ = ["HANDOFF_MAGIC", "BUNDLE_MAGIC", "KVFrameError", "PoolError", "write_frame", "read_handoff",
           "pool_sources", "bundle_of"]
