"""Where a quantized model departs from its reference: the output error of every residual branch.

For each decoder layer and each of its residual branches (attention, MLP; the `Branch` of
`turbollm.models.branches`), the candidate's branch and the reference's are run on the same
input, the **reference model's own residual stream** over some text, so an error is charged to the
branch that makes it and not to the layers before it. With y the reference branch's output and ŷ
the candidate's (after Gemma's post-branch norm: what is added to the stream), summed over tokens:

- ``rel_error`` = ‖ŷ − y‖² / ‖y‖²: how far the branch is from the reference;
- ``gain`` = ⟨ŷ − y, y⟩ / ⟨y, y⟩: the part of the error along the output itself. Rounding noise
  averages out of it; a systematic shrink (negative) or amplification (positive) of what the branch
  writes does not, and over many layers it moves how confident the model's output is. On
  qwen2.5-coder-0.5b both round-to-nearest int4's and AWQ's attention branches shrink on average
  (−1.3% and −0.9%), where perplexity and KLD rank the two differently (docs/AWQ_QWEN.md).

Branch outputs live in the residual stream's basis, so scales a method folds inside a branch (AWQ's,
the int8 equalization's) need no undoing. The embedding, final norm and LM head are not branches and
are not compared. `turbollm eval branches` is the command.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from turbollm.eval.perplexity import EvalError
from turbollm.models.branches import get_adapter
from turbollm.quantize.calibration_runner import CalibrationRunner


@dataclass(frozen=True)
class BranchError:
    """One branch of one layer: its output error against the reference's, over `tokens` tokens."""

    layer: int
    branch: str  # "self_attn" | "mlp"
    rel_error: float  # ‖ŷ − y‖² / ‖y‖²
    gain: float  # ⟨ŷ − y, y⟩ / ⟨y, y⟩
    tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


def _check_pair(ref: torch.nn.Module, cand: torch.nn.Module) -> None:
    rc, cc = ref.config, cand.config
    if rc.arch != cc.arch:
        raise EvalError(f"the candidate is a {cc.arch} model and the reference a {rc.arch} model")
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim"):
        if getattr(rc, field) != getattr(cc, field):
            raise EvalError(f"the candidate and the reference differ in {field}: "
                            f"{getattr(cc, field)} against {getattr(rc, field)}")


@torch.no_grad()
def branch_errors(ref: torch.nn.Module, cand: torch.nn.Module, windows: torch.Tensor, *,
                  progress: bool = True) -> list[BranchError]:
    """The `BranchError` of every branch of `cand` against `ref` (two CausalLMs of one architecture)
    on token `windows` ``[S, L]``, each window one causal sequence; layers in order, attention first."""
    from tqdm import tqdm

    _check_pair(ref, cand)
    adapter = get_adapter(ref.config.arch)
    runner = CalibrationRunner(ref, windows)
    x = runner.embed(adapter)
    out: list[BranchError] = []
    pairs = list(zip(ref.model.layers, cand.model.layers))
    for i, (ref_layer, cand_layer) in enumerate(tqdm(pairs, desc="branches", unit="layer", disable=not progress)):
        for rb, cb in zip(adapter.branches(ref_layer), adapter.branches(cand_layer)):
            ey = yy = ee = 0.0
            for rows, batch in runner.batches:
                xr = x[rows]
                y = rb.inner(rb.norm(xr), batch)
                yc = cb.inner(cb.norm(xr), batch)
                y_out = (rb.post(y) if rb.post is not None else y).double()
                e = (cb.post(yc) if cb.post is not None else yc).double() - y_out
                ey += float((e * y_out).sum())
                yy += float((y_out * y_out).sum())
                ee += float((e * e).sum())
                x[rows] = rb.residual(xr, y)
            yy = max(yy, 1e-30)
            out.append(BranchError(i, rb.name, ee / yy, ey / yy, runner.num_tokens))
    return out


def summarize(errors: list[BranchError]) -> dict[str, dict[str, float]]:
    """Per branch kind: mean relative error, mean / min / max gain, layers whose gain is negative."""
    summary: dict[str, dict[str, float]] = {}
    for kind in dict.fromkeys(e.branch for e in errors):
        rows = [e for e in errors if e.branch == kind]
        gains = [e.gain for e in rows]
        summary[kind] = {"layers": len(rows), "mean_rel_error": sum(e.rel_error for e in rows) / len(rows),
                         "mean_gain": sum(gains) / len(gains), "min_gain": min(gains), "max_gain": max(gains),
                         "negative_gain_layers": sum(g < 0 for g in gains)}
    return summary
