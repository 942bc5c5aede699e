"""Local placement's lockstep polish: move samples between one rank's own micro-batches.

Design note. Local placement packs every rank toward shared slot targets (``local.py``), but a
rank whose samples are coarse (a few long ones) cannot meet them, and the lockstep time
Σ_m max_r cost(r, m) is set slot by slot by whichever rank is heaviest there. This pass takes
the *binding* ranks (those holding some slot's maximum) and, for each, searches the best single
move (a sample to another of the rank's bins) or swap (two samples of two of its bins) against

    F_r = Σ_m max(O_m, c_r(m)),

where c_r(m) is the rank's m-th heaviest micro-batch (each rank runs its bins heaviest first)
and O_m the m-th slot's maximum over the *other* ranks. F_r is the step's lockstep time with the
other ranks fixed, so every accepted change lowers it: a busy rank learns to load slot 0 up to
what a coarse rank forces there anyway and to empty its other slots. Samples never leave their
rank; moves keep the token cap (and ``extra``, a vision cap) and never empty a bin. Only atoms
of *hot* bins (at or above the other ranks' maximum of their slot) leave their bin — every
term of F_r a change can lower is a hot bin's — and ranks of more than ``MAX_ATOMS`` atoms are
left to the packer (fine granularity, and the n_r² swap matrix).

Guarantees: lockstep time never rises; cap and locality hold; deterministic (ties: lowest
index). Cost: per change O(n_r² · K log K) numpy on the rank's n_r samples (a few dozen per
rank in RL steps), at most ``max_changes`` changes per step (default min(4·K + 8, 48)), and a
kind of change is skipped where it would price more than ``MAX_CANDIDATES``/K candidates at once.
Pairs are tried only when no single atom helps: a rank whose bins hold two mid-size samples each
often needs one pair swapped against a single sample.

Before the polish, ``local.py`` repairs each rank against the shared slot targets (its step 4)
with the two re-packers below: ``differencing_bins`` (Karmarkar–Karp toward the targets) and
``repartition_pairs`` (exact re-splits of two pooled bins). Where the polish needs a change that
lowers a slot maximum *now*, they work against fixed targets, so 128 ranks within 0.1% of one
slot's maximum (none of them alone lowering it) are all moved below it.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

from ..cost.models import CostModel, bin_costs

__all__ = ["polish_local", "RankBins", "STOP_GAP", "MAX_ATOMS", "differencing_bins", "repartition_pairs",
           "overshoot", "others_max"]

STOP_GAP = 1e-4  # a change must lower the step's lockstep time by this share of it
MAX_ATOMS = 256  # ranks holding more atoms are not polished (fine granularity: LPT balances them)
MAX_CANDIDATES = 1 << 20  # (changes × K) of one kind evaluated at once; beyond it that kind is skipped
PAIRS = 2  # bins (lowest excess first) a rank's bin furthest above its target is pooled with per round
POOL_ATOMS = 10  # the most atoms of two pooled bins re-split exactly (2^10 subsets priced at once)
_BITS: dict[int, np.ndarray] = {}  # m -> the 2^m × m matrix of subset bits


class RankBins(NamedTuple):
    """One rank's atoms and their bins (0..K-1)."""

    bins: np.ndarray
    costs: np.ndarray
    lens: np.ndarray
    extra: np.ndarray | None  # a second capped resource per atom (vision tokens), or None


def polish_local(ranks: dict[int, RankBins], grid: np.ndarray, cost: CostModel, cap: int, *,
                 extra_cap: int | None = None, max_changes: int | None = None) -> dict[int, np.ndarray]:
    """New bins of the polished ranks (the others keep theirs); ``grid[r, b]``: cost of rank r's bin b.

    Stops within ``STOP_GAP`` of the floor max_r Σ_b grid[r, b] (no slot arrangement beats the
    busiest rank's total), when no binding rank has a gaining change, or after ``max_changes``."""
    D, K = grid.shape
    grid = grid.copy()
    out: dict[int, np.ndarray] = {}
    budget = min(4 * K + 8, 48) if max_changes is None else max_changes
    tried: set[int] = set()
    while budget > 0:
        prof = -np.sort(-grid, axis=1)
        obj = float(prof.max(axis=0).sum())
        if obj <= float(grid.sum(axis=1).max()) * (1 + STOP_GAP):
            break
        binding = [int(r) for r in dict.fromkeys(np.argmax(prof, axis=0).tolist())
                   if r in ranks and r not in tried and ranks[r].bins.size <= MAX_ATOMS]
        if not binding:
            break
        r = binding[0]
        others = others_max(prof, r)
        rb = ranks[r]._replace(bins=out.get(r, ranks[r].bins))
        got = _best_change(rb, grid[r], others, cost, cap, extra_cap, tol=STOP_GAP * obj)
        if got is None:
            tried.add(r)
            continue
        out[r], grid[r] = got
        tried.clear()  # a changed rank changes O_m for every other rank
        budget -= 1
    return out


def others_max(prof: np.ndarray, r: int) -> np.ndarray:
    """Per slot, the maximum over every rank but r of the sorted profiles."""
    if prof.shape[0] == 1:
        return np.zeros(prof.shape[1])
    rest = np.delete(prof, r, axis=0)
    return rest.max(axis=0)


def _objective(C: np.ndarray, others: np.ndarray) -> np.ndarray:
    """F for each row of candidate bin costs ``C`` [N, K]."""
    return np.maximum(-np.sort(-C, axis=-1), others).sum(axis=-1)


class _Units(NamedTuple):
    """Atoms (and, with pairs, two atoms of one bin) that a change moves together."""

    first: np.ndarray   # atom index
    second: np.ndarray  # second atom index, -1 for a single atom
    bin: np.ndarray
    cost: np.ndarray
    lens: np.ndarray
    count: np.ndarray
    extra: np.ndarray | None


def _units(rb: RankBins, pairs: bool) -> _Units:
    """Every atom; with ``pairs`` also every pair of atoms sharing a bin."""
    b = rb.bins
    n = b.size
    first, second = np.arange(n), np.full(n, -1)
    if pairs:
        i, j = np.triu_indices(n, 1)
        same = b[i] == b[j]
        first, second = np.concatenate([first, i[same]]), np.concatenate([second, j[same]])
    two = second >= 0
    j = np.where(two, second, 0)

    def add(x: np.ndarray) -> np.ndarray:
        return x[first] + np.where(two, x[j], 0)
    return _Units(first, second, b[first], add(rb.costs), add(rb.lens.astype(np.float64)), 1 + two,
                  None if rb.extra is None else add(rb.extra))


def _best_change(rb: RankBins, c: np.ndarray, others: np.ndarray, cost: CostModel, cap: int,
                 extra_cap: int | None, *, tol: float) -> tuple[np.ndarray, np.ndarray] | None:
    """(new bins, new bin costs) of the rank after its best move or swap of single atoms — or, when
    none gains ``tol``, of pairs of atoms against single atoms — or None."""
    for pairs in (False, True):
        got = _best_unit_change(rb, c, others, cost, cap, extra_cap, tol=tol, pairs=pairs)
        if got is not None:
            return got
    return None


def _best_unit_change(rb: RankBins, c: np.ndarray, others: np.ndarray, cost: CostModel, cap: int,
                      extra_cap: int | None, *, tol: float, pairs: bool) -> tuple[np.ndarray, np.ndarray] | None:
    K = c.size
    b = rb.bins
    A = np.bincount(b, weights=rb.costs, minlength=K)
    T = np.bincount(b, weights=rb.lens, minlength=K)
    cnt = np.bincount(b, minlength=K)
    X = None if rb.extra is None else np.bincount(b, weights=rb.extra, minlength=K)
    order = np.argsort(-c, kind="stable")
    hot = np.zeros(K, dtype=bool)
    hot[order[c[order] >= others]] = True  # bins at or above the other ranks' maximum of their slot
    u = _units(rb, pairs)
    uh = np.flatnonzero(hot[u.bin])
    if not uh.size:
        return None
    best_val = float(_objective(c[None], others)[0]) - tol
    best: tuple[int, int, int, np.ndarray] | None = None  # (unit out, unit in or -1, its bin, new costs)
    single = np.flatnonzero(u.count == 1)
    groups = [(uh, None)]  # (units out of a hot bin, swap partners; None: moves)
    if pairs:  # a pair only against a single atom (either side hot)
        groups += [(uh[u.count[uh] == 2], single), (uh[u.count[uh] == 1], np.flatnonzero(u.count == 2))]
    else:
        groups.append((uh, single))
    cands = []
    for xs, ys in groups:
        if ys is None:  # moves: unit x of a hot bin -> bin t
            x, t = np.repeat(xs, K), np.tile(np.arange(K), xs.size)
            ok = (u.bin[x] != t) & (cnt[u.bin[x]] > u.count[x]) & (T[t] + u.lens[x] <= cap)
            if X is not None:
                ok &= X[t] + u.extra[x] <= extra_cap  # type: ignore[index]
            cands.append((x[ok], np.full(int(ok.sum()), -1), t[ok]))
            continue
        if xs.size * ys.size * K > MAX_CANDIDATES:  # a very large rank: this kind of change is skipped
            continue
        xx, yy = np.repeat(xs, ys.size), np.tile(ys, xs.size)  # swaps: unit x (hot bin) <-> unit y
        a, t2 = u.bin[xx], u.bin[yy]
        ok = (a != t2) & (~hot[t2] | (a < t2) | (u.count[xx] != u.count[yy]))  # each hot-hot swap once
        dl = u.lens[xx] - u.lens[yy]
        ok &= (T[t2] + dl <= cap) & (T[a] - dl <= cap)
        if X is not None:
            dx = u.extra[xx] - u.extra[yy]  # type: ignore[index]
            ok &= (X[t2] + dx <= extra_cap) & (X[a] - dx <= extra_cap)
        cands.append((xx[ok], yy[ok], t2[ok]))
    for ox, oy, tt in cands:
        if not ox.size:
            continue
        has_y = oy >= 0
        ys = np.where(has_y, oy, 0)
        z = lambda v: np.where(has_y, v[ys], 0)  # noqa: E731
        val, new = _candidates(c, A, T, cnt, u.bin[ox], tt, u.cost[ox], u.lens[ox], z(u.cost), z(u.lens),
                               u.count[ox] - z(u.count), others, cost)
        k = int(np.argmin(val))
        if val[k] < best_val:
            best_val, best = float(val[k]), (int(ox[k]), int(oy[k]), int(tt[k]), new[k])
    if best is None:
        return None
    ox, oy, dst, new_c = best
    src = int(u.bin[ox])
    bins = b.copy()
    for unit, to in ((ox, dst), (oy, src)):
        if unit >= 0:
            bins[u.first[unit]] = to
            if u.second[unit] >= 0:
                bins[u.second[unit]] = to
    return bins, new_c


def _candidates(c: np.ndarray, A: np.ndarray, T: np.ndarray, cnt: np.ndarray, a: np.ndarray, t: np.ndarray,
                ci: np.ndarray, li: np.ndarray, cj: np.ndarray, lj: np.ndarray, dn: np.ndarray, others: np.ndarray,
                cost: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """(F, bin costs) of every candidate moving unit i (ci, li) from bin a to bin t and unit j (cj, lj;
    zeros for a move) from t to a; ``dn``: the atoms bin a loses and t gains."""
    new_a = bin_costs(cost, A[a] - ci + cj, T[a] - li + lj, cnt[a] - dn)
    new_t = bin_costs(cost, A[t] - cj + ci, T[t] - lj + li, cnt[t] + dn)
    C = np.broadcast_to(c, (a.size, c.size)).copy()
    rows = np.arange(a.size)
    C[rows, a] = new_a
    C[rows, t] = new_t
    return _objective(C, others), C


def differencing_bins(costs: np.ndarray, lens: np.ndarray, targets: np.ndarray, cap: int,
                      extra: tuple[np.ndarray, int] | None = None) -> np.ndarray | None:
    """One rank's atoms in K = ``targets.size`` bins by Karmarkar–Karp differencing toward per-bin
    ``targets`` (descending), or None when a bin breaks the token (or ``extra``) cap or is empty.

    Every atom starts as a K-tuple (its cost, 0, …); bin k is pre-loaded with τ_0 − τ_k, so equal
    sums mean every bin at its target; the two tuples of largest spread are merged, heaviest
    part with lightest, until one tuple is left. Differencing places the big atoms against each
    other first, so it separates what LPT and two-bin re-splits cannot (tests/test_local_repair.py:
    a rank of bimodal dp 128 whose two 16k-token samples share one of K = 3 micro-batches, 1.039×
    its mean -> within 0.1% of it). O(n log n + n·K log K) Python: ~0.1 ms for 16 atoms in 3 bins,
    ~0.5 ms for 64 in 10."""
    K = targets.size
    n = costs.size
    if n < K:
        return None
    # a tuple: (−spread, tie, sums descending, parts: lists of atom ids); the pre-load's parts
    # carry the marker −1 − k of their bin k
    heap: list[tuple[float, int, list[float], list]] = []
    zeros = [0.0] * (K - 1)
    for i, c in enumerate(costs.tolist()):
        heap.append((-c, i, [c] + zeros, [[i]] + [[] for _ in range(K - 1)]))
    pre = (float(targets[0]) - targets).tolist()  # ascending bins' pre-loads, bin 0 none
    order = sorted(range(K), key=pre.__getitem__, reverse=True)
    heap.append((-(max(pre) - min(pre)), -1, [pre[k] for k in order], [[-1 - k] for k in order]))
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    while len(heap) > 1:
        _, t1, s1, m1 = pop(heap)
        _, t2, s2, m2 = pop(heap)
        s = [a + b for a, b in zip(s1, reversed(s2))]
        m = [a + b for a, b in zip(m1, reversed(m2))]
        idx = sorted(range(K), key=s.__getitem__, reverse=True)
        s = [s[i] for i in idx]
        push(heap, (s[-1] - s[0], t1 if t1 < t2 else t2, s, [m[i] for i in idx]))
    out = np.empty(n, dtype=np.int64)
    for part in heap[0][3]:
        k = -1 - min(part)  # the pre-load's marker names the bin
        out[[i for i in part if i >= 0]] = k
    counts = np.bincount(out, minlength=K)
    if counts.min() == 0 or np.bincount(out, weights=lens, minlength=K).max() > cap:
        return None
    if extra is not None and np.bincount(out, weights=extra[0], minlength=K).max() > extra[1]:
        return None
    return out


def overshoot(loads: np.ndarray, targets: np.ndarray) -> float:
    """Σ_k max(τ_k, k-th heaviest load): a rank's lockstep time against slot maxima ``targets``."""
    return float(_objective(loads, targets))


def repartition_pairs(bins: np.ndarray, costs: np.ndarray, lens: np.ndarray, targets: np.ndarray, cap: int, *,
                      extra: tuple[np.ndarray, int] | None = None, tol: float = 0.0,
                      max_rounds: int | None = None) -> np.ndarray:
    """One rank's bins re-partitioned two at a time toward sorted per-slot ``targets``.

    The bin with the largest excess (load − the target of its place among the loads, heaviest
    first) is pooled with another bin, lowest excess first (``PAIRS`` of them), and the pool is
    split the best way: every subset of its ``POOL_ATOMS`` costliest atoms is priced at once (the
    others stay), the pair's larger excess minimised under the caps, neither bin losing all of
    the pool. The first pair that lowers the largest excess by more than ``tol`` is kept — the
    largest excess never rises (loads matched to targets in sorted order minimise it). Stops
    when it is ≤ ``tol``, when no pair helps, or after ``max_rounds`` (default 4·K). A two-bin
    exchange of single atoms (``refine.refine_bins``) cannot trade one long sample for three
    mid-size ones; a pool's best split can."""
    K = targets.size
    out = bins.copy()
    ex = None if extra is None else extra[0]
    for _ in range(4 * K if max_rounds is None else max_rounds):
        load = np.bincount(out, weights=costs, minlength=K)
        tgt = np.empty(K)
        tgt[np.argsort(-load, kind="stable")] = targets
        excess = load - tgt
        h = int(excess.argmax())
        if excess[h] <= tol:
            break
        done = False
        for j in np.argsort(excess, kind="stable")[:PAIRS].tolist():
            if j == h:
                continue
            pool = np.flatnonzero((out == h) | (out == j))
            if pool.size < 2:
                continue
            t_h, t_j, room_h, room_j = float(tgt[h]), float(tgt[j]), cap, cap
            xr_h = xr_j = None if extra is None else extra[1]
            if pool.size > POOL_ATOMS:  # the costliest POOL_ATOMS atoms are re-split, the rest stay
                by = pool[np.argsort(-costs[pool], kind="stable")]
                pool, rest = by[:POOL_ATOMS], by[POOL_ATOMS:]
                in_h = out[rest] == h
                t_h -= float(costs[rest][in_h].sum())
                t_j -= float(costs[rest][~in_h].sum())
                room_h -= int(lens[rest][in_h].sum())
                room_j -= int(lens[rest][~in_h].sum())
                if ex is not None:
                    xr_h -= int(ex[rest][in_h].sum())  # type: ignore[operator]
                    xr_j -= int(ex[rest][~in_h].sum())  # type: ignore[operator]
            got = _best_split(costs[pool], lens[pool], None if ex is None else ex[pool], t_h, t_j,
                              room_h, room_j, xr_h, xr_j)
            if got is not None and got[1] < excess[h] - tol:
                out[pool] = np.where(got[0], h, j)
                done = True
                break
        if not done:
            break
    return out



def _subset_sums(x: np.ndarray) -> np.ndarray:
    """Σ over every subset of the rows of ``x`` [m, cols] (subset s holds row i iff bit i of s is set)."""
    m = x.shape[0]
    bits = _BITS.get(m)
    if bits is None:
        bits = _BITS[m] = ((np.arange(1 << m)[:, None] >> np.arange(m)) & 1).astype(np.float64)
    return bits @ x


def _best_split(c: np.ndarray, ln: np.ndarray, x: np.ndarray | None, t_a: float, t_b: float, room_a: int,
                room_b: int, x_a: int | None, x_b: int | None) -> tuple[np.ndarray, float] | None:
    """(mask of the atoms bin a takes, the larger excess) of the best split of a pool of atoms
    between bins a and b (targets t_a, t_b; token rooms room_a, room_b; ``x`` and x_a, x_b: a
    second capped resource), no bin left without atoms unless it holds others; None if none fits."""
    m = c.size
    cols = np.stack([c, ln.astype(np.float64)] + ([] if x is None else [x.astype(np.float64)]), axis=1)
    sums = _subset_sums(cols)
    cs, ls = sums[:, 0], sums[:, 1]
    ok = (ls <= room_a) & (ls[-1] - ls <= room_b)
    if x is not None:
        xs = sums[:, 2]
        ok &= (xs <= x_a) & (xs[-1] - xs <= x_b)
    ok[0] = ok[-1] = False  # neither bin left empty (a pool of the costliest atoms: still safe)
    if not ok.any():
        return None
    worst = np.where(ok, np.maximum(cs - t_a, cs[-1] - cs - t_b), np.inf)
    s = int(worst.argmin())
    return (s >> np.arange(m)) & 1 == 1, float(worst[s])
