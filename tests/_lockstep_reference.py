"""A frozen copy of ``microplan.stages.lockstep`` (refine_lockstep and its helpers) as it was before its
speed work: tests/test_lockstep_reference.py checks that the module returns bit-identical plans. Do
not edit: it is the reference the optimised pass must match."""

from __future__ import annotations

import numpy as np

from microplan.cost.models import CostModel, bin_costs

__all__ = ["refine_lockstep", "apply_change"]

_RECEIVERS = 24   # receiver bins examined per change: most headroom overall, and lightest of the slot
STOP_GAP = 1e-3  # stop once Σ slot maxima is this close to its floor (the mean load per rank)
_PATIENCE = 12    # changes without a strict gain (plateau moves) before giving up


def refine_lockstep(bin_of: np.ndarray, grid: np.ndarray, lens: np.ndarray, costs: np.ndarray,
                    cost: CostModel, cap: int, *, max_iters: int | None = None,
                    rel_tol: float = 1e-5, extra: tuple[np.ndarray, int] | None = None,
                    sums: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """An improved copy of ``bin_of`` for the slot layout ``grid[r, m]`` (bins keep their slot); ``bin_of``
    itself when the pass stops before any change. ``sums``: the bins' cost, token and sample sums when
    the caller has them (float64, float64, int64; the pass updates them in place)."""
    D, K = grid.shape
    nb = D * K
    n = lens.size
    if K < 1 or n <= 1:
        return bin_of
    A, T, cnt = sums if sums is not None else (np.bincount(bin_of, weights=costs, minlength=nb),
                                               np.bincount(bin_of, weights=lens, minlength=nb),
                                               np.bincount(bin_of, minlength=nb))
    X = None if extra is None else np.bincount(bin_of, weights=extra[0], minlength=nb)
    real = cnt > 0  # constant through the pass: a move leaves its source a sample, a swap keeps counts
    real_idx = np.flatnonzero(real)
    c_of = lambda a, t, c: bin_costs(cost, a, t, c)  # noqa: E731
    C = np.where(real, c_of(A, T, cnt), 0.0)  # placeholders (0) never set a slot's max: real bins cost > 0
    iters = max_iters if max_iters is not None else min(2 * K + 16, 64)
    mean = float(C[real].sum() + (nb - int(real.sum())) * cost.per_micro) / D  # nothing beats the mean
    lens_f = floor = None  # and the costliest lone sample: O(n), computed once the mean alone does not stop
    stuck: set[int] = set()
    best_obj, since = np.inf, 0
    by_slot = None  # the slots' view of C, refreshed only after a change (a slot found stuck changes nothing)
    for _ in range(iters):
        if by_slot is None:
            by_slot = C.reshape(-1)[grid.T]          # [K, D] costs per slot
            order = np.argsort(-by_slot, axis=1)
            top = by_slot[np.arange(K), order[:, 0]]
            second = by_slot[np.arange(K), order[:, 1]] if D > 1 else np.zeros(K)
            ranked = np.lexsort((np.arange(K), -top, -(top - second))).tolist()
        cand = [m for m in ranked if m not in stuck]
        if not cand:
            break
        obj = float(top.sum())
        if obj <= mean * (1 + STOP_GAP):  # within 0.1 % of the mean: below any machine's timing noise
            break
        if floor is None:
            lens_f = lens.astype(np.float64)
            floor = max(mean, float(bin_costs(cost, costs, lens_f, 1).max()))
            bin_of = bin_of.copy()
            slot_of = np.empty(nb, dtype=np.int64)
            slot_of[grid.reshape(-1)] = np.tile(np.arange(K), D)  # grid is [D, K] row-major
        if obj <= floor * (1 + STOP_GAP):
            break
        if obj < best_obj * (1 - rel_tol):
            best_obj, since = obj, 0
        elif since >= _PATIENCE:
            break
        since += 1
        m = cand[0]
        a = int(grid[order[m, 0], m])
        if cnt[a] == 0:  # a slot of placeholders only
            stuck.add(m)
            continue
        got = _best_change(a, m, bin_of, A, T, C, cnt, slot_of, by_slot, order, top, lens_f, costs, cost, cap, grid,
                           tol=rel_tol * float(top[m]), extra=None if extra is None else (extra[0], X, extra[1]),
                           real=(real, real_idx))
        if got is None:
            stuck.add(m)
            continue
        stuck.clear()
        i, b, j = got
        apply_change(i, a, b, j, bin_of, A, costs, T, lens_f, cnt, None if X is None else (X, extra[0]))  # type: ignore[index]
        for x in (a, b):
            C[x] = c_of(A[x:x + 1], T[x:x + 1], cnt[x:x + 1])[0]
        by_slot = None
    return bin_of


def apply_change(i: int, a: int, b: int, j: int, bin_of: np.ndarray, A: np.ndarray, costs: np.ndarray,
                 T: np.ndarray, lens: np.ndarray, cnt: np.ndarray,
                 extra: tuple[np.ndarray, np.ndarray] | None = None) -> None:
    """Move sample i from bin a to bin b (and, for a swap, sample j >= 0 from b to a), keeping the bins'
    sums in place: ``A[..., bin]`` additive costs (``costs[..., sample]``; a leading scenario axis is
    allowed), ``T`` tokens, ``cnt`` samples, ``extra``: (per-bin totals, per-sample amounts)."""
    for smp, src, dst in [(i, a, b)] + ([(j, b, a)] if j >= 0 else []):
        bin_of[smp] = dst
        A[..., src] -= costs[..., smp]
        A[..., dst] += costs[..., smp]
        T[src] -= lens[smp]
        T[dst] += lens[smp]
        cnt[src] -= 1
        cnt[dst] += 1
        if extra is not None:
            extra[0][src] -= extra[1][smp]
            extra[0][dst] += extra[1][smp]


def _rest_of_slot(by_slot_m: np.ndarray, ord_m: np.ndarray, col: np.ndarray, recv: np.ndarray) -> np.ndarray:
    """Slot m's maximum without its heaviest bin and without receiver b (per receiver)."""
    second = int(col[ord_m[1]]) if ord_m.size > 1 else -1
    second_val = by_slot_m[ord_m[1]] if ord_m.size > 1 else 0.0
    third_val = by_slot_m[ord_m[2]] if ord_m.size > 2 else 0.0
    return np.where(recv == second, third_val, second_val)


def _pick(delta: np.ndarray, new_a: np.ndarray, new_b: np.ndarray, top: float, tol: float) -> int | None:
    """Index of the best acceptable change: a strict gain, else a sideways move off a plateau.

    Sideways (Σ slot maxima unchanged) is accepted only when both changed micro-batches end
    strictly below the old maximum: Σ cost² then falls, so the search cannot cycle.
    """
    if delta.size == 0:
        return None
    side = (delta <= tol * 1e-3) & (new_a <= top - tol) & (new_b <= top - tol)
    score = np.where(delta < -tol, delta, np.where(side, -(top - new_a) * 1e-12, np.inf))
    k = int(np.argmin(score))
    return k if np.isfinite(score.flat[k]) else None


def _best_change(a: int, m: int, bin_of: np.ndarray, A: np.ndarray, T: np.ndarray, C: np.ndarray, cnt: np.ndarray,
                 slot_of: np.ndarray, by_slot: np.ndarray, order: np.ndarray, slot_max: np.ndarray, lens: np.ndarray,
                 costs: np.ndarray, cost: CostModel, cap: int, grid: np.ndarray, *, tol: float,
                 extra: tuple[np.ndarray, np.ndarray, int] | None = None,
                 real: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[int, int, int] | None:
    """(sample i of a, receiver bin b, sample j of b or -1) of the best acceptable move or swap
    (``slot_max``: each slot's largest cost, ``by_slot[k, order[k, 0]]``).

    ``extra``: (per-sample amount, per-bin totals, cap) of a second resource every change keeps.
    ``real``: the mask and ascending indices of the bins with samples (``cnt > 0``), when known."""
    members = np.flatnonzero(bin_of == a)
    top = by_slot[m, order[m, 0]]
    nb = A.size
    col = grid[:, m]
    # receivers: the real bins with the most headroom under their slot's maximum, and the lightest of
    # slot m (placeholders stay empty: their slot geometry is the plan's)
    real_mask, real_idx = (cnt > 0, None) if real is None else real
    pool = np.flatnonzero(real_mask & (np.arange(nb) != a)) if real_idx is None else real_idx[real_idx != a]
    if not pool.size:
        return None
    is_recv = np.zeros(nb, dtype=bool)
    if pool.size > 2 * _RECEIVERS:
        mine = np.sort(col[real_mask[col] & (col != a)])  # slot m's real bins but a, ascending (col: slot m's bins)
        head = slot_max[slot_of[pool]] - C[pool]
        is_recv[pool[np.argpartition(-head, _RECEIVERS)[:_RECEIVERS]]] = True
        is_recv[mine if mine.size <= _RECEIVERS else mine[np.argpartition(C[mine], _RECEIVERS)[:_RECEIVERS]]] = True
        recv = np.flatnonzero(is_recv)  # the union, ascending
    else:
        recv = pool
        is_recv[recv] = True
    rest_m = _rest_of_slot(by_slot[m], order[m], col, recv)  # slot m's max without a and the receiver
    same = slot_of[recv] == m
    ci, li = costs[members], lens[members]
    best: tuple[float, int, int, int] | None = None
    if members.size > 1:  # moves: sample i of a -> bin b
        new_a = np.broadcast_to(bin_costs(cost, A[a] - ci, T[a] - li, cnt[a] - 1)[:, None], (ci.size, recv.size))
        new_b = bin_costs(cost, A[recv][None] + ci[:, None], T[recv][None] + li[:, None], cnt[recv][None] + 1)
        fits = T[recv][None] + li[:, None] <= cap
        if extra is not None:
            fits = fits & (extra[1][recv][None] + extra[0][members][:, None] <= extra[2])
        other_max = slot_max[slot_of[recv]][None]
        d_same = np.maximum(np.maximum(new_a, new_b), rest_m[None]) - top
        d_other = (np.maximum(new_a, rest_m[None]) - top) + (np.maximum(other_max, new_b) - other_max)
        delta = np.where(fits, np.where(same[None], d_same, d_other), np.inf)
        k = _pick(delta, new_a, new_b, top, tol)
        if k is not None:
            i, bj = divmod(k, recv.size)
            best = (float(delta.flat[k]), int(members[i]), int(recv[bj]), -1)
    others = np.flatnonzero(is_recv[bin_of])
    if others.size:  # swaps: sample i of a <-> a lighter sample j of another bin
        ob = bin_of[others]
        cj, lj = costs[others], lens[others]
        pos = np.searchsorted(recv, ob)
        new_a = bin_costs(cost, A[a] - ci[:, None] + cj[None], T[a] - li[:, None] + lj[None], cnt[a])
        new_b = bin_costs(cost, (A[ob] - cj)[None] + ci[:, None], (T[ob] - lj)[None] + li[:, None], cnt[ob][None])
        fits = (T[a] - li[:, None] + lj[None] <= cap) & ((T[ob] - lj)[None] + li[:, None] <= cap)
        if extra is not None:
            xi, xj, Xt, xc = extra[0][members], extra[0][others], extra[1], extra[2]
            fits &= (Xt[a] - xi[:, None] + xj[None] <= xc) & ((Xt[ob] - xj)[None] + xi[:, None] <= xc)
        rm = rest_m[pos][None]
        om = slot_max[slot_of[ob]][None]
        d_same = np.maximum(np.maximum(new_a, new_b), rm) - top
        d_other = (np.maximum(new_a, rm) - top) + (np.maximum(om, new_b) - om)
        delta = np.where(fits, np.where(same[pos][None], d_same, d_other), np.inf)
        k = _pick(delta, new_a, new_b, top, tol)
        if k is not None and (best is None or delta.flat[k] < best[0] - tol):
            i, jj = divmod(k, others.size)
            best = (float(delta.flat[k]), int(members[i]), int(ob[jj]), int(others[jj]))
    return None if best is None else best[1:]
