"""A KV connector's worker half: the step's saves, sends and loads, done before the forward pass.

A block of a group is its bytes in every layer of the group this worker holds: K, V and, for a
quantized format, their scales (`LayerKVCache`), concatenated in layer order. Saves and sends come
first: a block saved is full and final, and this step's loads and copies may reuse a block freed since
the scheduler asked. A load writes every block of a sequence or reports the sequence failed (`execute`
returns it; the worker puts it in `ModelRunnerOutput.kv_loaded`): the scheduler then frees those blocks
unindexed, so a block that arrived short, corrupt or written for another key or layout is never read.

The block store's half (`StoreWorker`) copies each block out in the step (the only part on the step's
path) and writes the files on a thread of its own; `close` (at shutdown, and at exit) waits for the
writes. The prefill/decode half (`P2PWorker`) writes and reads whole sequences' bundles. Connectors are a
registry keyed by `kv_connector` (`WORKER_CONNECTORS`).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np
import torch

from turbollm.attention.kv_storage import LayerKVCache
from turbollm.handoff.kv_cache_spec import KVCacheConfig
from turbollm.handoff.kv_transfer import (KVBlockRef, KVRemoteLoad, KVSend, KVTransferConfig, KVTransferMeta,
                                          KVTransferStats)
from turbollm.handoff.scheduler_output import NULL_BLOCK
from turbollm.kv_transfer.block_store import BlockStore, BlockStoreError
from turbollm.kv_transfer.framing import KVFrameError, decode, encode_parts
from turbollm.log import init_logger

logger = init_logger()
_PARTS = ("k", "v", "k_scale", "v_scale")


class KVConnectorWorker:
    """The worker half every connector has: it knows each group's layers and what one block of them is."""

    def __init__(self, config: KVTransferConfig, kv_caches: list[LayerKVCache | None], layer_groups: list[int],
                 kv_config: KVCacheConfig, runner=None):
        self.config, self.block_size = config, kv_config.block_size
        self.runner = runner  # the model runner: its sequences' ring bounds (a quantized format's hand-off)
        # each group's key: the model's salt and the group's spec (what a block's K/V depend on besides its tokens)
        self.group_keys = [hashlib.blake2b(kv_config.salt(g), digest_size=8).hexdigest()
                           for g in range(len(kv_config.groups))]
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
        out = np.empty(self.payload_size(ref.group), np.uint8)
        self.copy_out(ref.group, ref.block, out)
        return out.tobytes()

    def copy_out(self, group: int, block: int, out: np.ndarray) -> None:
        """Block `block` of `group`, every layer's parts in order, into `out` (bytes, `payload_size` long)."""
        at = 0
        for t in self.parts[group]:
            src = t[block].view(-1).view(torch.uint8).numpy()
            out[at:at + src.size] = src
            at += src.size

    def write_block(self, ref: KVBlockRef, payload) -> None:
        """Fill block `ref.block` of its group from `block_bytes`' form (bytes or a memoryview; the caller checked
        its length)."""
        src = np.frombuffer(payload, np.uint8)
        at = 0
        for t in self.parts[ref.group]:
            dst = t[ref.block].view(-1).view(torch.uint8).numpy()
            dst[:] = src[at:at + dst.size]
            at += dst.size

    def payload_size(self, group: int) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.parts[group])

    def execute(self, meta: KVTransferMeta) -> tuple[dict[int, bool], list[int], KVTransferStats]:
        """Do a step's saves and sends, then its loads: (seq_id -> whether all its blocks loaded whole, the
        sequences whose blocks are not there yet, what was moved)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


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


BUNDLE_MAGIC = b"TLKVSEQ1"


class P2PWorker(KVConnectorWorker):
    """Prefill/decode disaggregation's worker half. A send writes one bundle (the frame of
    kv_transfer/framing.py, magic b"TLKVSEQ1"): the header names the model's group keys, the tokens' digest and
    count, each group's table positions and layout; the payload is, group by group and layer part by layer part
    (K, V of each layer), that part's blocks in position order — one gather on the producer and one scatter on
    the consumer per part; a quantized format's ring slot and bounds follow. It is written under a temporary
    name and renamed into place. A remote load reads the bundle (not there yet: the sequence waits another step,
    until its deadline; not on this host: from the producer's server), checks every field against this engine
    and the request, copies the blocks it needs into the blocks the scheduler took, and deletes the bundle (the
    producer's sweep deletes bundles no consumer took within `kv_timeout`)."""

    def __init__(self, config: KVTransferConfig, kv_caches, layer_groups, kv_config, runner=None):
        super().__init__(config, kv_caches, layer_groups, kv_config, runner)
        # a quantized format's rings (float16 blocks of each sequence's newest tokens, a view of the pool), per layer
        self.rings = [(layer, c) for layer, c in enumerate(kv_caches) if c is not None and c.k_recent is not None]
        self.ring_layout = [[layer, str(c.k_recent.dtype).removeprefix("torch."), c.layout.ring_blocks,
                             list(c.k_recent.shape[1:])] for layer, c in self.rings]
        # kept from bundle to bundle: a fresh buffer's first touch costs a page fault per 4 KiB, which on a
        # virtual machine can cost more than the copy itself
        self.out_buf = np.empty(0, np.uint8)
        self.in_buf = bytearray()

    def _buffer(self, name: str, n: int):
        buf = getattr(self, name)
        if len(buf) < n:
            setattr(self, name, buf := (np.empty(n, np.uint8) if name == "out_buf" else bytearray(n)))
        return buf

    def execute(self, meta: KVTransferMeta) -> tuple[dict[int, bool], list[int], KVTransferStats]:
        stats, loaded = KVTransferStats(), {}
        t0 = time.perf_counter()
        for send in meta.sends:
            stats.bytes_saved += self._send(send)
            stats.bundles_sent += 1
        if meta.sends:
            self._sweep(Path(meta.sends[0].path).parent)
        t1 = time.perf_counter()
        stats.save_seconds = t1 - t0
        waiting = []
        for load in meta.remote_loads:
            ok = self._receive(load, stats)
            if ok is None:
                waiting.append(load.seq_id)
            else:
                loaded[load.seq_id] = ok
        if waiting and not loaded:  # only waiting: do not spin the engine
            time.sleep(0.001)
        stats.load_seconds = time.perf_counter() - t1
        return loaded, waiting, stats

    def _ring_size(self) -> int:
        """Bytes of one ring slot in every layer (K and V)."""
        return sum(c.layout.ring_blocks * (t[0].numel() * t.element_size()) for _, c in self.rings
                   for t in (c.k_recent, c.v_recent))

    def _send(self, send: KVSend) -> int:
        nb = -(-send.num_tokens // self.block_size)
        positions = [[i for i in range(min(nb, len(t))) if t[i] != NULL_BLOCK] for t in send.tables]
        ring = self._ring_size() if send.ring_slot >= 0 else 0
        size = sum(len(p) * self.payload_size(g) for g, p in enumerate(positions)) + ring
        buf = self._buffer("out_buf", size)[:size]
        at = 0
        for g, pos in enumerate(positions):  # part-major: each layer part's blocks in one gather
            idx = torch.tensor([send.tables[g][i] for i in pos], dtype=torch.int64)
            for t in self.parts[g]:
                n = len(pos) * t[0].numel() * t.element_size()
                out = torch.from_numpy(buf[at:at + n]).view(t.dtype).view(len(pos), *t.shape[1:])
                torch.index_select(t, 0, idx, out=out)
                at += n
        header = {"model": self.group_keys, "num_tokens": send.num_tokens, "tokens": send.token_digest,
                  "groups": positions, "layout": [self.layouts[g] for g in range(len(positions))]}
        if ring:  # the newest tokens, in float16, and where the quantized blocks end
            st = self.runner.states[send.seq_id]
            for _, c in self.rings:
                for t in (c.k_recent, c.v_recent):
                    n = c.layout.ring_blocks * t[0].numel() * t.element_size()
                    m = c.layout.ring_blocks
                    slot = t[send.ring_slot * m:(send.ring_slot + 1) * m]
                    buf[at:at + n] = slot.reshape(-1).view(torch.uint8).numpy()
                    at += n
            header["ring"] = {"layout": self.ring_layout, "kv_qlo": st.kv_qlo, "ring_floor": st.ring_floor}
        parts = encode_parts(BUNDLE_MAGIC, header, memoryview(buf))
        path = Path(send.path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, path)
        except OSError as e:  # the consumer will not find it, and prefills itself
            logger.warning("kv p2p: writing bundle %s failed: %s", path, e)
            tmp.unlink(missing_ok=True)
            return 0
        return sum(len(p) for p in parts)

    def _receive(self, load: KVRemoteLoad, stats: KVTransferStats) -> bool | None:
        path = Path(load.path)
        try:
            with open(path, "rb") as f:  # (into a writable buffer: the blocks are copied from views of it)
                n = os.fstat(f.fileno()).st_size
                data = memoryview(self._buffer("in_buf", n))[:n]
                f.readinto(data)
        except FileNotFoundError:
            data = self._fetch(load) if load.url else None  # another host: from the producer's server
            if data is None and time.time() < load.deadline:
                return None
        except OSError as e:
            logger.warning("kv p2p: bundle %s unreadable (%s); prefilled here", path.name, e)
            return False
        if data is None:
            logger.warning("kv p2p: bundle %s did not arrive within kv_timeout; prefilled here", path.name)
            return False
        try:
            header, payload = decode(data, BUNDLE_MAGIC, path.name)
            for field, want in (("model", self.group_keys), ("num_tokens", load.num_tokens),
                                ("tokens", load.token_digest),
                                ("layout", [self.layouts[g] for g in range(len(self.group_keys))])):
                if header.get(field) != want:
                    raise KVFrameError(f"{path.name}: its {field} is not this engine's or this request's "
                                       "(another model, dtype, layout or prompt)")
            src_all = np.frombuffer(payload, np.uint8)
            at = 0
            for g, pos in enumerate(load.positions):
                index = {p: k for k, p in enumerate(header["groups"][g])}
                missing = [i for i, _ in pos if i not in index]
                if missing:
                    raise KVFrameError(f"{path.name}: no block at position {missing[0]} of group {g}")
                ks = [index[i] for i, _ in pos]
                dst_idx = torch.tensor([b for _, b in pos], dtype=torch.int64)
                whole = ks == list(range(len(index)))  # (the usual case: every block it holds, in order)
                for t in self.parts[g]:
                    n = len(index) * t[0].numel() * t.element_size()
                    seg = torch.from_numpy(src_all[at:at + n]).view(t.dtype).view(len(index), *t.shape[1:])
                    t.index_copy_(0, dst_idx, seg if whole else seg[torch.tensor(ks, dtype=torch.int64)])
                    at += n
                stats.blocks_loaded += len(pos)
            ring = header.get("ring")
            if (ring is not None) != (load.ring_slot >= 0) or ring is not None and ring["layout"] != self.ring_layout:
                raise KVFrameError(f"{path.name}: its ring of recent tokens is not this engine's")
            if ring is not None:
                for _, c in self.rings:
                    m = c.layout.ring_blocks
                    for t in (c.k_recent, c.v_recent):
                        n = m * t[0].numel() * t.element_size()
                        seg = torch.from_numpy(src_all[at:at + n]).view(t.dtype).view(m, *t.shape[1:])
                        t[load.ring_slot * m:(load.ring_slot + 1) * m] = seg
                        at += n
                self.runner.given_rings[load.seq_id] = (int(ring["kv_qlo"]), int(ring["ring_floor"]))
        except (KVFrameError, KeyError, TypeError, IndexError, RuntimeError) as e:
            logger.warning("kv p2p: %s; prefilled here", e)
            stats.blocks_failed += 1
            path.unlink(missing_ok=True)
            return False
        stats.bytes_loaded += len(data)
        stats.bundles_received += 1
        path.unlink(missing_ok=True)  # consumed
        return True

    def _fetch(self, load: KVRemoteLoad) -> memoryview | None:
        """The bundle from the producer's server over HTTP (GET /kv_transfer/ENGINE/NAME, which deletes it there);
        None while it is not there (404) or the server cannot be reached."""
        import httpx

        path = Path(load.path)
        url = f"{load.url.rstrip('/')}/kv_transfer/{path.parent.name}/{path.name}"
        try:
            r = httpx.get(url, timeout=min(10.0, max(1.0, load.deadline - time.time())))
        except httpx.HTTPError as e:
            logger.warning("kv p2p: fetching %s: %s", url, type(e).__name__)
            return None
        if r.status_code != 200:
            return None
        n = len(r.content)
        buf = self._buffer("in_buf", n)
        buf[:n] = r.content
        return memoryview(buf)[:n]

    def _sweep(self, folder: Path) -> None:
        """Delete this engine's bundles no consumer took within kv_timeout."""
        limit = time.time() - self.config.kv_timeout
        try:
            for entry in os.scandir(folder):
                try:
                    if entry.stat().st_mtime < limit:
                        os.unlink(entry.path)
                except FileNotFoundError:
                    pass
        except FileNotFoundError:
            pass


#: kv_connector -> its worker half
WORKER_CONNECTORS: dict[str, type[KVConnectorWorker]] = {"store": StoreWorker, "p2p": P2PWorker}


def make_worker_connector(config: KVTransferConfig | None, kv_caches, layer_groups, kv_config: KVCacheConfig,
                          runner=None) -> KVConnectorWorker | None:
    if config is None:
        return None
    return WORKER_CONNECTORS[config.kv_connector](config, kv_caches, layer_groups, kv_config, runner)
