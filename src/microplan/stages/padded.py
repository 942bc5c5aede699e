"""Pack a step for a padded layout: group samples of similar length, balance the padded cost.

Design note. In a padded layout a micro-batch of n samples is an ``[n, W]`` tensor, W its
longest sample (``padded-2d``: longest prompt + longest response) rounded up to the width
multiple; it occupies n·W tokens and costs n·r(W) + per_micro: every row runs as its own
sequence of W (``cost.models.row_costs``: a dense kernel computes all W² pairs of a masked
row). Padding is low when a micro-batch holds samples of similar length, so bins are
*contiguous runs* of the samples sorted by length (descending; 2D: by response length in
quarter-octave buckets, then by prompt length, so a run shares both its longest prompt and its
longest response, which pads less than sorting 2D rows by total length). Two ways to cut them, each polished by ``padded_search.py``:

1. Min-max runs for m bins: a bisection on a cost target τ; from each run start a, the run takes
   the most samples whose padded cost stays <= τ and whose footprint (and vision tokens) stay
   under the caps (vectorised for every start at once; sparse-table range maxima for the 2D
   width, whose binary search per start starts between the runs found at the nearest τ already
   searched: the longest run is monotone in τ). The smallest τ whose runs number <= m is the
   min-max partition; runs are split
   (costliest first) until there are exactly m. Every micro-batch gets the same budget.
2. Slot levels (``padded_levels.py``): a DP over the sorted samples gives each slot of dp
   micro-batches its own level (the longest samples alone in slot 0, the short tail cut fine in
   a cheap last slot) and predicts the time of every K at once.

K: the min-max walk from K's lower bound (padded tokens, the vision cap) up while the time
improves (one step of patience, at most ``MAX_EVALS`` packings), plus the level DP's three best
K over the whole range up to one sample per bin (its pass stops once K·per_micro plus the
step's body bound passes the best time); K is chosen on boundary moves, then the ``DEEP`` best
K get every move of ``padded_search.py`` — also from the volume cuts of ``padded_levels.py``,
whose slots may interleave in the sorted order, when their DP's work is within
``VOLUME_MAX_WORK`` (every step of ≤ 64 samples; on the large benchmark grid, the dp-8 steps
of 128–261 samples) — and the lowest predicted time wins. Every K tried is
recorded in the step's :class:`KChoice` (the DP's own prediction where it was not packed).
Static batching (``micro_batch_size``) runs the same with a count cap and K fixed by it.

Guarantees: every bin non-empty (placeholders only when the step has fewer samples than dp·K),
within the cap counting padding and within the vision cap; deterministic; never slower than the
min-max walk alone (its packings are candidates). The 2D width of a run is the max prompt plus
the max response over the run, exactly what ``pack_micro`` builds.
Trade-off: the volume cuts, the level DP and the deep search cost plan time (most on small and
mid steps) for the interleaved slots no boundary move reaches; benchmarks/bench_layouts.py
(``--quick``; ``--volume-max-work 0`` without the volume cuts), benchmarks/padded_exact.py and
benchmarks/padded_anneal.py measure the plans against the bound, the exhaustive optimum and an
annealing search, and the plan time.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._intmath import round_up
from ..cost.models import CostModel
from ..types import KChoice
from .padded_levels import level_plans, split_to_count, volume_cuts, volume_work
from .padded_rows import PaddedSamples, _max_run, _Sorted
from .padded_search import local_search, predicted_time

__all__ = ["PaddedSamples", "PaddedPacking", "pack_padded", "pack_padded_at", "runs_for_bins"]

MAX_EVALS = 12    # K values packed per step by the min-max walk
DEEP = 2          # the best K searched with every move of padded_search.py
VOLUME_MAX_WORK = 2_000_000  # the deep search also starts from padded_levels.volume_cuts within this work (volume_work)


class PaddedPacking(NamedTuple):
    bin_of: np.ndarray
    num_bins: int
    K: int
    choice: KChoice | None


def _cap_bound(srt: _Sorted, cap: int | None, max_count: int | None, vcap: int | None) -> np.ndarray:
    """For every start a: the longest run the caps allow ignoring cost (exact in 1D; an upper
    bound in 2D, whose width only grows with the run). Computed once per caps and step."""
    got = srt.bounds.get((cap, max_count, vcap))
    if got is None:
        got = srt.bounds[cap, max_count, vcap] = _cap_bound_of(srt, cap, max_count, vcap)
    return got


def _cap_bound_of(srt: _Sorted, cap: int | None, max_count: int | None, vcap: int | None) -> np.ndarray:
    n = srt.n
    a = np.arange(n, dtype=np.int64)
    hi = n - a
    if max_count is not None:
        hi = np.minimum(hi, max_count)
    if cap is not None:
        hi = np.minimum(hi, cap // round_up(srt.L, srt.unit))
    if vcap is not None:
        hi = np.minimum(hi, np.searchsorted(srt.vcum, srt.vcum[:-1] + vcap, side="right") - 1 - a)  # type: ignore[index]
    return np.maximum(hi, 1)  # a lone sample always fits (checked upstream)


def _runs(srt: _Sorted, tau: float, caps: tuple, bound: np.ndarray) -> list[int]:
    """Run boundaries [0, b1, ..., n] taking the longest run from each start."""
    step = (bound if tau == float("inf") and not srt.two_d else _max_run(srt, tau, bound, caps[0])).tolist()
    b, i, n = [0], 0, srt.n
    while i < n:  # a list, not the array: cheaper element access for this sequential walk
        i += step[i]
        b.append(i)
    return b


def runs_for_bins(srt: _Sorted, m: int, caps: tuple) -> list[int] | None:
    """Exactly m runs under the caps with (near) min-max cost; None if the caps need more."""
    n = srt.n
    bound = _cap_bound(srt, *caps)
    tight = _runs(srt, float("inf"), caps, bound)  # the fewest runs the caps allow
    if len(tight) - 1 > m:
        return None
    costs1 = srt.run_cost(np.arange(n), np.ones(n, dtype=np.int64))
    lo, hi = float(costs1.max()), float(srt.run_cost(np.array([0]), np.array([n]))[0])
    best = tight
    for _ in range(48):
        if hi <= lo * (1 + 1e-7):
            break
        mid = (lo + hi) / 2
        b = _runs(srt, mid, caps, bound)
        if len(b) - 1 <= m:
            best, hi = b, mid
        else:
            lo = mid
    return split_to_count(srt, best, m)


class _Runs(NamedTuple):
    """A packing of the sorted samples: run boundaries [0, ..., n] and their predicted time."""

    bounds: list[int]
    time: float


def _bins_at(srt: _Sorted, m: int, D: int, K: int, caps: tuple, per_micro: float, sync: str,
             start: list[int] | None = None, deep: bool = False) -> _Runs | None:
    """m runs and their predicted time, or None if the caps need more; ``start``: run boundaries
    to start the local search from (default: the min-max runs); ``deep``: every move of
    ``padded_search.py``, else boundary moves only (K is chosen on those)."""
    b = runs_for_bins(srt, m, caps) if start is None else start
    if b is None:
        return None
    b = local_search(srt, b, D, K, caps, per_micro, sync, deep=deep)
    bnd = np.array(b, dtype=np.int64)
    c = np.concatenate([srt.run_cost(bnd[:-1], np.diff(bnd)) + per_micro, np.full(D * K - m, per_micro)])
    return _Runs(b, predicted_time(c, D, K, sync))


def _bin_of(srt: _Sorted, b: list[int]) -> np.ndarray:
    """The bin of every sample (input order) for run boundaries b of the sorted samples."""
    bnd = np.array(b, dtype=np.int64)
    bin_of = np.empty(srt.n, dtype=np.int64)
    bin_of[srt.order] = np.repeat(np.arange(bnd.size - 1), np.diff(bnd))
    return bin_of


def _best_at(srt: _Sorted, K: int, D: int, caps: tuple, pm: float, sync: str,
             levels: list[int] | None, minmax: bool = True) -> _Runs | None:
    """The better of the level DP's runs and the min-max runs at K, each locally improved."""
    m = min(srt.n, D * K)
    got = _bins_at(srt, m, D, K, caps, pm, sync) if minmax else None
    if levels is not None:
        alt = _bins_at(srt, m, D, K, caps, pm, sync, start=levels)
        if alt is not None and (got is None or alt.time < got.time):
            got = alt
    return got


def _walk(srt: _Sorted, K0: int, dp: int, align: int, caps: tuple, pm: float,
          sync: str) -> tuple[dict[int, float], dict[int, _Runs]]:
    """K from K0 up while the min-max packing's time improves (one step of patience, at most
    ``MAX_EVALS`` packings; past them, on to the first K that packs): (times, packings) by K."""
    n = srt.n
    tried: dict[int, float] = {}
    found: dict[int, _Runs] = {}
    K, worse = K0, 0
    while True:
        m = min(n, dp * K)
        got = _bins_at(srt, m, dp, K, caps, pm, sync)
        t = float("inf") if got is None else got.time
        before = [x for x in tried.values() if np.isfinite(x)]  # the K tried before this one
        tried[K] = t
        if got is not None:
            found[K] = got
        if np.isfinite(t) and before and t > min(before) * (1 - 1e-12):
            worse += 1
        elif np.isfinite(t):
            worse = 0
        if worse >= 2 or m == n or (len(tried) >= MAX_EVALS and found):
            return tried, found
        K += align


def pack_padded(s: PaddedSamples, *, K0: int, dp: int, align: int, cap: int | None, micro_batch_size: int | None,
                vision_cap: int | None, cost: CostModel, sync: str) -> PaddedPacking:
    """Bins for one step in a padded layout, K chosen by predicted time (see the module note).

    ``K0``: the fewest micro-batches per rank the config allows (``fit.py``: the bins' lower bound,
    ``pipeline_stages``, ``align``); with ``micro_batch_size`` it is the K.
    """
    n = s.lens.size
    srt = _Sorted(s, cost)
    caps = (cap, micro_batch_size, vision_cap if s.vision is not None else None)
    pm = float(cost.per_micro)
    bound = _cap_bound(srt, *caps)
    if micro_batch_size is not None:
        lv = level_plans(srt, caps, bound, dp=dp, Ks=[K0], per_micro=pm, keep=1)
        got = _best_at(srt, K0, dp, caps, pm, sync, lv.runs.get(K0))
        assert got is not None  # a count cap of micro_batch_size always fits min(n, dp·K) runs
        got = _bins_at(srt, min(n, dp * K0), dp, K0, caps, pm, sync, start=got.bounds, deep=True)
        return PaddedPacking(_bin_of(srt, got.bounds), min(n, dp * K0), K0, None)  # type: ignore[union-attr]
    tried, found = _walk(srt, K0, dp, align, caps, pm, sync)
    k_all = K0 + max(0, -(-(-(-n // dp) - K0) // align)) * align  # the least aligned K giving every sample a bin
    lv = level_plans(srt, caps, bound, dp=dp, Ks=list(range(K0, k_all + 1, align)), per_micro=pm)
    lead = min(lv.runs, key=lambda k: lv.times[k], default=None)
    for K, runs in lv.runs.items():  # the level DP's best K: its runs (and at its best, min-max runs)
        got = _best_at(srt, K, dp, caps, pm, sync, runs, minmax=K == lead and K not in found)
        if got is not None and got.time < tried.get(K, float("inf")):
            tried[K], found[K] = got.time, got
    deep = sorted(found, key=lambda k: tried[k])[:DEEP]
    ms = [min(n, dp * K) for K in deep]
    cheap = sync == "micro" and volume_work(n, bound, max(ms, default=0)) <= VOLUME_MAX_WORK
    vol = volume_cuts(srt, ms, caps, bound) if cheap else {}
    for K in deep:  # every move for the best few K
        starts = [found[K].bounds] + [b for (m, _), b in vol.items() if m == min(n, dp * K)]
        for start in starts:
            got = None if start is None else _bins_at(srt, min(n, dp * K), dp, K, caps, pm, sync, start=start,
                                                      deep=True)
            if got is not None and got.time < tried[K]:
                tried[K], found[K] = got.time, got
    for K, t in lv.times.items():  # the DP's predicted time where nothing better was packed
        tried.setdefault(K, t)
    best_t = min(tried[k] for k in found)
    K = min(k for k in found if tried[k] == best_t)
    listing = ", ".join(f"K={k}: {tried[k]:.4g}" for k in sorted(tried))
    why = (f"K={K} has the lowest predicted {'lockstep' if sync == 'micro' else 'step-sync'} time of the K tried "
           f"({listing}) in the {s.padding.layout} layout: more micro-batches pad less but add per_micro "
           f"(lower bound K={K0} from the padded tokens)")
    choice = KChoice(K, K0, tuple(sorted(tried.items())), why)
    return PaddedPacking(_bin_of(srt, found[K].bounds), min(n, dp * K), K, choice)


def pack_padded_at(s: PaddedSamples, *, m: int, K: int, cap: int | None, micro_batch_size: int | None,
                   vision_cap: int | None, cost: CostModel, sync: str) -> np.ndarray | None:
    """m bins of one rank's samples at a given K (local placement), or None if the caps need more."""
    caps = (cap, micro_batch_size, vision_cap if s.vision is not None else None)
    srt = _Sorted(s, cost)
    got = _bins_at(srt, m, 1, K, caps, float(cost.per_micro), sync, deep=True)
    return None if got is None else _bin_of(srt, got.bounds)
