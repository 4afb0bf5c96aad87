"""`turbollm bench spec`: speculative decoding against none, in one run, on HumanEval prompts.

Each setting (no speculation, then each speculative config, at each batch size, and for the K sweep
each config with K pinned) builds its engine, warms it up with one short request, then runs every
prompt to `max_tokens` greedy tokens, end to end (prefill included): one prompt at a time at batch
1, else all submitted with `max_num_seqs` = B. Reported per setting: output tokens/s, the speedup
over no speculation at the same batch size, the acceptance rate (accepted / proposed drafts), the
mean accepted length (tokens per verification step, the target's own token included), the time in
the proposer ("draft") and the rest ("verify": the target's steps and the engine), and whether
the outputs equal the baseline's token for token.

Datasets: `humaneval` (the problems' prompts: plain code completion) and `rewrite`, an
input-grounded task built from the same problems: the prompt, its canonical solution, then
`REWRITE_INSTRUCTION`, so the model writes the given function again with one small change (no
docstring) and most of its output is in its input.
"""

from __future__ import annotations

import gzip
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from turbollm.benchmarks.datasets import default_data_dir
from turbollm.errors import BenchmarkError

REWRITE_INSTRUCTION = "\n\n# The same function, with its docstring removed:\n"
DATASETS = ("humaneval", "rewrite")


def humaneval_prompts(dataset: str, data_dir: str | Path | None, count: int | None) -> list[str]:
    path = Path(data_dir or default_data_dir()) / "humaneval" / "HumanEval_0-81.jsonl.gz"
    if not path.exists():
        raise BenchmarkError(f"HumanEval problems not found at {path} (--data-dir: the folder holding humaneval/)")
    problems = [json.loads(line) for line in gzip.open(path, "rt", encoding="utf-8")][:count]
    if dataset == "humaneval":
        return [p["prompt"] for p in problems]
    if dataset == "rewrite":
        return [p["prompt"] + p["canonical_solution"] + REWRITE_INSTRUCTION for p in problems]
    raise BenchmarkError(f"unknown dataset {dataset!r} (choose from {', '.join(DATASETS)})")


@dataclass
class SpecRun:
    name: str  # "none" or the method
    batch: int
    k: int | None  # None: no speculation; else num_speculative_tokens
    adaptive: bool
    seconds: float
    tokens: int
    propose_seconds: float = 0.0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def acceptance(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def row(self, base: "SpecRun | None") -> dict[str, Any]:
        return {"setting": self.name, "batch": self.batch, "K": self.k if self.k is not None else "-",
                "adaptive": self.adaptive, "tok_s": round(self.tok_s, 2),
                "speedup": round(base.seconds / self.seconds * self.tokens / base.tokens, 3) if base else None,
                "acceptance": round(self.acceptance, 3) if self.acceptance is not None else None,
                "mean_accepted_len": round(self.mean_accepted_length, 2) if self.mean_accepted_length else None,
                "draft_s": round(self.propose_seconds, 2), "verify_s": round(self.seconds - self.propose_seconds, 2),
                "token_exact": (self.outputs == base.outputs) if base else None}


def run_setting(args, config: dict | None, prompts: list[str], batch: int, max_tokens: int) -> SpecRun:
    """One engine with `config` (None: no speculation) and max_num_seqs = batch; every prompt, timed."""
    from turbollm import LLM, SamplingParams

    kw = {k: v for k, v in vars(replace(args, speculative_config=config, max_num_seqs=batch)).items()
          if k != "model"}
    llm = LLM(args.model, **kw)
    try:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
        sched = llm.engine.scheduler
        for key in sched.spec_counts:
            sched.spec_counts[key] = 0
        sched.spec_accepted_per_pos = [0] * len(sched.spec_accepted_per_pos)
        sched.propose_seconds = 0.0
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        if batch == 1:
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = [o.outputs[0].token_ids for o in outs]
        spec = llm.engine.args.speculative_config
        return SpecRun(config["method"] if config else "none", batch, spec.num_speculative_tokens if spec else None,
                       bool(spec and spec.adaptive), seconds, sum(map(len, tokens)), sched.propose_seconds,
                       accepted_per_pos=list(sched.spec_accepted_per_pos), outputs=tokens, **sched.spec_counts)
    finally:
        llm.engine.shutdown()
        del llm


def step_cost_profile(args) -> dict[int, float]:
    """The target's decode-shaped step time by rows (the adaptive planner's start-up profile), in ms."""
    from turbollm import LLM
    from turbollm.engine.step_profile import profile_step_costs
    from turbollm.spec_decode.adaptive import AdaptivePlanner

    kw = {k: v for k, v in vars(replace(args, speculative_config=None, max_num_seqs=max(args.max_num_seqs, 16)))
          .items() if k != "model"}
    llm = LLM(args.model, **kw)
    try:
        engine = llm.engine
        engine.scheduler.planner = planner = AdaptivePlanner(1, 16)  # what observes the steps' times
        profile_step_costs(engine, rows=tuple(range(1, 9)) + (16,), steps=6)
        costs = planner.costs
        return {r: round(costs.sums[r] / costs.weights[r] * 1000, 2) for r in sorted(costs.weights)}
    finally:
        llm.engine.shutdown()


def plot(runs: list[SpecRun], bases: dict[int, SpecRun], path: str) -> bool:
    """Speedup against K (batch 1, K pinned; adaptive dashed) and against batch size; False without matplotlib."""
    from turbollm.benchmarks.report import pyplot

    plt = pyplot()
    if plt is None:
        return False
    fig, (ax_k, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r.name for r in runs if r.k is not None):
        fixed = sorted((r.k, bases[1].seconds / r.seconds) for r in runs
                       if r.name == name and r.batch == 1 and not r.adaptive and 1 in bases)
        if fixed:
            line = ax_k.plot([k for k, _ in fixed], [s for _, s in fixed], marker="o", label=f"{name}, K pinned")
            for r in runs:
                if r.name == name and r.batch == 1 and r.adaptive:
                    ax_k.axhline(bases[1].seconds / r.seconds, linestyle="--", color=line[0].get_color(),
                                 label=f"{name}, adaptive (K ≤ {r.k})")
        by_batch = sorted((r.batch, bases[r.batch].seconds / r.seconds) for r in runs
                          if r.name == name and r.adaptive and r.batch in bases)
        if by_batch:
            ax_b.plot([b for b, _ in by_batch], [s for _, s in by_batch], marker="o", label=name)
    for ax, xlabel in ((ax_k, "K (drafts per step)"), (ax_b, "batch size (concurrent requests)")):
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("speedup over no speculation")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax_k.set_title("batch 1")
    ax_b.set_title("adaptive K")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True
