"""The scale searches of llama.cpp's k-quants, vectorized over groups of weights.

Each function is the vectorized form of the ``ggml-quants.c`` routine it is named after; a
group of ``n`` weights is a column of an ``(n, groups)`` float32 tensor, and the loops over
the candidates of the search run once for all groups, each group keeping its own best so far
(in the C code too a later candidate is scored against the state the earlier ones left).
Float32 operations follow the C source one rounding at a time (see ``_base``).

- :func:`make_qx_quants` - symmetric scale (Q6_K sub-blocks): try ``iscale = -(nmax + 0.1*k)/max``
  for ``k`` in -9..9 and keep the one maximising ``sum(w*x*l)**2 / sum(w*l*l)`` (the
  weighted least-squares scale of those quants), ``w = x*x`` ("rmse_type 1").
- :func:`make_q3_quants` - symmetric scale with iterative refinement (Q3_K sub-blocks): start at
  ``round(-nmax*x/max)`` and, up to 5 passes, move single quants to the value that most raises
  the same weighted objective.
- :func:`make_qkx2_quants` - scale and offset (Q2_K, Q4_K, Q5_K sub-blocks): try ``nstep + 1``
  grids ``iscale = (nmax + rmin + rdelta*k) / (max - min)``, solve the weighted least-squares
  ``x ~ scale*l + min`` for each, keep the lowest weighted error (squared or absolute).
"""

from __future__ import annotations

import torch

from ._base import f32, first_absmax, nearest_int_, rdiv, seq_sum

#: ``GROUP_MAX_EPS``: a group whose largest |x| is below this is all zeros.
GROUP_MAX_EPS = 1e-15


def _clamp_nearest(v: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``clamp(nearest_int(v), lo, hi)``, consuming the float32 temporary ``v``."""
    return nearest_int_(v).clamp_(lo, hi)


def make_qx_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, qw=NULL)``: ``(scale (G,), L (n, G) int32)``.

    ``L`` holds ``l + nmax`` with ``l`` in ``[-nmax, nmax - 1]``; all-zero groups get scale 0
    and ``L = 0``.
    """
    amax, mx = first_absmax(x, 0)
    zero = amax < GROUP_MAX_EPS
    w = x * x
    wx = w * x

    def candidate(iscale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lq = _clamp_nearest(x * iscale, -nmax, nmax - 1)
        lf = lq.to(torch.float32)
        return lq, seq_sum(wx * lf), seq_sum((w * lf).mul_(lf))

    lq, sumlx, suml2 = candidate(rdiv(float(-nmax), mx))
    L = lq + nmax
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(sumlx))
    best = scale * sumlx
    for k in range(-9, 10):
        if k == 0:
            continue
        step = f32(f32(nmax) + f32(f32(0.1) * k))
        lq, sumlx, suml2 = candidate(rdiv(-step, mx))
        better = (suml2 > 0) & ((sumlx * sumlx) > (best * suml2))
        L = torch.where(better, lq + nmax, L)
        scale = torch.where(better, sumlx / suml2, scale)
        best = torch.where(better, scale * sumlx, best)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    L = torch.where(zero, torch.zeros_like(L), L)
    return scale, L


def make_q3_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``make_q3_quants(n, nmax, x, L, do_rmse=true)``: ``(scale (G,), L (n, G) int32)``.

    ``L`` holds ``l + nmax``; all-zero groups get scale 0 and ``L = 0``.
    """
    n = x.shape[0]
    amax, mx = first_absmax(x, 0)
    zero = amax < GROUP_MAX_EPS
    L = _clamp_nearest(x * rdiv(float(-nmax), mx), -nmax, nmax - 1)
    w = x * x
    wx = w * x
    lf = L.to(torch.float32)
    sumlx = seq_sum(wx * lf)
    suml2 = seq_sum((w * lf) * lf)
    for _ in range(5):
        changed = torch.zeros_like(zero)
        for i in range(n):
            wi, wxi, xi = w[i], wx[i], x[i]
            li = L[i].to(torch.float32)
            slx = sumlx - wxi * li
            sl2 = suml2 - (wi * li) * li
            new_l = _clamp_nearest((xi * sl2).div_(slx), -nmax, nmax - 1)
            nlf = new_l.to(torch.float32)
            slx_new = slx + wxi * nlf
            sl2_new = sl2 + (wi * nlf) * nlf
            take = ((slx > 0) & (new_l != L[i]) & (sl2_new > 0)
                    & (((slx_new * slx_new) * suml2) > ((sumlx * sumlx) * sl2_new)))
            L[i] = torch.where(take, new_l, L[i])
            sumlx = torch.where(take, slx_new, sumlx)
            suml2 = torch.where(take, sl2_new, suml2)
            changed |= take
        if not bool(changed.any()):  # a pass that changes nothing would repeat itself
            break
    scale = torch.where(suml2 > 0, sumlx / suml2, torch.zeros_like(sumlx))
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    L = torch.where(zero, torch.zeros_like(L), L + nmax)
    return scale, L


def make_qkx2_quants(
    x: torch.Tensor, weights: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``make_qkx2_quants``: ``(scale (G,), the_min (G,), L (n, G) int32)`` with ``x ~ scale*L - the_min``.

    ``L`` is in ``[0, nmax]``; ``the_min >= 0`` is the negated offset. Groups whose max equals
    their min (after clamping min to <= 0) get scale 0 and ``L = 0``.
    """
    mn = x.amin(dim=0)
    mx = x.amax(dim=0)
    sum_w = seq_sum(weights, from_first=True)
    sum_x = seq_sum(weights * x, from_first=True)
    mn = torch.where(mn > 0, torch.zeros_like(mn), mn)
    flat = mx == mn

    # scratch tensors reused by every candidate (allocating them anew costs more than the math)
    tmp, lf, wl, err = (torch.empty_like(x) for _ in range(4))

    def quants(iscale: torch.Tensor) -> torch.Tensor:
        """clamp(nearest_int(iscale * (x - min)), 0, nmax) as int32, a view of ``tmp``."""
        return _clamp_nearest(torch.sub(x, mn, out=tmp).mul_(iscale), 0, nmax)

    def error(scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """Weighted error of ``scale * lf + offset`` against ``x``."""
        diff = torch.mul(lf, scale, out=err).add_(offset).sub_(x)  # (scale*l + min) - x
        diff = diff.abs_() if use_mad else diff.mul_(diff)
        return seq_sum(diff.mul_(weights))

    iscale = rdiv(float(nmax), mx - mn)
    scale = rdiv(1.0, iscale)
    L = quants(iscale).clone()
    lf.copy_(L)
    best = error(scale, mn)
    for k in range(nstep + 1):
        grid = f32(f32(f32(rmin) + f32(f32(rdelta) * k)) + nmax)
        laux = quants(rdiv(grid, mx - mn))
        lf.copy_(laux)
        torch.mul(weights, lf, out=wl)
        sum_l = seq_sum(wl)
        sum_xl = seq_sum(torch.mul(wl, x, out=err))  # (w*l)*x
        sum_l2 = seq_sum(wl.mul_(lf))  # (w*l)*l
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        clip = this_min > 0
        this_min = torch.where(clip, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(clip, sum_xl / sum_l2, this_scale)
        cur = error(this_scale, this_min)
        better = (D > 0) & (cur < best)
        L = torch.where(better, laux, L)
        best = torch.where(better, cur, best)
        scale = torch.where(better, this_scale, scale)
        mn = torch.where(better, this_min, mn)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    L = torch.where(flat, torch.zeros_like(L), L)
    return scale, -mn, L
