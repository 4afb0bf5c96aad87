"""GPTQ (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers"), written from the paper.

For one linear layer with weight ``W [N, K]`` and calibration inputs ``X [T, K]``, GPTQ
minimizes ``||X Wᵀ - X Ŵᵀ||²`` over quantized ``Ŵ``, one input column at a time (the Optimal
Brain Quantization update, applied to all rows at once because they share the Hessian
``H = 2 XᵀX``): quantize column j, then spread its error over the columns not yet quantized
in proportion to the inverse Hessian. The paper's three practical pieces are here:

- *Cholesky form*: the rows of ``H⁻¹`` the updates need are those of the upper Cholesky
  factor U of ``H⁻¹`` (``H⁻¹ = UᵀU``): column j's error is ``(w_j - q_j) / U[j, j]``, and it
  moves the later columns by ``err · U[j, j:]``. This is numerically stable at scale.
- *Lazy batch updates*: columns are processed in blocks of 128; inside a block the update
  touches only the block, and the rest of W gets the block's accumulated errors in one
  matrix product.
- *Dampening*: ``λ = damp · mean(diag H)`` is added to the diagonal (default damp 0.01),
  raised tenfold (up to 3 times) if the Cholesky factorization still fails.

Group-wise grids take each group's scale/zero from the *current* (already error-corrected)
columns of the group when the first of them is reached. With *act-order* the columns are
processed by decreasing ``diag(H)`` (most-activated inputs first, while most freedom remains)
and groups are consecutive in that order; the result keeps the order as its storage order
(`QuantizedWeight.perm`). Dead inputs (``H[j, j] = 0``) get a zero weight.

`HessianAccumulator` collects ``XᵀX`` over calibration batches; for wide inputs it computes
only the upper block triangle (about 0.6× the work of a full product) and mirrors it.
"""

from __future__ import annotations

import torch
from torch import nn

from turbollm.models.branches import Branch
from turbollm.quantization.group_quant import QuantGrid, QuantizedWeight
from turbollm.quantize.pipeline import BranchAlgorithm

BLOCK = 128  # lazy-batch width (columns)
TRIANGLE_MIN_K = 1024  # from this input width on, accumulate only the upper block triangle
TRIANGLE_BLOCK = 512


class HessianAccumulator:
    """Running ``XᵀX`` of a linear layer's inputs (float32), and the token count."""

    def __init__(self, k: int):
        self.k = k
        self.xtx = torch.zeros(k, k)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, self.k).float()
        self.tokens += x.shape[0]
        if self.k < TRIANGLE_MIN_K:
            self.xtx.addmm_(x.t(), x)
            return
        for i in range(0, self.k, TRIANGLE_BLOCK):
            j = min(self.k, i + TRIANGLE_BLOCK)
            self.xtx[i:j, i:].addmm_(x[:, i:j].t(), x[:, i:])

    def hessian(self) -> torch.Tensor:
        """``2 XᵀX / T`` (the scale does not change GPTQ's result; it keeps dampening relative)."""
        h = self.xtx
        if self.k >= TRIANGLE_MIN_K:
            h = torch.triu(h)
            h = h + h.t() - torch.diag(torch.diagonal(h))
        return h * (2.0 / max(1, self.tokens))


def _inverse_cholesky_upper(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + λI)⁻¹``, with λ raised tenfold on failure (3 retries)."""
    mean_diag = float(torch.diagonal(h).mean())
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    for attempt in range(4):
        lam = damp * (10 ** attempt) * mean_diag
        try:
            lower = torch.linalg.cholesky(h + lam * eye)
            hinv = torch.cholesky_inverse(lower)
            return torch.linalg.cholesky(hinv, upper=True)
        except RuntimeError:  # torch.linalg.LinAlgError: not positive definite
            continue
    raise RuntimeError(f"GPTQ: the Hessian is not positive definite even with dampening {damp * 1000:g}")


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, grid: QuantGrid, group_size: int, *, act_order: bool = False,
                  damp: float = 0.01) -> QuantizedWeight:
    """Quantize ``w [N, K]`` given the Hessian ``h [K, K]`` of its inputs; see the module docstring."""
    n, k = w.shape
    g = k if group_size in (-1, 0) else group_size
    if k % g:
        raise ValueError(f"group size {g} does not divide the {k} input columns")
    # Lazy batches of BLOCK columns need every group to start at a batch start (its grid is read
    # from the then-current weights): groups that divide BLOCK, multiples of it, or one per row.
    # (One batch per row-wide group made 8-bit per-channel GPTQ apply K rank-1 updates of the
    # whole remaining row: >100 s per qwen2.5-0.5b layer instead of ~35.)
    block = BLOCK if g <= BLOCK or g % BLOCK == 0 or g == k else g
    if g <= BLOCK and block % g:
        raise ValueError(f"group size {g} must divide the GPTQ block of {BLOCK} columns")
    w = w.detach().float().clone()
    h = h.detach().float().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        w, h = w[:, perm], h[perm][:, perm]
    u = _inverse_cholesky_upper(h, damp)
    del h
    codes = torch.zeros(n, k, dtype=torch.uint8)
    scales = torch.zeros(n, k // g)
    zeros = torch.zeros(n, k // g)
    scale = zero = None  # the current group's grid (a group may span several batches)
    for i1 in range(0, k, block):
        i2 = min(k, i1 + block)
        w1 = w[:, i1:i2].clone()
        err = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for j in range(i2 - i1):
            col = i1 + j
            if col % g == 0:  # first column of a group: its grid from the current (updated) values
                cur = w1[:, j:j + g] if j + g <= i2 - i1 else w[:, col:col + g]
                scale, zero = grid.params(cur)
                scales[:, col // g], zeros[:, col // g] = scale, zero
            col_w = w1[:, j]
            q = grid.quantize(col_w, scale, zero)
            codes[:, col] = q.to(torch.uint8)
            e = (col_w - (q - zero) * scale) / u1[j, j]
            w1[:, j:] -= e[:, None] * u1[j, j:][None, :]
            err[:, j] = e
        w[:, i2:] -= err @ u[i1:i2, i2:]
    return QuantizedWeight(codes, scales, zeros, grid.bits, g, perm, grid.symmetric)


class GPTQAlgorithm(BranchAlgorithm):
    """GPTQ in the layer pipeline: each linear from the Hessian of its (quantized-upstream) inputs."""

    first_final_early = True

    def __init__(self, grid: QuantGrid, group_size: int, act_order: bool = False, damp: float = 0.01):
        super().__init__()
        self.grid, self.group_size, self.act_order, self.damp = grid, group_size, act_order, damp
        self.hessians: dict[int, HessianAccumulator] = {}

    def _observe(self, linear: nn.Module, x: torch.Tensor) -> None:
        acc = self.hessians.get(id(linear))
        if acc is None:
            acc = self.hessians[id(linear)] = HessianAccumulator(linear.in_features)
        acc.add(x)

    def _quantize(self, linear: nn.Module) -> None:
        h = self.hessians.pop(id(linear)).hessian()
        self.store(linear, gptq_quantize(linear.weight.data, h, self.grid, self.group_size,
                                         act_order=self.act_order, damp=self.damp))

    def observe_first(self, br: Branch, h: torch.Tensor, index: int) -> None:
        self._observe(br.first, h)

    def first_ready(self, br: Branch) -> None:
        self._quantize(br.first)

    def observe_second(self, br: Branch, z: torch.Tensor, index: int) -> None:
        self._observe(br.second, z)

    def second_ready(self, br: Branch) -> None:
        self._quantize(br.second)
