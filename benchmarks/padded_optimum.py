"""Exhaustive optimum of padded lockstep time for small steps (a slow reference for tests and benchmarks).

Design note. A padded micro-batch of k samples costs ``per_micro + k·r(W)``, W its longest sample
(rounded up to the width multiple), r the row cost (``cost.models.row_costs``), and holds k·W
tokens under the cap. Lockstep time of dp·K micro-batch costs (placeholders cost per_micro) is
Σ_m max_r, which ``assign.arrange`` attains by cutting the sorted costs into slots of dp.

By the contiguity lemma (``stages/padded_bound.py``) some optimum is a partition of the samples,
sorted by length, into contiguous runs; so the exhaustive search enumerates the 2^(n-1)
compositions of the sorted samples (every K from 1 to ⌈n/dp⌉, runs ≤ dp·K) instead of the Bell
number of set partitions. :func:`brute_force_partitions` enumerates every set partition (n ≤ 8)
and is what the tests check the lemma against. Cost: 2^(n-1)·K evaluations: ~0.1 s at n = 12.
"""

from __future__ import annotations

from itertools import combinations
from typing import NamedTuple

import numpy as np

from microplan.cost.models import row_costs

__all__ = ["PaddedOptimum", "padded_optimum", "brute_force_partitions", "lockstep_of"]


class PaddedOptimum(NamedTuple):
    time: float                 # the least lockstep time of any plan
    K: int                      # micro-batches per rank of an optimal plan
    runs: tuple[int, ...]       # boundaries [0, b1, ..., n] of an optimal plan's runs (sorted, descending)


def lockstep_of(costs: np.ndarray, dp: int, K: int, per_micro: float) -> float:
    """Lockstep time of these micro-batch costs padded with placeholders to dp·K, best arranged."""
    c = np.concatenate([np.asarray(costs, dtype=np.float64), np.full(dp * K - len(costs), per_micro)])
    return float(np.sort(c)[::-1][::dp].sum())


def _bin_cost(w: int, k: int, cost) -> float:
    return float(cost.per_micro) + k * float(row_costs(cost, np.array([float(w)]), k)[0])


def padded_optimum(lens, *, dp: int, cap: int | None, cost, width_multiple: int = 1,
                   placeholders: bool = True) -> PaddedOptimum:
    """The least padded lockstep time over every plan of these samples on dp ranks (exhaustive).

    ``placeholders=False``: only plans without placeholder micro-batches where the samples allow
    (exactly min(n, dp·K) runs: the planner's contract under ``short_step``).
    """
    L = -np.sort(-np.asarray(lens, dtype=np.int64))
    W = -(-L // width_multiple) * width_multiple
    n = int(L.size)
    best = PaddedOptimum(float("inf"), 0, ())
    for m in range(1, n + 1):
        K = -(-m // dp)
        for cut in combinations(range(1, n), m - 1):
            b = (0, *cut, n)
            if cap is not None and any((b[i + 1] - b[i]) * W[b[i]] > cap for i in range(m)):
                continue
            c = [_bin_cost(int(W[b[i]]), b[i + 1] - b[i], cost) for i in range(m)]
            for k in range(K, -(-n // dp) + 1):  # more slots than runs: placeholders
                if not placeholders and m != min(n, dp * k):
                    continue
                t = lockstep_of(np.array(c), dp, k, cost.per_micro)
                if t < best.time:
                    best = PaddedOptimum(t, k, b)
    return best


def brute_force_partitions(lens, *, dp: int, cap: int | None, cost, width_multiple: int = 1) -> float:
    """The same optimum over every set partition of the samples (no contiguity assumed; n ≤ 8)."""
    L = np.asarray(lens, dtype=np.int64)
    W = -(-L // width_multiple) * width_multiple
    n = int(L.size)
    best = float("inf")

    def rec(i: int, blocks: list[list[int]]) -> None:
        nonlocal best
        if i == n:
            c = []
            for blk in blocks:
                w = int(W[blk].max())
                if cap is not None and len(blk) * w > cap:
                    return
                c.append(_bin_cost(w, len(blk), cost))
            for k in range(-(-len(blocks) // dp), -(-n // dp) + 1):
                best = min(best, lockstep_of(np.array(c), dp, k, cost.per_micro))
            return
        for blk in blocks:
            blk.append(i)
            rec(i + 1, blocks)
            blk.pop()
        blocks.append([i])
        rec(i + 1, blocks)
        blocks.pop()

    rec(0, [])
    return best
