"""`turbollm tune`: the engine configuration with the most goodput on a workload under an SLO.

1. The workload's requests split in two: the even ones tune, the odd ones are held out for the final check.
2. The block size from the prefix-cache hit rate the workload's own prompts would have (`prefix_hit_rate`:
   the blocks whose whole token prefix an earlier request already had, for each size): the largest size
   within 2 points of the best (fewer, larger blocks cost less to look up and copy).
3. The planner prunes: for every candidate (max_num_seqs x max_num_batched_tokens x K/V dtype x weight
   format) that fits in memory, the highest Poisson rate at which the simulated run keeps >= 90% of the
   requests inside the SLO (bisection over the rate; one cached profile per weight format x K/V dtype).
4. Lossy choices (int8 K/V, int8 weights) are measured by `eval ppl` against the file's own weights with
   float16 K/V and dropped past --max-quality-loss.
5. The best few by predicted goodput, the default configuration and the shipped recipes run for real on the
   tuning half (`replay`: requests at their arrival times): each one's goodput is the highest rate tried at
   which >= 90% of requests were inside, found by stepping the rate up or down from the prediction.
6. The winner, the default and the best recipe run again on the held-out half; the winner is written as a
   config file (`--config`), and every measured run is a point of the Pareto plot (tokens/s per user against
   total tokens/s).
Everything stops at the --minutes budget: what was measured by then decides. The profiles take at most half of it
and stop before one would leave less than a measurement needs (tune_search.MEASURE_SECONDS), so a short budget on a
busy machine profiles fewer formats rather than measuring nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from dataclasses import dataclass, field

from turbollm.planner.simulate import SimResult, simulate
from turbollm.planner.slo import ATTAINMENT, attainment
from turbollm.planner.workload import Workload, poisson

SEQS = (4, 8, 16, 32, 64)
BATCHED = (256, 512, 1024, 2048)
KV_DTYPES = ("float16", "int8")
WEIGHTS = (None, "int8")  # None: the checkpoint's own format (a GGUF's blocks)
LOSSY = {"kv_cache_dtype": ("int8", "int4"), "quantization": ("int8", "int4")}


@dataclass(frozen=True)
class Candidate:
    max_num_seqs: int
    max_num_batched_tokens: int
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    block_size: int | None = None
    name: str = ""  # "default", "recipe:NAME", or empty for a searched one

    @property
    def label(self) -> str:
        w = self.quantization or "file"
        return (self.name + " " if self.name else "") + (f"seqs={self.max_num_seqs} batched={self.max_num_batched_tokens} "
                                                         f"kv={self.kv_cache_dtype} weights={w} block={self.block_size}")

    @property
    def short(self) -> str:
        """For a plot: the name, or the knots in a few characters."""
        w = f" w{self.quantization}" if self.quantization else ""
        return self.name or f"s{self.max_num_seqs} b{self.max_num_batched_tokens} {self.kv_cache_dtype}{w}"

    def args(self, base):
        return dataclasses.replace(base, max_num_seqs=self.max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens,
                                   kv_cache_dtype=self.kv_cache_dtype, quantization=self.quantization,
                                   block_size=self.block_size, kv_recent_window=None)

    def settings(self) -> dict:
        d = {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
             "kv_cache_dtype": self.kv_cache_dtype}
        if self.quantization:
            d["quantization"] = self.quantization
        if self.block_size:
            d["block_size"] = self.block_size
        return d


@dataclass
class Measured:
    candidate: Candidate
    goodput: float  # requests/s finished at the best rate with >= 90% inside (0: no rate tried met it)
    rate: float | None  # that rate
    runs: list[dict] = field(default_factory=list)  # every rate tried: rate, attainment, tokens/s, per-user tok/s


def prefix_hit_rate(prompts: list[list[int]], block_size: int) -> float:
    """The share of prompt tokens in full blocks whose whole prefix an earlier prompt had (what a prefix cache
    of unlimited size would serve, blocks of `block_size`)."""
    seen: set[bytes] = set()
    hit = total = 0
    for ids in prompts:
        total += len(ids)
        h = b""
        for b in range(len(ids) // block_size):
            h = hashlib.blake2b(h + repr(ids[b * block_size:(b + 1) * block_size]).encode(), digest_size=16).digest()
            if h in seen:
                hit += block_size
            seen.add(h)
    return hit / max(1, total)


def choose_block_size(prompts: list[list[int]], sizes=(16, 32)) -> tuple[int, dict[int, float]]:
    rates = {b: prefix_hit_rate(prompts, b) for b in sizes}
    best = max(rates.values())
    return max(b for b, r in rates.items() if r >= best - 0.02), rates


def predicted_goodput(cost, cand: Candidate, work: Workload, slo: dict, kv_tokens: int | None, block: int,
                      lo: float = 0.01, hi: float = 64.0, iters: int = 10) -> tuple[float, SimResult | None]:
    """(the highest rate the simulated run holds with >= 90% inside, that run), by bisection in log rate."""
    def ok(rate: float) -> tuple[bool, SimResult]:
        r = simulate(poisson(work, rate), cost, cand.max_num_seqs, cand.max_num_batched_tokens, kv_tokens, block)
        return attainment(r, slo, len(work.items)) >= ATTAINMENT, r

    good, run = ok(lo)
    if not good:
        return 0.0, None
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        g, r = ok(mid)
        lo, hi = (mid, hi) if g else (lo, mid)
        if g:
            run = r
    return lo, run


@functools.lru_cache(maxsize=None)
def _ppl(model: str, quantization: str | None, kv: str, tokens: int, ctx: int) -> float:
    """`eval ppl` of one configuration, once per process (the reference is shared by every lossy choice)."""
    from turbollm.eval.ppl_run import wikitext_ppl

    return wikitext_ppl(model, quantization, kv, tokens, ctx)


def quality_loss(model: str, quantization: str | None, kv: str, tokens: int = 2048, ctx: int = 512) -> float:
    """Perplexity change (fraction) of weights `quantization` and K/V `kv` against the file's own weights with
    float16 K/V, on WikiText-2 (`turbollm eval ppl`: the first `tokens` tokens, windows of `ctx`)."""
    return _ppl(model, quantization, kv, tokens, ctx) / _ppl(model, None, "float16", tokens, ctx) - 1.0


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (more is better on each)."""
    return [i for i, (x, y) in enumerate(points)
            if not any(x2 >= x and y2 >= y and (x2, y2) != (x, y) for x2, y2 in points)]


def plot_pareto(measured: list[Measured], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts, labels = [], []
    for m in measured:
        for r in m.runs:
            pts.append((r["output_tok_s"], r["per_user_tok_s"]))
            labels.append(m.candidate.short)
    front = set(pareto_front(pts))
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], c=["C3" if i in front else "C0" for i in range(len(pts))])
    for i in sorted(front, key=lambda i: pts[i][0]):
        ax.annotate(labels[i], pts[i], fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("total output tokens/s")
    ax.set_ylabel("tokens/s per user (1 / mean time per output token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
