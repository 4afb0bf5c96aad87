"""What `bench throughput` / `bench latency` and their vLLM peer run share: the workload's checks and
requests, and the K/V element size for the physics."""

from __future__ import annotations

from turbollm.errors import BenchmarkError


def kv_itemsize(engine) -> float:
    """Bytes per stored K/V element (a quantized format: its blocks' bytes, scales included, per element)."""
    import torch

    kv = getattr(engine, "kv_config", None)
    if kv is None:
        return torch.empty(0, dtype=torch.float32).element_size()
    lay = kv.groups[0].spec.layout
    return lay.bytes_per_token / (2 * lay.num_kv_heads * lay.head_dim)


def check_workload(ns) -> None:
    """Fail on bad flags or a missing data file before any model is loaded."""
    from turbollm.benchmarks.datasets import sharegpt_path

    for name in ("num_prompts", "output_len", "input_len", "max_input_len"):
        if getattr(ns, name) < 1:
            raise BenchmarkError(f"--{name.replace('_', '-')} must be >= 1")
    if any(b < 1 for b in ns.hf_batch_size):
        raise BenchmarkError("--hf-batch-size must be >= 1")
    if ns.dataset == "sharegpt":
        sharegpt_path(ns.data_dir)


def workload_requests(ns, tokenizer):
    """The benchmark's requests: ShareGPT prompts in file order, or random token ids."""
    from turbollm.benchmarks.datasets import random_requests, sharegpt_requests

    if ns.dataset == "sharegpt":
        return sharegpt_requests(tokenizer, ns.num_prompts, ns.output_len, ns.max_input_len, ns.data_dir)
    return random_requests(tokenizer, ns.num_prompts, ns.input_len, ns.output_len, ns.prompt_seed)
