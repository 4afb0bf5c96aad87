"""The transformers baseline: the same requests through `model.generate` in static padded batches.

The model is `AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)` for a
GGUF file (transformers dequantizes it to the same fp32 weights we hold), or the folder itself
for a Hugging Face checkpoint. Requests are sorted by prompt length (shortest first) to reduce
padding, cut into batches of `batch_size`, left-padded with an attention mask, and generated
greedily with `max_new_tokens = min_new_tokens = output_len` (every row yields exactly
`output_len` tokens, as turbollm's requests do). The timed region is every `generate` call
plus decoding the new tokens to text (turbollm detokenizes as it goes); loading and one tiny
warm-up call are outside it. Same process, same threads, same prompt ids as turbollm.

Physics: weight bytes read per step × forward steps/s (one prefill + output_len - 1 decode
forwards per batch), GFLOP/s over the useful tokens (padding left out) and over every token
transformers actually computed (padding included).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from turbollm.benchmarks.datasets import BenchRequest
from turbollm.benchmarks.physics import Ceilings, ModelPhysics, bandwidth_figures, compute_figures, gflops
from turbollm.errors import BenchmarkError


def load_hf_model(resolved):
    """transformers' model for the checkpoint `resolved` points at, in fp32, eval mode."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise BenchmarkError("the hf backend needs transformers (pip install 'turbollm[test]')") from None
    from turbollm.hub.resolve import CheckpointFormat

    path = resolved.path
    with _quiet_transformers():
        if resolved.format is CheckpointFormat.GGUF:
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()


@contextmanager
def _quiet_transformers():
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    old, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(old)
        if bars:
            hf_logging.enable_progress_bar()


def pad_id_for(model, tokenizer) -> int:
    """The model's pad token, else the tokenizer's, else EOS (what is padded is masked anyway)."""
    for tid in (getattr(model.generation_config, "pad_token_id", None), getattr(tokenizer, "pad_token_id", None),
                tokenizer.eos_token_id):
        if isinstance(tid, int):
            return tid
    return 0


def _batch_tensors(batch: list[BenchRequest], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for row, r in enumerate(batch):
        ids[row, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids, dtype=torch.int64)
        mask[row, width - r.prompt_len:] = 1
    return ids, mask


def _generate(model, ids: torch.Tensor, mask: torch.Tensor, output_len: int, pad_id: int) -> torch.Tensor:
    with _quiet_transformers(), torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=output_len,
                             min_new_tokens=output_len, pad_token_id=pad_id)
    return out[:, ids.shape[1]:]


def run_hf_throughput(model, tokenizer, requests: list[BenchRequest], batch_size: int, phys: ModelPhysics,
                      ceilings: Ceilings, warmup: bool = True) -> dict:
    """Time transformers on `requests` in static batches of `batch_size` (see the module docstring)."""
    output_len = requests[0].output_len
    if any(r.output_len != output_len for r in requests):
        raise BenchmarkError("the hf backend needs one output length for every request")
    pad_id = pad_id_for(model, tokenizer)
    if warmup:
        ids, mask = _batch_tensors([BenchRequest(requests[0].prompt_token_ids[:8], 2)], pad_id)
        _generate(model, ids, mask, 2, pad_id)
    ordered = sorted(requests, key=lambda r: r.prompt_len)
    batches = [ordered[i:i + batch_size] for i in range(0, len(ordered), batch_size)]
    padded_prompt_tokens = output_tokens = 0
    t0 = time.perf_counter()
    for batch in batches:
        ids, mask = _batch_tensors(batch, pad_id)
        new = _generate(model, ids, mask, output_len, pad_id)
        if new.shape[1] != output_len:
            raise BenchmarkError(f"transformers generated {new.shape[1]} tokens instead of {output_len}")
        for row in new.tolist():
            tokenizer.decode(row, skip_special_tokens=True)
        padded_prompt_tokens += ids.numel()
        output_tokens += new.numel()
    elapsed = time.perf_counter() - t0
    n = len(requests)
    prompt_tokens = sum(r.prompt_len for r in requests)
    steps = len(batches) * output_len
    useful = prompt_tokens + n * (output_len - 1)
    computed = padded_prompt_tokens + n * (output_len - 1)
    return {
        "backend": "hf", "batch_size": batch_size, "num_batches": len(batches),
        "elapsed_s": round(elapsed, 3), "num_requests": n,
        "prompt_tokens": prompt_tokens, "padded_prompt_tokens": padded_prompt_tokens, "output_tokens": output_tokens,
        "requests_per_s": round(n / elapsed, 3),
        "output_tok_per_s": round(output_tokens / elapsed, 2),
        "total_tok_per_s": round((prompt_tokens + output_tokens) / elapsed, 2),
        "steps": steps,
        "physics": {"all_steps": {**bandwidth_figures(phys, steps, elapsed, ceilings),
                                  **compute_figures(phys, useful, output_tokens, elapsed, ceilings),
                                  "GFLOPs_incl_padding": round(gflops(phys.flops(computed, output_tokens), elapsed), 2)},
                    "weights_read_per_step_MB": round(phys.step_weight_bytes / 1e6, 1)},
    }


def best_run(runs: list[dict]) -> dict:
    """The batch size with the highest output tok/s."""
    return max(runs, key=lambda r: r["output_tok_per_s"])
