"""The lockstep pass (``stages/lockstep.py``) returns what its frozen reference
(``tests/_lockstep_reference.py``: the pass before its per-state rankings, member table and batched
probes) returns, bit for bit, and leaves the caller's bin sums as the reference does: on random slot
layouts with placeholders and crowded bins, integer costs (ties everywhere: between bins' costs, at
the 24th receiver, between equally good changes), additive, packed-row, token and unrecognised cost
models, and a second capped resource. Each probe path is also checked against the reference's
``_best_change`` slot by slot."""

from __future__ import annotations

from dataclasses import dataclass

import _lockstep_reference as ref
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from microplan.cost.models import FlopsCost, TokenCost, bin_costs
from microplan.stages import lockstep as new
from microplan.stages.assign import arrange


@dataclass(frozen=True, kw_only=True)
class _Dense(FlopsCost):
    """A FlopsCost the pass does not recognise by type: its probes take the one-slot path."""


def _cost(kind: str, values: str):
    q = 0.01 if values == "wide" else 0.0  # integer lengths and no quadratic term: integer costs, ties everywhere
    pm = 0.0 if values == "zeros" else 3.0  # empty samples and no per-micro cost: real micro-batches of cost 0
    return {"additive": FlopsCost(linear=1.0, quadratic=q, per_micro=pm),
            "packed": FlopsCost(linear=1.0, quadratic=q, per_micro=pm,
                                packed_quadratic=0.004 if values == "wide" else 1.0),
            "token": TokenCost(per_micro=pm),
            "unrecognised": _Dense(linear=1.0, quadratic=q, per_micro=pm, packed_quadratic=0.5)}[kind]


def _case(seed: int, D: int, K: int, kind: str, values: str, layout: str, arranged: bool, with_extra: bool):
    """(bin_of, grid, lens, costs, cost, cap, extra) of one random lockstep pass. ``values``: lengths in
    1..5 ("ties": equal costs at every boundary), 1..300 ("ints": equal changes), 1..400 ("wide"), or
    0..3 without a per-micro cost ("zeros": real micro-batches that cost no more than a placeholder),
    or 1..400 with one sample's cost NaN ("nan");
    ``layout``: bins drawn at random, some "crowded" and some empty (placeholders), one "piled" high,
    or "spread" as the planner leaves them (every bin real, most holding one or two samples)."""
    rng = np.random.default_rng(seed)
    nb = D * K
    top = {"ties": 6, "ints": 301, "wide": 401, "zeros": 4, "nan": 401}[values]
    low = 0 if values == "zeros" else 1
    if layout == "spread":  # the longest samples alone, the shorter ones paired with the shortest of those
        n = nb + int(rng.integers(0, nb + 1))
        lens = np.sort(rng.integers(low, top, n))[::-1].copy()
        bin_of = np.empty(n, dtype=np.int64)
        bin_of[:nb] = rng.permutation(nb)
        bin_of[nb:] = bin_of[nb - 1 - (np.arange(n - nb) % nb)]
        shuffle = rng.permutation(n)
        lens, bin_of = lens[shuffle], bin_of[shuffle]
    else:
        n = int(rng.integers(max(2, nb // 2), 3 * nb + 3))
        bin_of = rng.integers(0, nb, n)
        if layout == "crowded":
            bin_of[rng.random(n) < 0.3] = rng.integers(0, max(1, nb // 4))
        elif layout == "piled":  # one bin too full for the member table: probes scan the batch
            bin_of[rng.random(n) < 0.4] = rng.integers(0, nb)
        lens = rng.integers(low, top, n)
    cost = _cost(kind, values)
    costs = cost.sample_costs(lens.astype(np.float64))
    if values == "nan":
        costs[rng.integers(0, n)] = np.nan
    A, T, c = (np.bincount(bin_of, weights=costs, minlength=nb), np.bincount(bin_of, weights=lens, minlength=nb),
               np.bincount(bin_of, minlength=nb))
    C = np.where(c > 0, bin_costs(cost, A, T, c), 0.0)
    grid = arrange(C, D, K) if arranged else rng.permutation(nb).reshape(D, K)
    cap = int(max(T.max(), lens.max()) + rng.integers(0, top))
    extra = None
    if with_extra:
        amount = rng.integers(0, 10, n).astype(np.float64)  # a second cap some bins already exceed: it stops changes
        extra = (amount, int(np.quantile(np.bincount(bin_of, weights=amount, minlength=nb), rng.uniform(0.5, 1.0))))
    return bin_of, grid, lens, costs, cost, cap, extra


_KINDS = st.sampled_from(["additive", "packed", "token", "unrecognised"])
_VALUES = st.sampled_from(["ties", "ints", "wide", "zeros", "nan"])
_LAYOUTS = st.sampled_from(["random", "crowded", "spread", "piled"])


@settings(max_examples=150)
@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 40), st.integers(1, 8), _KINDS, _VALUES, _LAYOUTS,
       st.booleans(), st.booleans(), st.sampled_from([None, 3, 200]), st.sampled_from([1e-5, 0.0]))
def test_refine_lockstep_matches_reference(seed, D, K, kind, values, layout, arranged, with_extra, max_iters, rel_tol):
    """The same bins out, the same sums left, the input untouched."""
    bin_of, grid, lens, costs, cost, cap, extra = _case(seed, D, K, kind, values, layout, arranged, with_extra)
    nb = D * K
    sums = [(np.bincount(bin_of, weights=costs, minlength=nb), np.bincount(bin_of, weights=lens, minlength=nb),
             np.bincount(bin_of, minlength=nb)) for _ in range(2)]
    given_ = bin_of.copy()
    out = new.refine_lockstep(given_, grid, lens, costs, cost, cap, max_iters=max_iters, rel_tol=rel_tol,
                              extra=extra, sums=sums[0])
    want = ref.refine_lockstep(bin_of.copy(), grid, lens, costs, cost, cap, max_iters=max_iters, rel_tol=rel_tol,
                               extra=extra, sums=sums[1])
    assert np.array_equal(out, want)
    assert np.array_equal(given_, bin_of)  # the input is never written
    for got, exp in zip(*sums):
        assert np.array_equal(got, exp, equal_nan=True)


def _probe_state(seed, D, K, kind, values, layout, with_extra):
    """A pass's state at its start: the reference's arguments for every slot, and the new pass's view."""
    bin_of, grid, lens, costs, cost, cap, extra = _case(seed, D, K, kind, values, layout, False, with_extra)
    nb = D * K
    A, T, cnt = (np.bincount(bin_of, weights=costs, minlength=nb), np.bincount(bin_of, weights=lens, minlength=nb),
                 np.bincount(bin_of, minlength=nb))
    C = np.where(cnt > 0, bin_costs(cost, A, T, cnt), 0.0)
    X = None if extra is None else np.bincount(bin_of, weights=extra[0], minlength=nb)
    ext = None if extra is None else (extra[0], X, extra[1])
    lens_f = lens.astype(np.float64)
    by_slot, order, top, _, _ = new._slots(C, np.ascontiguousarray(grid.T))
    ps = new._Pass(bin_of, grid, lens_f, costs, cost, cap, A, T, C, cnt, cnt > 0, ext)
    ps.refresh(by_slot, order, top)
    slot_of = np.empty(nb, dtype=np.int64)
    slot_of[grid.reshape(-1)] = np.tile(np.arange(K), D)
    args = (bin_of, A, T, C, cnt, slot_of, by_slot, order, top, lens_f, costs, cost, cap, grid)
    return ps, args, ext, (order, top, cnt)


@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 40), st.integers(1, 8), _KINDS, _VALUES, _LAYOUTS, st.booleans())
def test_each_probe_path_matches_reference_best_change(seed, D, K, kind, values, layout, with_extra):
    """The one-slot probe, and a batch of one slot wherever a batch may probe it, find the reference's change."""
    ps, args, ext, (order, top, cnt) = _probe_state(seed, D, K, kind, values, layout, with_extra)
    ps.prep()
    for m in range(K):
        a = int(args[-1][order[m, 0], m])
        if cnt[a] == 0:
            continue
        tol = 1e-5 * float(top[m])
        want = ref._best_change(a, m, *args, tol=tol, extra=ext)
        assert new._best_change(ps, a, m, tol=tol) == want
        if ps.ok[m]:
            found = new._swap_batch(ps, np.array([m]), 1e-5)
            assert (None if found is None else found[1]) == want


@settings(max_examples=200)
@given(st.integers(0, 2 ** 32 - 1), st.integers(8, 40), st.integers(2, 8), _KINDS, _VALUES, st.booleans())
def test_batch_returns_the_first_slot_with_a_change(seed, D, K, kind, values, with_extra):
    """A batch of several slots (bins as the planner leaves them: the heaviest alone) stops at the first
    whose probe finds a change, with that change."""
    ps, args, ext, (order, top, cnt) = _probe_state(seed, D, K, kind, values, "spread", with_extra)
    ps.prep()
    rows = [m for m in range(K) if ps.ok[m]]
    if not rows:
        return
    found = new._swap_batch(ps, np.array(rows), 1e-5)
    wants = [ref._best_change(int(args[-1][order[m, 0], m]), m, *args, tol=1e-5 * float(top[m]), extra=ext)
             for m in rows]
    first = next((k for k, w in enumerate(wants) if w is not None), None)
    assert (None if found is None else found[0]) == first
    if found is not None:
        assert found[1] == wants[first]


def _reference_receivers(a, m, C, cnt, slot_of, slot_max, grid):
    """The receivers ``_lockstep_reference._best_change`` examines (its lines; R for its _RECEIVERS)."""
    nb, R = C.size, ref._RECEIVERS
    col = grid[:, m]
    real_mask = cnt > 0
    pool = np.flatnonzero(real_mask & (np.arange(nb) != a))
    is_recv = np.zeros(nb, dtype=bool)
    if pool.size > 2 * R:
        mine = np.sort(col[real_mask[col] & (col != a)])
        head = slot_max[slot_of[pool]] - C[pool]
        is_recv[pool[np.argpartition(-head, R)[:R]]] = True
        is_recv[mine if mine.size <= R else mine[np.argpartition(C[mine], R)[:R]]] = True
        return np.flatnonzero(is_recv)
    return pool


@given(st.integers(0, 2 ** 32 - 1), st.integers(20, 40), st.integers(2, 8), _VALUES, _LAYOUTS)
def test_shared_rankings_give_each_probe_its_own_receivers(seed, D, K, values, layout):
    """Wherever a probe or a batch takes its receivers from the state's rankings, they are the ones the
    probe would rank on its own (ties at the 24th receiver, placeholders, real bins of cost 0)."""
    ps, args, ext, (order, top, cnt) = _probe_state(seed, D, K, "additive", values, layout, False)
    ps.prep()
    for m in range(K):
        a = int(args[-1][order[m, 0], m])
        if cnt[a] == 0:
            continue
        want = _reference_receivers(a, m, ps.C, cnt, ps.slot_of, top, args[-1])
        assert np.array_equal(new._receivers(ps, a, m), want)
        if ps.ok[m]:
            own = new._own_receivers(ps, np.array([m]))[0]
            got = np.union1d(ps.head, own[own < ps.table.shape[0] - 1])
            assert np.array_equal(got, want)


@given(st.integers(0, 2 ** 32 - 1), st.integers(26, 40), st.integers(2, 6), st.sampled_from(["tie", "zero"]),
       st.booleans())
def test_receivers_at_a_slots_lightest_boundary(seed, D, K, mode, with_extra):
    """Distinct costs (a unique headroom ranking), one sample per bin, and per slot either a tie between
    its 24th and 25th lightest ("tie"), or real bins of cost 0 beside placeholders ("zero"): each probe's
    receivers, and the pass, are the reference's."""
    rng = np.random.default_rng(seed)
    nb = D * K
    n = nb - (int(rng.integers(1, K + 1)) if mode == "zero" else 0)
    bin_of = rng.permutation(nb)[:n]
    costs = rng.random(n) * 100 + 1
    grid = rng.permutation(nb).reshape(D, K)
    slot = np.empty(nb, dtype=np.int64)
    slot[grid.reshape(-1)] = np.tile(np.arange(K), D)
    for m in range(K):
        own = np.flatnonzero(slot[bin_of] == m)  # the slot's samples, one per bin
        own = own[np.argsort(costs[own])][:-1]  # lightest first, its heaviest left out
        if mode == "tie":
            costs[own[24]] = costs[own[23]]
        else:
            costs[own[rng.integers(0, own.size, 2)]] = 0.0
    cost = FlopsCost(linear=1.0, per_micro=0.0 if mode == "zero" else 3.0)
    lens = rng.integers(1, 400, n)
    cap, extra = int(lens.max()) * 2, None
    if with_extra:
        extra = (rng.integers(0, 10, n).astype(np.float64), 12)
    out = new.refine_lockstep(bin_of, grid, lens, costs, cost, cap, extra=extra)
    assert np.array_equal(out, ref.refine_lockstep(bin_of, grid, lens, costs, cost, cap, extra=extra))
    cnt = np.bincount(bin_of, minlength=nb)
    A, T = np.bincount(bin_of, weights=costs, minlength=nb), np.bincount(bin_of, weights=lens, minlength=nb)
    C = np.where(cnt > 0, bin_costs(cost, A, T, cnt), 0.0)
    by_slot, order, top, _, _ = new._slots(C, np.ascontiguousarray(grid.T))
    ps = new._Pass(bin_of, grid, lens.astype(np.float64), costs, cost, cap, A, T, C, cnt, cnt > 0, None)
    ps.refresh(by_slot, order, top)
    ps.prep()
    for m in range(K):
        a = int(grid[order[m, 0], m])
        if cnt[a] == 0:
            continue
        want = _reference_receivers(a, m, C, cnt, ps.slot_of, top, grid)
        assert np.array_equal(new._receivers(ps, a, m), want)
        if ps.ok[m]:
            own = new._own_receivers(ps, np.array([m]))[0]
            assert np.array_equal(np.union1d(ps.head, own[own < ps.table.shape[0] - 1]), want)
