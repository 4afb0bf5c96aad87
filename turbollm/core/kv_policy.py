"""KV policies: which K/V a layer group keeps, one registry entry each (`--kv-policy`).

A policy builds the spec of each layer group (`handoff/kv_cache_spec.py`) from the group's storage
layout, its attention window and the policy's options (`KVPolicyConfig`: sinks, window); the spec's
rule (`first_needed_position`, `kept_blocks`, `max_blocks`, `attention`) is what the KV-cache
manager, the pool sizing and the attention kernels follow, so a policy never threads a flag
through the core.

- "auto" (default): a sliding-window layer releases the blocks its window has passed, so Gemma 3's
  15 local layers hold about 512 tokens each at any context; full-attention layers keep everything.
- "dense": every layer keeps every block (the sliding layers still attend to their window only):
  the baseline that "auto" is measured against (same outputs, more memory).
- "streaming" (StreamingLLM): every full-attention layer keeps the first `sinks` tokens and the
  last `window`, releasing the blocks between them (a model's own sliding layers keep their window,
  or the policy's when that is shorter), so a sequence of any length runs at flat memory and past
  the model's trained context; `sinks=0` is the window-only baseline.
- "h2o" / "snapkv" (attention-score eviction, `core/kv_eviction.py`): each sequence keeps at most
  `budget` tokens, its least-attended blocks released after each step (H2O: attention accumulated
  from every query; SnapKV: from the last 32 queries); full-attention models only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from turbollm.attention.kv_storage import KVLayout
from turbollm.core.kv_eviction import SCORERS, EvictionSpec
from turbollm.errors import InvalidRequestError
from turbollm.handoff.kv_cache_spec import DEFAULT_ATTENTION_SINKS, KVCacheSpec, SinkWindowSpec, SlidingWindowSpec


@dataclass(frozen=True)
class KVPolicyConfig:
    """A policy and its options, as the engine's arguments give them (plain data)."""

    name: str = "auto"
    sinks: int | None = None  # attention sinks (streaming; default DEFAULT_ATTENTION_SINKS)
    window: int | None = None  # tokens each layer keeps besides the sinks (streaming; required)
    budget: int | None = None  # tokens each sequence keeps (h2o, snapkv; required)

    @property
    def sink_count(self) -> int:
        return DEFAULT_ATTENTION_SINKS if self.sinks is None else self.sinks


@dataclass(frozen=True)
class KVPolicy:
    name: str
    help: str
    # (layout, the layer group's own window or None, the options) -> the group's spec
    spec: Callable[[KVLayout, int | None, KVPolicyConfig], KVCacheSpec]
    options: tuple[str, ...] = ()  # the KVPolicyConfig fields it reads (any other given is refused)
    releases_all: bool = False  # every group releases blocks: sequences may outgrow the trained context
    check: Callable[[KVPolicyConfig, int], None] | None = None  # (options, block size): bad options raise
    lossless: bool = True  # attends to what the model attends to (only memory differs)
    evicts: bool = False  # drops K/V by attention score: no prefix caching, no speculation, float K/V only


KV_POLICIES: dict[str, KVPolicy] = {}

# the engine-argument name of each option, for error messages
OPTION_FLAGS = {"sinks": "attention_sinks", "window": "kv_window", "budget": "kv_budget"}


def register_kv_policy(policy: KVPolicy) -> KVPolicy:
    KV_POLICIES[policy.name] = policy
    return policy


def get_kv_policy(name: str) -> KVPolicy:
    if name not in KV_POLICIES:
        raise InvalidRequestError(f"kv_policy {name!r}: choose one of {', '.join(KV_POLICIES)}")
    return KV_POLICIES[name]


def check_kv_policy(options: KVPolicyConfig, block_size: int) -> None:
    """Refuse an unknown policy, an option the policy does not take, or a bad value (naming the flag)."""
    policy = get_kv_policy(options.name)
    for field in OPTION_FLAGS:
        if getattr(options, field) is not None and field not in policy.options:
            raise InvalidRequestError(f"{OPTION_FLAGS[field]} applies to kv_policy "
                                      f"{' or '.join(repr(p.name) for p in KV_POLICIES.values() if field in p.options)}"
                                      f", not {options.name!r}")
    if policy.check is not None:
        policy.check(options, block_size)


def _own(layout: KVLayout, window: int | None, release: bool = True) -> KVCacheSpec:
    return KVCacheSpec(layout) if window is None else SlidingWindowSpec(layout, window, release_blocks=release)


def _streaming_spec(layout: KVLayout, window: int | None, options: KVPolicyConfig) -> KVCacheSpec:
    if window is not None and window <= options.window:  # a sliding layer whose window is already shorter
        return SlidingWindowSpec(layout, window)
    return SinkWindowSpec(layout, options.window, sinks=options.sink_count)


def _check_streaming(options: KVPolicyConfig, block_size: int) -> None:
    sinks = options.sink_count
    if options.window is None:
        raise InvalidRequestError("kv_policy 'streaming' needs kv_window (the recent tokens each layer keeps)")
    if sinks < 0:
        raise InvalidRequestError(f"attention_sinks must be >= 0, got {sinks}")
    if options.window < block_size or options.window < sinks:
        raise InvalidRequestError(f"kv_window {options.window} must be at least a block ({block_size} tokens) and "
                                  f"at least attention_sinks ({sinks})")


def _eviction_spec(score: str) -> Callable[[KVLayout, int | None, KVPolicyConfig], KVCacheSpec]:
    def spec(layout: KVLayout, window: int | None, options: KVPolicyConfig) -> KVCacheSpec:
        if window is not None:
            raise InvalidRequestError(f"kv_policy {score!r} evicts from full-attention layers only; this model has "
                                      f"{window}-token sliding-window layers (use kv_policy 'auto' or 'streaming')")
        return EvictionSpec(layout, budget=options.budget, score=score)
    return spec


def _check_eviction(score: str) -> Callable[[KVPolicyConfig, int], None]:
    def check(options: KVPolicyConfig, block_size: int) -> None:
        if options.budget is None:
            raise InvalidRequestError(f"kv_policy {score!r} needs kv_budget (the tokens each sequence keeps)")
        recent = SCORERS[score].recent(options.budget, block_size)
        if options.budget < 2 * block_size or options.budget // block_size * block_size <= recent:
            raise InvalidRequestError(f"kv_budget {options.budget} must be at least two blocks ({2 * block_size} "
                                      f"tokens) and more than the {recent} recent tokens kv_policy {score!r} "
                                      "always keeps, plus a block")
    return check


register_kv_policy(KVPolicy(
    "auto", "sliding-window layers release the blocks their window has passed; other layers keep every block",
    lambda layout, window, options: _own(layout, window)))
register_kv_policy(KVPolicy(
    "dense", "every layer keeps every block (sliding-window layers still attend to their window only)",
    lambda layout, window, options: _own(layout, window, release=False)))
register_kv_policy(KVPolicy(
    "streaming", "attention sinks + a window (StreamingLLM): each layer keeps the first attention_sinks tokens and "
                 "the last kv_window, at flat memory for any length",
    _streaming_spec, options=("sinks", "window"), releases_all=True, check=_check_streaming, lossless=False))
register_kv_policy(KVPolicy(
    "h2o", "attention-score eviction (H2O): each sequence keeps kv_budget tokens, the newest half and the blocks "
           "with the most attention accumulated from every query", _eviction_spec("h2o"), options=("budget",),
    check=_check_eviction("h2o"), lossless=False, evicts=True))
register_kv_policy(KVPolicy(
    "snapkv", "attention-score eviction (SnapKV): each sequence keeps kv_budget tokens, the newest 32 and the blocks "
              "the last 32 queries attend to most", _eviction_spec("snapkv"), options=("budget",),
    check=_check_eviction("snapkv"), lossless=False, evicts=True))
