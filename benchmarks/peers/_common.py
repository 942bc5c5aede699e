"""Helpers the peer re-implementations share: the plan type, first-fit, a crash signal.

A peer plan is ``plan[r][m]`` = int64 array of global sample indices of micro-batch m on
rank r, for ONE step. Lists may differ in length across ranks, micro-batches may exceed the cap
or be empty (padding micro-batches): the metrics reveal it. A negative index ``i`` stands for a
zero-loss padding *copy* of sample ``~i`` (SkyRL pads rows that way): it costs compute but is not
a duplicate. verl's 2-token pad samples are dropped from the plan (negligible cost).

First-fit is written the way the peers write it: plain Python, scanning bins from the first.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["PeerPlan", "PeerCrash", "first_fit", "to_plan", "ceil_div"]

PeerPlan = list[list[np.ndarray]]


class PeerCrash(RuntimeError):
    """The upstream planner would fail here (assertion, index error): the bench records a crash."""


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def first_fit(lens: Sequence[int], cap: int, order: Sequence[int] | None = None) -> tuple[list[list[int]], list[int]]:
    """First-fit in ``order`` (default: input order): each item to the first bin with room.

    An item longer than ``cap`` opens its own bin (it sits alone). Returns (bins, bin token sums).
    """
    bins: list[list[int]] = []
    sums: list[int] = []
    for i in (range(len(lens)) if order is None else order):
        L = lens[i]
        for b in range(len(sums)):
            if sums[b] + L <= cap:
                sums[b] += L
                bins[b].append(i)
                break
        else:
            bins.append([i])
            sums.append(L)
    return bins, sums


def to_plan(ranks: Sequence[Sequence[Sequence[int]]]) -> PeerPlan:
    """Lists of index lists -> the int64-array plan form."""
    return [[np.asarray(m, dtype=np.int64) for m in rank] for rank in ranks]
