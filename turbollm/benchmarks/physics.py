"""The physics of a forward step: what it reads from memory, what it computes, and the ceilings.

Decode is memory-bound: every weight is read once per engine step, however many sequences
the step decodes, so achieved bandwidth = weight bytes read per step × steps/s. Prefill and
large batches are compute-bound: a token costs 2 FLOP per parameter of every matrix it is
multiplied by.

What we count:
- *weight bytes read per step*: every resident parameter byte (shared tensors once), except
  an untied input-embedding table, of which a step reads only the rows of its tokens. With
  tied embeddings the table is the LM head and is read in full. Resident bytes are
  `LoadedModel.weight_bytes`: the GGUF blocks themselves by default, float32 with "none".
- *matmul parameters*: the decoder's linear layers (q/k/v/o projections, gate/up/down) per
  processed token, plus the LM head (vocab × hidden) per sampled row: the engine projects
  only the rows it samples (the last prompt token of a prefill, every decode token).
  Attention scores and values (QKᵀ, PV), norms, RoPE and activations are not counted.
- *KV bytes* (reported apart): the K and V a step must read for its sequences' contexts,
  sliding-window layers capped at their window. An ideal minimum; a backend that gathers
  padded blocks reads more.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

# Measured on the project machine (2-core AMD EPYC Zen 3, AVX2/FMA, 24 GiB): memory bandwidth
# 16–18 GB/s (1 GiB copy / sum), fp32 GEMM ~100 GFLOP/s (2048³ matmul). See ../shared/DESIGN.md §1.
# Override with --bandwidth-gbs / --peak-gflops on other machines.
MEMORY_BANDWIDTH_GBS = 17.0
FP32_GFLOPS = 100.0


@dataclass(frozen=True)
class Ceilings:
    """The machine's limits the results are compared against."""

    bandwidth_gbs: float = MEMORY_BANDWIDTH_GBS
    fp32_gflops: float = FP32_GFLOPS


def measure_read_bandwidth(nbytes: int = 256 << 20, reps: int = 3) -> float:
    """GB/s of summing a float32 buffer of `nbytes` (far larger than the caches) with torch's current
    threads: best of `reps`. Printed beside the ceiling, because the ceiling is one machine's figure
    and this VM's bandwidth moves (2026-11-30: 22.7 GB/s at 1 thread, 37.3 at 2, against DESIGN.md's
    16-18)."""
    import time

    import torch

    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    buf.sum()  # first touch
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


def add_ceiling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bandwidth-gbs", type=float, default=MEMORY_BANDWIDTH_GBS,
                   help=f"memory-bandwidth ceiling in GB/s (default {MEMORY_BANDWIDTH_GBS:g}, the project machine)")
    p.add_argument("--peak-gflops", type=float, default=FP32_GFLOPS,
                   help=f"fp32 compute ceiling in GFLOP/s (default {FP32_GFLOPS:g}, the project machine)")


def ceilings_from(ns: argparse.Namespace) -> Ceilings:
    return Ceilings(ns.bandwidth_gbs, ns.peak_gflops)


@dataclass(frozen=True)
class ModelPhysics:
    """What one forward step of a model reads and computes (see the module docstring)."""

    weight_bytes: int  # resident bytes of all parameters, shared tensors once
    step_weight_bytes: int  # weight bytes read per step (an untied embedding table left out)
    linear_params: int  # decoder linear layers: multiplied by every processed token
    lm_head_params: int  # vocab × hidden: multiplied by every sampled row
    kv_layer_bytes: tuple[int, ...] = ()  # per layer: K+V bytes of one cached token
    layer_windows: tuple[int | None, ...] = ()  # per layer: sliding window or None
    weights_storage: str = "float32"  # how the weights are held (LoadedModel.weights_storage)

    def flops(self, processed_tokens: int, sampled_rows: int) -> float:
        """Matmul FLOPs of `processed_tokens` through the decoder and `sampled_rows` through the LM head."""
        return 2.0 * self.linear_params * processed_tokens + 2.0 * self.lm_head_params * sampled_rows

    def kv_bytes_read(self, context_len: int) -> int:
        """K/V bytes one sequence reads in a step whose context (new tokens included) is `context_len`."""
        total = 0
        for i, per_token in enumerate(self.kv_layer_bytes):
            window = self.layer_windows[i] if i < len(self.layer_windows) else None
            total += per_token * (min(context_len, window) if window else context_len)
        return total

    def as_dict(self) -> dict:
        return {"weight_bytes": self.weight_bytes, "step_weight_bytes": self.step_weight_bytes,
                "linear_params": self.linear_params, "lm_head_params": self.lm_head_params,
                "kv_bytes_per_token": sum(self.kv_layer_bytes)}


def gbps(num_bytes: float, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else 0.0


def gflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e9 if seconds > 0 else 0.0


def bandwidth_figures(phys: ModelPhysics, steps: int, seconds: float, ceilings: Ceilings,
                      kv_bytes: float = 0.0) -> dict:
    """Achieved weight-read bandwidth of `steps` steps in `seconds` (and with the KV reads added)."""
    weights = gbps(phys.step_weight_bytes * steps, seconds)
    out = {"weights_GBps": round(weights, 2), "weights_pct_of_bandwidth": round(100 * weights / ceilings.bandwidth_gbs, 1)}
    if kv_bytes:
        both = gbps(phys.step_weight_bytes * steps + kv_bytes, seconds)
        out.update(weights_plus_kv_GBps=round(both, 2),
                   weights_plus_kv_pct_of_bandwidth=round(100 * both / ceilings.bandwidth_gbs, 1))
    return out


def compute_figures(phys: ModelPhysics, processed_tokens: int, sampled_rows: int, seconds: float,
                    ceilings: Ceilings) -> dict:
    """Achieved matmul GFLOP/s of `processed_tokens` (and `sampled_rows` LM-head rows) in `seconds`."""
    g = gflops(phys.flops(processed_tokens, sampled_rows), seconds)
    return {"GFLOPs": round(g, 2), "pct_of_peak_GFLOPs": round(100 * g / ceilings.fp32_gflops, 1)}


def decode_ceiling_steps_per_s(phys: ModelPhysics, ceilings: Ceilings) -> float:
    """Steps/s if a decode step only had to stream its weights at full bandwidth (the roofline)."""
    return ceilings.bandwidth_gbs * 1e9 / phys.step_weight_bytes if phys.step_weight_bytes else 0.0


# ----------------------------------------------------------------------------- counting
def physics_of_turbollm(footprint, config, kv_itemsize: int = 4) -> ModelPhysics:
    """Count a turbollm model from its `ModelFootprint` (`LLMEngine.footprint`; linear layers by their
    logical shape, packed weights too)."""
    per_layer = 2 * config.num_kv_heads * config.head_dim * kv_itemsize
    windows = tuple(config.layer_window(i) for i in range(config.num_layers))
    return ModelPhysics(footprint.weight_bytes, footprint.weight_bytes - footprint.untied_embedding_bytes,
                        footprint.linear_params, footprint.lm_head_params, (per_layer,) * config.num_layers, windows,
                        footprint.weights_storage)


def physics_of_hf(model, kv_itemsize: int = 4) -> ModelPhysics:
    """Count a transformers causal LM the same way (nn.Linear layers, its output embeddings)."""
    from torch import nn

    head = model.get_output_embeddings()
    head_ptr = head.weight.data_ptr() if head is not None else None
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear) and m is not head)
    lm_head = head.weight.numel() if head is not None else 0
    from turbollm.loader.footprint import unique_bytes

    weight_bytes = unique_bytes(model.parameters())
    untied = unique_bytes(m.weight for m in model.modules()
                           if isinstance(m, nn.Embedding) and m.weight.data_ptr() != head_ptr)
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers = cfg.num_hidden_layers
    return ModelPhysics(weight_bytes, weight_bytes - untied, linear, lm_head,
                        (2 * kv_heads * head_dim * kv_itemsize,) * layers, (None,) * layers)
