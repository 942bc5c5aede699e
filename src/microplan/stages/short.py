"""``short_step="drop"``: the one loop that drops the fewest whole trailing rollouts.

Design note. When a step cannot give every rank K non-empty micro-batches, ``short_step="drop"``
keeps the longest prefix of whole rollouts (in their order of first appearance) that a fit lays
out with no placeholder — the slime fix. The global fit (``fit.py``), the local fit
(``local.py``) and dynamic context parallel (``cp.py``) differ only in how they lay a prefix out
and in the bounds that rule a prefix out without trying it, so they pass those to
:func:`drop_trailing`. A rollout is never split: positions are kept or dropped rollout by rollout.
Cost: one layout per prefix not ruled out by its bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

__all__ = ["rollout_order", "drop_trailing"]

R = TypeVar("R")


def rollout_order(rollouts: np.ndarray) -> np.ndarray:
    """Each position's rollout as 0..R-1 in ascending code order (codes ascend in first-appearance order)."""
    return np.unique(rollouts, return_inverse=True)[1].astype(np.int64)


def drop_trailing(order: np.ndarray, attempt: Callable[[np.ndarray], R | None], *,
                  ruled_out: Callable[[int], bool] | None = None) -> tuple[R, np.ndarray, np.ndarray] | None:
    """The longest proper prefix of whole rollouts ``attempt`` lays out with no placeholder.

    ``order``: :func:`rollout_order` of the positions; ``attempt(kept positions)``: the layout, or
    None when it needs a placeholder; ``ruled_out(k)``: True when a bound shows that the first k
    rollouts cannot fill the ranks (``attempt`` is not called). Returns (layout, kept positions,
    dropped positions), or None when no prefix of at least one rollout works.
    """
    R_ = int(order.max()) + 1 if order.size else 0
    for keep in range(R_ - 1, 0, -1):
        if ruled_out is not None and ruled_out(keep):
            continue
        pos = np.flatnonzero(order < keep).astype(np.int64)
        got = attempt(pos)
        if got is not None:
            return got, pos, np.flatnonzero(order >= keep).astype(np.int64)
    return None
