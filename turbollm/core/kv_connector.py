"""A KV connector's scheduler half: which blocks of a new sequence's prefix the outside holds, which newly full
blocks to save, which finished sequences leave their K/V for another instance and which take theirs from one
(the worker half, worker/kv_connector.py, moves the bytes).

The KV-cache manager asks `lookup` for the prefix blocks its own pools miss (`take_cached_prefix`) and calls
`block_cached` for every block it indexes in its prefix cache; the scheduler asks `remote_prefill` of every
sequence it admits and tells `request_finished` of every sequence that ends. It parks a sequence whose blocks
are being loaded until the worker says they arrived (core/scheduler_kv_transfer.py), and `take_meta` hands
the step's loads, saves and sends to the workers in `SchedulerOutput.kv_transfer`; `poll` (each schedule) and
`step_done` (each step's report) let a p2p producer free the blocks it held for a consumer. Connectors are a registry
keyed by `kv_connector` (`SCHEDULER_CONNECTORS`): the block store (`store`), prefill/decode hand-off (`p2p`).
"""

from __future__ import annotations

import bisect
import os
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

from turbollm.core.sequence import Sequence
from turbollm.errors import InvalidRequestError
from turbollm.handoff.kv_transfer import (KVBlockRef, KVLoad, KVRemoteLoad, KVSend, KVTransferConfig, KVTransferMeta,
                                          KVTransferStats, token_digest)
from turbollm.handoff.scheduler_output import NULL_BLOCK
from turbollm.kv_transfer.block_store import BlockStore, BlockStoreError
from turbollm.kv_transfer.shared_pool import EXPIRED, TAKING, claim, finish
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
    "kv_blocks_held": "Blocks a prefill instance holds now for decode instances still to copy them (p2p; a gauge).",
    "kv_bundles_received": "Prompts whose K/V came from a prefill instance (p2p).",
    "kv_remote_fallbacks": "Requests a decode instance prefilled itself: the hand-off missing, late, corrupt or "
                           "of another model, dtype or prompt (p2p).",
    "kv_handoffs_expired": "Hand-offs no decode instance took within kv_timeout: their held blocks freed (p2p).",
}

#: counters above that are gauges (a value now, not a running total)
GAUGES = ("kv_blocks_held",)
#: each transfer's seconds (a sequence's load, a p2p send), as a histogram: counts per bucket (upper bounds; the
#: last count is above them all) and the sum
TRANSFER_HISTOGRAM = "kv_transfer_seconds"
TRANSFER_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


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
        self.stats[TRANSFER_HISTOGRAM] = {"counts": [0] * (len(TRANSFER_BUCKETS) + 1), "sum": 0.0}

    def attach(self, pools: list, block_size: int) -> None:
        """The KV-cache manager's block pools, one per group (a p2p producer holds blocks in them)."""
        self.pools, self.block_size = pools, block_size

    def poll(self) -> None:
        """At the start of each schedule: finish what the outside finished (a p2p producer frees the blocks a
        consumer has copied)."""

    @property
    def holding(self) -> bool:
        """Blocks are held for the outside (a p2p producer's hand-offs not yet taken): `poll` has work even while no
        request runs."""
        return False

    @property
    def busy(self) -> bool:
        """Work for the workers is waiting (the engine runs a step for it even with no request left)."""
        return bool(self.loads or self.saves or self.sends or self.remote_loads)

    def remote_prefill(self, seq: Sequence) -> tuple[str, int, float, str | None] | None:
        """(hand-off file, tokens it holds, deadline, the producer's server) when `seq`'s prompt K/V come from a producer;
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
        """A consumer's hand-off that will not be read (its request ended or fell back): release it."""

    def load(self, seq_id: int, blocks: list[KVBlockRef], tokens: int) -> None:
        self.loads.append(KVLoad(seq_id, blocks))
        self.stats["kv_external_hit_tokens"] += tokens

    def take_meta(self) -> KVTransferMeta:
        """The loads, saves and sends gathered since the last step, for the workers."""
        meta = KVTransferMeta(self.loads, self.saves, self.sends, self.remote_loads)
        self.loads, self.saves, self.sends, self.remote_loads = [], [], [], []
        return meta

    def step_done(self, meta: KVTransferMeta) -> None:
        """The workers have done `meta` (the step that carried it reported back)."""

    def snapshot(self) -> dict:
        """The counters now (a copy: the histogram too)."""
        hist = self.stats[TRANSFER_HISTOGRAM]
        return {**self.stats, TRANSFER_HISTOGRAM: {"counts": list(hist["counts"]), "sum": hist["sum"]}}

    def observe(self, stats: KVTransferStats | None, failed_loads: int) -> None:
        """Fold a step's worker report into the counters (and each transfer's time into the histogram)."""
        self.stats["kv_load_failures"] += failed_loads
        if stats is not None:
            for k, v in asdict(stats).items():
                if k == "transfer_seconds":
                    hist = self.stats[TRANSFER_HISTOGRAM]
                    for t in v:
                        hist["counts"][bisect.bisect_left(TRANSFER_BUCKETS, t)] += 1
                        hist["sum"] += t
                else:
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


@dataclass
class _Hold:
    """A producer's finished prompt whose blocks wait for a consumer to copy them."""

    path: str
    tables: list[list[int]]  # per group, the blocks held (one reference each)
    deadline: float
    written: bool = False  # the step that carried its send has run: its hand-off file is written (or failed)


class P2PScheduler(KVConnectorScheduler):
    """Prefill/decode disaggregation. A producer's request asking `do_remote_decode` leaves, when it finishes,
    its K/V for a consumer: the scheduler keeps a reference on each of its blocks, the worker writes the hand-off
    file naming them into this engine's folder under `kv_buffer_path` at the start of the next step, and the
    request's output names that file (`kv_transfer_params`). A consumer's request carrying those params takes
    fresh blocks for its prompt and copies them from this engine's pool (core/scheduler_kv_transfer.py,
    worker/kv_p2p.py); a hand-off missing past `kv_timeout`, corrupt, or of another model, dtype or prompt makes
    it prefill itself. Each schedule (`poll`) frees the blocks of hand-offs a consumer has taken, and of those
    none took within `kv_timeout` (kv_transfer/shared_pool.py has the claim protocol)."""

    def __init__(self, config: KVTransferConfig):
        super().__init__(config)
        self.engine_id = uuid.uuid4().hex[:12]
        self.folder = Path(config.kv_buffer_path) / self.engine_id
        self.holds: list[_Hold] = []
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
        nb = -(-n // self.block_size)
        tables = [[b for b in t[:nb] if b != NULL_BLOCK] for t in seq.block_tables]
        for pool, table in zip(self.pools, tables):
            for b in table:
                pool.touch(b)
        self.holds.append(_Hold(path, tables, time.time() + self.config.kv_timeout))
        self.stats["kv_blocks_held"] += sum(map(len, tables))
        self.sends.append(KVSend(seq.seq_id, path, tuple(list(t) for t in seq.block_tables), n,
                                 token_digest(seq.token_slice(0, n)), ring_slot))
        seq.kv_transfer_out = {"do_remote_prefill": True, "remote_engine_id": self.engine_id, "remote_bundle": path,
                               "remote_num_tokens": n}

    @property
    def holding(self) -> bool:
        return bool(self.holds)

    def step_done(self, meta: KVTransferMeta) -> None:
        sent = {s.path for s in meta.sends}
        for h in self.holds:
            h.written = h.written or h.path in sent

    def poll(self) -> None:
        if not self.holds:
            return
        now, kept = time.time(), []
        for h in self.holds:
            if h.written and self._settled(h, now):
                for pool, table in zip(self.pools, h.tables):
                    pool.release(table)
                self.stats["kv_blocks_held"] -= sum(map(len, h.tables))
            else:
                kept.append(h)
        self.holds = kept

    def _settled(self, h: _Hold, now: float) -> bool:
        """Whether hold `h` is over: its file taken and released, or expired (renamed so that no consumer takes it
        after), or claimed by a consumer that has not released it long past the deadline (deleted: that consumer
        will see it and not use what it copied)."""
        taking = h.path + TAKING
        if os.path.exists(h.path):
            if now < h.deadline:
                return False
            try:
                os.rename(h.path, h.path + EXPIRED)
            except FileNotFoundError:  # claimed just now
                return False
            Path(h.path + EXPIRED).unlink(missing_ok=True)
            self.stats["kv_handoffs_expired"] += 1
            return True
        if os.path.exists(taking):
            if now < h.deadline + self.config.kv_timeout:
                return False
            Path(taking).unlink(missing_ok=True)
            self.stats["kv_handoffs_expired"] += 1
        return True

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
        """A consumer's hand-off that will not be read (its request ended or fell back): claim and release it, so
        that its producer frees the blocks now."""
        taking = claim(path)
        if taking is not None:
            finish(taking)


#: kv_connector -> its scheduler half
SCHEDULER_CONNECTORS: dict[str, type[KVConnectorScheduler]] = {"store": StoreScheduler, "p2p": P2PScheduler}


def make_scheduler_connector(config: KVTransferConfig | None) -> KVConnectorScheduler | None:
    return SCHEDULER_CONNECTORS[config.kv_connector](config) if config is not None else None
