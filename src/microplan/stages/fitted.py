"""What every fitter of the flow returns: one result for global, local and CP-group fitting.

Design note. ``place.lay_out`` calls one fitter per step — ``fit.fit_step`` (any rank),
``local.fit_local`` (each atom on its owner's rank) or ``cp.fit_dynamic_cp`` (bins with CP
widths) — and reads one :class:`Fit` back: the units that train, the bin of each, K and its
:class:`~microplan.types.KChoice`, and what the fitter already fixed of the ranks × slots grid.
The rest of the flow (bin footprints, the predicted time with placeholders priced,
``short_step`` across granularities, micro-batches, pipeline order) is one tail for all three.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..types import KChoice

__all__ = ["Fit", "Slots"]


class Slots(NamedTuple):
    """A packing's per-GPU micro-batch costs and their slot grid (``assign.arrange``), kept with the
    packing: the K timer and the layout re-use the grid when they price the same costs."""

    bin_of: np.ndarray        # the packing they belong to
    costs: np.ndarray         # per-GPU cost of each of the dp·K micro-batches
    grid: np.ndarray          # arrange(costs, dp, K)


class Fit(NamedTuple):
    """One step's fit; positions are into the fitter's units (samples or atoms of the step)."""

    kept: np.ndarray                  # unit positions that train (ascending)
    bin_of: np.ndarray                # bin of each kept unit
    K: int                            # micro-batches per rank
    choice: KChoice | None            # why K (static batching: set by the layout, the K its count fixes)
    num_bins: int                     # bins that hold a unit (the rest of the grid's bins are placeholders)
    width: np.ndarray | None = None   # dynamic CP: each bin's CP width (None: every bin the static CP degree)
    grid: np.ndarray | None = None    # [dp, K] bin of each rank and slot when the fitter fixed it (dynamic CP's
    #                                   groups; the local hedge, which levelled bin r·K + m against slot m)
    slots: Slots | None = None        # global fit: its packing's per-GPU costs and arrange grid, when known
    time: float | None = None         # dynamic CP: the predicted step time it chose by (placeholders as they run)
    short: bool = False               # some rank has fewer units than K (placeholders)
