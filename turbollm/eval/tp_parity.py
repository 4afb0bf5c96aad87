"""Tensor and pipeline parallelism against one process: the same greedy tokens, under the parity margin rule.

The reference is the same model in one process (`tensor_parallel_size=1`, one stage), greedy, with the top-2
logprobs of every generated token. The tensor-parallel run must give the reference's tokens up to
the first step where the reference's top-1/top-2 margin is below `parity.MARGIN` (past a near-tie
the ranks' different summation order may pick the other token; pipeline stages alone sum in the same
order, but a micro-batch's rows take other kernels' paths than the whole batch's), on the parity prompts and the
HumanEval prompts given. Also reported: each rank's resident weight bytes against the whole.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from turbollm.eval.parity import MARGIN


@dataclass
class PromptResult:
    name: str
    tokens: int  # greedy tokens compared
    equal_prefix: int  # leading tokens equal to the reference's
    first_tie: int | None  # first step whose reference margin is below MARGIN (None: none)
    max_logprob_diff: float  # over the equal prefix

    @property
    def ok(self) -> bool:
        return self.equal_prefix == self.tokens or (self.first_tie is not None and self.equal_prefix >= self.first_tie)


@dataclass
class TPParityReport:
    model: str
    quantization: str | None
    tensor_parallel_size: int
    pipeline_parallel_size: int = 1
    prompts: list[PromptResult] = field(default_factory=list)
    weight_bytes_whole: int = 0
    weight_bytes_per_rank: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.prompts)

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok, "margin": MARGIN,
                "token_exact": sum(p.equal_prefix == p.tokens for p in self.prompts)}


def _generate(llm, prompts: list[str], max_tokens: int, top: int):
    from turbollm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=top, ignore_eos=True)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def run_tp_parity(model: str, prompts: dict[str, str], size: int, max_tokens: int = 64,
                  quantization: str | None = None, threads: int | None = None, pp: int = 1) -> TPParityReport:
    from turbollm import LLM

    t0 = time.perf_counter()
    report = TPParityReport(model, quantization, size, pp)
    names, texts = list(prompts), list(prompts.values())
    one = LLM(model, quantization=quantization, threads=threads)
    ref = _generate(one, texts, max_tokens, 2)
    report.weight_bytes_whole = one.engine.executor.footprint.weight_bytes
    one.engine.shutdown()
    del one
    llm = LLM(model, quantization=quantization, threads=threads, tensor_parallel_size=size, pipeline_parallel_size=pp)
    try:
        got = _generate(llm, texts, max_tokens, 0)
        report.weight_bytes_per_rank = [f.weight_bytes for f in llm.engine.executor.call("footprint")]
    finally:
        llm.engine.shutdown()
    for name, r, g in zip(names, ref, got):
        margins = []
        for tok, pos in zip(r.token_ids, r.logprobs):
            ranked = sorted((lp.logprob for lp in pos.values()), reverse=True)
            margins.append(ranked[0] - ranked[1] if len(ranked) > 1 else float("inf"))
        equal = next((i for i, (a, b) in enumerate(zip(r.token_ids, g.token_ids)) if a != b), len(r.token_ids))
        diffs = [abs(r.logprobs[i][r.token_ids[i]].logprob - g.logprobs[i][g.token_ids[i]].logprob)
                 for i in range(equal)]
        report.prompts.append(PromptResult(name, len(r.token_ids), equal,
                                           next((i for i, m in enumerate(margins) if m < MARGIN), None),
                                           max(diffs, default=0.0)))
    report.seconds = time.perf_counter() - t0
    return report
