"""The tuner's search (the steps are in planner/tuner.py's docstring): planner-pruned candidates, real runs on
the tuning half, the held-out check, the winner's config file and the Pareto plot."""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import time
from dataclasses import dataclass, field

from turbollm.errors import BenchmarkError
from turbollm.planner.slo import ATTAINMENT, attainment, served_rate
from turbollm.planner.tuner import (BATCHED, KV_DTYPES, LOSSY, SEQS, WEIGHTS, Candidate, Measured, choose_block_size,
                                    plot_pareto, predicted_goodput, quality_loss)
from turbollm.planner.workload import Workload, poisson
from turbollm.procfs import available_memory

#: the time left that measuring a candidate needs: the profiles stop before another would leave less (the first
#: always runs), and no candidate starts with less
MEASURE_SECONDS = 60.0


@dataclass
class TuneReport:
    model: str
    slo: dict
    block_size: int
    hit_rates: dict
    predicted: list[dict] = field(default_factory=list)  # every candidate the planner ranked
    quality: dict = field(default_factory=dict)  # "weights/kv" -> perplexity change, or the reason it is missing
    tuned: list[Measured] = field(default_factory=list)  # measured on the tuning half
    held_out: list[Measured] = field(default_factory=list)  # the winner, the default, the best recipe
    winner: Candidate | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict:
        def m(x: Measured) -> dict:
            return {"candidate": x.candidate.label, "settings": x.candidate.settings(), "goodput": round(x.goodput, 4),
                    "rate": x.rate, "runs": x.runs}

        return {"model": self.model, "slo_s": self.slo, "block_size": self.block_size,
                "prefix_hit_rates": self.hit_rates, "predicted": self.predicted, "quality": self.quality,
                "tuning_half": [m(x) for x in self.tuned], "held_out_half": [m(x) for x in self.held_out],
                "winner": self.winner.settings() if self.winner else None, "seconds": round(self.seconds, 1)}


class Clock:
    def __init__(self, minutes: float):
        self.t0, self.budget = time.perf_counter(), 60.0 * minutes

    @property
    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def log(self, msg: str) -> None:
        used = time.perf_counter() - self.t0
        print(f"[tune {used / 60:4.1f}/{self.budget / 60:.0f} min] {msg}", file=sys.stderr, flush=True)


def recipe_candidates(block: int) -> list[Candidate]:
    """The shipped recipes that apply to one engine on this host (no parallelism, no speculation, no policy)."""
    from turbollm.recipes import load_recipe, recipe_names

    out = []
    for name in recipe_names():
        s = load_recipe(name).settings
        if any(s.get(k) not in (None, 1, "auto") for k in ("tensor_parallel_size", "pipeline_parallel_size",
                                                           "kv_policy")) or s.get("speculative_config"):
            continue
        q = s.get("quantization")
        out.append(Candidate(int(s.get("max_num_seqs", 64)), int(s.get("max_num_batched_tokens", 2048)),
                             s.get("kv_cache_dtype", "auto"), None if q in (None, "gguf") else q,
                             s.get("block_size"), f"recipe:{name}"))
    return out


def start_rate(base, cand: Candidate, work: Workload, slo: dict, fallback: float) -> float:
    """The planner's goodput for `cand` when a profile of its formats is cached (else `fallback`): where its real
    runs start."""
    from turbollm.planner.plan import make_plan
    from turbollm.planner.profile import cached_profile

    args = cand.args(base)
    prof = cached_profile(args)
    if prof is None:
        return fallback
    plan = make_plan(args, work, prof)
    good, _ = predicted_goodput(prof.cost, cand, work, slo, plan.kv_tokens, args.block_size)
    return good or fallback


def measure_goodput(base, cand: Candidate, work: Workload, slo: dict, start: float, clock: Clock,
                    tries: int = 5) -> Measured:
    """Real runs of `cand` on `work` at Poisson rates stepped from `start` (x1.5 up while >= 90% are inside,
    /1.5 down while not), then halfway (geometrically) between the best rate that held and the lowest that did
    not, within the clock."""
    from turbollm.engine.llm_engine import LLMEngine
    from turbollm.planner.replay import replay

    engine = LLMEngine.from_engine_args(cand.args(base))
    res = Measured(cand, 0.0, None)
    failed: float | None = None  # the lowest rate that did not hold
    try:
        rate, direction = max(start, 0.02), 0
        for _ in range(tries):
            expected = len(work.items) / rate + 30.0
            if clock.left < min(expected, 60.0):
                break
            run = replay(engine, poisson(work, rate), time_limit=min(clock.left, 3 * expected))
            att = attainment(run, slo, len(work.items))
            tpot = sorted(run.tpot)
            res.runs.append({"rate": round(rate, 4), "attainment": round(att, 3), "served_rps": round(served_rate(run), 4),
                             "output_tok_s": round(run.output_tok_s, 1),
                             "per_user_tok_s": round(1 / (sum(tpot) / len(tpot)), 2) if tpot and sum(tpot) > 0 else 0.0,
                             "ttft_p99_ms": round(1e3 * sorted(run.ttft)[int(0.99 * (len(run.ttft) - 1))], 1)
                             if run.ttft else None})
            clock.log(f"  {cand.name or 'candidate'} at {rate:.3g} req/s: {100 * att:.0f}% inside the SLO, "
                      f"{run.output_tok_s:.1f} tok/s")
            ok = att >= ATTAINMENT
            if ok and served_rate(run) > res.goodput:
                res.goodput, res.rate = served_rate(run), rate
            if not ok:
                failed = rate if failed is None else min(failed, rate)
            if direction == 2:  # the one step between the bracket's ends is done
                break
            if ok and direction >= 0 and failed is None:
                rate, direction = rate * 1.5, 1
            elif not ok and direction <= 0 and res.rate is None:
                rate, direction = rate / 1.5, -1
            elif res.rate is not None and failed is not None:
                rate, direction = math.sqrt(res.rate * failed), 2
            else:
                break
    finally:
        engine.shutdown()
    return res


def run_tune(base, workload: Workload, slo: dict, minutes: float, max_quality_loss: float | None,
             top: int = 3) -> TuneReport:
    from turbollm.planner.plan import make_plan
    from turbollm.planner.profile import profile

    clock = Clock(minutes)
    tune_half, held_half = workload.halves()
    block, hits = choose_block_size(tune_half.prompts or ())  # (random token ids share no prefix)
    rep = TuneReport(base.model, slo, block, {str(k): round(v, 4) for k, v in hits.items()})
    clock.log(f"{len(tune_half.items)} requests to tune on, {len(held_half.items)} held out; prefix-cache hit rate by "
              f"block size {rep.hit_rates}: block {block}")
    avail = available_memory()
    ranked, last_profile = [], 0.0
    for weights, kv in itertools.product(WEIGHTS, KV_DTYPES):
        if clock.left < 0.5 * clock.budget:
            clock.log("half the budget spent on profiles: no more weight/K-V formats")
            break
        if last_profile and clock.left - last_profile < MEASURE_SECONDS:
            clock.log("another profile would leave too little time to measure: no more weight/K-V formats")
            break
        probe = Candidate(SEQS[-1], BATCHED[-1], kv, weights, block if kv == "float16" else max(block, 32))
        started = clock.left
        try:
            prof = profile(probe.args(base), log=clock.log)
        except Exception as e:  # a format this model cannot take (int4 groups...): say so, go on
            clock.log(f"  no profile for weights={weights or 'file'} kv={kv}: {e}")
            continue
        finally:
            last_profile = started - clock.left
        for seqs, batched in itertools.product(SEQS, BATCHED):
            cand = dataclasses.replace(probe, max_num_seqs=seqs, max_num_batched_tokens=batched)
            plan = make_plan(cand.args(base), tune_half, prof)
            if plan.memory.peak > avail:
                continue
            good, _ = predicted_goodput(prof.cost, cand, tune_half, slo, plan.kv_tokens, cand.block_size or block)
            ranked.append((good, cand))
    ranked.sort(key=lambda gc: -gc[0])
    rep.predicted = [{"candidate": c.label, "predicted_goodput": round(g, 4)} for g, c in ranked]
    clock.log(f"planner: {len(ranked)} candidates fit; best predicted " +
              ", ".join(f"{g:.3g} req/s ({c.label})" for g, c in ranked[:top]))
    chosen: list[tuple[float, Candidate]] = []
    for good, cand in ranked:
        if len(chosen) >= top or good <= 0:
            break
        key = f"{cand.quantization or 'file'}/{cand.kv_cache_dtype}"
        lossy = cand.kv_cache_dtype in LOSSY["kv_cache_dtype"] or cand.quantization in LOSSY["quantization"]
        if lossy and key not in rep.quality:
            if max_quality_loss is None:
                rep.quality[key] = "lossy: skipped (no --max-quality-loss)"
            else:
                clock.log(f"quality of {key} (eval ppl on WikiText-2)")
                rep.quality[key] = round(quality_loss(base.model, cand.quantization, cand.kv_cache_dtype), 5)
                clock.log(f"  perplexity {100 * rep.quality[key]:+.2f}% against the file's weights with float16 K/V "
                          f"(bound {100 * max_quality_loss:.2f}%)")
        if lossy and not (isinstance(rep.quality.get(key), float) and rep.quality[key] <= max_quality_loss):
            continue
        chosen.append((good, cand))
    default = Candidate(base.max_num_seqs, base.max_num_batched_tokens, "auto", None, None, "default")
    fallback = chosen[0][0] if chosen else 0.1
    lineup = list(chosen) + [(start_rate(base, c, tune_half, slo, fallback), c)
                             for c in [default, *recipe_candidates(block)]]
    for start, cand in lineup:
        if clock.left < MEASURE_SECONDS:
            clock.log("out of time: the rest are not measured")
            break
        clock.log(f"measuring {cand.label} on the tuning half from {start:.3g} req/s")
        rep.tuned.append(measure_goodput(base, cand, tune_half, slo, start, clock))
    searched = [m for m in rep.tuned if not m.candidate.name]
    if not searched:
        raise BenchmarkError("no candidate could be measured within the budget (raise --minutes)")
    best = max(searched, key=lambda m: m.goodput)
    rep.winner = best.candidate
    recipes = [m for m in rep.tuned if m.candidate.name.startswith("recipe:")]
    finals = [best] + [m for m in rep.tuned if m.candidate.name == "default"]
    if recipes:
        finals.append(max(recipes, key=lambda m: m.goodput))
    for m in finals:
        if clock.left < 30:
            clock.log("out of time for the held-out check")
            break
        clock.log(f"held-out half: {m.candidate.label}")
        rep.held_out.append(measure_goodput(base, m.candidate, held_half, slo, m.rate or 0.1, clock))
    rep.seconds = clock.budget - clock.left
    return rep


def winner_yaml(rep: TuneReport, workload: str) -> str:
    lines = [f"# turbollm tune {rep.model} --workload {workload}: the winner of {len(rep.tuned)} measured "
             f"configurations under {rep.slo} (seconds)"]
    for m in rep.held_out:
        lines.append(f"# held-out goodput {m.goodput:.4g} req/s: {m.candidate.name or 'this configuration'}")
    lines += [f"{k}: {v}" for k, v in rep.winner.settings().items()]
    return "\n".join(lines) + "\n"


def plot(rep: TuneReport, path: str) -> None:
    plot_pareto(rep.tuned + rep.held_out, path, f"turbollm tune {rep.model}: every measured run (red: Pareto front)")
