"""Hedged balance: a last lockstep pass over several plausible machines, for a cost known roughly.

Design note. A cost fitted to a few steps of noisy timings (``CostMeter``) knows the attention
term only to some ±sd (``FlopsCost.attention_rel_sd``). The lockstep pass (``lockstep.py``)
levels each slot under the point estimate, and micro-batches of equal predicted cost can hold very
different attention work (a few long samples against many short ones): on the real machine, where
attention is some % off, the slot's maximum then stands above its mean by that % of the spread.
This pass keeps the packing's slots and moves or swaps samples to lower

    F = Σ_s Σ_m max_r cost_s(r, m),   s over the scenarios attention × (1 − sd), × 1, × (1 + sd)

so a slot's micro-batches end level in predicted cost AND in attention share: a plan that is
balanced whichever scenario the machine is. Each iteration takes the micro-batches that set some
scenario's slot maximum, largest lead over that slot's second first, and applies the best single
move (a sample to another micro-batch) or swap (with a sample of another micro-batch) by the
change of F, summed over the scenarios (a receiver in another slot may rise up to that slot's
maximum, per scenario, for free); it stops when no change lowers F.

Guarantees: F never increases; the cap (and a second capped resource, ``extra``) holds; no
micro-batch empties; deterministic. The point-estimate lockstep time may rise a little: that is
the hedge. Cost: O(iterations · S · (receiver samples · samples of the chosen micro-batch)) numpy;
at most ``max_iters`` iterations (default min(2·K + 16, 64)), receivers bounded as in lockstep.py;
it stops within ``STOP_GAP`` (0.05 %) of F's floor, Σ_s of each scenario's mean load per rank.
Trade-off: the hedged pass costs several times the plain plan's time (small beside a training
step; ``python -m benchmarks.bench_meter --grid`` measures the gain, ``benchmarks.bench_speed``'s
"hedged" row the price), and ``CostMeter(hedge=False)`` plans on the point estimate.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..cost.models import CostModel, FlopsCost, bin_costs
from .lockstep import apply_change

__all__ = ["hedge_scenarios", "hedge_lockstep"]

_RECEIVERS = 16   # receiver micro-batches examined per change: most headroom, and the lightest of the slot
_TRIES = 4        # candidate micro-batches (slot maxima) tried per iteration before giving up
STOP_GAP = 5e-4   # stop once F is this close to its floor (Σ_s of each scenario's mean load per rank)


def hedge_scenarios(cost: CostModel) -> tuple[CostModel, ...]:
    """The machines to hedge over: the attention terms × (1 − sd), × 1, × (1 + sd); () when the cost
    is not a :class:`FlopsCost` with ``attention_rel_sd > 0`` or has no attention term."""
    sd = float(getattr(cost, "attention_rel_sd", 0.0) or 0.0)
    if sd <= 0.0 or not isinstance(cost, FlopsCost) or (cost.quadratic == 0.0 and cost.packed_quadratic == 0.0):
        return ()
    base = replace(cost, attention_rel_sd=0.0)
    return tuple(replace(base, quadratic=cost.quadratic * f, packed_quadratic=cost.packed_quadratic * f)
                 for f in (1.0 - sd, 1.0, 1.0 + sd))


def hedge_lockstep(bin_of: np.ndarray, grid: np.ndarray, lens: np.ndarray, costs: np.ndarray,
                   scenarios: tuple[CostModel, ...], cap: int, *, max_iters: int | None = None,
                   extra: tuple[np.ndarray, int] | None = None, same_rank: bool = False) -> np.ndarray:
    """An improved copy of ``bin_of`` for the slot layout ``grid[r, m]`` (bins keep their slot), or
    ``bin_of`` itself when nothing moved. ``costs``: each item's cost under the point estimate
    (``scenarios[1]``); under scenario s it is scaled by the ratio of that scenario's sample cost
    to the point estimate's at the item's length (prefix-tree atoms keep their own shape).
    ``same_rank``: items move or swap only between bins of one grid row (local placement: every
    sample stays on its rank)."""
    D, K = grid.shape
    nb, n, S = D * K, lens.size, len(scenarios)
    if K < 1 or n <= 1 or S == 0:
        return bin_of
    lf = lens.astype(np.float64)
    ref = scenarios[S // 2].sample_costs(lf)
    sc = np.stack([costs * (m.sample_costs(lf) / ref) for m in scenarios])  # [S, n]
    A = np.stack([np.bincount(bin_of, weights=sc[s], minlength=nb) for s in range(S)])
    T = np.bincount(bin_of, weights=lf, minlength=nb)
    cnt = np.bincount(bin_of, minlength=nb)
    X = None if extra is None else np.bincount(bin_of, weights=extra[0], minlength=nb)
    slot_of = np.empty(nb, dtype=np.int64)
    slot_of[grid.reshape(-1)] = np.tile(np.arange(K), D)
    rank_of = None
    if same_rank:
        rank_of = np.empty(nb, dtype=np.int64)
        rank_of[grid.reshape(-1)] = np.repeat(np.arange(D), K)
    out = bin_of
    empty = int(np.count_nonzero(cnt == 0))  # placeholders: per_micro each (the same in every scenario)
    # F's floor: Σ_s of the mean load per rank; nothing beats it
    floor = float(_costs(scenarios, A, T, cnt).sum() + S * empty * float(scenarios[0].per_micro)) / D
    for _ in range(max_iters if max_iters is not None else min(2 * K + 16, 64)):
        C = _costs(scenarios, A, T, cnt)
        by = C[:, grid.T]                                   # [S, K, D]
        if float(by.max(axis=2).sum()) <= floor * (1 + STOP_GAP):
            break
        srt = np.sort(by, axis=2)
        lead = (srt[:, :, -1] - (srt[:, :, -2] if D > 1 else 0.0))  # [S, K]
        heads = grid[by.argmax(axis=2), np.arange(K)[None, :]]      # [S, K] bin setting each slot max
        score = np.zeros(nb)
        np.add.at(score, heads.reshape(-1), lead.reshape(-1))
        tried = 0
        got = None
        for a in np.argsort(-score, kind="stable").tolist():
            if score[a] <= 0.0 or tried >= _TRIES:
                break
            tried += 1
            if cnt[a] == 0:
                continue
            got = _best_change(a, out, A, T, C, cnt, slot_of, by, grid, lf, sc, scenarios, cap,
                               None if extra is None else (extra[0], X, extra[1]), rank_of)  # type: ignore[arg-type]
            if got is not None:
                break
        if got is None:
            break
        if out is bin_of:
            out = bin_of.copy()
        i, b, j = got
        apply_change(i, int(out[i]), b, j, out, A, sc, T, lf, cnt, None if X is None else (X, extra[0]))  # type: ignore[index]
    return out


def _costs(scenarios: tuple[CostModel, ...], A: np.ndarray, T: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    """[S, bins] cost of every bin under every scenario; placeholders 0 (they never set a maximum)."""
    return np.where(cnt > 0, _bin(scenarios, A, T, cnt), 0.0)


def _receivers(a: int, m: int, C: np.ndarray, cnt: np.ndarray, slot_of: np.ndarray, slot_max: np.ndarray,
               rank_of: np.ndarray | None = None) -> np.ndarray:
    """Real bins other than ``a`` (of a's rank when ``rank_of`` is given): all of them, or the most
    headroom (summed over scenarios) and the lightest of slot m when there are many."""
    nb = cnt.size
    ok = (cnt > 0) & (np.arange(nb) != a)
    if rank_of is not None:
        ok &= rank_of == rank_of[a]
    pool = np.flatnonzero(ok)
    if pool.size <= 2 * _RECEIVERS:
        return pool
    room = (slot_max[:, slot_of[pool]] - C[:, pool]).sum(axis=0)
    free = pool[np.argpartition(-room, _RECEIVERS)[:_RECEIVERS]]
    mine = pool[slot_of[pool] == m]
    if mine.size > _RECEIVERS:
        mine = mine[np.argpartition(C[:, mine].sum(axis=0), _RECEIVERS)[:_RECEIVERS]]
    return np.union1d(free, mine)


def _best_change(a: int, bin_of: np.ndarray, A: np.ndarray, T: np.ndarray, C: np.ndarray, cnt: np.ndarray,
                 slot_of: np.ndarray, by: np.ndarray, grid: np.ndarray, lf: np.ndarray, sc: np.ndarray,
                 scenarios: tuple[CostModel, ...], cap: int,
                 extra: tuple[np.ndarray, np.ndarray, int] | None,
                 rank_of: np.ndarray | None = None) -> tuple[int, int, int] | None:
    """(sample i of a, receiver bin b, sample j of b or -1) of the change that lowers F most, or None."""
    S = len(scenarios)
    m = int(slot_of[a])
    slot_max = by.max(axis=2)                               # [S, K]
    recv = _receivers(a, m, C, cnt, slot_of, slot_max, rank_of)
    if not recv.size:
        return None
    col = grid[:, m]
    vals = np.where(col[None, :] == a, -np.inf, by[:, m, :])  # slot m without a, per scenario [S, D]
    o = np.argsort(-vals, axis=1)
    first_bin = col[o[:, 0]]
    v1 = vals[np.arange(S), o[:, 0]]
    v2 = vals[np.arange(S), o[:, 1]] if col.size > 2 else np.full(S, -np.inf)
    rest = np.maximum(np.where(recv[None, :] == first_bin[:, None], v2[:, None], v1[:, None]), 0.0)  # [S, R]
    same = slot_of[recv] == m
    top = slot_max[:, m][:, None, None]                      # [S, 1, 1]
    om = slot_max[:, slot_of[recv]][:, None, :]              # [S, 1, R]
    members = np.flatnonzero(bin_of == a)
    ci, li = sc[:, members], lf[members]
    tol = 1e-9 * float(slot_max.sum())
    best: tuple[float, int, int, int] | None = None
    if members.size > 1:  # moves: sample i of a -> bin b
        new_a = _bin(scenarios, A[:, a][:, None] - ci, T[a] - li, cnt[a] - 1)[:, :, None]            # [S, I, 1]
        new_b = _bin(scenarios, A[:, recv][:, None, :] + ci[:, :, None], T[recv][None] + li[:, None],
                     cnt[recv][None] + 1)                                                             # [S, I, R]
        fits = T[recv][None] + li[:, None] <= cap
        if extra is not None:
            fits &= extra[1][recv][None] + extra[0][members][:, None] <= extra[2]
        best = _pick(new_a, new_b, rest[:, None, :], top, om, same[None, None, :], fits, tol, best,
                     lambda k: (int(members[k // recv.size]), int(recv[k % recv.size]), -1))
    is_recv = np.zeros(cnt.size, dtype=bool)
    is_recv[recv] = True
    others = np.flatnonzero(is_recv[bin_of])
    if others.size:  # swaps: sample i of a <-> sample j of another bin
        ob = bin_of[others]
        pos = np.searchsorted(recv, ob)
        cj, lj = sc[:, others], lf[others]
        new_a = _bin(scenarios, A[:, a][:, None, None] - ci[:, :, None] + cj[:, None, :], T[a] - li[:, None] + lj[None],
                     cnt[a])
        new_b = _bin(scenarios, (A[:, ob] - cj)[:, None, :] + ci[:, :, None], (T[ob] - lj)[None] + li[:, None],
                     cnt[ob][None])
        fits = (T[a] - li[:, None] + lj[None] <= cap) & ((T[ob] - lj)[None] + li[:, None] <= cap)
        if extra is not None:
            xi, xj, Xt, xc = extra[0][members], extra[0][others], extra[1], extra[2]
            fits &= (Xt[a] - xi[:, None] + xj[None] <= xc) & ((Xt[ob] - xj)[None] + xi[:, None] <= xc)
        best = _pick(new_a, new_b, rest[:, pos][:, None, :], top, om[:, :, pos], same[pos][None, None, :], fits, tol,
                     best, lambda k: (int(members[k // others.size]), int(ob[k % others.size]),
                                      int(others[k % others.size])))
    return None if best is None else best[1:]


def _bin(scenarios: tuple[CostModel, ...], A: np.ndarray, T: np.ndarray, cnt: np.ndarray | int) -> np.ndarray:
    """Bin costs under every scenario: ``A`` [S, ...] additive sums, ``T`` and ``cnt`` shared."""
    return np.stack([bin_costs(mdl, A[s], T, cnt) for s, mdl in enumerate(scenarios)])


def _pick(new_a: np.ndarray, new_b: np.ndarray, rest: np.ndarray, top: np.ndarray, om: np.ndarray,
          same: np.ndarray, fits: np.ndarray, tol: float, best: tuple[float, int, int, int] | None,
          where) -> tuple[float, int, int, int] | None:
    """Fold the candidates [S, I, J] into ``best`` by ΔF summed over scenarios (strict gains only)."""
    d_same = np.maximum(np.maximum(new_a, new_b), rest) - top
    d_other = (np.maximum(new_a, rest) - top) + (np.maximum(om, new_b) - om)
    delta = np.where(same, d_same, d_other).sum(axis=0)
    delta = np.where(fits, delta, np.inf)
    k = int(np.argmin(delta))
    d = float(delta.flat[k])
    if d < -tol and (best is None or d < best[0]):
        return (d, *where(k))
    return best
