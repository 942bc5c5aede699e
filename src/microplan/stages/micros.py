"""Build the Micro value objects of one step from a bin assignment (shared by every step planner).

Samples are grouped by bin with one stable argsort, so each micro-batch's arrays are read-only
slices of four shared arrays (ascending global index = execution order): building dp·K Micros
costs one argsort and dp·K slices, no per-sample Python work. :func:`grid_micros` builds the
ranks × slots rows directly (``types._micro_row``: one small dict per Micro, ``indices`` sliced,
the other three arrays on first read; ``types._micro_grid``: every rank in one pass when the
step has no placeholder).
"""

from __future__ import annotations

import numpy as np

from .._sort import stable_argsort
from ..batch import Batch
from ..footprint import Footprint
from ..types import Micro, _micro_grid, _micro_row

__all__ = ["MicroParts", "binned_micros", "grid_micros"]

MicroParts = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # indices, seq_lens, loss_tokens, loss_scale


def _columns(kept: np.ndarray, bin_of: np.ndarray, num_bins: int, scale: np.ndarray,
             batch: Batch) -> tuple[list[np.ndarray], np.ndarray]:
    """The four read-only columns grouped by bin (ascending global index inside a bin) and the
    bin bounds: bin b's samples are ``cols[:, bounds[b]:bounds[b + 1]]``."""
    order = stable_argsort(bin_of)
    bounds = np.zeros(num_bins + 1, dtype=np.int64)
    np.cumsum(np.bincount(bin_of, minlength=num_bins)[:num_bins], out=bounds[1:])
    idx = kept[order]
    cols = [idx, batch.seq_lens[idx], batch.loss_tokens[idx], scale[order].astype(np.float64, copy=False)]
    for a in cols:
        a.setflags(write=False)
    return cols, bounds


def binned_micros(kept: np.ndarray, bin_of: np.ndarray, num_bins: int, scale: np.ndarray,
                  batch: Batch) -> list[MicroParts]:
    """The four arrays of each bin's Micro (bins past the real ones are placeholders).

    Build rank r's Micro with ``Micro._trusted(*parts[b], cp_size, cp_rank, cp_group)``.
    """
    (i, n, t, w), bounds = _columns(kept, bin_of, num_bins, scale, batch)
    b = bounds.tolist()
    empty = (i[:0], n[:0], t[:0], w[:0])  # one shared tuple for every placeholder bin
    return [(i[lo:hi], n[lo:hi], t[lo:hi], w[lo:hi]) if hi > lo else empty for lo, hi in zip(b[:-1], b[1:])]


def grid_micros(kept: np.ndarray, bin_of: np.ndarray, grid: np.ndarray, scale: np.ndarray, batch: Batch, *,
                cp_size: int, footprint: Footprint | None) -> list[list[Micro]]:
    """Rank r's Micros, slot by slot, for the bins ``grid[r, m]`` of a ranks × slots grid; a
    rank's empty bins share one (immutable) placeholder."""
    cols, bounds = _columns(kept, bin_of, grid.size, scale, batch)
    lo_g, hi_g = bounds[:-1][grid], bounds[1:][grid]
    if grid.size and (hi_g > lo_g).all():  # no placeholder: every rank's Micros in one pass
        return _micro_grid(cols, lo_g.ravel().tolist(), hi_g.ravel().tolist(), grid.shape[1], cp_size, footprint)
    los, his = lo_g.tolist(), hi_g.tolist()
    return [_micro_row(cols, lo, hi, (r,), cp_size, footprint) for r, (lo, hi) in enumerate(zip(los, his))]
