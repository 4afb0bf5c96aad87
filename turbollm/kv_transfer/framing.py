"""The frame every KV file shares: magic | header length (u32) | JSON header | payload | CRC-32 (u32).

The CRC covers the header and the payload; the header says the payload's length, so a file cut short or
grown is caught before its CRC is even read. `decode` raises `KVFrameError` with what is wrong; callers
check the header's fields (a block store block: its key and layout; a p2p hand-off or bundle: its model's keys,
its tokens and positions).
"""

from __future__ import annotations

import json
import struct
import zlib

_HEAD = struct.Struct("<8sI")
_CRC = struct.Struct("<I")


class KVFrameError(Exception):
    """A KV file that cannot be used (short, corrupt, or written for something else)."""


def encode(magic: bytes, header: dict, payload: bytes | memoryview) -> bytes:
    return b"".join(encode_parts(magic, header, payload))


def encode_parts(magic: bytes, header: dict, payload: bytes | memoryview) -> list:
    """The frame as pieces to write one after the other (the payload not copied)."""
    head = json.dumps({**header, "payload": len(payload)}).encode()
    crc = zlib.crc32(payload, zlib.crc32(head))
    return [_HEAD.pack(magic, len(head)) + head, payload, _CRC.pack(crc)]


def decode(data: bytes, magic: bytes, name: str = "file") -> tuple[dict, memoryview]:
    """(header, payload) of a frame; raises KVFrameError naming `name` and the defect."""
    if len(data) < _HEAD.size + _CRC.size:
        raise KVFrameError(f"{name}: short file ({len(data)} bytes)")
    got, hlen = _HEAD.unpack_from(data)
    if got != magic:
        raise KVFrameError(f"{name}: not a {magic.decode(errors='replace')} file")
    end = _HEAD.size + hlen
    if end + _CRC.size > len(data):
        raise KVFrameError(f"{name}: short file ({len(data)} bytes)")
    head = memoryview(data)[_HEAD.size:end]
    try:
        header = json.loads(bytes(head))
    except ValueError:
        raise KVFrameError(f"{name}: corrupt header") from None
    n = header.get("payload") if isinstance(header, dict) else None
    if not isinstance(n, int) or end + n + _CRC.size != len(data):
        raise KVFrameError(f"{name}: short or overlong file")
    payload = memoryview(data)[end:end + n]
    (crc,) = _CRC.unpack_from(data, end + n)
    if zlib.crc32(payload, zlib.crc32(head)) != crc:
        raise KVFrameError(f"{name}: checksum mismatch")
    return header, payload
