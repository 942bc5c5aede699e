"""SkyRL (NovaSky-AI/SkyRL, 2026-08) mini-batch dispatch + token micro-batching, one step.

Re-implemented from PEERS.md, not from upstream source:

1. The step (a mini-batch in prompt units) is padded to a multiple of dp with zero-loss copies of
   real rows — the first ``pad`` rows (``tensor[:pad].clone()``); when ``pad`` exceeds the rows
   there are, that slice is too short and upstream fails (:class:`PeerCrash`). A copy of sample
   j is written ``~j`` (negative) in the plan: it costs compute but is not a duplicate.
2. Cut into dp contiguous, equal-count slabs in row order (no balancing): rank r gets rows
   ``[r·s, (r+1)·s)``.
3. Per rank, worst-fit decreasing under ``cap``: rows by length descending, each to the
   least-loaded bin (fewest tokens) that still fits, else a new bin.
4. The bin count is all-reduced MAX (simulated); ranks with fewer bins append padding
   micro-batches (empty here).

``align`` and ``cost`` are ignored.
"""

from __future__ import annotations

import numpy as np

from ._common import PeerCrash, PeerPlan, to_plan

__all__ = ["plan_skyrl"]


def _worst_fit_decreasing(rows: list[int], length: dict[int, int], cap: int) -> list[list[int]]:
    bins: list[list[int]] = []
    load: list[int] = []
    for row in sorted(rows, key=lambda i: -length[i]):
        L = length[row]
        best = -1
        for b in range(len(load)):
            if load[b] + L <= cap and (best < 0 or load[b] < load[best]):
                best = b
        if best < 0:
            bins.append([row])
            load.append(L)
        else:
            bins[best].append(row)
            load[best] += L
    return bins


def plan_skyrl(seq_lens: np.ndarray, *, dp: int, cap: int, align: int = 1, cost=None) -> PeerPlan:
    """One step laid out the SkyRL way (see module docstring)."""
    n = len(seq_lens)
    pad = (-n) % dp
    if pad > n:
        raise PeerCrash(f"skyrl: padding {n} rows to a multiple of dp={dp} needs {pad} copies, tensor[:pad] has {n}")
    rows = list(range(n)) + [~j for j in range(pad)]
    length = {i: int(seq_lens[i if i >= 0 else ~i]) for i in rows}
    slab = len(rows) // dp
    ranks = [_worst_fit_decreasing(rows[r * slab:(r + 1) * slab], length, cap) for r in range(dp)]
    k = max(len(b) for b in ranks)                    # all_reduce(MAX)
    return to_plan([b + [[] for _ in range(k - len(b))] for b in ranks])
