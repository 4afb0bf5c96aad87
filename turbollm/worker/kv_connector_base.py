"""What every KV connector's worker half has: each group's layer parts and what one block of them is
(worker/kv_connector.py has the registry and the block store's half, worker/kv_p2p.py the prefill/decode one)."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from turbollm.attention.kv_storage import LayerKVCache
from turbollm.handoff.kv_cache_spec import KVCacheConfig
from turbollm.handoff.kv_transfer import KVBlockRef, KVTransferConfig, KVTransferMeta, KVTransferStats

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

    @classmethod
    def shares_pool(cls, config: KVTransferConfig) -> bool:
        """Whether the worker's K/V pool must live in shared memory for this connector (kv_transfer/shared_pool.py)."""
        return False
