"""Local search after packing: pull the heaviest micro-batch toward the lightest, under the cap.

Design note. LPT leaves a spread of about one small sample between micro-batch costs; with
few samples per micro-batch (K = 2–3, ~5 samples each) that spread is several percent. Each
iteration takes the heaviest micro-batch h and the lightest l and applies the best single move
(a sample of h to l) or swap (a sample of h with a lighter one of l) that keeps both under
the token cap and brings the pair's costs closest to their mean; it stops when no move
strictly lowers max(cost_h, cost_l). Guarantees: the cap still holds, no micro-batch becomes
empty, the maximum cost never increases, the result is deterministic. Cost: O(iterations ·
samples-per-bin²) with at most ``max_iters`` iterations (default min(2 · bins, 256)); on a few
samples per bin an iteration is ~20 numpy calls, so their fixed cost is the cost: the pair's
columns are gathered once and ``count_nonzero`` stands for ``any``.
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from .._sort import stable_argsort

__all__ = ["refine_bins"]

_PATIENCE = 32  # iterations without the heaviest bin dropping by rel_tol before giving up


def _best_exchange(ci: np.ndarray, li: np.ndarray, cj: np.ndarray, lj: np.ndarray, gap: float,
                   room_h: int, room_l: int, can_move: bool,
                   xroom: tuple[np.ndarray, np.ndarray, int, int] | None = None) -> tuple[int, int, float] | None:
    """Best (i, j or -1, delta) moving cost delta from h to l; delta in (0, gap).

    ``xroom``: (extra of h's samples, extra of l's samples, room of h, room of l) for a second
    capped resource."""
    best: tuple[int, int, float] | None = None
    half = gap / 2
    if can_move:
        ok = (ci < gap) & (li <= room_l)
        if xroom is not None:
            ok &= xroom[0] <= xroom[3]
        if np.count_nonzero(ok):  # on a few samples: ~5x cheaper than ok.any()'s reduction
            k = int(np.where(ok, np.abs(ci - half), np.inf).argmin())
            best = (k, -1, float(ci[k]))
    d = ci[:, None] - cj[None, :]
    dl = li[:, None] - lj[None, :]
    ok = (d > 0) & (d < gap) & (dl <= room_l) & (dl >= -room_h)
    if xroom is not None:
        dx = xroom[0][:, None] - xroom[1][None, :]
        ok &= (dx <= xroom[3]) & (-dx <= xroom[2])
    if np.count_nonzero(ok):
        score = np.where(ok, np.abs(d - half), np.inf)
        k = int(score.argmin())
        i, j = divmod(k, cj.size)
        if best is None or abs(d[i, j] - half) < abs(best[2] - half):
            best = (i, j, float(d[i, j]))
    return best


def refine_bins(bin_of: np.ndarray, lens: np.ndarray, costs: np.ndarray, num_bins: int, cap: int | None,
                *, offset: np.ndarray | None = None, max_iters: int | None = None,
                rel_tol: float = 1e-3, extra: tuple[np.ndarray, int] | None = None, moves: bool = True) -> np.ndarray:
    """Return an improved copy of ``bin_of`` (same bins, same cap, lower or equal max cost).

    ``offset`` (per bin) makes the search balance ``cost − offset`` instead, i.e. toward
    per-bin targets. Stops when the heaviest micro-batch is within ``rel_tol`` of the mean load
    above the mean (above its target, with ``offset``), when the heaviest and lightest differ by
    at most that much, when no exchange helps, after 32 iterations in which the heaviest bin did
    not drop by that much, or after ``max_iters`` (default min(2 · bins, 256)) iterations.
    ``extra``: a second per-sample resource and its per-bin cap, kept like the token cap.
    ``moves=False``: swaps only, so every bin keeps its sample count (equal-size partitions).
    """
    if num_bins < 2 or bin_of.size <= num_bins:
        return bin_of
    order = stable_argsort(bin_of)
    bounds = [0] + np.cumsum(np.bincount(bin_of, minlength=num_bins)).tolist()
    members: dict[int, list[int]] = {}  # only the bins a move touched, materialised lazily

    def mem(b: int) -> list[int]:
        if b not in members:
            members[b] = order[bounds[b]:bounds[b + 1]].tolist()
        return members[b]
    load = np.bincount(bin_of, weights=costs, minlength=num_bins)
    if offset is not None:
        load = load - offset
    tok = np.bincount(bin_of, weights=lens, minlength=num_bins).astype(np.int64)
    ex, ex_cap = extra if extra is not None else (None, 0)
    xtok = None if ex is None else np.bincount(bin_of, weights=ex, minlength=num_bins).astype(np.int64)
    big = np.iinfo(np.int64).max // 4 if cap is None else cap
    tol = rel_tol * float(costs.sum()) / num_bins
    ref = 0.0 if offset is not None else float(load.mean())  # moves never change the mean
    best_max, since = float(load.max()), 0
    for _ in range(max_iters if max_iters is not None else min(2 * num_bins, 256)):
        h, l = int(load.argmax()), int(load.argmin())
        gap = float(load[h] - load[l])
        if gap <= tol or load[h] - ref <= tol:  # only the heaviest bin sets the step time
            break
        if load[h] < best_max - tol:
            best_max, since = float(load[h]), 0
        elif since >= _PATIENCE:  # a plateau of near-equal heavy bins: more moves buy < rel_tol
            break
        since += 1
        mh, ml = mem(h), mem(l)
        nh = len(mh)
        both = np.array(mh + ml)  # one gather per column for the pair of bins
        cb, lb = costs[both], lens[both]
        xroom = None if ex is None else (ex[both[:nh]], ex[both[nh:]],  # type: ignore[index]
                                         int(ex_cap - xtok[h]), int(ex_cap - xtok[l]))  # type: ignore[index]
        got = _best_exchange(cb[:nh], lb[:nh], cb[nh:], lb[nh:], gap,
                             int(big - tok[h]), int(big - tok[l]), moves and nh > 1, xroom)
        if got is None:
            break
        i, j, _ = got
        exchange = [(mh[i], h, l)] + ([(ml[j], l, h)] if j >= 0 else [])
        for smp, src, dst in exchange:
            mem(src).remove(smp)
            mem(dst).append(smp)
            load[src] -= costs[smp]
            load[dst] += costs[smp]
            tok[src] -= lens[smp]
            tok[dst] += lens[smp]
            if xtok is not None:
                xtok[src] -= ex[smp]  # type: ignore[index]
                xtok[dst] += ex[smp]  # type: ignore[index]
    out = bin_of.copy()
    if members:  # the touched bins' samples, written in one scatter
        moved = list(members.values())
        out[np.fromiter(chain.from_iterable(moved), dtype=np.int64)] = np.repeat(list(members), list(map(len, moved)))
    return out
