"""A KV connector's worker half: the step's saves, sends and loads, done before the forward pass.

A block of a group is its bytes in every layer of the group this worker holds: K, V and, for a
quantized format, their scales (`LayerKVCache`), concatenated in layer order. Saves and sends come
first: a block saved is full and final, and this step's loads and copies may reuse a block freed since
the scheduler asked. A load writes every block of a sequence or reports the sequence failed (`execute`
returns it; the worker puts it in `ModelRunnerOutput.kv_loaded`): the scheduler then frees those blocks
unindexed, so a block that arrived short, corrupt or written for another key or layout is never read.

The block store's half (`StoreWorker`) copies each block out in the step (the only part on the step's
path) and writes the files on a thread of its own; `close` (at shutdown, and at exit) waits for the
writes. The prefill/decode half (`P2PWorker`, worker/kv_p2p.py) leaves a finished prompt's blocks in its pool
for a decode instance and copies them from there. Connectors are a registry keyed by `kv_connector`
(`WORKER_CONNECTORS`).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time

from turbollm.handoff.kv_cache_spec import KVCacheConfig
from turbollm.handoff.kv_transfer import KVBlockRef, KVTransferConfig, KVTransferMeta, KVTransferStats
from turbollm.kv_transfer.block_store import BlockStore, BlockStoreError
from turbollm.log import init_logger
from turbollm.worker.kv_connector_base import KVConnectorWorker
from turbollm.worker.kv_p2p import P2PWorker

logger = init_logger()


class StoreWorker(KVConnectorWorker):
    """The block store's worker half: loads from the memory tier or the files, saves through a writer thread."""

    def __init__(self, config: KVTransferConfig, kv_caches, layer_groups, kv_config, runner=None):
        super().__init__(config, kv_caches, layer_groups, kv_config, runner)
        self.store = BlockStore(config.kv_store_path, config.kv_store_max_bytes, config.kv_store_ram_bytes)
        self.pending: queue.Queue = queue.Queue()
        self.writer = threading.Thread(target=self._write_loop, name="kv-store-writer", daemon=True)
        self.writer.start()
        atexit.register(self.close)

    def execute(self, meta: KVTransferMeta) -> tuple[dict[int, bool], list[int], KVTransferStats]:
        stats, loaded = KVTransferStats(), {}
        t0 = time.perf_counter()
        for ref in meta.saves:  # copied out now, written behind the steps
            payload = self.block_bytes(ref)
            self.store.remember(ref.key, payload)
            self.pending.put((ref.key, self.layouts[ref.group], payload))
            stats.blocks_saved += 1
            stats.bytes_saved += len(payload)
        t1 = time.perf_counter()
        stats.save_seconds = t1 - t0
        for load in meta.loads:
            ok, start = True, time.perf_counter()
            for ref in load.blocks:  # (after a failure the rest are still read: every bad file is found and dropped)
                payload = self._read(ref)
                if payload is None:
                    ok = False
                    stats.blocks_failed += 1
                elif ok:
                    self.write_block(ref, payload)
                    stats.blocks_loaded += 1
                    stats.bytes_loaded += len(payload)
            loaded[load.seq_id] = ok
            stats.transfer_seconds.append(time.perf_counter() - start)
        stats.load_seconds = time.perf_counter() - t1
        return loaded, [], stats

    def _read(self, ref: KVBlockRef) -> bytes | None:
        try:
            payload = self.store.get(ref.key, self.layouts[ref.group])
        except BlockStoreError as e:
            logger.warning("kv store: %s; the block is dropped and recomputed", e)
            self.store.discard(ref.key)
            return None
        if payload is not None and len(payload) != self.payload_size(ref.group):
            logger.warning("kv store: block %s holds %d bytes, not %d; recomputed", ref.key.hex(), len(payload),
                           self.payload_size(ref.group))
            self.store.discard(ref.key)
            return None
        return payload

    def _write_loop(self) -> None:
        while True:
            item = self.pending.get()
            try:
                if item is None:
                    return
                self.store.write(*item)
            except OSError as e:  # a full or vanished disk costs the block, never the step
                logger.warning("kv store: writing a block failed: %s", e)
            finally:
                self.pending.task_done()

    def flush(self) -> None:
        """Wait until every block handed to the writer is in its file."""
        if self.writer.is_alive():
            self.pending.join()

    def close(self) -> None:
        if self.writer.is_alive():
            self.pending.put(None)
            self.writer.join()


#: kv_connector -> its worker half
WORKER_CONNECTORS: dict[str, type[KVConnectorWorker]] = {"store": StoreWorker, "p2p": P2PWorker}


def connector_shares_pool(config: KVTransferConfig | None) -> bool:
    """Whether this connector wants the worker's K/V pool in shared memory (a p2p producer's)."""
    return config is not None and WORKER_CONNECTORS[config.kv_connector].shares_pool(config)


def make_worker_connector(config: KVTransferConfig | None, kv_caches, layer_groups, kv_config: KVCacheConfig,
                          runner=None, arena=None) -> KVConnectorWorker | None:
    """The worker half of `config`'s connector; `arena`: the pool's shared-memory file, when it wanted one."""
    if config is None:
        return None
    cls = WORKER_CONNECTORS[config.kv_connector]
    return cls(config, kv_caches, layer_groups, kv_config, runner, arena) if cls.shares_pool(config) else \
        cls(config, kv_caches, layer_groups, kv_config, runner)
