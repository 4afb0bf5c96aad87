"""Folding column scales into a residual branch without changing its float function.

A residual branch (``models/branches.py: Branch``) reads ``norm(x)`` through its *first*
linear and feeds channels that its *feeder rows* produce linearly into its *second* linear.
Scaling ``first``'s input columns by ``s1`` (and dividing the norm weight by it), and the feeder
rows' channels by ``1 / s2`` (and ``second``'s matching input columns by ``s2``) leaves the
function unchanged up to rounding. AWQ (offline, ``quantize/awq.py``) and the ``int8`` method's
channel equalization at load (``equalize.py``) both pick such scales and fold them here. With GQA
one V row feeds the same channel of ``group`` query heads: `expand_group` / `reduce_group` map
between the two indexings.
"""

from __future__ import annotations

import torch


def expand_group(s: torch.Tensor, group: int, head_dim: int) -> torch.Tensor:
    """Per KV-head channel → per column of `group` query heads of `head_dim` (each value repeated
    over the group); identity when ``group == 1``."""
    if group == 1:
        return s
    return s.view(-1, 1, head_dim).expand(-1, group, head_dim).reshape(-1)


def reduce_group(col_stat: torch.Tensor, group: int, head_dim: int, how: str = "mean") -> torch.Tensor:
    """The inverse direction of `expand_group`: a per-column statistic → per KV-head channel, by
    the group's ``how`` ("mean" or "amax"); identity when ``group == 1``."""
    if group == 1:
        return col_stat
    return getattr(col_stat.view(-1, group, head_dim), how)(1).reshape(-1)


def fold_scales(br, s1: torch.Tensor, s2: torch.Tensor) -> None:
    """Fold column scales (AWQ's, or the int8 method's equalization) into the branch `br` (a
    ``models.branches.Branch``); the float function is unchanged (up to rounding).

    `s1` scales `first`'s input columns (divided out of the norm weight); `s2` scales the
    feeder rows' channels as `second` reads them (feeder rows and bias divided by `s2`,
    `second`'s input columns multiplied by ``expand(s2)``).
    """
    br.norm.weight.data.div_(s1)
    br.first.weight.data.mul_(s1[None, :])
    br.first.weight.data[br.feeder].div_(s2[:, None])
    bias = getattr(br.first, "bias", None)
    if bias is not None:
        bias.data[br.feeder].div_(s2)
    br.second.weight.data.mul_(br.expand(s2)[None, :])
