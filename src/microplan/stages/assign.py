"""Arrange a step's micro-batches into a ranks × slots grid (equal count per rank).

Design note. Given dp·K micro-batch costs (placeholders cost 0), sort them descending and cut
the order into K slots of dp consecutive micro-batches. For ``sync="micro"`` the step time is
Σ_m max_r cost(r, m); grouping sorted costs into consecutive blocks minimises that sum for a
fixed set of micro-batch costs (an exchange argument: any slot mixing a heavier and a lighter
block can swap without increasing either maximum). Inside a slot, the heaviest micro-batch goes
to the rank with the least cumulative cost so far, which keeps max_r Σ_m cost(r, m) within one
micro-batch of the mean for ``sync="step"``. Slots run heaviest first, so placeholders (cost 0)
come last on every rank. Cost: O(dp·K log(dp·K) + K · dp log dp).
"""

from __future__ import annotations

import numpy as np

from .._sort import stable_argsort

__all__ = ["arrange", "grid_time"]


def arrange(micro_costs: np.ndarray, dp: int, K: int) -> np.ndarray:
    """``grid[r, m]``: index into ``micro_costs`` of the micro-batch rank r runs in slot m.

    ``micro_costs`` has exactly ``dp·K`` entries (placeholders included).
    """
    order = stable_argsort(micro_costs, descending=True)
    ranked = micro_costs[order]                        # the costs in that order: a slot's block is a slice
    grid = np.empty((dp, K), dtype=np.int64)
    rank_load = np.zeros(dp, dtype=np.float64)
    for m in range(K):
        block = order[m * dp:(m + 1) * dp]           # descending cost
        ranks = rank_load.argsort(kind="stable")      # lightest rank first
        grid[ranks, m] = block
        rank_load[ranks] += ranked[m * dp:(m + 1) * dp]
    return grid


def grid_time(grid: np.ndarray, sync: str) -> float:
    """Predicted step time of a ranks × slots cost grid: Σ_m max_r under ``sync="micro"`` (every
    micro-batch is a sync point), max_r Σ_m under ``"step"`` (ranks meet once per step)."""
    if grid.size == 0:
        return 0.0
    return float(grid.max(axis=0).sum()) if sync == "micro" else float(grid.sum(axis=1).max())
