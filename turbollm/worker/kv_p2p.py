"""The p2p KV connector's worker half: prefill/decode hand-off on one host by copying blocks straight out of the
prefill instance's pool, across hosts by a bundle fetched from its server (kv_transfer/pool_handoff.py,
kv_transfer/shared_pool.py; the scheduler half is core/kv_connector.py `P2PScheduler`)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from turbollm.handoff.kv_transfer import KVRemoteLoad, KVSend, KVTransferConfig, KVTransferMeta, KVTransferStats
from turbollm.handoff.scheduler_output import NULL_BLOCK
from turbollm.kv_transfer.block_copy import as_blocks, copy_blocks
from turbollm.kv_transfer.framing import KVFrameError, decode
from turbollm.kv_transfer.pool_handoff import BUNDLE_MAGIC, HANDOFF_MAGIC, pool_sources, read_handoff, write_frame
from turbollm.kv_transfer.shared_pool import PoolError, claim, finish, unclaim
from turbollm.log import init_logger
from turbollm.worker.kv_connector_base import KVConnectorWorker

logger = init_logger()


class P2PWorker(KVConnectorWorker):
    """Prefill/decode disaggregation's worker half (kv_transfer/pool_handoff.py has the files' layout).

    A producer's pool lives in shared memory (kv_transfer/shared_pool.py); a send writes the small hand-off file
    naming the pool, the blocks of each group's positions and their layout (a quantized format's float16 ring of
    recent tokens rides in it), and the scheduler keeps those blocks until a consumer has copied them. A consumer
    claims the file, checks every field against this engine and the request, and copies the blocks it needs
    straight from the producer's pool into the blocks its scheduler took — one copy, one memcpy per block and layer
    part (csrc/kv_copy.cpp). A hand-off not there yet makes the sequence wait another step, until its deadline;
    one whose pool this process cannot open (another host) comes as a bundle from the producer's server over HTTP,
    built there from the pool."""

    @classmethod
    def shares_pool(cls, config: KVTransferConfig) -> bool:
        return config.saves

    def __init__(self, config: KVTransferConfig, kv_caches, layer_groups, kv_config, runner=None, arena=None):
        super().__init__(config, kv_caches, layer_groups, kv_config, runner)
        self.arena = arena  # a producer's pool, in shared memory
        # a quantized format's rings (float16 blocks of each sequence's newest tokens, a view of the pool), per layer
        self.rings = [(layer, c) for layer, c in enumerate(kv_caches) if c is not None and c.k_recent is not None]
        self.ring_layout = [[layer, str(c.k_recent.dtype).removeprefix("torch."), c.layout.ring_blocks,
                             list(c.k_recent.shape[1:])] for layer, c in self.rings]
        self.targets = {g: [as_blocks(t) for t in parts] for g, parts in self.parts.items()}
        # a producer's pool as a hand-off names it (the same for every hand-off)
        self.pool_ref = None if arena is None else {
            **arena.ref(), "num_blocks": [self.parts[g][0].shape[0] for g in sorted(self.parts)],
            "parts": [[[arena.offset(t), t[0].numel() * t.element_size()] for t in self.parts[g]]
                      for g in sorted(self.parts)]}
        self.in_buf = bytearray()  # a fetched bundle (kept: a fresh buffer's first touch costs a page fault per 4 KiB)

    def execute(self, meta: KVTransferMeta) -> tuple[dict[int, bool], list[int], KVTransferStats]:
        stats, loaded = KVTransferStats(), {}
        t0 = time.perf_counter()
        for send in meta.sends:
            start = time.perf_counter()
            stats.bytes_saved += self._send(send)
            stats.bundles_sent += 1
            stats.transfer_seconds.append(time.perf_counter() - start)
        t1 = time.perf_counter()
        stats.save_seconds = t1 - t0
        waiting = []
        for load in meta.remote_loads:
            start = time.perf_counter()
            ok = self._receive(load, stats)
            if ok is None:
                waiting.append(load.seq_id)
            else:
                loaded[load.seq_id] = ok
                stats.transfer_seconds.append(time.perf_counter() - start)
        if waiting and not loaded:  # only waiting: do not spin the engine
            time.sleep(0.001)
        stats.load_seconds = time.perf_counter() - t1
        return loaded, waiting, stats

    def _ring_bytes(self, slot: int) -> np.ndarray:
        """A ring slot's float16 blocks in every layer, K then V, as bytes."""
        pieces = [t[slot * c.layout.ring_blocks:(slot + 1) * c.layout.ring_blocks].reshape(-1).view(torch.uint8)
                  for _, c in self.rings for t in (c.k_recent, c.v_recent)]
        return torch.cat(pieces).numpy() if pieces else np.empty(0, np.uint8)

    def _send(self, send: KVSend) -> int:
        """Write the hand-off file (the blocks stay in the pool, held by the scheduler); its bytes."""
        nb = -(-send.num_tokens // self.block_size)
        positions = [[i for i in range(min(nb, len(t))) if t[i] != NULL_BLOCK] for t in send.tables]
        groups = range(len(positions))
        header = {"model": self.group_keys, "num_tokens": send.num_tokens, "tokens": send.token_digest,
                  "groups": positions, "blocks": [[send.tables[g][i] for i in pos] for g, pos in enumerate(positions)],
                  "layout": [self.layouts[g] for g in groups], "pool": self.pool_ref}
        ring = np.empty(0, np.uint8)
        if send.ring_slot >= 0:  # the newest tokens, in float16, and where the quantized blocks end
            st = self.runner.states[send.seq_id]
            ring = self._ring_bytes(send.ring_slot)
            header["ring"] = {"layout": self.ring_layout, "kv_qlo": st.kv_qlo, "ring_floor": st.ring_floor}
        try:
            return write_frame(send.path, HANDOFF_MAGIC, header, ring)
        except OSError as e:  # the consumer will not find it, and prefills itself (the scheduler frees the blocks)
            logger.warning("kv p2p: writing hand-off %s failed: %s", send.path, e)
            return 0

    def _receive(self, load: KVRemoteLoad, stats: KVTransferStats) -> bool | None:
        name = Path(load.path).name
        taking = claim(load.path)
        if taking is None:  # not written yet, or written on another host: from the producer's server
            try:
                data = self._fetch(load) if load.url else None
            except KVFrameError as e:
                logger.warning("kv p2p: %s; prefilled here", e)
                stats.blocks_failed += 1
                return False
            if data is not None:
                return self._load_bundle(data, load, stats, name)
            if time.time() < load.deadline:
                return None
            logger.warning("kv p2p: hand-off %s did not arrive within kv_timeout; prefilled here", name)
            return False
        try:
            header, ring = read_handoff(taking, name)
            self._check(header, load, name)
            try:
                sources = pool_sources(header)
            except PoolError as e:
                if not load.url:
                    raise
                logger.info("kv p2p: %s: %s; fetching it from %s", name, e, load.url)
                unclaim(taking)
                taking = None
                data = self._fetch(load)  # (a KVFrameError: prefilled here, below)
                return self._load_bundle(data, load, stats, name) if data is not None else False
            moved = 0
            for g, pos in enumerate(load.positions):
                srcs, blocks = sources[g]
                _, src_idx, dst_idx = _block_indices(header, g, pos, name)
                copy_blocks(srcs, self.targets[g], torch.tensor(blocks, dtype=torch.int64)[src_idx], dst_idx)
                moved += len(pos) * self.payload_size(g)
                stats.blocks_loaded += len(pos)
            moved += self._fill_ring(header, np.frombuffer(ring, np.uint8), 0, load, name)
            done, taking = finish(taking), None
            if not done:
                raise KVFrameError(f"{name}: the producer freed its blocks before the copy ended (kv_timeout passed)")
        except (OSError, PoolError, KVFrameError, KeyError, TypeError, IndexError, ValueError, RuntimeError) as e:
            logger.warning("kv p2p: %s; prefilled here", e)
            stats.blocks_failed += 1
            return False
        finally:
            if taking is not None:  # released: the producer frees the blocks
                finish(taking)
        stats.bytes_loaded += moved
        stats.bundles_received += 1
        return True

    def _check(self, header: dict, load: KVRemoteLoad, name: str) -> None:
        for field, want in (("model", self.group_keys), ("num_tokens", load.num_tokens), ("tokens", load.token_digest),
                            ("layout", [self.layouts[g] for g in range(len(self.group_keys))])):
            if header.get(field) != want:
                raise KVFrameError(f"{name}: its {field} is not this engine's or this request's "
                                   "(another model, dtype, layout or prompt)")
        ring = header.get("ring")
        if (ring is not None) != (load.ring_slot >= 0) or ring is not None and ring.get("layout") != self.ring_layout:
            raise KVFrameError(f"{name}: its ring of recent tokens is not this engine's")

    def _fill_ring(self, header: dict, src: np.ndarray, at: int, load: KVRemoteLoad, name: str) -> int:
        """A quantized format's ring slot from `src[at:]` and the sequence's bounds; the bytes taken."""
        ring = header.get("ring")
        if ring is None:
            return 0
        start = at
        for _, c in self.rings:
            m = c.layout.ring_blocks
            for t in (c.k_recent, c.v_recent):
                n = m * t[0].numel() * t.element_size()
                if at + n > src.size:
                    raise KVFrameError(f"{name}: its ring of recent tokens is short")
                t[load.ring_slot * m:(load.ring_slot + 1) * m] = \
                    torch.from_numpy(src[at:at + n]).view(t.dtype).view(m, *t.shape[1:])
                at += n
        self.runner.given_rings[load.seq_id] = (int(ring["kv_qlo"]), int(ring["ring_floor"]))
        return at - start

    def _load_bundle(self, data: memoryview, load: KVRemoteLoad, stats: KVTransferStats, name: str) -> bool:
        """Blocks from a bundle (fetched from another host's producer): every part's blocks in position order."""
        try:
            header, payload = decode(data, BUNDLE_MAGIC, name)
            self._check(header, load, name)
            src_all = np.frombuffer(payload, np.uint8)
            at = 0
            for g, pos in enumerate(load.positions):
                count, src_idx, dst_idx = _block_indices(header, g, pos, name)
                srcs = []
                for t in self.targets[g]:
                    n = count * t.shape[1]
                    if at + n > src_all.size:
                        raise KVFrameError(f"{name}: short payload")
                    srcs.append(torch.from_numpy(src_all[at:at + n]).view(count, t.shape[1]))
                    at += n
                copy_blocks(srcs, self.targets[g], src_idx, dst_idx)
                stats.blocks_loaded += len(pos)
            self._fill_ring(header, src_all, at, load, name)
        except (KVFrameError, KeyError, TypeError, IndexError, ValueError, RuntimeError) as e:
            logger.warning("kv p2p: %s; prefilled here", e)
            stats.blocks_failed += 1
            return False
        stats.bytes_loaded += len(data)
        stats.bundles_received += 1
        return True

    def _fetch(self, load: KVRemoteLoad) -> memoryview | None:
        """The bundle from the producer's server over HTTP (GET /kv_transfer/ENGINE/NAME, built there from its pool);
        None while it is not there (404) or the server cannot be reached; KVFrameError when the server refuses it."""
        import httpx

        path = Path(load.path)
        url = f"{load.url.rstrip('/')}/kv_transfer/{path.parent.name}/{path.name}"
        try:
            r = httpx.get(url, timeout=min(10.0, max(1.0, load.deadline - time.time())))
        except httpx.HTTPError as e:
            logger.warning("kv p2p: fetching %s: %s", url, type(e).__name__)
            return None
        if r.status_code == 404:  # not written yet (or gone: the deadline ends the wait)
            return None
        if r.status_code != 200:
            raise KVFrameError(f"{url}: {r.status_code} {r.text[:200]}")
        n = len(r.content)
        if len(self.in_buf) < n:
            self.in_buf = bytearray(n)
        self.in_buf[:n] = r.content
        return memoryview(self.in_buf)[:n]


def _block_indices(header: dict, g: int, pos, name: str) -> tuple[int, torch.Tensor, torch.Tensor]:
    """For KV group `g`: how many blocks the hand-off holds, and for each wanted (position, own block) pair the
    index of the position's block among the hand-off's and the block it is copied into; a position the hand-off
    lacks is refused."""
    index = {p: k for k, p in enumerate(header["groups"][g])}
    missing = [i for i, _ in pos if i not in index]
    if missing:
        raise KVFrameError(f"{name}: no block at position {missing[0]} of group {g}")
    return (len(index), torch.tensor([index[i] for i, _ in pos], dtype=torch.int64),
            torch.tensor([b for _, b in pos], dtype=torch.int64))
