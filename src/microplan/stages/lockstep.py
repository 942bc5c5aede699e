"""Lockstep refinement: move samples between micro-batches to lower Σ_m max_r cost(r, m).

Design note. LPT and the bin refine (``refine.py``) balance micro-batch *costs*; the lockstep
time only charges each slot's *maximum*. After the micro-batches are arranged into slots
(``assign.py``), this pass repeatedly takes the slot whose heaviest micro-batch stands out most
above its slot's second heaviest and applies the best single move (a sample of that micro-batch
to any other micro-batch) or swap (with a lighter sample of any other micro-batch) that lowers
the sum of slot maxima — a receiver in another slot may rise up to its own slot's maximum for
free. Costs are exact for non-additive models (the packed-row term is re-evaluated at the new
totals). Moves keep every micro-batch within the token cap (and a second capped resource,
``extra``: vision tokens) and non-empty.

The receivers of a change are the 24 real micro-batches with the most headroom under their slot's
maximum and the 24 lightest of the slot itself. Between two changes nothing moves, so the pass
ranks the slots and the headroom once per change (``_Pass.prep``) and every probe until the next
change reuses them; a probe ranks its own receivers (``_receivers_exact``) wherever the shared
ranking could differ from its own: a tie at the 24th receiver, a non-finite cost, or a slot whose
real micro-batches do not all cost more than its placeholders. The probes a state can still make
(the slots next in line, as far as patience and iterations reach) run as one batch of numpy
operations, one row per slot (``_swap_batch``: heaviest micro-batches of one sample, bin costs
computed element by element: additive, FlopsCost and TokenCost models); the first
slot with a change is the one the pass applies, and the rows before it are the probes that found
none. Every value a row compares is computed by the operations the one-slot probe
(``_best_change``) applies to it, and ties between equally good changes go to the lowest sample
index, as there. Each bin's samples are kept in a table updated by every change, ascending, so a
probe reads its receivers' samples without a scan over the batch.

Guarantees: Σ_m max cost never increases; the cap holds; no micro-batch empties; deterministic; the
shared rankings and the batches change no decision (tests/test_lockstep_reference.py compares the
pass with a frozen one-slot-at-a-time copy, bit for bit).
Cost: O(bins) numpy per change (the slots' order, the headroom ranking) and one batch of
O(slots × receivers' samples) numpy per change; a slot whose heaviest micro-batch holds several
samples is probed alone (O(its samples × receivers' samples)); O(n) per probe only when a bin holds
more samples than the table's width (``_TABLE_WIDTH``, and at most ``_TABLE_SLACK`` cells per sample
in all). At most ``max_iters`` probes (default min(2·K + 16, 64)).
Trade-off: the slot-blind bin refine leaves a spread of a few percent in the slots after the
first, which this pass removes (benchmarks/bench_meter.py measures it). It stops within
``STOP_GAP`` (0.1 %) of its floor: the last fractions of a percent are the dearest.
"""

from __future__ import annotations

import numpy as np

from ..cost.models import CostModel, FlopsCost, TokenCost, bin_costs, is_additive

__all__ = ["refine_lockstep", "apply_change"]

_RECEIVERS = 24   # receiver bins examined per change: most headroom overall, and lightest of the slot
STOP_GAP = 1e-3  # stop once Σ slot maxima is this close to its floor (the mean load per rank)
_PATIENCE = 12    # changes without a strict gain (plateau moves) before giving up
_TABLE_WIDTH = 64  # bins' samples kept in a [bins, width] table while no bin holds more (and the table stays
_TABLE_SLACK = 8   # within this many cells per sample); else each probe finds them by a scan over the batch


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
    C = np.where(real, bin_costs(cost, A, T, cnt), 0.0)  # placeholders (0) never set a slot's max: real bins cost > 0
    iters = max_iters if max_iters is not None else min(2 * K + 16, 64)
    mean = float(C[real].sum() + (nb - int(real.sum())) * cost.per_micro) / D  # nothing beats the mean
    floor = None  # and the costliest lone sample: O(n), computed once the mean alone does not stop
    ps: _Pass | None = None
    best_obj, since = np.inf, 0
    state = None  # the slots' view of C, refreshed only after a change (a slot found stuck changes nothing)
    slots = np.ascontiguousarray(grid.T)
    for it in range(iters):
        if state is None:
            state, stuck = _slots(C, slots), 0  # stuck: the first `stuck` slots of `ranked` moved nothing
        by_slot, order, top, ranked, obj = state
        if stuck >= K:
            break
        if obj <= mean * (1 + STOP_GAP):  # within 0.1 % of the mean: below any machine's timing noise
            break
        if ps is None:
            lens_f = lens.astype(np.float64)
            floor = max(mean, float(bin_costs(cost, costs, lens_f, 1).max()))
            bin_of = bin_of.copy()
            ps = _Pass(bin_of, grid, lens_f, costs, cost, cap, A, T, C, cnt, real,
                       None if extra is None else (extra[0], X, extra[1]))  # type: ignore[arg-type]
        if obj <= floor * (1 + STOP_GAP):  # type: ignore[operator]
            break
        if obj < best_obj * (1 - rel_tol):
            best_obj, since = obj, 0
        elif since >= _PATIENCE:
            break
        since += 1
        m = ranked[stuck]
        a = int(grid[order[m, 0], m])
        if cnt[a] == 0:  # a slot of placeholders only
            stuck += 1
            continue
        ps.refresh(by_slot, order, top)
        if m in ps.known:  # found by a batch of this state's probes
            got = ps.known[m]
        else:  # the probes this state can still make: slots left, iterations left, patience left
            window = ranked[stuck:stuck + min(iters - it, _PATIENCE - since + 1)]
            got = _probe(ps, window, rel_tol)
        if got is None:
            stuck += 1
            continue
        i, b, j = got
        apply_change(i, a, b, j, bin_of, A, costs, T, ps.lens, cnt,
                     None if X is None else (X, extra[0]))  # type: ignore[index]
        ps.changed(i, a, b, j)
        state = None
    return bin_of


def _slots(C: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int], float]:
    """The slots' costs ``by_slot[m, r]`` (``slots``: ``grid.T``, contiguous), each slot's order (heaviest
    first), its maximum, the slots by lead of their maximum over their second (largest first), and Σ of
    the maxima."""
    K, D = slots.shape
    by_slot = C[slots]          # [K, D] costs per slot
    order = np.argsort(-by_slot, axis=1)
    ar = np.arange(K)
    top = by_slot[ar, order[:, 0]]
    second = by_slot[ar, order[:, 1]] if D > 1 else np.zeros(K)
    ranked = np.lexsort((ar, -top, -(top - second))).tolist()
    return by_slot, order, top, ranked, float(top.sum())


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


class _Pass:
    """One pass's inputs and the views it keeps current: each bin's samples (a [bins + 1, width] table,
    ascending, -1 padded; its last row is empty), and per state (between two changes) the slots'
    bins in order, the bins ranked by headroom, and which slots a batch can probe (``prep``)."""

    def __init__(self, bin_of: np.ndarray, grid: np.ndarray, lens: np.ndarray, costs: np.ndarray, cost: CostModel,
                 cap: int, A: np.ndarray, T: np.ndarray, C: np.ndarray, cnt: np.ndarray, real: np.ndarray,
                 extra: tuple[np.ndarray, np.ndarray, int] | None) -> None:
        D, K = grid.shape
        nb = D * K
        self.bin_of, self.grid, self.lens, self.costs, self.cost, self.cap = bin_of, grid, lens, costs, cost, cap
        self.A, self.T, self.C, self.cnt, self.extra = A, T, C, cnt, extra
        self.real, self.real_idx = real, np.flatnonzero(real)
        self.slot_of = np.empty(nb, dtype=np.int64)
        self.slot_of[grid] = np.arange(K)  # grid[r, m] is a bin of slot m
        self.slot_real = self.slot_of[self.real_idx]
        self.finite = bool(np.isfinite(C).all())
        self.size = np.bincount(bin_of, minlength=nb)  # samples per bin, as the table holds them
        self.table: np.ndarray | None = None
        self.width = min(_TABLE_WIDTH, (_TABLE_SLACK * bin_of.size + 1024) // (nb + 1))  # the widest table kept
        if int(self.size.max()) <= self.width:
            keys = bin_of.astype(np.uint16) if nb <= 1 << 16 else bin_of  # a stable sort is unique: radix is exact
            srt = np.argsort(keys, kind="stable")  # by bin, ascending samples within a bin
            by_bin = bin_of[srt]
            self.table = np.full((nb + 1, int(self.size.max())), -1, dtype=np.int64)
            self.table[by_bin, np.arange(srt.size) - (np.cumsum(self.size) - self.size)[by_bin]] = srt
        # the slot-major bins, and per slot where its real bins end in its order (a batch's receivers)
        self.slot_bins, self.at = np.ascontiguousarray(grid.T).reshape(-1), (np.arange(K) * D)[:, None]
        nr = np.bincount(self.slot_real, minlength=K)
        self.n_real, self.full, self.few = nr.tolist(), nr == D, nr - 1 <= _RECEIVERS
        self.all_real, self.all_few = self.real_idx.size == nb, bool(self.few.all())
        base = np.arange(K) * D
        self.ends = (base + np.maximum(nr - 1, 0), base + np.maximum(nr - _RECEIVERS - 1, 0),
                     base + np.maximum(nr - _RECEIVERS, 0))
        pos = np.maximum(nr - _RECEIVERS, 1)[:, None] + np.arange(_RECEIVERS)  # the lightest real bins but the first
        self.light_at, self.light_ok = base[:, None] + np.minimum(pos, D - 1), pos < nr[:, None]
        self.packed = not is_additive(cost)  # bin costs read the token totals and counts
        self.batch = (self.table is not None and self.real_idx.size - 1 > 2 * _RECEIVERS
                      and (not self.packed or type(cost) in (FlopsCost, TokenCost)))  # elementwise costs
        self.state: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.known: dict[int, tuple[int, int, int] | None] = {}

    def refresh(self, by_slot: np.ndarray, order: np.ndarray, top: np.ndarray) -> None:
        """Take a new state's slot view (after a change); its rankings are made at its first probe."""
        if self.state is None:
            self.state, self.ready, self.known = (by_slot, order, top), False, {}

    def prep(self) -> None:
        """The state's rankings: each slot's bins and costs heaviest first (``bins``, ``vals``: [K, D]);
        the ``_RECEIVERS`` real bins with the most headroom (``head``, ascending; ``head_mask``;
        ``head_samples``) and the least headroom among them (``low``: NaN when that set is not unique —
        a tie with the next bin — or a cost is not finite: each probe then ranks its own receivers);
        and per slot whether a batch can probe it (``ok``)."""
        if self.ready:
            return
        self.ready = True
        by_slot, order, top = self.state  # type: ignore[misc]
        flat = order + self.at
        self.bins, self.vals = self.slot_bins[flat], by_slot.reshape(-1)[flat]
        self.low = np.nan
        if self.real_idx.size - 1 > 2 * _RECEIVERS:
            if self.all_real:  # the same values every probe's own ranking sees
                head = top[self.slot_of] - self.C
            else:
                head = top[self.slot_real] - self.C[self.real_idx]
            part = np.argpartition(-head, _RECEIVERS)
            low = float(head[part[:_RECEIVERS]].min())
            if self.finite and low > head[part[_RECEIVERS]]:
                self.low = low
                self.head = np.sort(part[:_RECEIVERS] if self.all_real else self.real_idx[part[:_RECEIVERS]])
                self.head_mask = np.zeros(self.C.size, dtype=bool)
                self.head_mask[self.head] = True
        self.heavy = a = self.bins[:, 0]  # each slot's heaviest: headroom 0, the least, never in a unique top set
        if not self.batch or np.isnan(self.low):
            self.ok = [False] * a.size
            return
        rows = self.table[self.head]  # type: ignore[index]
        self.head_samples = rows[rows >= 0]
        ok = self.size[a] == 1  # one sample: no moves, and not a slot of placeholders only
        v, (last, above, at) = self.vals.reshape(-1), self.ends
        if not self.all_real:  # the slot's real bins lead its order (placeholders cost 0)
            ok &= self.full | (v[last] > 0)
        if not self.all_few:  # no tie at the slot's 24th lightest
            ok &= self.few | (v[above] > v[at])
        self.ok = ok.tolist()

    def members(self, a: int) -> np.ndarray:
        """Bin a's samples, ascending."""
        if self.table is not None:
            return self.table[a, :self.size[a]]
        return np.flatnonzero(self.bin_of == a)

    def samples_of(self, recv: np.ndarray) -> np.ndarray:
        """The samples of the bins ``recv``, ascending."""
        if self.table is not None:
            rows = self.table[recv]
            return np.sort(rows[rows >= 0])
        is_recv = np.zeros(self.C.size, dtype=bool)
        is_recv[recv] = True
        return np.flatnonzero(is_recv[self.bin_of])

    def changed(self, i: int, a: int, b: int, j: int) -> None:
        """After ``apply_change(i, a, b, j, ...)``: the two bins' costs and samples; a new state follows."""
        C, A, T, cnt = self.C, self.A, self.T, self.cnt
        for x in (a, b):
            C[x] = bin_costs(self.cost, A[x:x + 1], T[x:x + 1], cnt[x:x + 1])[0]
        self.finite = self.finite and bool(np.isfinite(C[a]) and np.isfinite(C[b]))
        self.state = None
        self.size[a] += (j >= 0) - 1
        self.size[b] += 1 - (j >= 0)
        if self.table is None:
            return
        rows = {x: [s for s in self.table[x].tolist() if s >= 0 and s not in (i, j)] for x in (a, b)}
        rows[b].append(i)
        if j >= 0:
            rows[a].append(j)
        w = max(len(rows[a]), len(rows[b]))
        if w > self.width:
            self.table, self.batch = None, False
            return
        if w > self.table.shape[1]:
            pad = np.full((self.table.shape[0], w - self.table.shape[1]), -1, dtype=np.int64)
            self.table = np.concatenate([self.table, pad], axis=1)
        for x, row in rows.items():
            self.table[x] = -1
            self.table[x, :len(row)] = sorted(row)


def _probe(ps: _Pass, window: list[int], rel_tol: float) -> tuple[int, int, int] | None:
    """The best change out of slot ``window[0]``'s heaviest bin. When a batch can probe it, the next slots
    of ``window`` it can probe are probed with it (``ps.known``: None for each slot before the first
    with a change, and that change)."""
    ps.prep()
    m = window[0]
    rows = [c for c in window if ps.ok[c]]  # the others are probed one by one (or, placeholders only, not at all)
    if not rows or rows[0] != m:
        return _best_change(ps, int(ps.heavy[m]), m, tol=rel_tol * float(ps.state[2][m]))  # type: ignore[index]
    found = _swap_batch(ps, np.array(rows), rel_tol)
    for k, c in enumerate(rows):
        ps.known[c] = None if found is None or k < found[0] else found[1]
        if found is not None and k == found[0]:
            break
    return ps.known[m]


def _swap_batch(ps: _Pass, ms: np.ndarray, rel_tol: float) -> tuple[int, tuple[int, int, int]] | None:
    """(k, change) for the first slot ``ms[k]`` whose heaviest bin (one sample) has an acceptable swap,
    with the change :func:`_best_change` returns for it; None if none has. One row per slot: the
    samples of its receivers (the headroom ones, then its own lightest), -1 padded; every value is
    computed by the operations :func:`_best_change` applies to it, so each row decides as it would."""
    slot_max = ps.state[2]  # type: ignore[index]
    table, A, T, cnt, bin_of, cost, cap, extra = ps.table, ps.A, ps.T, ps.cnt, ps.bin_of, ps.cost, ps.cap, ps.extra
    assert table is not None
    P, D = ms.size, ps.bins.shape[1]
    a = ps.heavy[ms]
    i = table[a, 0]
    S = np.concatenate((np.broadcast_to(ps.head_samples, (P, ps.head_samples.size)),
                        table[_own_receivers(ps, ms)].reshape(P, -1)), axis=1)
    ob = bin_of[S]
    cj, lj, so = ps.costs[S], ps.lens[S], ps.slot_of[ob]
    ci, li = ps.costs[i][:, None], ps.lens[i][:, None]
    top = slot_max[ms][:, None]
    tol = rel_tol * top
    tok_a = (T[a][:, None] - li) + lj
    tok_b = (T[ob] - lj) + li
    new_a = bin_costs(cost, (A[a][:, None] - ci) + cj, tok_a, cnt[a][:, None] if ps.packed else 0)
    new_b = bin_costs(cost, (A[ob] - cj) + ci, tok_b, cnt[ob] if ps.packed else 0)
    fits = (S >= 0) & (tok_a <= cap) & (tok_b <= cap)
    if extra is not None:
        xi, xj, Xt, xc = extra[0][i][:, None], extra[0][S], extra[1], extra[2]
        fits &= ((Xt[a][:, None] - xi) + xj <= xc) & ((Xt[ob] - xj) + xi <= xc)
    rm = np.where(ob == (ps.bins[ms, 1][:, None] if D > 1 else -1), ps.vals[ms, 2][:, None] if D > 2 else 0.0,
                  ps.vals[ms, 1][:, None] if D > 1 else 0.0)  # slot m's max without a and the receiver
    delta = _delta(fits, so == ms[:, None], new_a, new_b, rm, top, slot_max[so])
    score = _score(delta, new_a, new_b, top, tol)
    low = score.min(axis=1)
    hit = np.flatnonzero(np.isfinite(low))
    if not hit.size:
        return None
    k = int(hit[0])
    j = int(S[k][score[k] == low[k]].min())  # the first best in ascending sample order, as argmin takes it
    return k, (int(i[k]), int(bin_of[j]), j)


def _own_receivers(ps: _Pass, ms: np.ndarray) -> np.ndarray:
    """[slots, _RECEIVERS]: each slot's lightest real bins but its heaviest that are not headroom receivers,
    padded with the member table's empty row (for slots ``ps.ok`` marks)."""
    light = ps.bins.reshape(-1)[ps.light_at[ms]]
    return np.where(ps.light_ok[ms] & ~ps.head_mask[light], light, ps.table.shape[0] - 1)  # type: ignore[union-attr]


def _receivers(ps: _Pass, a: int, m: int) -> np.ndarray:
    """Ascending receiver bins of a change out of bin a (slot m's heaviest): the real bins but a with the
    most headroom under their slot's maximum, and the lightest of slot m; every real bin but a when
    there are at most 2·``_RECEIVERS`` of them. From the state's rankings when they are this probe's."""
    real_idx = ps.real_idx
    if real_idx.size - 1 <= 2 * _RECEIVERS:
        return real_idx[real_idx != a]
    ps.prep()
    if np.isnan(ps.low):  # no unique headroom ranking
        return _receivers_exact(ps, a, m)
    nr, v, (last, above, at) = ps.n_real[m], ps.vals.reshape(-1), ps.ends
    if not ((ps.full[m] or v[last[m]] > 0) and (ps.few[m] or v[above[m]] > v[at[m]])):
        return _receivers_exact(ps, a, m)
    light = ps.bins[m, max(nr - _RECEIVERS, 1):nr]
    return np.sort(np.concatenate((ps.head, light[~ps.head_mask[light]])))


def _receivers_exact(ps: _Pass, a: int, m: int) -> np.ndarray:
    """:func:`_receivers` ranked for this probe alone (argpartition's choice among ties included)."""
    _, _, slot_max = ps.state  # type: ignore[misc]
    C, real_mask, real_idx, col = ps.C, ps.real, ps.real_idx, ps.grid[:, m]
    pool = real_idx[real_idx != a]
    is_recv = np.zeros(C.size, dtype=bool)
    mine = np.sort(col[real_mask[col] & (col != a)])  # slot m's real bins but a, ascending (col: slot m's bins)
    head = slot_max[ps.slot_of[pool]] - C[pool]
    is_recv[pool[np.argpartition(-head, _RECEIVERS)[:_RECEIVERS]]] = True
    is_recv[mine if mine.size <= _RECEIVERS else mine[np.argpartition(C[mine], _RECEIVERS)[:_RECEIVERS]]] = True
    return np.flatnonzero(is_recv)  # the union, ascending


def _rest_of_slot(by_slot_m: np.ndarray, ord_m: np.ndarray, col: np.ndarray) -> tuple[int, float, float]:
    """Slot m's second heaviest bin, and the slot's maximum without its heaviest bin: without the second
    too (for a receiver that is the second), and with it."""
    second = int(col[ord_m[1]]) if ord_m.size > 1 else -1
    second_val = by_slot_m[ord_m[1]] if ord_m.size > 1 else 0.0
    third_val = by_slot_m[ord_m[2]] if ord_m.size > 2 else 0.0
    return second, third_val, second_val


def _pick(delta: np.ndarray, new_a: np.ndarray, new_b: np.ndarray, top: float, tol: float) -> int | None:
    """Index of the best acceptable change: a strict gain, else a sideways move off a plateau.

    Sideways (Σ slot maxima unchanged) is accepted only when both changed micro-batches end
    strictly below the old maximum: Σ cost² then falls, so the search cannot cycle.
    """
    if delta.size == 0:
        return None
    score = _score(delta, new_a, new_b, top, tol)
    k = int(np.argmin(score))
    return k if np.isfinite(score.flat[k]) else None


def _score(delta: np.ndarray, new_a: np.ndarray, new_b: np.ndarray, top: float | np.ndarray,
           tol: float | np.ndarray) -> np.ndarray:
    """Each change's rank for :func:`_pick` (lower is better; inf: not acceptable): its gain when strict,
    else a tiny bonus for how far a sideways move brings bin a below the maximum (``top``, ``tol``:
    scalars or per-row columns of a batch)."""
    side = (delta <= tol * 1e-3) & (new_a <= top - tol) & (new_b <= top - tol)
    return np.where(delta < -tol, delta, np.where(side, -(top - new_a) * 1e-12, np.inf))


def _delta(fits: np.ndarray, same: np.ndarray, new_a: np.ndarray, new_b: np.ndarray, rest: np.ndarray | float,
           top: float | np.ndarray, other_max: np.ndarray) -> np.ndarray:
    """Change of Σ slot maxima for each change out of slot m's heaviest bin (``top``): bin a becomes
    ``new_a`` and the receiver ``new_b``; ``rest``: slot m's maximum without both; a receiver of another
    slot (``same`` False) raises that slot's maximum ``other_max`` only above it; inf where it does not fit."""
    d_same = np.maximum(np.maximum(new_a, new_b), rest) - top
    d_other = (np.maximum(new_a, rest) - top) + (np.maximum(other_max, new_b) - other_max)
    return np.where(fits, np.where(same, d_same, d_other), np.inf)


def _best_change(ps: _Pass, a: int, m: int, *, tol: float) -> tuple[int, int, int] | None:
    """(sample i of a, receiver bin b, sample j of b or -1) of the best acceptable move or swap out of
    bin a, slot m's heaviest (``tol``: the least gain that counts as one)."""
    members = ps.members(a)
    recv = _receivers(ps, a, m)
    if not recv.size:
        return None
    by_slot, order, slot_max = ps.state  # type: ignore[misc]
    A, T, cnt, slot_of, cost, cap, extra = ps.A, ps.T, ps.cnt, ps.slot_of, ps.cost, ps.cap, ps.extra
    top = by_slot[m, order[m, 0]]
    second, third_val, second_val = _rest_of_slot(by_slot[m], order[m], ps.grid[:, m])
    ci, li = ps.costs[members], ps.lens[members]
    best: tuple[float, int, int, int] | None = None
    if members.size > 1:  # moves: sample i of a -> bin b
        rest_m = np.where(recv == second, third_val, second_val)  # slot m's max without a and the receiver
        new_a = np.broadcast_to(bin_costs(cost, A[a] - ci, T[a] - li, cnt[a] - 1)[:, None], (ci.size, recv.size))
        new_b = bin_costs(cost, A[recv][None] + ci[:, None], T[recv][None] + li[:, None], cnt[recv][None] + 1)
        fits = T[recv][None] + li[:, None] <= cap
        if extra is not None:
            fits = fits & (extra[1][recv][None] + extra[0][members][:, None] <= extra[2])
        delta = _delta(fits, (slot_of[recv] == m)[None], new_a, new_b, rest_m[None], top, slot_max[slot_of[recv]][None])
        k = _pick(delta, new_a, new_b, top, tol)
        if k is not None:
            i, bj = divmod(k, recv.size)
            best = (float(delta.flat[k]), int(members[i]), int(recv[bj]), -1)
    others = ps.samples_of(recv)
    if others.size:  # swaps: sample i of a <-> a lighter sample j of another bin
        ob = ps.bin_of[others]
        cj, lj = ps.costs[others], ps.lens[others]
        so = slot_of[ob]
        Ta = T[a] - li[:, None]
        Tb = T[ob] - lj
        new_a = bin_costs(cost, A[a] - ci[:, None] + cj[None], Ta + lj[None], cnt[a])
        new_b = bin_costs(cost, (A[ob] - cj)[None] + ci[:, None], Tb[None] + li[:, None], cnt[ob][None])
        fits = (Ta + lj[None] <= cap) & (Tb[None] + li[:, None] <= cap)
        if extra is not None:
            xi, xj, Xt, xc = extra[0][members], extra[0][others], extra[1], extra[2]
            fits &= (Xt[a] - xi[:, None] + xj[None] <= xc) & ((Xt[ob] - xj)[None] + xi[:, None] <= xc)
        rm = np.where(ob == second, third_val, second_val)[None]
        delta = _delta(fits, (so == m)[None], new_a, new_b, rm, top, slot_max[so][None])
        k = _pick(delta, new_a, new_b, top, tol)
        if k is not None and (best is None or delta.flat[k] < best[0] - tol):
            i, jj = divmod(k, others.size)
            best = (float(delta.flat[k]), int(members[i]), int(ob[jj]), int(others[jj]))
    return None if best is None else best[1:]

