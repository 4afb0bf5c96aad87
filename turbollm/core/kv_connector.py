"""A KV connector's scheduler half: which blocks of a new sequence's prefix the outside holds, which newly full
blocks to save, which finished sequences leave their K/V for another instance and which take theirs from one
(the worker half, worker/kv_connector.py, moves the bytes).

The KV-cache manager asks `lookup` for the prefix blocks its own pools miss (`take_cached_prefix`) and calls
`block_cached` for every block it indexes in its prefix cache; the scheduler asks `remote_prefill` of every
sequence it admits and tells `request_finished` of every sequence that ends. It parks a sequence whose blocks
are being loaded until the worker says they arrived (core/scheduler_kv_transfer.py), and `take_meta` hands
the step's loads, saves and sends to the workers in `SchedulerOutput.kv_transfer`. Connectors are a registry
keyed by `kv_connector` (`SCHEDULER_CONNECTORS`): the block store (`store`), prefill/decode hand-off (`p2p`).
"""

from __future__ import annotations

import os
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path

from turbollm.core.sequence import Sequence
from turbollm.errors import InvalidRequestError
from turbollm.handoff.kv_transfer import (KVBlockRef, KVLoad, KVRemoteLoad, KVSend, KVTransferConfig, KVTransferMeta,
                                          KVTransferStats, token_digest)
from turbollm.kv_transfer.block_store import BlockStore, BlockStoreError
from turbollm.log import init_logger

logger = init_logger()

KNOWN_KEYS = 1 << 20  # keys remembered as stored (a save skipped for each), least recently seen forgotten

#: the counters every connector keeps (`LLMEngine.stats()`, the server's /metrics), with what each counts
STAT_DOCS = {
    "kv_external_queries": "Prefix blocks the prefix cache missed and the KV connector was asked for.",
    "kv_external_hit_tokens": "Prompt tokens whose K/V the KV connector held (loaded instead of computed).",
    "kv_load_failures": "Sequences whose KV load failed (a block missing, short or corrupt): prefilled locally.",
    "kv_blocks_loaded": "KV blocks loaded through the KV connector.",
    "kv_bytes_loaded": "Bytes of KV blocks loaded through the KV connector.",
    "kv_load_seconds": "Seconds the workers spent loading KV blocks.",
    "kv_blocks_failed": "KV blocks that arrived missing, short, corrupt or for another key (recomputed).",
    "kv_blocks_saved": "KV blocks handed to the KV connector to save.",
    "kv_bytes_saved": "Bytes of KV blocks handed to the KV connector to save.",
    "kv_save_seconds": "Seconds the workers spent copying KV blocks out to save (files are written behind).",
    "kv_bundles_sent": "Finished prefills whose K/V were left for a decode instance (p2p).",
    "kv_bundles_received": "Prompts whose K/V came from a prefill instance (p2p).",
    "kv_remote_fallbacks": "Requests a decode instance prefilled itself: the bundle missing, late, corrupt or "
                           "of another model, dtype or prompt (p2p).",
}


class KVConnectorScheduler:
    """The scheduler half every connector has; counters in `stats` (tokens, blocks, bytes, seconds)."""

    looks_up_prefixes = False  # whether `lookup` can find prefix blocks (the block store)

    def __init__(self, config: KVTransferConfig):
        self.config = config
        self.loads: list[KVLoad] = []
        self.saves: list[KVBlockRef] = []
        self.sends: list[KVSend] = []
        self.remote_loads: list[KVRemoteLoad] = []
        self.stats = dict.fromkeys(STAT_DOCS, 0)

    @property
    def busy(self) -> bool:
        """Work for the workers is waiting (the engine runs a step for it even with no request left)."""
        return bool(self.loads or self.saves or self.sends or self.remote_loads)

    def remote_prefill(self, seq: Sequence) -> tuple[str, int, float, str | None] | None:
        """(bundle, tokens it holds, deadline, the producer's server) when `seq`'s prompt K/V come from a producer;
        None otherwise."""
        return None

    def request_finished(self, seq: Sequence, ring_slot: int = -1) -> None:
        """`seq` finished (its blocks, and a quantized format's ring slot, are still its own): a producer leaves its
        K/V for a consumer."""

    def lookup(self, keys: list[bytes]) -> list[bool]:
        """Which of these block keys the outside holds (asked only for blocks the pools miss)."""
        return [False] * len(keys)

    def block_cached(self, group: int, block: int, key: bytes) -> None:
        """A block just became full and entered the prefix cache under `key` (a producer may save it)."""

    def load_failed(self, blocks: list[KVBlockRef]) -> None:
        """A load of these blocks failed: they are recomputed (and a producer saves them again)."""

    def forget_bundle(self, path: str) -> None:
        """A consumer's bundle that will not be read (its request ended or fell back): drop it."""

    def load(self, seq_id: int, blocks: list[KVBlockRef], tokens: int) -> None:
        self.loads.append(KVLoad(seq_id, blocks))
        self.stats["kv_external_hit_tokens"] += tokens

    def take_meta(self) -> KVTransferMeta:
        """The loads, saves and sends gathered since the last step, for the workers."""
        meta = KVTransferMeta(self.loads, self.saves, self.sends, self.remote_loads)
        self.loads, self.saves, self.sends, self.remote_loads = [], [], [], []
        return meta

    def observe(self, stats: KVTransferStats | None, failed_loads: int) -> None:
        """Fold a step's worker report into the counters."""
        self.stats["kv_load_failures"] += failed_loads
        if stats is not None:
            for k, v in asdict(stats).items():
                self.stats[f"kv_{k}"] += v


class StoreScheduler(KVConnectorScheduler):
    """The block store's scheduler half: a block is there when its file is (or this engine saved it)."""

    looks_up_prefixes = True

    def __init__(self, config: KVTransferConfig):
        super().__init__(config)
        try:  # (the scheduler only looks: no memory tier, and the folder is not walked — the worker's store does)
            self.store = BlockStore(config.kv_store_path, config.kv_store_max_bytes, scan=False)
        except BlockStoreError as e:
            raise InvalidRequestError(str(e)) from None
        self.known: OrderedDict[bytes, None] = OrderedDict()

    def _know(self, key: bytes) -> None:
        self.known[key] = None
        self.known.move_to_end(key)
        if len(self.known) > KNOWN_KEYS:
            self.known.popitem(last=False)

    def lookup(self, keys: list[bytes]) -> list[bool]:
        if not self.config.loads:
            return [False] * len(keys)
        self.stats["kv_external_queries"] += len(keys)
        found = [self.store.contains(k) for k in keys]
        for k, f in zip(keys, found):
            if f:
                self._know(k)
        return found

    def load_failed(self, blocks: list[KVBlockRef]) -> None:
        for ref in blocks:  # (the worker deleted the bad files; the good ones stay, and their writes are skipped)
            self.known.pop(ref.key, None)

    def block_cached(self, group: int, block: int, key: bytes) -> None:
        if not self.config.saves:
            return
        if key in self.known:
            self.known.move_to_end(key)
            return
        self._know(key)  # (a file another instance wrote meanwhile is left alone by the worker's write)
        self.saves.append(KVBlockRef(group, block, key))


class P2PScheduler(KVConnectorScheduler):
    """Prefill/decode disaggregation. A producer's request asking `do_remote_decode` leaves, when it finishes,
    its K/V for a consumer: the worker writes them as one bundle into this engine's folder under
    `kv_buffer_path` (shared memory on one host) at the start of the next step, before anything can reuse the
    blocks, and the request's output names the bundle (`kv_transfer_params`). A consumer's request carrying
    those params takes fresh blocks for its prompt and loads them (core/scheduler_kv_transfer.py); a bundle
    missing past `kv_timeout`, corrupt, or of another model, dtype or prompt makes it prefill itself."""

    def __init__(self, config: KVTransferConfig):
        super().__init__(config)
        self.engine_id = uuid.uuid4().hex[:12]
        self.folder = Path(config.kv_buffer_path) / self.engine_id
        if config.saves:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise InvalidRequestError(f"kv_buffer_path {config.kv_buffer_path!r} is not a writable folder: "
                                          f"{e.strerror or e}") from None

    def request_finished(self, seq: Sequence, ring_slot: int = -1) -> None:
        p = seq.params.kv_transfer_params
        if not (self.config.saves and p and p.get("do_remote_decode")):
            return
        if seq.finish_reason not in ("length", "stop") or not seq.block_tables or not seq.num_computed_tokens:
            return
        n = seq.num_computed_tokens
        path = str(self.folder / f"{uuid.uuid4().hex}.kvs")
        self.sends.append(KVSend(seq.seq_id, path, tuple(list(t) for t in seq.block_tables), n,
                                 token_digest(seq.token_slice(0, n)), ring_slot))
        seq.kv_transfer_out = {"do_remote_prefill": True, "remote_engine_id": self.engine_id, "remote_bundle": path,
                               "remote_num_tokens": n}

    def remote_prefill(self, seq: Sequence) -> tuple[str, int, float, str | None] | None:
        p = seq.params.kv_transfer_params
        if not (self.config.loads and p and p.get("do_remote_prefill")):
            return None
        path, n = p.get("remote_bundle"), p.get("remote_num_tokens")
        if not isinstance(path, str) or not isinstance(n, int):
            logger.warning("kv p2p: request %s: kv_transfer_params without remote_bundle / remote_num_tokens; "
                           "prefilled here", seq.request_id)
            return None
        url = p.get("remote_url")
        return path, n, time.time() + self.config.kv_timeout, url if isinstance(url, str) else None

    def forget_bundle(self, path: str) -> None:
        """A consumer's bundle that will not be read (its request ended or fell back): drop it."""
        try:
            os.unlink(path)
        except OSError:
            pass


#: kv_connector -> its scheduler half
SCHEDULER_CONNECTORS: dict[str, type[KVConnectorScheduler]] = {"store": StoreScheduler, "p2p": P2PScheduler}


def make_scheduler_connector(config: KVTransferConfig | None) -> KVConnectorScheduler | None:
    return SCHEDULER_CONNECTORS[config.kv_connector](config) if config is not None else None
