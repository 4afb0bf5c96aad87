"""A KV connector's scheduler half: which blocks of a new sequence's prefix the outside holds, and which
newly full blocks to save (the worker half, worker/kv_connector.py, moves the bytes).

The KV-cache manager asks `lookup` for the prefix blocks its own pools miss (`take_cached_prefix`) and
calls `block_cached` for every block it indexes in its prefix cache; the scheduler parks a sequence
whose blocks are being loaded until the worker says they arrived (core/scheduler_kv_transfer.py), and
`take_meta` hands the step's loads and saves to the workers in `SchedulerOutput.kv_transfer`.
Connectors are a registry keyed by `kv_connector` (`SCHEDULER_CONNECTORS`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict

from turbollm.handoff.kv_transfer import KVBlockRef, KVLoad, KVTransferConfig, KVTransferMeta, KVTransferStats
from turbollm.kv_transfer.block_store import BlockStore, BlockStoreError
from turbollm.errors import InvalidRequestError

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
}


class KVConnectorScheduler:
    """The scheduler half every connector has; counters in `stats` (tokens, blocks, bytes, seconds)."""

    def __init__(self, config: KVTransferConfig, block_size: int):
        self.config, self.block_size = config, block_size
        self.loads: list[KVLoad] = []
        self.saves: list[KVBlockRef] = []
        self.stats = dict.fromkeys(STAT_DOCS, 0)

    def lookup(self, keys: list[bytes]) -> list[bool]:
        """Which of these block keys the outside holds (asked only for blocks the pools miss)."""
        raise NotImplementedError

    def block_cached(self, group: int, block: int, key: bytes) -> None:
        """A block just became full and entered the prefix cache under `key` (a producer may save it)."""

    def load_failed(self, blocks: list[KVBlockRef]) -> None:
        """A load of these blocks failed: they are recomputed (and a producer saves them again)."""

    def load(self, seq_id: int, blocks: list[KVBlockRef], tokens: int) -> None:
        self.loads.append(KVLoad(seq_id, blocks))
        self.stats["kv_external_hit_tokens"] += tokens

    def take_meta(self) -> KVTransferMeta:
        """The loads and saves gathered since the last step, for the workers."""
        meta = KVTransferMeta(self.loads, self.saves)
        self.loads, self.saves = [], []
        return meta

    def observe(self, stats: KVTransferStats | None, failed_loads: int) -> None:
        """Fold a step's worker report into the counters."""
        self.stats["kv_load_failures"] += failed_loads
        if stats is not None:
            for k, v in asdict(stats).items():
                self.stats[f"kv_{k}"] += v


class StoreScheduler(KVConnectorScheduler):
    """The block store's scheduler half: a block is there when its file is (or this engine saved it)."""

    def __init__(self, config: KVTransferConfig, block_size: int):
        super().__init__(config, block_size)
        try:  # (the scheduler only looks: no memory tier here)
            self.store = BlockStore(config.kv_store_path, config.kv_store_max_bytes)
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


#: kv_connector -> its scheduler half
SCHEDULER_CONNECTORS: dict[str, type[KVConnectorScheduler]] = {"store": StoreScheduler}


def make_scheduler_connector(config: KVTransferConfig | None, block_size: int) -> KVConnectorScheduler | None:
    return SCHEDULER_CONNECTORS[config.kv_connector](config, block_size) if config is not None else None
