"""A padded step's samples sorted for runs, and the longest run from each start within a cost.

Design note. ``padded.py`` cuts a step's samples, sorted once (:class:`_Sorted`: by length in
1D, by response bucket then prompt in 2D), into consecutive runs, one micro-batch each.
:func:`_max_run` gives, for every start, the longest run within a cost τ and the caps (a closed
form in 1D, a bracketed binary search otherwise, warm-started from the τ already searched).
``padded.py``, ``padded_levels.py`` and ``padded_search.py`` all read these, so they live here,
below the three. Cost: O(n log n) to sort, O(n log n) per τ searched.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np

from .._intmath import round_up
from ..cost.models import CostModel, row_costs
from ..footprint import Padding

__all__ = ["PaddedSamples", "BRACKET_VALUES"]

BRACKET_VALUES = 4_000_000  # longest runs kept per step for _max_run's warm starts (2D, vision): 16 MB of int32


class PaddedSamples(NamedTuple):
    """One step's samples in a padded layout (arrays aligned, local positions)."""

    lens: np.ndarray                 # int64 real lengths
    prompt_lens: np.ndarray | None   # int64 (padded-2d) or None
    vision: np.ndarray | None        # int64 vision tokens or None
    extra_costs: np.ndarray | None   # float64 per-sample vision cost or None
    padding: Padding

    def take(self, pos: np.ndarray) -> PaddedSamples:
        pick = lambda a: None if a is None else a[pos]  # noqa: E731
        return PaddedSamples(self.lens[pos], pick(self.prompt_lens), pick(self.vision), pick(self.extra_costs),
                             self.padding)


class _Sorted:
    """Samples sorted for runs, with O(1) range-max widths and prefix sums."""

    def __init__(self, s: PaddedSamples, cost: CostModel) -> None:
        L = s.lens
        p = s.prompt_lens
        if p is None:  # 1D: by length, descending
            self.order = np.lexsort((np.arange(L.size), -L))
        else:  # 2D: responses in quarter-octave buckets (descending), prompts descending inside one
            bucket = np.floor(np.log2(L - p + 1) * 4)
            self.order = np.lexsort((np.arange(L.size), -L, -p, -bucket))
        self.L = L[self.order]
        self.p = None if p is None else p[self.order]
        self.unit = s.padding.width_multiple
        self.cost = cost
        self.n = L.size
        self._tables = None if p is None else (_sparse_max(self.p), _sparse_max(self.L - self.p))
        vis = s.vision
        self.vcum = None if vis is None else np.concatenate([[0], np.cumsum(vis[self.order])])
        ex = s.extra_costs
        self.xcum = None if ex is None else np.concatenate([[0.0], np.cumsum(ex[self.order])])
        self.bounds: dict[tuple, np.ndarray] = {}  # _cap_bound per caps (one array per caps: read-only)
        self.searched: dict[tuple, tuple[np.ndarray, list[float], list[np.ndarray]]] = {}  # _max_run's brackets

    @property
    def two_d(self) -> bool:
        return self._tables is not None

    def closed_form(self, tau: float) -> np.ndarray | None:
        """1D runs without vision cost: the most samples k with k·r(W) <= τ for every start (W = the
        start's padded length, r = ``row_costs`` of a multi-row micro-batch); None for 2D or vision."""
        if self._tables is not None or self.xcum is not None:
            return None
        w = round_up(self.L, self.unit).astype(np.float64)
        s = row_costs(self.cost, w, 2)  # rows of a multi-row micro-batch (a lone row may cost less)
        k = np.floor(tau / np.maximum(s, 1e-300) * (1 + 1e-12))
        return np.minimum(k, self.n).astype(np.int64)

    def width(self, a: np.ndarray, k: np.ndarray) -> np.ndarray:
        """Padded width of the runs [a, a+k) (k >= 1)."""
        if self._tables is None:
            w = self.L[a]
        else:
            w = _range_max(self._tables[0], a, a + k) + _range_max(self._tables[1], a, a + k)
        return round_up(w, self.unit)

    def run_cost(self, a: np.ndarray, k: np.ndarray, w: np.ndarray | None = None) -> np.ndarray:
        """Cost of runs [a, a+k) without per_micro: k rows of width W (+ vision); ``w``: their widths."""
        w = (self.width(a, k) if w is None else w).astype(np.float64)
        c = k * row_costs(self.cost, w, k)
        if self.xcum is not None:
            c = c + self.xcum[a + k] - self.xcum[a]
        return c


def _sparse_max(x: np.ndarray) -> np.ndarray:
    """Sparse table ``t[k, i] = max x[i : i + 2^k]`` (entries past the end are padding)."""
    n = x.size
    levels = max(1, int(n).bit_length())
    t = np.zeros((levels, n), dtype=np.int64)
    t[0] = x
    for k in range(1, levels):
        j = 1 << (k - 1)
        t[k, : n - j] = np.maximum(t[k - 1, : n - j], t[k - 1, j:])
    return t


def _range_max(t: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """max x[lo:hi] per pair (hi > lo), two lookups each."""
    lev = np.log2(np.maximum(hi - lo, 1)).astype(np.int64)  # exact for spans < 2^52
    return np.maximum(t[lev, lo], t[lev, hi - (1 << lev)])


def _max_run(srt: _Sorted, tau: float, bound: np.ndarray, cap: int | None) -> np.ndarray:
    """For every start a: the longest run from a within cost τ and the caps (>= 1)."""
    closed = srt.closed_form(tau)
    if closed is not None:  # 1D, cost k·r(W): solve for k
        return np.clip(closed, 1, bound)
    n = srt.n
    a = np.arange(n, dtype=np.int64)
    # keyed by the bound array itself (kept alive by its entry, so its id is not reused): one per caps
    _, taus, ks = srt.searched.setdefault((id(bound), cap), (bound, [], []))
    j = bisect.bisect_left(taus, tau)
    if j < len(taus) and taus[j] == tau:
        return ks[j].astype(np.int64)
    # the longest run within τ is monotone in τ: the nearest τ searched below is feasible, above an upper limit
    lo = ks[j - 1].astype(np.int64) if j > 0 else np.ones(n, dtype=np.int64)
    hi = ks[j].astype(np.int64) if j < len(taus) else bound.copy()
    while True:  # binary search the largest k in [lo, hi] within τ (and, in 2D, the cap)
        active = lo < hi
        if not active.any():
            if (len(taus) + 1) * n <= BRACKET_VALUES:
                taus.insert(j, tau)
                ks.insert(j, lo.astype(np.int32))
            return lo
        mid = (lo + hi + 1) // 2
        ok = np.ones(n, dtype=bool)
        aa, kk = a[active], mid[active]
        w = srt.width(aa, kk)
        good = srt.run_cost(aa, kk, w) <= tau
        if cap is not None and srt.two_d:
            good &= kk * w <= cap
        ok[active] = good
        lo = np.where(active & ok, mid, lo)
        hi = np.where(active & ~ok, mid - 1, hi)
