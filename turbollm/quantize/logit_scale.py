"""Logit-scale fit: one scalar after offline quantization, chosen to bring the output distribution
back to the reference's.

Rounding every linear of a model changes more than each layer's output: the small, same-sign
errors of many layers add up to a model that is, on the whole, more or less confident than its
reference (on qwen2.5-coder-0.5b, AWQ's output distributions are sharper than the fp32 model's
and round-to-nearest's flatter; docs/AWQ_QWEN.md). A per-layer objective does not see that; the
model's output does. This step fits the one number that acts on it, a factor β on the logits,
by minimizing the mean KL divergence KL(p_ref ‖ softmax(β · z)) from the reference model's
next-token distributions p_ref to the quantized model's, on calibration windows (never the
evaluation text), and folds β into the final norm's weight, so the checkpoint layout and the
cost of inference do not change (a scaled norm output scales the LM head's logits; with a
final logit soft-cap the cap is applied to β · z, as the model computes it).

The fit: the reference's final hidden states are taken from the float model before it is
quantized (`final_hidden`), the quantized model's after, on the same `FIT_WINDOWS`
calibration windows; KL(β) is evaluated on a grid of `GRID` factors in [`LOW`, `HIGH`] and the
minimum refined by a parabola through its neighbours. KL(β) is convex in β when the logits are
linear in it. β = 1 is on the grid, and the fit reports the KL at 1 and at β (`LogitScaleFit`,
recorded in the folder's ``quantization_config``): a model that needs no correction gets β ≈ 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from tqdm import tqdm

from turbollm.quantize.calibration_runner import CalibrationRunner, spread_indices

FIT_WINDOWS = 8
LOW, HIGH, GRID = 0.80, 1.20, 21  # β grid: 0.80, 0.82, ..., 1.20 (1.0 on it)
ROWS = 256  # tokens per chunk of logits


@dataclass(frozen=True)
class LogitScaleFit:
    """The fitted factor and what it did on the fit tokens (KL in nats per token)."""

    beta: float
    kl_before: float  # mean KL(p_ref ‖ q) at β = 1
    kl_after: float  # at `beta`
    entropy_ref: float  # mean entropy of the reference's distributions
    entropy_before: float
    entropy_after: float
    tokens: int

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        return (f"β = {self.beta:.4f} on {self.tokens} calibration tokens: KL {self.kl_before:.5f} → "
                f"{self.kl_after:.5f}, entropy {self.entropy_before:.3f} → {self.entropy_after:.3f} nats "
                f"(reference {self.entropy_ref:.3f})")


def fit_windows(windows: torch.Tensor, count: int = FIT_WINDOWS) -> torch.Tensor:
    """`count` of the calibration windows ``[S, L]``, spread evenly over them."""
    return windows[spread_indices(windows.shape[0], count)]


@torch.no_grad()
def final_hidden(model: nn.Module, windows: torch.Tensor) -> torch.Tensor:
    """The model's final hidden states (after its final norm) ``[S·L, hidden]`` for token windows
    ``[S, L]``, each window one causal sequence."""
    runner = CalibrationRunner(model, windows)
    return torch.cat([model(batch) for _, batch in runner.batches])


@torch.no_grad()
def kl_curve(model: nn.Module, ref_hidden: torch.Tensor, hidden: torch.Tensor, betas: torch.Tensor,
             progress: bool = False) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mean KL(p_ref ‖ q_β) and mean entropy of q_β for each β, q_β the distribution of the logits of
    ``β · hidden``, and the reference's mean entropy. `model` supplies the LM head, shared by both
    (not quantized, no bias: the head's output for β · h is β times its output for h)."""
    kl = torch.zeros(len(betas), dtype=torch.float64)
    ent = torch.zeros(len(betas), dtype=torch.float64)
    ent_ref = 0.0
    for s in tqdm(range(0, hidden.shape[0], ROWS), desc="logit scale", unit="chunk", disable=not progress):
        lp = model.compute_logits(ref_hidden[s:s + ROWS]).log_softmax(-1)
        p = lp.exp()
        neg_ent = (p * lp).sum(-1)
        ent_ref -= float(neg_ent.sum())
        z = model.lm_head(hidden[s:s + ROWS])
        for j, b in enumerate(betas.tolist()):
            lq = model.cap_logits(z * b).log_softmax(-1)
            kl[j] += float((neg_ent - (p * lq).sum(-1)).sum())
            ent[j] -= float((lq.exp() * lq).sum())
    n = hidden.shape[0]
    return kl / n, ent / n, ent_ref / n


def refine(betas: torch.Tensor, values: torch.Tensor) -> float:
    """The grid minimum of `values`, moved to the vertex of the parabola through it and its two
    neighbours (kept within them; a minimum on the grid's edge stays there)."""
    j = int(values.argmin())
    if j == 0 or j == len(betas) - 1:
        return float(betas[j])
    (x0, x1, x2), (y0, y1, y2) = betas[j - 1:j + 2].tolist(), values[j - 1:j + 2].tolist()
    denom = (x0 - x1) * (x0 - x2) * (x1 - x2)
    a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / denom
    b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / denom
    if a <= 0:
        return float(betas[j])
    return min(max(-b / (2 * a), x0), x2)


@torch.no_grad()
def fit_logit_scale(model: nn.Module, ref_hidden: torch.Tensor, windows: torch.Tensor,
                    progress: bool = False) -> LogitScaleFit:
    """Fit β for `model` (quantized) against the reference's final hidden states `ref_hidden` on the
    same `windows`; the model is not changed (see `apply_logit_scale`)."""
    hidden = final_hidden(model, windows)
    betas = torch.linspace(LOW, HIGH, GRID, dtype=torch.float64)
    kl, ent, ent_ref = kl_curve(model, ref_hidden, hidden, betas, progress)
    one, best = int((betas - 1.0).abs().argmin()), int(kl.argmin())
    beta = refine(betas, kl)
    kl_b, ent_b, _ = kl_curve(model, ref_hidden, hidden, torch.tensor([beta], dtype=torch.float64))
    if float(kl_b[0]) > float(kl[best]):  # the parabola missed: keep the grid's best
        beta, kl_b, ent_b = float(betas[best]), kl[best:best + 1], ent[best:best + 1]
    return LogitScaleFit(beta, float(kl[one]), float(kl_b[0]), ent_ref, float(ent[one]), float(ent_b[0]),
                         hidden.shape[0])


def apply_logit_scale(model: nn.Module, beta: float) -> None:
    """Multiply the final norm's weight by `beta` (every logit's input scaled by β)."""
    model.model.norm.weight.data.mul_(beta)
