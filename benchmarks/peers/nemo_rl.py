"""NeMo-RL (NVIDIA-NeMo/RL, 2026-08) ``nemo_rl/data/packing/algorithms.py`` sequence packing.

Re-implemented from PEERS.md, not from upstream source:

1. First-fit decreasing: samples by length descending (ties by index), each to the first bin
   with room under ``cap``, else a new bin.
2. Bin count at least dp and a multiple of dp: while it is not, move one sequence (the last one
   placed, i.e. the shortest) out of the bin holding the most sequences into a new bin. When every
   bin holds a single sequence nothing can move and empty bins are added (fewer samples than dp).
3. Bin i goes to rank i mod dp (round-robin, not by load); a rank runs its bins in index order.

``align`` and ``cost`` are ignored (the packer knows neither a VPP group nor a cost model).
The modified-FFD variant (worst-fit last phase) is not modelled.
"""

from __future__ import annotations

import numpy as np

from ._common import PeerPlan, ceil_div, first_fit, to_plan

__all__ = ["plan_nemo_rl"]


def _round_to_dp(bins: list[list[int]], dp: int) -> None:
    """Grow the bin list to max(dp, ceil(len/dp)·dp) bins by moving single sequences (in place)."""
    target = max(dp, ceil_div(len(bins), dp) * dp)
    while len(bins) < target:
        fullest = max(range(len(bins)), key=lambda j: (len(bins[j]), -j)) if bins else -1
        if fullest < 0 or len(bins[fullest]) < 2:
            bins.append([])
            continue
        bins.append([bins[fullest].pop()])


def plan_nemo_rl(seq_lens: np.ndarray, *, dp: int, cap: int, align: int = 1, cost=None) -> PeerPlan:
    """One step packed the NeMo-RL way (see module docstring)."""
    lens = [int(x) for x in seq_lens]
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    bins, _ = first_fit(lens, cap, order)
    _round_to_dp(bins, dp)
    return to_plan([bins[r::dp] for r in range(dp)])
