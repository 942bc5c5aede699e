"""Pack a step for a padded layout: group samples of similar length, balance the padded cost.

Design note. In a padded layout a micro-batch of n samples is an ``[n, W]`` tensor, W its
longest sample (``padded-2d``: longest prompt + longest response) rounded up to the width
multiple; it occupies n·W tokens and costs n·r(W) + per_micro: every row runs as its own
sequence of W (``cost.models.row_costs``: a dense kernel computes all W² pairs of a masked row). Padding is low when a micro-batch holds samples of similar length, so bins are
*contiguous runs* of the samples sorted by length (descending; 2D: by response length in
quarter-octave buckets, then by prompt length, so a run shares both its longest prompt and its
longest response — measured 1.09 padded/real tokens against 1.15 when sorting 2D rows by total
length). For a given number of bins m:

1. Bisection on a cost target τ: from each run start a, the run takes the most samples whose
   padded cost stays <= τ and whose footprint (and vision tokens) stay under the caps
   (vectorised for every start at once; sparse-table range maxima for the 2D width). The
   smallest τ whose runs number <= m is the min-max partition; runs are split (costliest first)
   until there are exactly m.
2. Local search on the lockstep time: bins are arranged as ``assign.arrange`` will arrange them
   (sorted costs cut into slots of dp), and run boundaries next to each slot's heaviest bin move
   by one or two samples while the predicted time falls (bounded by ``MAX_MOVES``).
3. K: from its lower bound (padded tokens, the vision cap), the K of lowest predicted time is
   kept — more, smaller micro-batches pad less but add ``per_micro`` — walking up while the time
   improves (one step of patience, at most ``MAX_EVALS`` packings); every K tried is recorded in
   the step's :class:`KChoice`. Static batching (``micro_batch_size``) runs the same with a
   count cap and K fixed by it.

Guarantees: every bin non-empty (placeholders only when the step has fewer samples than dp·K),
within the cap counting padding and within the vision cap; deterministic. The 2D width of a
run is the max prompt plus the max response over the run, exactly what ``pack_micro`` builds.
Measured (benchmarks/bench_layouts.py, 7B cost, long-tailed and step-wise families, dp 8–32,
medians): 1.013–1.017 padded/real tokens, 0 micro-batches over the cap, lockstep 1.056–1.063×
the varlen lower bound (NeMo-RL's sorted buckets: 1.19–1.20 padded/real, 1.26–1.33×; a fixed
micro_batch_size: 3.7–3.8×). Trade-off: balance within the padded cost is 1.04–1.05× its own
bound — a padded micro-batch costs a whole multiple of its row, so with 2–10 samples per
micro-batch slots cannot be evened finer; against the granularity-aware bound of
``padded_bound.py`` the plan is 1.046–1.054× (median), and on 12-sample steps 1.014–1.034× the
exhaustive optimum (median, ``benchmarks/padded_optimum.py``; worst 1.20 when the K walk stops
below the optimum's K). Cost: O(n log n) per τ, ~30 τ per K, a few K: 10–25 ms
at n = 0.1–2k (2D: 70–200 ms).
"""

from __future__ import annotations

from itertools import combinations
from math import comb
from typing import NamedTuple

import numpy as np

from ..cost.models import CostModel
from ..cost.models import row_costs
from ..footprint import Padding, round_up
from ..types import KChoice
from .assign import arrange
from .padded_levels import level_plans

__all__ = ["PaddedSamples", "PaddedPacking", "pack_padded", "pack_padded_at", "runs_for_bins"]

MAX_EVALS = 12    # K values packed per step
MAX_MOVES = 4000  # boundary moves tried per packing in the local search
MERGE_SPLIT_MAX_RUNS = 64  # merge-and-cut moves are scored for steps of at most this many runs
MERGE_SPLIT_ROUNDS = 16    # ... at most this many times per packing
RELOCATE_MAX_SAMPLES = 40  # steps this small move any one or two run boundaries anywhere instead
RELOCATE_PAIRS = 40000     # ... two at once when at most this many pairs of moves exist
RELOCATE_ROUNDS = 64


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


class PaddedPacking(NamedTuple):
    bin_of: np.ndarray
    num_bins: int
    K: int
    choice: KChoice | None


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


def _cap_bound(srt: _Sorted, cap: int | None, max_count: int | None, vcap: int | None) -> np.ndarray:
    """For every start a: the longest run the caps allow ignoring cost (exact in 1D; an upper
    bound in 2D, whose width only grows with the run)."""
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


def _max_run(srt: _Sorted, tau: float, bound: np.ndarray, cap: int | None) -> np.ndarray:
    """For every start a: the longest run from a within cost τ and the caps (>= 1)."""
    closed = srt.closed_form(tau)
    if closed is not None:  # 1D, cost k·r(W): solve for k
        return np.clip(closed, 1, bound)
    n = srt.n
    a = np.arange(n, dtype=np.int64)
    lo, hi = np.ones(n, dtype=np.int64), bound.copy()
    while True:  # binary search the largest k in [lo, hi] within τ (and, in 2D, the cap)
        active = lo < hi
        if not active.any():
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


def _runs(srt: _Sorted, tau: float, caps: tuple, bound: np.ndarray) -> list[int]:
    """Run boundaries [0, b1, ..., n] taking the longest run from each start."""
    step = bound if tau == float("inf") and not srt.two_d else _max_run(srt, tau, bound, caps[0])
    b, i = [0], 0
    while i < srt.n:
        i += int(step[i])
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
    return _split_to(srt, best, m)


def _split_to(srt: _Sorted, b: list[int], m: int) -> list[int]:
    """Split the costliest multi-sample runs in two until there are m (splitting never breaks a cap)."""
    b = list(b)
    while len(b) - 1 < m:
        starts, ends = np.array(b[:-1]), np.array(b[1:])
        k = ends - starts
        c = np.where(k > 1, srt.run_cost(starts, np.maximum(k, 1)), -1.0)
        j = int(np.argmax(c))
        b.insert(j + 1, int(starts[j] + k[j] // 2))
    return b


def _time(costs: np.ndarray, D: int, K: int, sync: str) -> float:
    """Predicted step time of dp·K micro-batch costs arranged by ``assign.arrange``.

    Under ``sync="micro"`` that is the sum of every dp-th cost in descending order (arrange cuts
    the sorted costs into slots of dp); under ``"step"`` the arranged grid's heaviest rank.
    """
    if sync == "micro":
        return float(np.sort(costs)[::-1][::D].sum())
    grid = costs[arrange(costs, D, K)]
    return float(grid.sum(axis=1).max())


def _improve(srt: _Sorted, b: list[int], D: int, K: int, caps: tuple, per_micro: float, sync: str) -> list[int]:
    """Move run boundaries next to the heaviest bins while the predicted time falls."""
    cap, max_count, vcap = caps
    bnd = np.array(b, dtype=np.int64)
    m = bnd.size - 1
    if m < 2:
        return b

    def run(a: int, e: int) -> float | None:
        """Cost of the run [a, e), or None when it breaks a cap."""
        k = e - a
        if k < 1 or (max_count is not None and k > max_count):
            return None
        if cap is not None and k * int(srt.width(np.array([a]), np.array([k]))[0]) > cap:
            return None
        if vcap is not None and srt.vcum[e] - srt.vcum[a] > vcap:  # type: ignore[index]
            return None
        return float(srt.run_cost(np.array([a]), np.array([k]))[0]) + per_micro

    c = np.concatenate([srt.run_cost(bnd[:-1], np.diff(bnd)) + per_micro, np.full(D * K - m, per_micro)])
    cur = _time(c, D, K, sync)
    moves = 0
    improved = True
    while improved and moves < MAX_MOVES:
        improved = False
        desc = np.argsort(-c, kind="stable")
        heads = desc[::D]  # the heaviest bin of every slot (arrange cuts sorted costs into slots of dp)
        for j in [int(x) for x in heads if x < m] + [int(x) for x in desc[1::D] if x < m]:
            for e in (j, j + 1):             # a boundary of run j (index into bnd)
                if e <= 0 or e >= m:
                    continue
                for d in (-1, 1, -2, 2):
                    moves += 1
                    x = int(bnd[e]) + d
                    if not bnd[e - 1] < x < bnd[e + 1]:
                        continue
                    left, right = run(int(bnd[e - 1]), x), run(x, int(bnd[e + 1]))
                    if left is None or right is None:
                        continue
                    old = c[e - 1], c[e]
                    c[e - 1], c[e] = left, right
                    t = _time(c, D, K, sync)
                    if t < cur * (1 - 1e-12):
                        bnd[e], cur, improved = x, t, True
                        break
                    c[e - 1], c[e] = old
                if improved:
                    break
            if improved:
                break
    return bnd.tolist()


def _halves(srt: _Sorted, a: int, e: int, caps: tuple) -> tuple[int, float, float] | None:
    """The cut x of the run [a, e) (two samples or more) whose halves' costlier one is cheapest."""
    x = np.arange(a + 1, e)
    left = srt.run_cost(np.full(x.size, a), x - a)
    right = srt.run_cost(x, e - x)
    j = int(np.argmin(np.maximum(left, right)))
    return int(x[j]), float(left[j]), float(right[j])


def _merge_split(srt: _Sorted, b: list[int], D: int, K: int, caps: tuple, per_micro: float) -> list[int] | None:
    """The best lockstep move that merges two adjacent runs and cuts another in two (the count
    stays): it lets a slot take a run of two short neighbours while another slot's head halves;
    None when no move lowers the time. All pairs are scored at once (lockstep only)."""
    bnd = np.array(b, dtype=np.int64)
    m = bnd.size - 1
    k = np.diff(bnd)
    if m < 3 or m > MERGE_SPLIT_MAX_RUNS or not (k > 1).any():
        return None
    c = srt.run_cost(bnd[:-1], k) + per_micro
    pad = np.full(D * K - m, per_micro)
    cur = float(np.sort(np.concatenate([c, pad]))[::-1][::D].sum())
    ok = np.array([_fits(srt, int(bnd[j]), int(bnd[j + 2]), caps) for j in range(m - 1)])
    merged = srt.run_cost(bnd[:-2], k[:-1] + k[1:]) + per_micro
    cuts = {r: _halves(srt, int(bnd[r]), int(bnd[r + 1]), caps) for r in np.flatnonzero(k > 1)}
    cand, moves = [], []
    for j in np.flatnonzero(ok):
        for r, (x, lft, rgt) in cuts.items():
            if r in (j, j + 1):
                continue
            v = c.copy()
            v[j], v[j + 1] = merged[j], np.nan
            v[r] = lft + per_micro
            cand.append(np.concatenate([v[~np.isnan(v)], [rgt + per_micro], pad]))
            moves.append((int(j), int(r), x))
    if not cand:
        return None
    t = np.sort(np.array(cand), axis=1)[:, ::-1][:, ::D].sum(axis=1)
    i = int(np.argmin(t))
    if t[i] >= cur * (1 - 1e-12):
        return None
    j, r, x = moves[i]
    out = [int(v) for v in bnd if v != bnd[j + 1]] + [x]
    return sorted(out)


def _run_table(srt: _Sorted, caps: tuple) -> np.ndarray:
    """C[a, e]: cost of the run [a, e) (inf when empty, reversed or over a cap); small steps only."""
    n = srt.n
    a, e = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    ok = e > a
    C = np.full((n + 1, n + 1), np.inf)
    C[ok] = srt.run_cost(a[ok], e[ok] - a[ok])
    for i, j in zip(*np.nonzero(ok)):
        if not _fits(srt, int(i), int(j), caps):
            C[i, j] = np.inf
    return C


def _relocate(C: np.ndarray, b: list[int], D: int, K: int, per_micro: float, depth: int) -> list[int] | None:
    """The best move of ``depth`` inner boundaries to new places (lockstep), None if none helps."""
    bnd = np.array(b, dtype=np.int64)
    n, m = int(bnd[-1]), bnd.size - 1
    inner, free = bnd[1:-1], np.setdiff1d(np.arange(1, n), bnd)
    if inner.size < depth or free.size < depth:
        return None
    rm = np.array(list(combinations(range(inner.size), depth)), dtype=np.int64).reshape(-1, depth)
    add = np.array(list(combinations(free.tolist(), depth)), dtype=np.int64).reshape(-1, depth)
    keep = np.ones((rm.shape[0], inner.size), dtype=bool)
    keep[np.repeat(np.arange(rm.shape[0]), depth), rm.ravel()] = False
    kept = np.broadcast_to(inner, keep.shape)[keep].reshape(rm.shape[0], -1)
    rows = np.concatenate([np.repeat(kept, add.shape[0], axis=0), np.tile(add, (rm.shape[0], 1))], axis=1)
    rows = np.sort(rows, axis=1)
    full = np.concatenate([np.zeros((rows.shape[0], 1), np.int64), rows, np.full((rows.shape[0], 1), n)], axis=1)
    c = C[full[:, :-1], full[:, 1:]] + per_micro
    c = np.concatenate([c, np.full((c.shape[0], D * K - m), per_micro)], axis=1)
    t = np.sort(c, axis=1)[:, ::-1][:, ::D].sum(axis=1)
    cur = C[bnd[:-1], bnd[1:]] + per_micro
    now = float(np.sort(np.concatenate([cur, np.full(D * K - m, per_micro)]))[::-1][::D].sum())
    i = int(np.argmin(t))
    return full[i].tolist() if t[i] < now * (1 - 1e-12) else None


def _relocations(C: np.ndarray, b: list[int], D: int, K: int, per_micro: float) -> list[int]:
    """Move one boundary, else two, to where the lockstep time falls most, while it falls."""
    for _ in range(RELOCATE_ROUNDS):
        nb = _relocate(C, b, D, K, per_micro, 1)
        if nb is None and comb(len(b) - 2, 2) * comb(int(b[-1]) - len(b) + 1, 2) <= RELOCATE_PAIRS:
            nb = _relocate(C, b, D, K, per_micro, 2)
        if nb is None:
            break
        b = nb
    return b


def _fits(srt: _Sorted, a: int, e: int, caps: tuple) -> bool:
    """Whether the run [a, e) keeps the caps."""
    cap, max_count, vcap = caps
    k = e - a
    if max_count is not None and k > max_count:
        return False
    if cap is not None and k * int(srt.width(np.array([a]), np.array([k]))[0]) > cap:
        return False
    return vcap is None or srt.vcum[e] - srt.vcum[a] <= vcap  # type: ignore[index]


def _search(srt: _Sorted, b: list[int], D: int, K: int, caps: tuple, per_micro: float, sync: str) -> list[int]:
    """Boundary moves, then (lockstep) merge-and-cut moves, alternating while the time falls."""
    b = _improve(srt, b, D, K, caps, per_micro, sync)
    if sync == "micro" and srt.n <= RELOCATE_MAX_SAMPLES and len(b) > 2:
        return _relocations(_run_table(srt, caps), b, D, K, per_micro)
    for _ in range(MERGE_SPLIT_ROUNDS if sync == "micro" else 0):
        nb = _merge_split(srt, b, D, K, caps, per_micro)
        if nb is None:
            break
        b = _improve(srt, nb, D, K, caps, per_micro, sync)
    return b


def _bins_at(srt: _Sorted, m: int, D: int, K: int, caps: tuple, per_micro: float, sync: str,
             start: list[int] | None = None) -> tuple[np.ndarray, float] | None:
    """bin_of (in the input order) and predicted time for m bins, or None if the caps need more;
    ``start``: run boundaries to start the local search from (default: the min-max runs)."""
    b = runs_for_bins(srt, m, caps) if start is None else start
    if b is None:
        return None
    b = _search(srt, b, D, K, caps, per_micro, sync)
    bnd = np.array(b, dtype=np.int64)
    run_of = np.repeat(np.arange(bnd.size - 1), np.diff(bnd))
    bin_of = np.empty(srt.n, dtype=np.int64)
    bin_of[srt.order] = run_of
    c = np.concatenate([srt.run_cost(bnd[:-1], np.diff(bnd)) + per_micro, np.full(D * K - m, per_micro)])
    return bin_of, _time(c, D, K, sync)


def _best_at(srt: _Sorted, K: int, D: int, caps: tuple, pm: float, sync: str,
             levels: list[int] | None, minmax: bool = True) -> tuple[np.ndarray, float] | None:
    """The better of the level DP's runs and the min-max runs at K, each locally improved."""
    m = min(srt.n, D * K)
    got = _bins_at(srt, m, D, K, caps, pm, sync) if minmax else None
    if levels is not None:
        alt = _bins_at(srt, m, D, K, caps, pm, sync, start=levels)
        if alt is not None and (got is None or alt[1] < got[1]):
            got = alt
    return got


def _walk(srt: _Sorted, K0: int, dp: int, align: int, caps: tuple, pm: float,
          sync: str) -> tuple[dict[int, float], dict[int, tuple[np.ndarray, int]]]:
    """K from K0 up while the min-max packing's time improves (one step of patience, at most
    ``MAX_EVALS`` packings; past them, on to the first K that packs): (times, packings) by K."""
    n = srt.n
    tried: dict[int, float] = {}
    found: dict[int, tuple[np.ndarray, int]] = {}
    K, worse = K0, 0
    while True:
        m = min(n, dp * K)
        got = _bins_at(srt, m, dp, K, caps, pm, sync)
        t = float("inf") if got is None else got[1]
        tried[K] = t
        if got is not None:
            found[K] = (got[0], m)
        finite = [x for x in tried.values() if np.isfinite(x)]
        if np.isfinite(t) and len(finite) > 1 and t > min(finite) * (1 - 1e-12):
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
        return PaddedPacking(got[0], min(n, dp * K0), K0, None)
    tried, found = _walk(srt, K0, dp, align, caps, pm, sync)
    k_all = K0 + max(0, -(-(-(-n // dp) - K0) // align)) * align  # the least aligned K giving every sample a bin
    lv = level_plans(srt, caps, bound, dp=dp, Ks=list(range(K0, k_all + 1, align)), per_micro=pm)
    for K, runs in lv.runs.items():  # the level DP's best K: its runs (and min-max runs where not packed yet)
        got = _best_at(srt, K, dp, caps, pm, sync, runs, minmax=K not in found)
        if got is not None and got[1] < tried.get(K, float("inf")):
            tried[K], found[K] = got[1], (got[0], min(n, dp * K))
    for K, t in lv.times.items():  # the DP's predicted time where nothing better was packed
        tried.setdefault(K, t)
    best_t = min(tried[k] for k in found)
    K = min(k for k in found if tried[k] == best_t)
    listing = ", ".join(f"K={k}: {tried[k]:.4g}" for k in sorted(tried))
    why = (f"K={K} has the lowest predicted {'lockstep' if sync == 'micro' else 'step-sync'} time of the K tried "
           f"({listing}) in the {s.padding.layout} layout: more micro-batches pad less but add per_micro "
           f"(lower bound K={K0} from the padded tokens)")
    bin_of, m = found[K]
    return PaddedPacking(bin_of, m, K, KChoice(K, K0, tuple(sorted(tried.items())), why))


def pack_padded_at(s: PaddedSamples, *, m: int, K: int, cap: int | None, micro_batch_size: int | None,
                   vision_cap: int | None, cost: CostModel, sync: str) -> np.ndarray | None:
    """m bins of one rank's samples at a given K (local placement), or None if the caps need more."""
    caps = (cap, micro_batch_size, vision_cap if s.vision is not None else None)
    got = _bins_at(_Sorted(s, cost), m, 1, K, caps, float(cost.per_micro), sync)
    return None if got is None else got[0]
