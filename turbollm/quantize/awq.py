"""AWQ (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization for LLM Compression and
Acceleration"), written from the paper.

Weights that meet large activations matter most. AWQ protects them without mixed precision:
for a linear ``y = W x`` it scales input channel c of W up by ``s_c`` and the activation
down by ``s_c`` (``y = (W·diag(s)) (diag(s)⁻¹ x)``), which is exact in float but shrinks the
relative rounding error of the scaled-up columns. Per linear group:

- ``s = mean|x|^α / w_mean^(1−α)`` per input channel, normalized by ``sqrt(max·min)``, with
  ``mean|x|`` over the calibration tokens and ``w_mean`` the channel's mean |w| relative to the
  largest |w| of its quantization group (the scale family of the paper's released code: at α = 0
  it evens out how much of each group's range a column uses, at α → 1 it follows the
  activations). α on a grid of `N_GRID` = 20 points in [0, 1).
- The α of least error. For the norm-fed linears (Q/K/V, gate/up) the error is measured on the
  **whole branch output** with `second` still in float: attention through RoPE, softmax and
  o_proj on whole calibration sequences, the MLP through ``act(gate) * up`` and down_proj on
  sampled tokens. For the second linear (o_proj fed by V, down_proj fed by up) it is the
  linear's own output error ``||X (Q(W·s)/s - W)ᵀ||²``; V → o_proj keeps ``s = mean|x|^α``
  (with GQA one V channel's scale serves the o_proj columns of `group` query heads).
  On qwen2.5-coder-0.5b (32k tokens, no clipping) this family and objective took AWQ from +17.6%
  to +14.3–15.4% perplexity (two runs of the same code; round-to-nearest: +14.15%) at a lower KLD
  (0.124 vs 0.129); with the logit-scale fit below, +11.6% / 0.120 (docs/AWQ_QWEN.md).
- ``diag(s)⁻¹`` is folded into whatever produces x, so inference costs nothing:
  attention input → the preceding RMSNorm's weight (Q/K/V share it), the MLP input → its
  RMSNorm (gate/up share it), o_proj's input → the rows of V (attention is linear in V;
  with GQA one V channel feeds `group` query heads, so their scales are tied and their
  statistics averaged), down_proj's input → the rows of up (``act(gate) * up`` is linear in up).
  Gemma's ``x·(1+w)`` norms hold the effective ``1+w`` in our model, so dividing it is exact;
  the exporter subtracts the one again.
- Weight clipping, optional (``clip=True``, ``--awq-clip``; off by default): per (row, group), the
  range is shrunk by r ∈ {1, 0.95, …, 0.55}, keeping the r of least output error of that group
  (block-diagonal part of XᵀX). Q and K rows are not clipped (attention logits are sensitive to
  them), as in the paper's released code. Measured with this objective (docs/AWQ_QWEN.md):
  on qwen2.5-coder-0.5b it took perplexity from +14.3% to +31.4% and KLD from 0.124 to 0.163; on
  smollm2-135m (g64) it helped a little (+19.6% → +18.2%). Hence off unless asked for.
- After the last layer, by default, `turbollm quantize` fits one factor on the logits against the
  float model (quantize/logit_scale.py; not from the paper). Each search above minimizes its own
  branch's squared error, which leaves the model as a whole sharper than its reference on
  qwen2.5-coder-0.5b; the fit flattens it back where KL to the reference is least.

Statistics: ``mean|x|`` over every calibration token for the norm-fed linears; the error
terms (and o/down statistics) on a sample of about ``search_tokens`` tokens from the batches
`CalibrationRunner.spread` picks (`BranchAlgorithm.stage2_batches`), which keeps the 20-point
searches affordable on a CPU; the attention branch's output error on every token of those
batches (whole sequences). At the default 2,048 tokens that is one batch, the first (8 windows
of 512), i.e. the start of the calibration corpus. Which windows they are moves
qwen2.5-coder-0.5b's perplexity by several points (docs/AWQ_QWEN.md, "Which calibration
windows"). Linear errors use ``XᵀX`` when it is smaller than X.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from turbollm.models.branches import Branch
from turbollm.models.forward_batch import ForwardBatch
from turbollm.quantization.group_quant import QuantGrid, QuantizedWeight, rtn_quantize
from turbollm.quantization.scale_folding import fold_scales
from turbollm.quantize.calibration_runner import CalibrationRunner
from turbollm.quantize.pipeline import BranchAlgorithm

N_GRID = 20
CLIP_STEPS = 10  # shrink ratios 1 - i / N_GRID for i < CLIP_STEPS: 1.0 ... 0.55
SEARCH_TOKENS = 2048


class ActStats:
    """mean |x| per input channel over all observed tokens, plus a sample of token rows."""

    def __init__(self, k: int, quota: int, generator: torch.Generator):
        self.abs_sum = torch.zeros(k, dtype=torch.float64)
        self.count = 0
        self.quota, self.generator = quota, generator
        self.rows: list[torch.Tensor] = []

    def add(self, x: torch.Tensor, keep: bool) -> None:
        x = x.reshape(-1, self.abs_sum.numel()).float()
        self.abs_sum += x.abs().sum(0, dtype=torch.float64)
        self.count += x.shape[0]
        if keep:
            idx = torch.randperm(x.shape[0], generator=self.generator)[:self.quota]
            self.rows.append(x[idx.sort().values].clone())

    def mean_abs(self) -> torch.Tensor:
        return (self.abs_sum / max(1, self.count)).float()

    def sample(self) -> torch.Tensor:
        return torch.cat(self.rows)


class OutputLoss:
    """``||X Δᵀ||²`` for weight changes ``Δ [N, K]``, X the sampled inputs ``[T, K]``."""

    def __init__(self, x: torch.Tensor, h: torch.Tensor | None = None):
        self.k = x.shape[1]
        self.x = x
        self.h = h if h is not None else (x.t() @ x if self.k <= x.shape[0] else None)

    def scaled(self, s: torch.Tensor) -> "OutputLoss":
        """The loss for inputs ``x / s`` (after folding s)."""
        h = None if self.h is None else self.h / s[:, None] / s[None, :]
        return OutputLoss(self.x / s, h)

    def total(self, delta: torch.Tensor) -> float:
        if self.h is not None:
            return float(((delta @ self.h) * delta).sum())
        return float((self.x @ delta.t()).pow(2).sum())

    def per_group(self, delta: torch.Tensor, g: int) -> torch.Tensor:
        """``[N, K/g]``: the error of each (row, group) alone (block-diagonal part of XᵀX)."""
        blocks = self._blocks(g)
        d = delta.view(delta.shape[0], -1, g)
        return torch.einsum("ngi,gij,ngj->ng", d, blocks, d)

    def _blocks(self, g: int) -> torch.Tensor:
        cached = getattr(self, "_block_cache", None)
        if cached is None or cached.shape[-1] != g:
            xg = self.x.view(self.x.shape[0], -1, g).transpose(0, 1)  # [G, T, g]
            cached = self._block_cache = xg.transpose(1, 2) @ xg
        return cached


def fake_quantize(w: torch.Tensor, grid: QuantGrid, g: int, ratio: torch.Tensor | None = None) -> torch.Tensor:
    """RTN round trip of ``w [N, K]``, optionally with each (row, group) range shrunk by `ratio`."""
    wg = w.view(w.shape[0], -1, g)
    scale, zero = grid.params(wg if ratio is None else wg * ratio[..., None])
    return grid.fake_quantize(wg, scale[..., None], zero[..., None]).view_as(w)


def quantize_with_ratio(w: torch.Tensor, grid: QuantGrid, g: int, ratio: torch.Tensor) -> QuantizedWeight:
    wg = w.view(w.shape[0], -1, g)
    scale, zero = grid.params(wg * ratio[..., None])
    q = grid.quantize(wg, scale[..., None], zero[..., None]).reshape(w.shape).to(torch.uint8)
    return QuantizedWeight(q, scale, zero, grid.bits, g, symmetric=grid.symmetric)


def group_relative_mean(w: torch.Tensor, g: int) -> torch.Tensor:
    """Per input channel of ``w [N, K]``: mean over rows of |w| / (its group's max |w|)."""
    wg = w.abs().view(w.shape[0], -1, g)
    return (wg / (wg.amax(-1, keepdim=True) + 1e-6)).view_as(w).mean(0)


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor | None, alpha: float) -> torch.Tensor:
    """``mean|x|^α`` (``w_mean`` None) or ``mean|x|^α / w_mean^(1−α)``, normalized by sqrt(max·min)."""
    if w_mean is None:
        s = x_mean.clamp(min=1e-4).pow(alpha)
    else:
        s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def search_scale(x_mean: torch.Tensor, w_mean: torch.Tensor | None,
                 error: Callable[[torch.Tensor], float]) -> tuple[torch.Tensor, float]:
    """The candidate scale (α on the grid) of least ``error(s)``, and that α."""
    best = (math.inf, None, 0.0)
    for i in range(N_GRID):
        s = candidate_scales(x_mean, w_mean, i / N_GRID)
        err = error(s)
        if err < best[0]:
            best = (err, s, i / N_GRID)
    return best[1], best[2]


def linear_error(w: torch.Tensor, loss: OutputLoss, grid: QuantGrid, g: int,
                 expand: Callable[[torch.Tensor], torch.Tensor] = lambda s: s) -> Callable[[torch.Tensor], float]:
    """``s ↦ ||X (Q(W·s)/s − W)ᵀ||²`` for one linear (`expand` maps s to W's input columns)."""
    def error(s: torch.Tensor) -> float:
        cols = expand(s)
        return loss.total(fake_quantize(w * cols, grid, g) / cols - w)
    return error


@contextmanager
def branch_error(br: Branch, parts: list[tuple[torch.Tensor, ForwardBatch | None]], grid: QuantGrid,
                 g: int) -> Iterator[Callable[[torch.Tensor], float]]:
    """``s ↦ Σ ||inner'(h) − inner(h)||²`` over the (branch input h, batch) `parts`, with `first`'s
    weight replaced by ``Q(W·s)/s`` in inner' (`second` as it is: float). Restored on exit."""
    w = br.first.weight.data
    orig = w.clone()
    targets = [br.inner(h, batch) for h, batch in parts]

    def error(s: torch.Tensor) -> float:
        w.copy_(fake_quantize(orig * s, grid, g) / s)
        return sum(float((br.inner(h, batch) - t).pow(2).sum()) for (h, batch), t in zip(parts, targets))
    try:
        yield error
    finally:
        w.copy_(orig)


def search_clip(w: torch.Tensor, loss: OutputLoss, grid: QuantGrid, g: int, rows: slice | None = None) -> torch.Tensor:
    """Shrink ratio ``[N, K/g]`` of least error per (row, group); 1 outside `rows`."""
    n = w.shape[0]
    best_err = torch.full((n, w.shape[1] // g), math.inf)
    best_ratio = torch.ones_like(best_err)
    for i in range(CLIP_STEPS):
        r = torch.full_like(best_err, 1.0 - i / N_GRID)
        err = loss.per_group(fake_quantize(w, grid, g, r) - w, g)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_ratio = torch.where(better, r, best_ratio)
    if rows is not None:
        keep = torch.ones(n, dtype=torch.bool)
        keep[rows] = False
        best_ratio[keep] = 1.0
    return best_ratio


class AWQAlgorithm(BranchAlgorithm):
    """AWQ in the layer pipeline: scales searched and folded per branch, then (``clip``) clipping,
    then RTN."""

    def __init__(self, grid: QuantGrid, group_size: int, search_tokens: int = SEARCH_TOKENS, seed: int = 0,
                 clip: bool = False):
        super().__init__()
        self.grid, self.group_size, self.search_tokens, self.clip = grid, group_size, search_tokens, clip
        self.generator = torch.Generator().manual_seed(seed)
        self.kept: list[int] = []
        self.batches: list[tuple[slice, ForwardBatch]] = []  # the runner's, set in `prepare`
        self.first_stats: ActStats | None = None
        self.second_stats: ActStats | None = None
        self.whole: list[tuple[torch.Tensor, ForwardBatch]] = []  # attention inputs of the kept batches
        self.alphas: dict[str, tuple[float, float]] = {}

    def prepare(self, runner: CalibrationRunner) -> None:
        per_batch = runner.batches[0][0].stop - runner.batches[0][0].start
        self.kept = runner.spread(max(1, math.ceil(self.search_tokens / per_batch)))
        self.batches = runner.batches

    def stage2_batches(self, runner: CalibrationRunner) -> list[int]:
        return self.kept

    def _quota(self) -> int:
        return max(1, math.ceil(self.search_tokens / len(self.kept)))

    def observe_first(self, br: Branch, h: torch.Tensor, index: int) -> None:
        if self.first_stats is None:
            self.first_stats = ActStats(br.first.in_features, self._quota(), self.generator)
        self.first_stats.add(h, keep=index in self.kept)
        if br.name == "self_attn" and index in self.kept:
            self.whole.append((h.clone(), self.batches[index][1]))

    def observe_second(self, br: Branch, z: torch.Tensor, index: int) -> None:
        if self.second_stats is None:
            self.second_stats = ActStats(br.second.in_features, self._quota(), self.generator)
        self.second_stats.add(z, keep=True)

    @torch.no_grad()
    def second_ready(self, br: Branch) -> None:
        first_stats, second_stats = self.first_stats, self.second_stats
        self.first_stats = self.second_stats = None
        g, grid = self.group_size, self.grid
        w1, w2 = br.first.weight.data, br.second.weight.data
        x1, loss2 = first_stats.sample(), OutputLoss(second_stats.sample())
        # norm-fed linears: the branch output (attention needs whole sequences; the MLP is token-wise)
        parts = self.whole if br.name == "self_attn" else [(x1, None)]
        self.whole = []
        with branch_error(br, parts, grid, g) as error1:
            s1, a1 = search_scale(first_stats.mean_abs(), group_relative_mean(w1, g), error1)
        if br.name == "mlp":
            s2, a2 = search_scale(second_stats.mean_abs(), group_relative_mean(w2, g), linear_error(w2, loss2, grid, g))
        else:  # V → o_proj: mean|x|^α, one V channel's statistic averaged over the o_proj columns it feeds
            s2, a2 = search_scale(br.reduce(second_stats.mean_abs()), None,
                                  linear_error(w2, loss2, grid, g, br.expand))
        self.alphas[self.name(br.first)] = (a1, a2)
        fold_scales(br, s1, s2)
        if not self.clip:
            self.store(br.first, rtn_quantize(w1, grid, g))
            self.store(br.second, rtn_quantize(w2, grid, g))
            return
        r1 = search_clip(w1, OutputLoss(x1).scaled(s1), grid, g, br.feeder if br.name == "self_attn" else None)
        r2 = search_clip(w2, loss2.scaled(br.expand(s2)), grid, g)
        self.store(br.first, quantize_with_ratio(w1, grid, g, r1))
        self.store(br.second, quantize_with_ratio(w2, grid, g, r2))
