"""What one GPU pays for each micro-batch of a step: the one per-GPU bin price of the planner and the stats.

Design note. A bin (micro-batch) of a step costs its model cost (``models.bin_costs``, or the
footprint's ``bin_footprint``), spread over its CP group by the one CP price
(``cp.cp_micro_costs``); a bin holding no sample is a placeholder and runs one dummy token
(``models.placeholder_cost``). Every place that prices a laid-out step — the candidate times of
``stages/place.py`` and ``stages/cp.py``, and ``Plan.stats`` — calls :func:`gpu_costs`, so a
plan is predicted as it is reported; the packers' K search prices its bins with
:func:`gpu_bin_costs` (the same CP price, an empty bin at ``per_micro``).
"""

from __future__ import annotations

import numpy as np

from .cp import cp_micro_costs
from .models import CostModel, bin_costs, placeholder_cost

__all__ = ["gpu_costs", "gpu_bin_costs"]


def gpu_costs(cost: CostModel, micro_costs: np.ndarray, tokens: np.ndarray, width: np.ndarray | int, *,
              empty: np.ndarray | None = None) -> np.ndarray:
    """Per-GPU cost of every bin: ``micro_costs`` (per_micro included) of ``tokens`` over CP groups
    of ``width``; ``empty`` bins (default: those of 0 tokens) at a placeholder's price instead."""
    mc = np.asarray(micro_costs, dtype=np.float64)
    t = np.asarray(tokens)
    empty = t == 0 if empty is None else empty
    if np.any(empty):
        mc = np.where(empty, placeholder_cost(cost), mc)
        t = np.where(empty, 1, t)
    return cp_micro_costs(cost, mc, t, width)


def gpu_bin_costs(cost: CostModel, additive: np.ndarray, tokens: np.ndarray, count: np.ndarray,
                  width: np.ndarray | int = 1) -> np.ndarray:
    """Per-GPU cost of bins given their Σ sample costs, Σ tokens and sample counts (``bin_costs``)
    over CP groups of ``width``, as the packers price them while they search (an empty bin pays
    ``per_micro`` only; :func:`gpu_costs` prices a finished layout's placeholders)."""
    mc = bin_costs(cost, additive, tokens, count)
    return mc if np.all(np.asarray(width) == 1) else cp_micro_costs(cost, mc, tokens, width)
