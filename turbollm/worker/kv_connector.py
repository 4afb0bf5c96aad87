"""A KV connector's worker half: the step's saves and loads, done before the forward pass.

A block of a group is its bytes in every layer of the group this worker holds: K, V and, for a
quantized format, their scales (`LayerKVCache`), concatenated in layer order. Saves come first: a
block saved is full and final, and this step's loads and copies may reuse a block freed since the
scheduler asked. A load writes every block of a sequence or reports the sequence failed
(`ModelRunnerOutput.kv_loaded`, which the worker fills from `execute`): the scheduler then frees those blocks unindexed, so a block that
arrived short, corrupt or written for another key or layout is never read.

The block store's half copies each block out in the step (the only part on the step's path) and
writes the files on a thread of its own; `close` (at shutdown, and at exit) waits for the writes.
Connectors are a registry keyed by `kv_connector` (`WORKER_CONNECTORS`).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time

import torch

from turbollm.attention.kv_storage import LayerKVCache
from turbollm.handoff.kv_transfer import KVBlockRef, KVTransferConfig, KVTransferMeta, KVTransferStats
from turbollm.kv_transfer.block_store import BlockStore, BlockStoreError
from turbollm.log import init_logger

logger = init_logger()
_PARTS = ("k", "v", "k_scale", "v_scale")


class KVConnectorWorker:
    """The worker half every connector has: it knows each group's layers and what one block of them is."""

    def __init__(self, config: KVTransferConfig, kv_caches: list[LayerKVCache | None], layer_groups: list[int]):
        self.config = config
        self.parts: dict[int, list[torch.Tensor]] = {}  # group -> every storage tensor of its layers, in order
        self.layouts: dict[int, list] = {}  # group -> [layer, part, dtype, shape of one block] of each
        for layer, (cache, g) in enumerate(zip(kv_caches, layer_groups)):
            if cache is None:  # (another pipeline stage's layer)
                continue
            for name in _PARTS:
                t = getattr(cache, name)
                if t is not None:
                    self.parts.setdefault(g, []).append(t)
                    self.layouts.setdefault(g, []).append([layer, name, str(t.dtype).removeprefix("torch."),
                                                           list(t.shape[1:])])

    def block_bytes(self, ref: KVBlockRef) -> bytes:
        """Block `ref.block` of its group, every layer's parts, as one byte string."""
        return b"".join(t[ref.block].contiguous().view(torch.uint8).numpy().tobytes() for t in self.parts[ref.group])

    def write_block(self, ref: KVBlockRef, payload: bytes) -> None:
        """Fill block `ref.block` of its group from `block_bytes`' form (the caller checked its length)."""
        src = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        at = 0
        for t in self.parts[ref.group]:
            dst = t[ref.block].view(-1).view(torch.uint8)
            dst.copy_(src[at:at + dst.numel()])
            at += dst.numel()

    def payload_size(self, group: int) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.parts[group])

    def execute(self, meta: KVTransferMeta) -> tuple[dict[int, bool], KVTransferStats]:
        """Do a step's saves, then its loads: (seq_id -> whether all its blocks loaded whole, what was moved)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class StoreWorker(KVConnectorWorker):
    """The block store's worker half: loads from the memory tier or the files, saves through a writer thread."""

    def __init__(self, config: KVTransferConfig, kv_caches, layer_groups):
        super().__init__(config, kv_caches, layer_groups)
        self.store = BlockStore(config.kv_store_path, config.kv_store_max_bytes, config.kv_store_ram_bytes)
        self.pending: queue.Queue = queue.Queue()
        self.writer = threading.Thread(target=self._write_loop, name="kv-store-writer", daemon=True)
        self.writer.start()
        atexit.register(self.close)

    def execute(self, meta: KVTransferMeta) -> tuple[dict[int, bool], KVTransferStats]:
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
            ok = True
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
        stats.load_seconds = time.perf_counter() - t1
        return loaded, stats

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
WORKER_CONNECTORS: dict[str, type[KVConnectorWorker]] = {"store": StoreWorker}


def make_worker_connector(config: KVTransferConfig | None, kv_caches, layer_groups) -> KVConnectorWorker | None:
    return WORKER_CONNECTORS[config.kv_connector](config, kv_caches, layer_groups) if config is not None else None
