"""OpenRLHF (OpenRLHF/OpenRLHF, 2026-08) dynamic batching + experience balancing, one step.

Re-implemented from PEERS.md, not from upstream source:

1. Micro count: first-fit on the unsorted lengths under ``cap`` gives F bins; the count is
   ``M = max(floor(F/dp)·dp, dp)`` — rounded *down* to a multiple of dp, at least dp.
2. Karmarkar–Karp (``equal_size=False``) on token counts into M micro-batches, no cap check (the
   round-down makes over-cap micro-batches likely).
3. Cross-DP balancing, length-sorted snake deal: micro-batches by tokens descending are dealt to
   ranks 0..dp-1, then dp-1..0, and so on; each rank gets M/dp and runs them in dealt order.

``align`` and ``cost`` are ignored.
"""

from __future__ import annotations

import numpy as np

from ._common import PeerPlan, first_fit, to_plan
from .kk import karmarkar_karp

__all__ = ["plan_openrlhf"]


def _snake(order: list[int], dp: int) -> list[list[int]]:
    ranks: list[list[int]] = [[] for _ in range(dp)]
    for pos, j in enumerate(order):
        rnd, off = divmod(pos, dp)
        ranks[off if rnd % 2 == 0 else dp - 1 - off].append(j)
    return ranks


def plan_openrlhf(seq_lens: np.ndarray, *, dp: int, cap: int, align: int = 1, cost=None) -> PeerPlan:
    """One step laid out the OpenRLHF way (see module docstring)."""
    lens = [int(x) for x in seq_lens]
    bins, _ = first_fit(lens, cap)
    m = max(len(bins) // dp * dp, dp)
    micros = karmarkar_karp(lens, m, equal_size=False)
    tokens = [sum(lens[i] for i in mb) for mb in micros]
    order = sorted(range(m), key=lambda j: (-tokens[j], j))
    return to_plan([[micros[j] for j in rank] for rank in _snake(order, dp)])
