"""Greedy sampling cost per call: the plain-greedy path (argmax of the logits as they are) against the general path
(copy, penalties and masks, NaN pass, argmax) forced in the same run, over vocabulary sizes and batch sizes.

    python scripts/bench_sampler.py [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

import turbollm.worker.sampler as S
from turbollm.sampling_params import SamplingParams


def per_call_ms(batch: int, vocab: int, plain: bool, iters: int = 200) -> float:
    orig = S._plain_greedy
    if not plain:
        S._plain_greedy = lambda r: False  # the general path, as before the plain-greedy one existed
    try:
        logits = torch.randn(batch, vocab)
        rows = [S.SamplingRow(SamplingParams(temperature=0), [1, 2, 3], 2, (0,)) for _ in range(batch)]
        sampler = S.Sampler()
        for _ in range(5):
            sampler.sample(logits, rows)
        t0 = time.perf_counter()
        for _ in range(iters):
            sampler.sample(logits, rows)
        return (time.perf_counter() - t0) / iters * 1e3
    finally:
        S._plain_greedy = orig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args()
    torch.set_num_threads(ns.threads)
    print(f"greedy Sampler.sample, ms per call; torch {torch.__version__}, {ns.threads} threads, random float32 logits")
    for vocab in (49152, 151936):
        for batch in (1, 16, 64):
            a, b = per_call_ms(batch, vocab, False), per_call_ms(batch, vocab, True)
            print(f"vocab {vocab:6d} batch {batch:3d}: general {a:7.3f} ms  plain greedy {b:7.3f} ms  "
                  f"saved {a - b:7.3f} ms ({a / b:.2f}x); logits read {batch * vocab * 4 / b / 1e6:.1f} GB/s")


if __name__ == "__main__":
    main()
