"""A workload as the planner sees it: each request's prompt and output lengths, and when it arrives.

`--workload` takes `random:IN:OUT` (N requests of IN prompt tokens and OUT new tokens), `sharegpt` (the
ShareGPT prompts' token counts under the model's tokenizer, OUT new tokens each: `sharegpt:OUT`, default
256) or `azure` (the Azure LLM inference trace's context and generated token counts and arrival times;
`azure:SPEEDUP` replays it faster). Requests arrive at once unless a rate (requests/s, Poisson) or the
trace's times say otherwise.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from turbollm.errors import BenchmarkError


@dataclass(frozen=True)
class WorkItem:
    prompt_len: int
    output_len: int
    arrival: float = 0.0  # seconds after the first request


@dataclass(frozen=True)
class Workload:
    name: str
    items: tuple[WorkItem, ...]
    prompts: tuple[tuple[int, ...], ...] | None = None  # each request's token ids (a text workload), else None

    @property
    def mean_in(self) -> float:
        return sum(i.prompt_len for i in self.items) / len(self.items)

    @property
    def mean_out(self) -> float:
        return sum(i.output_len for i in self.items) / len(self.items)

    def halves(self) -> tuple["Workload", "Workload"]:
        """Even and odd requests (the tuner measures on one, checks on the other)."""
        p = self.prompts
        return (Workload(self.name + "[even]", self.items[0::2], None if p is None else p[0::2]),
                Workload(self.name + "[odd]", self.items[1::2], None if p is None else p[1::2]))


def poisson(workload: Workload, rate: float, seed: int = 0) -> Workload:
    """`workload`'s requests arriving as a Poisson process of `rate` requests/s (the first at 0)."""
    rng, t, items = random.Random(seed), 0.0, []
    for it in workload.items:
        items.append(WorkItem(it.prompt_len, it.output_len, t))
        t += rng.expovariate(rate)
    return Workload(f"{workload.name}@{rate:.3g}/s", tuple(items), workload.prompts)


def parse_workload(spec: str, tokenizer=None, num: int = 64, max_input_len: int = 1024, max_output_len: int = 256,
                   rate: float | None = None, data_dir: str | Path | None = None, seed: int = 0) -> Workload:
    """The workload named by `spec` (see the module's docstring); a BenchmarkError naming what is wrong."""
    kind, _, rest = spec.partition(":")
    prompts = None
    if num < 1:
        raise BenchmarkError(f"a workload needs at least one request, got {num}")
    if kind == "random":
        parts = rest.split(":")
        try:
            n_in, n_out = (int(p) for p in parts)
        except ValueError:
            raise BenchmarkError(f"workload {spec!r}: write random:IN:OUT with two whole numbers, e.g. "
                                 "random:256:128") from None
        if n_in < 1 or n_out < 1:
            raise BenchmarkError(f"workload {spec!r}: IN and OUT must be >= 1")
        items = [WorkItem(n_in, n_out) for _ in range(num)]
    elif kind == "sharegpt":
        from turbollm.benchmarks.datasets import load_sharegpt_texts

        out = _int(rest, spec, 256)
        if tokenizer is None:
            raise BenchmarkError("the sharegpt workload needs the model's tokenizer")
        texts = load_sharegpt_texts(data_dir, num)
        if not texts:
            raise BenchmarkError("the ShareGPT file holds no prompts")
        prompts = tuple(tuple(ids[:max_input_len]) for ids in tokenizer.encode_batch(texts))
        items = [WorkItem(max(1, len(ids)), out) for ids in prompts]
    elif kind == "azure":
        try:
            speedup = float(rest or 1.0)
        except ValueError:
            raise BenchmarkError(f"workload {spec!r}: azure:SPEEDUP takes a number, e.g. azure:2") from None
        items = _azure(data_dir, num, max_input_len, max_output_len, speedup)
    else:
        raise BenchmarkError(f"unknown workload {spec!r}: give random:IN:OUT, sharegpt[:OUT] or azure[:SPEEDUP]")
    wl = Workload(spec, tuple(items), prompts)
    return poisson(wl, rate, seed) if rate is not None and kind != "azure" else wl


def _int(text: str, spec: str, default: int) -> int:
    if not text:
        return default
    try:
        v = int(text)
    except ValueError:
        raise BenchmarkError(f"workload {spec!r}: {text!r} is not a whole number") from None
    if v < 1:
        raise BenchmarkError(f"workload {spec!r}: the output length must be >= 1")
    return v


def _azure(data_dir, num: int, max_in: int, max_out: int, speedup: float) -> list[WorkItem]:
    from turbollm.benchmarks.datasets import default_data_dir
    from turbollm.benchmarks.serve_bench import azure_trace_requests

    if speedup <= 0:
        raise BenchmarkError("azure:SPEEDUP must be > 0")
    path = (Path(data_dir) if data_dir else default_data_dir()) / "azure_llm_trace" / "AzureLLMInferenceTrace_conv.csv"
    reqs = azure_trace_requests(path, num, max_in, max_out, speedup)
    if not reqs:
        raise BenchmarkError(f"{path} holds no requests")
    return [WorkItem(len(r.prompt), r.max_tokens, r.arrival) for r in reqs]
