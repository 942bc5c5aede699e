"""Build the Micro value objects of one step from a bin assignment (shared by every step planner).

Samples are grouped by bin with one stable argsort, so each micro-batch's arrays are read-only
slices of four shared arrays (ascending global index = execution order): building dp·K Micros
costs one argsort and dp·K slices, no per-sample Python work.
"""

from __future__ import annotations

import numpy as np

from ..batch import Batch

__all__ = ["MicroParts", "binned_micros"]

MicroParts = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # indices, seq_lens, loss_tokens, loss_scale


def binned_micros(kept: np.ndarray, bin_of: np.ndarray, num_bins: int, scale: np.ndarray,
                  batch: Batch) -> list[MicroParts]:
    """The four arrays of each bin's Micro (bins past the real ones are placeholders).

    Build rank r's Micro with ``Micro._trusted(*parts[b], cp_size, cp_rank, cp_group)``.
    """
    order = np.argsort(bin_of, kind="stable")
    bounds = np.searchsorted(bin_of[order], np.arange(num_bins + 1)).tolist()
    idx = kept[order]
    cols = [idx, batch.seq_lens[idx], batch.loss_tokens[idx], scale[order].astype(np.float64)]
    for a in cols:
        a.setflags(write=False)
    i, n, t, w = cols
    empty = (i[:0], n[:0], t[:0], w[:0])  # one shared tuple for every placeholder bin
    return [(i[lo:hi], n[lo:hi], t[lo:hi], w[lo:hi]) if hi > lo else empty for lo, hi in zip(bounds[:-1], bounds[1:])]
