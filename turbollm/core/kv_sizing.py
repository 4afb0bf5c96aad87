"""How many KV blocks each group gets: the model's layers grouped by attention kind, each group's spec built
by the KV policy (`core/kv_policy.py`), and the most blocks that fit a memory budget.

The scheduler side computes the `KVCacheConfig` (`turbollm.handoff.kv_cache_spec`, plain data) here and sends it to
the workers, which allocate each layer's storage from it (`worker/kv_allocation.py`). A releasing group never holds
more than `KVCacheSpec.max_blocks` blocks (every sequence slot a window's worth, plus the step's new tokens), so its
pool is capped there and the rest of the budget goes to the groups that keep everything. `size_kv_cache` is
the engine's whole sizing: the context length, the budget (given, or by default what max_num_seqs sequences of
the full context can use), the config, and the checks that one sequence always fits.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from turbollm.attention.kv_storage import KVLayout
from turbollm.config import ModelConfig
from turbollm.core.kv_policy import KVPolicyConfig, get_kv_policy
from turbollm.errors import InvalidRequestError
from turbollm.handoff.kv_cache_spec import KVCacheConfig, KVCacheGroup

if TYPE_CHECKING:  # (engine_args reads core's KV policies: no import back)
    from turbollm.engine_args import EngineArgs

logger = logging.getLogger("turbollm")


def kv_config_for_model(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32,
                        model_salt: bytes = b"", policy: str | KVPolicyConfig = "auto", max_num_seqs: int | None = None,
                        max_num_batched_tokens: int | None = None, spec_tokens: int = 0,
                        recent_window: int = 0) -> KVCacheConfig:
    """The model's layers grouped by attention kind (full, or each sliding-window size), each group's
    spec as the KV policy builds it. Given `max_num_seqs` and `max_num_batched_tokens`, a group that
    releases blocks gets no more than it can hold at once (`KVCacheSpec.max_blocks`). A quantized
    `dtype` (torch.int8: int8, torch.uint8: int4) keeps `recent_window` tokens per sequence in float16,
    in a ring of pool blocks each running sequence takes (`KVCacheConfig.ring_blocks`)."""
    options = policy if isinstance(policy, KVPolicyConfig) else KVPolicyConfig(policy)
    make_spec = get_kv_policy(options.name).spec
    layout = KVLayout(dtype, block_size, cfg.num_kv_heads, cfg.head_dim)
    if layout.quant:
        layout = KVLayout(dtype, block_size, cfg.num_kv_heads, cfg.head_dim, recent_window)
    by_window: dict[int | None, list[int]] = {}
    for i in range(cfg.num_layers):
        by_window.setdefault(cfg.layer_window(i), []).append(i)
    groups = tuple(KVCacheGroup(make_spec(layout, w, options), tuple(ids))
                   for w, ids in sorted(by_window.items(), key=lambda kv: (kv[0] is not None, kv[0] or 0)))
    num_blocks = max(1, int(num_blocks))
    caps = _caps(groups, max_num_seqs, max_num_batched_tokens, spec_tokens)
    counts = tuple(num_blocks if c is None else min(c, num_blocks) for c in caps)
    return KVCacheConfig(num_blocks, block_size, groups, model_salt, counts if set(counts) != {num_blocks} else ())


def kv_config_from_budget(cfg: ModelConfig, memory_bytes: int, block_size: int, dtype: torch.dtype = torch.float32,
                          model_salt: bytes = b"", policy: str | KVPolicyConfig = "auto",
                          max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                          spec_tokens: int = 0, recent_window: int = 0) -> KVCacheConfig:
    """The most blocks for the groups that keep everything such that every group's blocks fit `memory_bytes`
    (the capped groups taking their cap first)."""
    def build(n: int) -> KVCacheConfig:
        return kv_config_for_model(cfg, n, block_size, dtype, model_salt, policy, max_num_seqs,
                                   max_num_batched_tokens, spec_tokens, recent_window)

    probe = build(1)
    if probe.total_bytes > memory_bytes:
        raise InvalidRequestError(f"the KV-cache budget ({memory_bytes / (1 << 20):.1f} MiB) is smaller than one "
                                  "block per group: raise kv_cache_memory")
    # no group can have more blocks than the budget buys of the cheapest one; bytes grow with n
    lo, hi = 1, max(1, memory_bytes // min(probe.block_bytes(g) for g in range(len(probe.groups))))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if build(mid).total_bytes <= memory_bytes else (lo, mid - 1)
    return build(lo)


def _caps(groups: tuple[KVCacheGroup, ...], max_num_seqs: int | None, max_num_batched_tokens: int | None,
          spec_tokens: int) -> list[int | None]:
    if max_num_seqs is None or max_num_batched_tokens is None:
        return [None] * len(groups)
    return [g.spec.max_blocks(max_num_seqs, max_num_batched_tokens, spec_tokens) for g in groups]


def default_kv_budget(cfg: ModelConfig, dtype: torch.dtype, block_size: int, max_model_len: int,
                      max_num_seqs: int, policy: str | KVPolicyConfig = "auto",
                      max_num_batched_tokens: int | None = None, spec_tokens: int = 0, recent_window: int = 0) -> int:
    """Bytes for `max_num_seqs` sequences of `max_model_len` tokens each (whole blocks, and a quantized
    format's rings; a group that releases blocks no more than its cap): the most a default-sized cache can
    ever use, so a small model with a short context is not given gigabytes."""
    per_seq = -(-max_model_len // block_size)
    probe = kv_config_for_model(cfg, 1, block_size, dtype, recent_window=recent_window)
    return kv_config_for_model(cfg, (per_seq + probe.ring_blocks) * max_num_seqs, block_size, dtype, b"", policy,
                               max_num_seqs, max_num_batched_tokens, spec_tokens, recent_window).total_bytes


def batched_tokens(args: EngineArgs) -> int:
    """The scheduler's token budget per step (at least a block)."""
    return max(args.max_num_batched_tokens, args.block_size)


def size_kv_cache(args: EngineArgs, cfg: ModelConfig, dtype: torch.dtype, salt: bytes) -> tuple[KVCacheConfig, int]:
    """(the engine's `KVCacheConfig` per rank, max_model_len). The cache is described per rank: each tensor-parallel
    rank keeps its share of the KV heads (all of them when there are fewer heads than ranks) and of the budget.
    max_model_len is capped to the tokens the pool holds (with a log line), so one sequence always fits alone."""
    tp, policy = args.tensor_parallel_size, args.kv_policy_config()
    kv_model = cfg if tp == 1 else dataclasses.replace(cfg, num_kv_heads=max(1, cfg.num_kv_heads // tp))
    releases_all = get_kv_policy(args.kv_policy).releases_all  # every position meets keys at most a window away
    model_len = args.max_model_len or cfg.max_position_embeddings
    if not releases_all:
        model_len = min(model_len, cfg.max_position_embeddings)
    spec = args.speculative_config
    spec_tokens = spec.num_speculative_tokens if spec is not None else 0  # drafts' blocks (window caps)
    sizing = (args.block_size, dtype, salt, policy, args.max_num_seqs, batched_tokens(args), spec_tokens,
              args.kv_recent_window or 0)
    budget = args.kv_cache_bytes() // tp
    if args.kv_cache_memory is None:  # never more than max_num_seqs sequences of the full context
        budget = min(budget, default_kv_budget(kv_model, dtype, args.block_size, model_len, args.max_num_seqs, policy,
                                               batched_tokens(args), spec_tokens, args.kv_recent_window or 0))
    kv = kv_config_from_budget(kv_model, budget, *sizing)
    _log_kv(args, kv, kv_model, releases_all)
    _check_one_sequence_fits(args, kv, spec_tokens, model_len)
    held = kv.max_seq_tokens
    if held is not None and model_len > held:
        logger.warning("max_model_len %d is more than the KV cache holds: capped to %d tokens (raise "
                       "kv_cache_memory for the full context)", model_len, held)
        model_len = held
    return kv, model_len


def _log_kv(args: EngineArgs, kv: KVCacheConfig, kv_model: ModelConfig, releases_all: bool) -> None:
    held, policy = kv.num_tokens, args.kv_policy_config()
    evicts = get_kv_policy(args.kv_policy).evicts
    caching = args.enable_prefix_caching and not evicts
    logger.info("KV cache: %s, %.0f MiB (%s; %s; prefix caching %s)",
                f"{kv.num_blocks} blocks of {args.block_size} tokens = {held} tokens" if held
                else "sequences of any length at flat memory" if releases_all
                else "each sequence within its budget", kv.total_bytes / (1 << 20), kv.format_name, kv.describe(),
                "on" if caching else f"off: kv_policy {policy.name!r} evicts" if evicts else "off")
    if kv.ring_blocks and held is not None:
        float16 = kv_config_for_model(kv_model, 1, args.block_size, torch.float16).bytes_per_token
        logger.info("KV cache: %s blocks of %.0f bytes a token, %.2fx the tokens float16 K/V would hold in the same "
                    "budget; each running sequence's %d-token float16 ring takes %d of its blocks (at most %d rings)",
                    args.kv_cache_dtype, kv.bytes_per_token, float16 * held / max(1, kv.total_bytes),
                    args.kv_recent_window, kv.ring_blocks, kv.ring_slots)


def _check_one_sequence_fits(args: EngineArgs, kv: KVCacheConfig, spec_tokens: int, model_len: int) -> None:
    """A group that releases blocks must hold one sequence's window alone (else a long sequence would preempt
    itself forever), or its whole context when that is shorter; a group that keeps every block bounds
    max_model_len instead. A quantized format's pool must hold one ring and a block more."""
    if kv.ring_blocks and (kv.ring_slots < 1 or min(kv.blocks_of(g) for g in range(len(kv.groups))) <= kv.ring_blocks):
        raise InvalidRequestError(
            f"kv_cache_memory holds {min(kv.blocks_of(g) for g in range(len(kv.groups)))} blocks, but one sequence's "
            f"float16 ring of recent tokens takes {kv.ring_blocks} (kv_recent_window {args.kv_recent_window}) and "
            "its tokens need more: raise kv_cache_memory or lower kv_recent_window")
    for g, group in enumerate(kv.groups):
        need = group.spec.max_blocks(1, batched_tokens(args), spec_tokens)
        if need is not None:  # a sequence alone never copies on write: its whole context at most
            need = min(need, -(-model_len // args.block_size))
        if need is not None and kv.blocks_of(g) < need and kv.num_tokens is None:
            raise InvalidRequestError(
                f"kv_cache_memory holds {kv.blocks_of(g)} blocks for the {group.spec.kind} layers but one sequence "
                f"needs {need}: raise kv_cache_memory or lower kv_window / kv_budget / max_num_batched_tokens")
