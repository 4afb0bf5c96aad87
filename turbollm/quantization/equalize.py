"""Channel equalization before per-output-channel round-to-nearest (the ``int8`` method); no text.

Per-output-channel symmetric rounding gives every weight of a row the same step,
``max_j |W_ij| / 127``, so one large weight in a row coarsens the whole row. In a decoder the
large weights sit in a few *input columns* (on qwen2.5-coder-0.5b's ffn_down, one column holds
the maximum of up to 78 of the 896 rows). Those columns can be rescaled without changing the
float function, because the operation before the linear is per channel:

* the *first* linear of a residual branch (qkv_proj, gate_up_proj) reads ``norm(x)``: scaling
  its input column j by ``c_j`` and dividing the RMSNorm weight ``γ_j`` by ``c_j`` is exact;
* the *second* linear (o_proj, down_proj) reads channels that its branch's *feeder rows* (V rows
  through attention, up rows through ``act(gate) * up``) produce linearly: scaling its input
  column by ``c_j`` and dividing the feeder row (and its bias) by ``c_j`` is exact (with GQA one
  V row feeds the same column of every query head in its group, so the group shares one scale).

This is cross-layer equalization (Nagel et al., "Data-Free Quantization Through Weight
Equalization and Bias Correction", ICCV 2019) adapted to per-row scales: a per-row rounding is
invariant to scaling a whole row, so the feeder rows' own rounding is untouched and only the
column side matters. The error a choice of ``c`` leaves is estimated from the weights and one
statistic per input channel. Rounding row i to steps ``Δ_i = max_j |W_ij c_j| / 127`` leaves an
error of variance ``Δ_i² / 12`` on each scaled weight; mapped back through ``1 / c_j`` onto an
input of root-mean-square ``a_j`` it adds ``Δ_i² a_j² / (12 c_j²)`` to the output's error, so

    E(c) = Σ_i (max_j |W_ij| c_j)² · Σ_j (a_j / c_j)²           (`rtn_error`, up to a constant)

``a_j`` is measured on a *synthetic* input, no text: one sequence of `SYNTH_TOKENS` random token
ids (seeded; the model's BOS first) through the float model, the RMS of each linear's input
channels (`synthetic_input_rms`). That sequence still shows the channels a model drives hard
(the attention-sink position's massive activations); without it (``a_j = 1`` for o_proj and
down_proj) smollm2-135m got *worse* than plain rounding (docs/QUANTIZATION.md). The scales searched
are ``c_j ∝ a_j^β · colmax_j^(−α)`` (geometric mean 1) over a small grid of α and β that
includes ``c = 1``; the one with the least ``E`` is kept, so the estimate never gets worse.

Searches run on the weights as loaded: scaling a branch's feeder rows (second side) does not
change how those rows round (per-row steps), so the two sides of a branch are chosen
independently and then both folded (`scale_folding.py`). The model describes its own branches
(`CausalLM.residual_branches`, from the branch adapters of `models/branches.py`, shared with the
offline quantizers) and runs the synthetic sequence (`CalibrationRunner` behind
`CausalLM.forward_windows`): this package sits below the models and imports none of them.
Measured effect: docs/QUANTIZATION.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from turbollm.quantization.scale_folding import expand_group, fold_scales, reduce_group

#: α (how much a column's largest weight is pulled in) and β (how much the column's input size
#: pushes it out) tried by `search_column_scales`; (0, 0) is "no equalization".
ALPHAS = tuple(i / 10 for i in range(11))
BETAS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: no column scale leaves this range around the geometric mean (keeps folds well conditioned)
MAX_RATIO = 1e4
#: the synthetic input whose channel sizes weigh the error estimate: random token ids, seeded
SYNTH_TOKENS = 256
SYNTH_SEED = 0


def rtn_error(w: torch.Tensor, c: torch.Tensor, a: torch.Tensor) -> float:
    """Estimated output error of rounding ``w · diag(c)`` per row (module docstring's E(c)).

    `w` [rows, cols]; `c` column scales; `a` typical input size per column (original units).
    The plain form of one candidate; the search scores all its candidates with `rtn_errors`.
    """
    rowmax = (w.abs() * c).amax(1)
    return float(rowmax.square().sum() * (a / c).square().sum())


def rtn_errors(absw: torch.Tensor, cands: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """`rtn_error` of every candidate ``cands[k]`` (column scales, ``[K, cols]``) at once, float64 ``[K]``.

    `absw` is ``w.abs()``. The row maxima come from the C++ kernel ``scaled_row_max`` (one pass
    over the matrix for all candidates) when it is built, else from `scaled_row_max_reference`;
    both give the same values.
    """
    from turbollm.kernels import cpu_kernels

    kernels = cpu_kernels()
    absw, cands = absw.float().contiguous(), cands.float().contiguous()
    rowmax = kernels.scaled_row_max(absw, cands) if kernels is not None else scaled_row_max_reference(absw, cands)
    return rowmax.double().square().sum(1) * (a[None, :].double() / cands.double()).square().sum(1)


def scaled_row_max_reference(absw: torch.Tensor, cands: torch.Tensor) -> torch.Tensor:
    """``out[k, i] = max_j absw[i, j] · cands[k, j]``, one product matrix per candidate."""
    buf = torch.empty_like(absw)
    return torch.stack([torch.mul(absw, c, out=buf).amax(1) for c in cands])


def _column_scales(colmax: torch.Tensor, a: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    c = a.pow(beta) * colmax.pow(-alpha)
    c = c / c.log().mean().exp()
    return c.clamp(1.0 / MAX_RATIO, MAX_RATIO)


def _floor(v: torch.Tensor) -> torch.Tensor:
    """`v` with zeros (dead columns, zero norm weights) lifted to a small positive value."""
    top = float(v.max())
    return v.clamp_min(top * 1e-6 if top > 0 else 1.0)


@torch.no_grad()
def search_column_scales(w: torch.Tensor, a: torch.Tensor | None = None, group: int = 1,
                         head_dim: int = 1) -> tuple[torch.Tensor, float]:
    """Column scales for `w` that minimise `rtn_error`, and the error ratio they reach (≤ 1).

    `a`: input RMS per column (default 1). With ``group > 1`` the columns are ``group`` query
    heads of ``head_dim`` per KV head and the returned scales are per *KV-head channel*
    (``cols / group``), expanded over the group for the error (GQA feeder rows).
    """
    w = w.float()
    absw = w.abs()
    cols = w.shape[1]
    a_full = torch.ones(cols) if a is None else _floor(a.float().abs())
    colmax = reduce_group(_floor(absw.amax(0)), group, head_dim, "amax")
    a_red = reduce_group(a_full, group, head_dim)

    one = torch.ones_like(colmax)
    cands = [one] + [_column_scales(colmax, a_red, alpha, beta)
                     for beta in (BETAS if a is not None else (0.0,))  # with a = 1, a^β is 1 for every β
                     for alpha in ALPHAS if (alpha, beta) != (0.0, 0.0)]
    errs = rtn_errors(absw, torch.stack([expand_group(c, group, head_dim) for c in cands]), a_full)
    pick = int(errs.argmin())  # the first of equal errors: the identity wins a tie
    base, best_err, best = float(errs[0]), float(errs[pick]), cands[pick]
    return best, (best_err / base if base > 0 else 1.0)


@dataclass
class EqualizeReport:
    """What `equalize_decoder` did: folds applied and the estimated error ratio per linear kind."""

    ratios: dict[str, list[float]] = field(default_factory=dict)  # "self_attn.first" → per layer

    @property
    def folds(self) -> int:
        return sum(len(v) for v in self.ratios.values())

    def summary(self) -> str:
        parts = [f"{k} {sum(v) / len(v):.2f}" for k, v in sorted(self.ratios.items())]
        return f"{self.folds} column scalings folded; mean estimated rounding error ratio: " + ", ".join(parts)


@torch.no_grad()
def synthetic_input_rms(model: nn.Module, branches: list, tokens: int = SYNTH_TOKENS,
                        seed: int = SYNTH_SEED) -> dict[int, torch.Tensor]:
    """RMS per input channel of each branch's two linears (keyed by ``id(linear)``) over one
    sequence of `tokens` random token ids (BOS first when the model has one) through `model`."""
    cfg = model.config
    tokens = min(tokens, cfg.max_position_embeddings)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(seed))
    if cfg.bos_token_id is not None:
        ids[0, 0] = cfg.bos_token_id
    rms: dict[int, torch.Tensor] = {}

    def hook(module: nn.Module, args) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        rms[id(module)] = x.square().mean(0).sqrt()

    handles = [lin.register_forward_pre_hook(hook) for br in branches for lin in (br.first, br.second)]
    try:
        model.forward_windows(ids)
    finally:
        for h in handles:
            h.remove()
    return rms


@torch.no_grad()
def equalize_decoder(model: nn.Module) -> EqualizeReport:
    """Equalize every decoder layer of the CausalLM `model` in place (float function unchanged).

    The model's linears must still compute in float (before any rounding). Raises
    UnsupportedArchitectureError for an architecture without a branch adapter.
    """
    branches = model.residual_branches()
    rms = synthetic_input_rms(model, branches)
    report = EqualizeReport()
    for br in branches:
        s1, r1 = search_column_scales(br.first.weight.data, rms[id(br.first)])
        s2, r2 = search_column_scales(br.second.weight.data, rms[id(br.second)], group=br.group,
                                      head_dim=br.head_dim)
        report.ratios.setdefault(f"{br.name}.first", []).append(r1)
        report.ratios.setdefault(f"{br.name}.second", []).append(r2)
        fold_scales(br, s1, s2)
    return report
