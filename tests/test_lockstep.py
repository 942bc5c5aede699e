"""The lockstep pass (``stages/lockstep.py``) keeps its guarantees on random slot layouts with
placeholders, additive and packed-row costs: Σ slot maxima never rises, the cap holds, no
micro-batch empties. (That it decides as its frozen reference does: test_lockstep_reference.py.)"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from microplan.cost.models import FlopsCost, bin_costs
from microplan.stages.lockstep import refine_lockstep


def _state(seed: int, D: int, K: int, packed: bool):
    rng = np.random.default_rng(seed)
    nb = D * K
    grid = rng.permutation(nb).reshape(D, K)
    n = int(rng.integers(nb // 2, 3 * nb))
    lens = rng.integers(1, 400, n).astype(np.float64)
    bin_of = rng.integers(0, nb, n)
    bin_of[rng.random(n) < 0.2] = rng.integers(0, max(1, nb // 3))  # some bins crowded, some empty (placeholders)
    cost = FlopsCost(linear=1.0, quadratic=0.01, per_micro=50.0, packed_quadratic=0.004 if packed else 0.0)
    costs = lens + 0.01 * lens ** 2
    return grid, lens, bin_of, costs, cost


def _slot_sum(bin_of, grid, lens, costs, cost):
    nb = grid.size
    A, T, c = (np.bincount(bin_of, weights=costs, minlength=nb), np.bincount(bin_of, weights=lens, minlength=nb),
               np.bincount(bin_of, minlength=nb))
    C = np.where(c > 0, bin_costs(cost, A, T, c), 0.0)
    return float(C[grid].max(axis=0).sum()), T, c


@given(st.integers(0, 2 ** 32 - 1), st.integers(2, 40), st.integers(1, 8), st.booleans())
def test_refine_lockstep_never_worse_keeps_cap_and_bins(seed, D, K, packed):
    grid, lens, bin_of, costs, cost = _state(seed, D, K, packed)
    before, T0, c0 = _slot_sum(bin_of, grid, lens, costs, cost)
    cap = int(max(T0.max(), lens.max()))
    out = refine_lockstep(bin_of, grid, lens, costs, cost, cap)
    after, T1, c1 = _slot_sum(out, grid, lens, costs, cost)
    assert after <= before * (1 + 1e-12)
    assert (T1 <= cap).all() and ((c1 > 0) == (c0 > 0)).all()
