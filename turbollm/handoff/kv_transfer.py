"""KV transfer: the connector's config and what its two halves tell each other each step (plain data).

A KV connector moves K/V blocks between this engine and something outside it: a block store that
outlives the process (`store`), or another instance (`p2p`: prefill/decode disaggregation — a producer's
finished request leaves its prompt's K/V in its pool (in shared memory), and a consumer given the producer's
`kv_transfer_params` loads it and decodes on from the producer's first token). It has two halves, as vLLM's
`KVConnectorBase_V1`: the scheduler side (core/kv_connector.py) says which blocks of a new request's
prefix the outside holds and which newly full blocks to save; the worker side (worker/kv_connector.py)
loads and saves them around the forward pass. Their instructions ride in
`SchedulerOutput.kv_transfer` and the results come back in `ModelRunnerOutput.kv_loaded`.

A block is named by its key: the group's key (a digest of the model's salt and the group's spec:
checkpoint, quantization, kernel form, dense dtype, K/V dtype, block size, heads, window) followed by
the prefix-cache hash chained over every token up to the block's end (`core/block_pool.hash_block`).
Equal keys mean equal K/V; a block from another model, dtype or prefix has another key and is never
found, and the worker side checks the key written inside the block before using it.

    --kv-transfer-config '{"kv_connector": "store", "kv_role": "kv_both", "kv_store_path": "/var/kv"}'
    --kv-store-path /var/kv            (the same, shorter)
    --kv-transfer-config '{"kv_connector": "p2p", "kv_role": "kv_producer"}'   (prefill instance)
    --kv-transfer-config '{"kv_connector": "p2p", "kv_role": "kv_consumer"}'   (decode instance)

A request asks for the hand-off in `SamplingParams.kv_transfer_params` (vLLM's names): `{"do_remote_decode":
true}` on the producer (whose `RequestOutput.kv_transfer_params` then names the hand-off file), and those
returned params, with `"first_token"`, on the consumer.
"""

from __future__ import annotations

import difflib
import hashlib
from array import array
from dataclasses import dataclass, field, fields
from typing import Any

from turbollm.errors import InvalidRequestError, json_object

#: the connectors (each has a scheduler half in core/kv_connector.py and a worker half in worker/kv_connector.py)
KV_CONNECTORS = ("store", "p2p")
#: vLLM's roles: a producer saves the blocks it computes, a consumer loads what it finds, both do both
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_STORE_BYTES = 8 << 30
DEFAULT_STORE_RAM_BYTES = 256 << 20
DEFAULT_BUFFER_PATH = "/dev/shm/turbollm-kv"  # p2p: where a producer leaves its hand-off files


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str = "kv_both"
    # store: the folder (shared by every instance that names it), its size cap on disk (least recently
    # used blocks deleted beyond it) and the worker's in-memory tier in front of it
    kv_store_path: str | None = None
    kv_store_max_bytes: int = DEFAULT_STORE_BYTES
    kv_store_ram_bytes: int = DEFAULT_STORE_RAM_BYTES
    # p2p: the folder a producer leaves its hand-off files in, and how long a hand-off waits for its consumer (the
    # producer then frees the blocks; a claim is broken at twice this) and a consumer for its hand-off (it then
    # prefills itself)
    kv_buffer_path: str = DEFAULT_BUFFER_PATH
    kv_timeout: float = 30.0

    @property
    def saves(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def _nearest(name: str, names) -> str:
    near = difflib.get_close_matches(name, list(names), n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""


def parse_kv_transfer_config(value: Any, store_path: str | None = None) -> KVTransferConfig | None:
    """A `KVTransferConfig` from a dict, its JSON text, a config, or None; `store_path` (`--kv-store-path`)
    alone means the store connector in role kv_both. Every bad field is named."""
    if isinstance(value, KVTransferConfig):
        return value
    if value is None:
        return KVTransferConfig("store", kv_store_path=store_path) if store_path else None
    value = json_object(value, "kv_transfer_config")
    known = {f.name for f in fields(KVTransferConfig)}
    for key in value:
        if key not in known:
            raise InvalidRequestError(f"kv_transfer_config: unknown field {key!r}{_nearest(key, known)}; "
                                      f"fields: {', '.join(sorted(known))}")
    d = dict(value)
    if store_path is not None:
        d.setdefault("kv_store_path", store_path)
    connector = d.get("kv_connector")
    if connector not in KV_CONNECTORS:
        raise InvalidRequestError(f"kv_transfer_config: unknown kv_connector {connector!r}"
                                  f"{_nearest(str(connector), KV_CONNECTORS)}; "
                                  f"choose one of {', '.join(KV_CONNECTORS)}")
    role = d.get("kv_role", "kv_both")
    if role not in KV_ROLES:
        raise InvalidRequestError(f"kv_transfer_config: unknown kv_role {role!r}{_nearest(str(role), KV_ROLES)}; "
                                  f"choose one of {', '.join(KV_ROLES)}")
    t = d.get("kv_timeout", 1.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
        raise InvalidRequestError(f"kv_transfer_config: 'kv_timeout' must be a number of seconds > 0, got {t!r}")
    for name in ("kv_store_max_bytes", "kv_store_ram_bytes"):
        v = d.get(name, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InvalidRequestError(f"kv_transfer_config: {name!r} must be a byte count >= 0, got {v!r}")
    if connector == "store" and not d.get("kv_store_path"):
        raise InvalidRequestError("kv_transfer_config: the store connector needs 'kv_store_path' (or --kv-store-path)")
    return KVTransferConfig(**d)


def token_digest(tokens: list[int]) -> str:
    """What a hand-off's tokens are checked by (a consumer with other tokens refuses it)."""
    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class KVBlockRef:
    """One block of one KV-cache group, and the key its contents are known by."""

    group: int
    block: int
    key: bytes


@dataclass
class KVLoad:
    """Blocks to fill from outside before a sequence runs (the scheduler holds them for it)."""

    seq_id: int
    blocks: list[KVBlockRef]


@dataclass
class KVSend:
    """A producer's finished sequence: the K/V of its first `num_tokens` tokens, left in its pool for a consumer (the hand-off file at `path` names them)."""

    seq_id: int
    path: str
    tables: tuple[list[int], ...]  # its block table per group (NULL_BLOCK: released out of a window)
    num_tokens: int
    token_digest: str  # of those tokens: a consumer with other tokens refuses the hand-off
    ring_slot: int = -1  # a quantized format: its float16 ring of recent tokens, which travels too


@dataclass
class KVRemoteLoad:
    """A consumer's sequence: its prompt's K/V from a producer's pool (or a bundle over HTTP), into the blocks the scheduler took."""

    seq_id: int
    path: str
    positions: list[list[tuple[int, int]]]  # per group: (table position, block to fill)
    num_tokens: int
    token_digest: str
    deadline: float  # time.time() after which a hand-off still missing fails the load
    ring_slot: int = -1  # a quantized format: the ring slot the scheduler took for it, filled from the hand-off
    url: str | None = None  # the producer's server, asked for the blocks when `path` is not on this host


@dataclass
class KVTransferMeta:
    """A step's connector work, done by the worker before the forward pass: saves and sends first (a block
    saved is full and final, and read before this step writes anything: its loads and copies may reuse a block
    freed since), then loads."""

    loads: list[KVLoad] = field(default_factory=list)
    saves: list[KVBlockRef] = field(default_factory=list)
    sends: list[KVSend] = field(default_factory=list)
    remote_loads: list[KVRemoteLoad] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.sends or self.remote_loads)


@dataclass
class KVTransferStats:
    """What a worker's connector did in one step (summed by the engine into its counters)."""

    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    blocks_failed: int = 0  # a block missing, short, corrupt or of another key: its sequence recomputes
    blocks_saved: int = 0
    bytes_saved: int = 0
    save_seconds: float = 0.0  # copying the blocks out (the files are written behind the steps)
    bundles_sent: int = 0  # p2p hand-offs (the counters keep their first name)
    bundles_received: int = 0
    transfer_seconds: list[float] = field(default_factory=list)  # each sequence's load and each p2p send, in turn
