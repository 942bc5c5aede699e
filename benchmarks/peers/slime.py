"""slime (THUDM/slime, 2026-08) ``slime/utils/dp_schedule.py``, one step.

Re-implemented from PEERS.md, not from upstream source:

1. First-fit in input order (not decreasing) under ``cap`` (× cp, 1 here); a sample longer than
   the cap sits alone.
2. Align: target ``K* = max(ceil(K/a)·a, a)`` micro-batches in total, ``a = dp × align`` (align is
   the VPP micro-batch group; 1 = no VPP). Reached by repeatedly splitting the multi-sample bin
   with the most tokens into two halves: its samples sorted by length descending, each to the
   half with fewer tokens. Singletons cannot split; when every bin is a singleton before K* is
   reached upstream dies on a bare ``AssertionError`` (the slime seed) — raised here as
   :class:`PeerCrash`.
3. Distribute: each rank gets K*/dp micro-batches. ``--balance-data`` (the variant reported as
   "slime"): KK with ``equal_size=True`` over micro-batch FLOPs into dp parts; slime's FLOPs
   formula is the full model's (linear + 2·heads·head_dim·L² per layer), which is what ``cost``
   (a FlopsCost) models, so micro FLOPs = Σ sample costs. Without it (``plan_slime_rr``): strided
   round-robin, rank r gets bins r, r+dp, ...

A rank's micro-batches run in bin order.
"""

from __future__ import annotations

import numpy as np

from ._common import PeerCrash, PeerPlan, ceil_div, first_fit, to_plan
from .kk import karmarkar_karp

__all__ = ["plan_slime", "plan_slime_rr"]


def _halve(items: list[int], lens: list[int]) -> tuple[list[int], list[int]]:
    """Split one bin in two: longest first, each sample to the half with fewer tokens."""
    a: list[int] = []
    b: list[int] = []
    ta = tb = 0
    for i in sorted(items, key=lambda i: -lens[i]):
        if ta <= tb:
            a.append(i)
            ta += lens[i]
        else:
            b.append(i)
            tb += lens[i]
    return a, b


def _expand(bins: list[list[int]], sums: list[int], lens: list[int], target: int) -> None:
    """Split the heaviest multi-sample bin until there are ``target`` bins (in place)."""
    while len(bins) < target:
        best = -1
        for j, items in enumerate(bins):
            if len(items) > 1 and (best < 0 or sums[j] > sums[best]):
                best = j
        if best < 0:
            raise PeerCrash(f"slime: could only produce {len(bins)} mbs after maximal splitting; need {target}")
        a, b = _halve(bins[best], lens)
        bins[best], sums[best] = a, sum(lens[i] for i in a)
        bins.append(b)
        sums.append(sum(lens[i] for i in b))


def _bins(seq_lens: np.ndarray, dp: int, cap: int, align: int) -> tuple[list[list[int]], list[int]]:
    lens = [int(x) for x in seq_lens]
    bins, sums = first_fit(lens, cap)
    a = dp * (align if align > 1 else 1)
    target = max(ceil_div(len(bins), a) * a, a)
    _expand(bins, sums, lens, target)
    return bins, lens


def plan_slime(seq_lens: np.ndarray, *, dp: int, cap: int, align: int = 1, cost=None,
               balance_data: bool = True) -> PeerPlan:
    """slime with ``--balance-data`` (KK equal_size over micro FLOPs); see module docstring.

    ``cost``: a microplan cost model giving per-sample FLOPs (default: tokens).
    """
    bins, lens = _bins(seq_lens, dp, cap, align)
    if not balance_data:
        return to_plan([bins[r::dp] for r in range(dp)])
    sample_flops = cost.sample_costs(np.asarray(lens)).tolist() if cost is not None else lens
    flops = [sum(sample_flops[i] for i in items) for items in bins]
    parts = karmarkar_karp(flops, dp, equal_size=True)
    return to_plan([[bins[j] for j in part] for part in parts])


def plan_slime_rr(seq_lens: np.ndarray, *, dp: int, cap: int, align: int = 1, cost=None) -> PeerPlan:
    """slime without ``--balance-data``: strided round-robin of the aligned bins."""
    return plan_slime(seq_lens, dp=dp, cap=cap, align=align, cost=cost, balance_data=False)
