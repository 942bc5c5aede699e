"""Local search on a padded step's runs: move boundaries while the predicted time falls.

Design note. ``padded.py`` cuts the samples, sorted by length, into contiguous runs (min-max
runs, or the slot levels of ``padded_levels.py``); the predicted time of the runs is that of
their costs as ``assign.arrange`` lays them out (lockstep: Σ of every dp-th cost in descending
order). Moves, each kept only when that time falls:

1. Boundary moves: a boundary of a slot's heaviest (or second) run moves by one or two
   samples. Under lockstep every such move of a round is scored at once and the best kept (at
   most ``MAX_ROUNDS`` rounds; step sync: first improvement, at most ``MAX_MOVES`` tried).
   K is chosen on these moves alone (``deep=False``); the deep search below runs on the best K.
2. Wide boundary moves (deep, at most ``WIDE_MAX_RUNS`` runs): every boundary, by up to four.
3. Merge-and-cut (deep, lockstep, at most ``MERGE_SPLIT_MAX_RUNS`` runs): two neighbouring runs
   merge and another run is cut where its halves are most even, the count kept — a slot can
   then hold a run of two short neighbours beside long singles while another slot's head halves
   (slots of an optimal plan need not be neighbours in the sorted order). All pairs at once.
4. Relocations (deep, lockstep, steps of at most ``RELOCATE_MAX_SAMPLES`` samples): any one,
   else any two, inner boundaries move anywhere, scored at once on a table of every run's cost.

Guarantees: every run stays non-empty and within the caps, the count of runs is kept, the time
never rises; deterministic. Cost: a lockstep round sorts the costs
once and scores each of its O(K) moves in O(K) (``_lockstep_two_changed``: the slot heads with the
two changed runs taken out and put back, not a sort per move); moves 3 score O(m²) per round;
moves 4 at most 40k pairs per round.
"""

from __future__ import annotations

from itertools import combinations
from math import comb
from typing import TYPE_CHECKING

import numpy as np

from .assign import arrange

if TYPE_CHECKING:
    from .padded_rows import _Sorted

__all__ = ["local_search", "predicted_time"]

MAX_MOVES = 4000  # boundary moves tried per packing in the local search (step sync)
MAX_ROUNDS = 400  # best-move rounds of the lockstep boundary search
WIDE_MAX_RUNS = 160  # the deep search moves every boundary by up to 4 on steps of at most this many runs
MERGE_SPLIT_MAX_RUNS = 64  # merge-and-cut moves are scored for steps of at most this many runs
MERGE_SPLIT_ROUNDS = 16    # ... at most this many times per packing
MERGE_SPLIT_ALL_RUNS = 64  # ... cutting any run up to this many runs, else one of the two costliest of a slot
RELOCATE_MAX_SAMPLES = 40  # steps this small move any one or two run boundaries anywhere instead
RELOCATE_PAIRS = 40000     # ... two at once when at most this many pairs of moves exist
RELOCATE_ROUNDS = 64


def predicted_time(costs: np.ndarray, D: int, K: int, sync: str) -> float:
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
    if sync == "micro":
        return _improve_lockstep(srt, b, D, K, caps, per_micro)
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
    cur = predicted_time(c, D, K, sync)
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
                    t = predicted_time(c, D, K, sync)
                    if t < cur * (1 - 1e-12):
                        bnd[e], cur, improved = x, t, True
                        break
                    c[e - 1], c[e] = old
                if improved:
                    break
            if improved:
                break
    return bnd.tolist()


def _lockstep(V: np.ndarray, D: int) -> np.ndarray:
    """Lockstep time of every row of micro-batch costs (placeholders included): Σ of every D-th
    cost in descending order."""
    return np.sort(V, axis=-1)[..., ::-1][..., ::D].sum(axis=-1)


def _lockstep_two_changed(c: np.ndarray, D: int, i1: np.ndarray, v1: np.ndarray, i2: np.ndarray,
                          v2: np.ndarray) -> np.ndarray:
    """``_lockstep`` of ``c`` (length D·K) with c[i1] := v1 and c[i2] := v2 (i1 != i2), for every
    candidate at once, without sorting a row per candidate: the slot heads of the changed row are
    read off the sorted base row with the two old values taken out and the two new ones put in.
    O(M log M + C·K) for C candidates instead of O(C·M log M); the same sums, bit for bit."""
    M = c.size
    order = np.argsort(-c, kind="stable")
    s = c[order]                                  # descending
    rank = np.empty(M, dtype=np.int64)
    rank[order] = np.arange(M)
    r1, r2 = np.minimum(rank[i1], rank[i2]), np.maximum(rank[i1], rank[i2])
    hi, lo = np.maximum(v1, v2), np.minimum(v1, v2)
    asc = s[::-1]
    old1, old2 = c[i1], c[i2]

    def above(u: np.ndarray) -> np.ndarray:  # values > u left once the two old values are out
        return (M - np.searchsorted(asc, u, side="right")) - (old1 > u) - (old2 > u)
    P1, P2 = above(hi)[:, None], above(lo)[:, None] + 1
    p = (np.arange(M // D) * D)[None, :]          # slot heads of the new row
    q = p - (p > P1) - (p > P2)                   # position among the M − 2 values kept
    q = q + (q >= r1[:, None]) + (q >= r2[:, None] - 1)
    head = np.where(p == P1, hi[:, None], np.where(p == P2, lo[:, None], s[np.minimum(q, M - 1)]))
    return head.sum(axis=1)


def _fit_mask(srt: _Sorted, a: np.ndarray, e: np.ndarray, caps: tuple) -> np.ndarray:
    """Whether each run [a, e) (non-empty) keeps the caps."""
    cap, max_count, vcap = caps
    k = e - a
    ok = np.ones(a.size, dtype=bool)
    if max_count is not None:
        ok &= k <= max_count
    if cap is not None:
        ok &= k * srt.width(a, k) <= cap
    if vcap is not None:
        ok &= srt.vcum[e] - srt.vcum[a] <= vcap  # type: ignore[index]
    return ok


def _improve_lockstep(srt: _Sorted, b: list[int], D: int, K: int, caps: tuple, per_micro: float,
                      wide: bool = False) -> list[int]:
    """:func:`_improve` under lockstep, every candidate of a round scored at once: the boundaries
    of each slot's two costliest runs move by one or two samples, the best move is kept, while
    the time falls (at most ``MAX_ROUNDS`` rounds). ``wide``: every boundary, by up to four."""
    bnd = np.array(b, dtype=np.int64)
    m = bnd.size - 1
    if m < 2:
        return b
    pad = np.full(D * K - m, per_micro)
    c = np.concatenate([srt.run_cost(bnd[:-1], np.diff(bnd)) + per_micro, pad])
    cur = float(_lockstep(c, D))
    steps = np.array([-1, 1, -2, 2, -3, 3, -4, 4] if wide else [-1, 1, -2, 2])
    for _ in range(MAX_ROUNDS):
        desc = np.argsort(-c, kind="stable")
        runs = np.arange(m) if wide else np.unique(np.concatenate([desc[::D], desc[1::D]]))
        runs = runs[runs < m]
        e = np.unique(np.concatenate([runs, runs + 1]))
        e = e[(e > 0) & (e < m)]
        e, x = np.repeat(e, steps.size), (bnd[e][:, None] + steps).ravel()
        ok = (bnd[e - 1] < x) & (x < bnd[e + 1])
        e, x = e[ok], x[ok]
        ok = _fit_mask(srt, bnd[e - 1], x, caps) & _fit_mask(srt, x, bnd[e + 1], caps)
        e, x = e[ok], x[ok]
        if e.size == 0:
            break
        left = srt.run_cost(bnd[e - 1], x - bnd[e - 1]) + per_micro
        right = srt.run_cost(x, bnd[e + 1] - x) + per_micro
        t = _lockstep_two_changed(c, D, e - 1, left, e, right)
        i = int(np.argmin(t))
        if t[i] >= cur * (1 - 1e-12):
            break
        c = c.copy()
        c[e[i] - 1], c[e[i]] = left[i], right[i]
        bnd[e[i]], cur = x[i], float(t[i])
    return bnd.tolist()


def _halves(srt: _Sorted, a: int, e: int) -> tuple[int, float, float]:
    """The cut x of the run [a, e) (two samples or more) whose halves' costlier one is cheapest."""
    x = np.arange(a + 1, e)
    left = srt.run_cost(np.full(x.size, a), x - a)
    right = srt.run_cost(x, e - x)
    j = int(np.argmin(np.maximum(left, right)))
    return int(x[j]), float(left[j]), float(right[j])


def _merge_split(srt: _Sorted, b: list[int], D: int, K: int, caps: tuple, per_micro: float) -> list[int] | None:
    """The best lockstep move that merges two adjacent runs and cuts another in two (the count
    stays): it lets a slot take a run of two short neighbours while another slot's head halves;
    None when no move lowers the time. The cut run is any run on small steps, else one of the two
    costliest of a slot; every pair is scored at once (lockstep only)."""
    bnd = np.array(b, dtype=np.int64)
    m = bnd.size - 1
    k = np.diff(bnd)
    if m < 3 or m > MERGE_SPLIT_MAX_RUNS or not (k > 1).any():
        return None
    c = srt.run_cost(bnd[:-1], k) + per_micro
    pad = np.full(D * K - m, per_micro)
    cur = float(np.sort(np.concatenate([c, pad]))[::-1][::D].sum())
    merges = np.array([j for j in range(m - 1) if _fits(srt, int(bnd[j]), int(bnd[j + 2]), caps)], dtype=np.int64)
    merged = srt.run_cost(bnd[:-2], k[:-1] + k[1:]) + per_micro
    desc = np.argsort(-np.concatenate([c, pad]), kind="stable")
    lead = np.arange(m) if m <= MERGE_SPLIT_ALL_RUNS else np.concatenate([desc[::D], desc[1::D]])
    cut = np.array(sorted(int(r) for r in set(lead.tolist()) if r < m and k[r] > 1), dtype=np.int64)
    if merges.size == 0 or cut.size == 0:
        return None
    halves = np.array([_halves(srt, int(bnd[r]), int(bnd[r + 1])) for r in cut])
    J, R = np.repeat(merges, cut.size), np.tile(np.arange(cut.size), merges.size)
    keep = (cut[R] != J) & (cut[R] != J + 1)
    J, R = J[keep], R[keep]
    if J.size == 0:
        return None
    V = np.tile(np.concatenate([c, pad]), (J.size, 1))  # a multiset: the three changed runs take
    rows = np.arange(J.size)                             # the merged pair's and the cut run's places
    V[rows, J] = merged[J]
    V[rows, J + 1] = halves[R, 2] + per_micro
    V[rows, cut[R]] = halves[R, 1] + per_micro
    t = np.sort(V, axis=1)[:, ::-1][:, ::D].sum(axis=1)
    i = int(np.argmin(t))
    if t[i] >= cur * (1 - 1e-12):
        return None
    drop, add = int(bnd[J[i] + 1]), int(halves[R[i], 0])
    return sorted([int(v) for v in bnd if v != drop] + [add])


def run_cost_table(srt: _Sorted, caps: tuple, bound: np.ndarray) -> np.ndarray:
    """[n, k_max]: the cost of the run [a, a + k) at [a, k - 1], inf past ``bound[a]`` or a cap."""
    n = srt.n
    top = int(bound.max(initial=1))
    a = np.repeat(np.arange(n), top)
    k = np.tile(np.arange(1, top + 1), n)
    live = k <= bound[a]
    a, k = a[live], k[live]
    ok = _fit_mask(srt, a, a + k, caps)
    table = np.full((n, top), np.inf)
    table[a[ok], k[ok] - 1] = srt.run_cost(a[ok], k[ok])
    return table


def _run_table(srt: _Sorted, caps: tuple) -> np.ndarray:
    """C[a, e]: cost of the run [a, e) (inf when empty, reversed or over a cap); small steps only."""
    n = srt.n
    table = run_cost_table(srt, caps, n - np.arange(n))  # every run [a, a + k), k up to the end
    a, k = np.nonzero(np.isfinite(table))
    C = np.full((n + 1, n + 1), np.inf)
    C[a, a + k + 1] = table[a, k]
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


def local_search(srt: _Sorted, b: list[int], D: int, K: int, caps: tuple, per_micro: float, sync: str, *,
                 deep: bool = True) -> list[int]:
    """Boundary moves, then (lockstep) merge-and-cut moves, alternating while the time falls."""
    b = _improve(srt, b, D, K, caps, per_micro, sync)
    if not deep:
        return b
    if sync == "micro" and len(b) - 1 <= WIDE_MAX_RUNS:
        b = _improve_lockstep(srt, b, D, K, caps, per_micro, wide=True)
    if sync == "micro" and srt.n <= RELOCATE_MAX_SAMPLES and len(b) > 2:
        return _relocations(_run_table(srt, caps), b, D, K, per_micro)
    for _ in range(MERGE_SPLIT_ROUNDS if sync == "micro" else 0):
        nb = _merge_split(srt, b, D, K, caps, per_micro)
        if nb is None:
            break
        b = _improve(srt, nb, D, K, caps, per_micro, sync)
    return b
