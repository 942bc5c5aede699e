"""The batched fallback placement of ``stages/pack.py`` equals its one-at-a-time reference.

``_place_rest_batched`` searches only the bins a block of samples can choose; these properties
check it against ``_place_rest_one_by_one`` (masked argmin over every bin per sample) bit for
bit — bins, loads and tokens — on states with tied loads, negative starting loads (slot
targets), widths, per-token increments, and samples that fit nowhere; and ``lpt_pack_wide``
end to end with the fast path against the same packer forced onto the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from microplan.stages import exact, pack
from microplan.stages.exact import first_fit_decreasing
from microplan.stages.pack import REST_BLOCK, _place_rest_batched, _place_rest_one_by_one, lpt_pack_wide


@st.composite
def states(draw):
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    B = draw(st.integers(1, 80))
    n = draw(st.integers(1, 3 * REST_BLOCK + 5))
    cap = draw(st.integers(8, 200))
    width = rng.integers(1, 3, B) if draw(st.booleans()) else np.ones(B, dtype=np.int64)
    room = width * cap
    tokens = (rng.random(B) * room * draw(st.sampled_from([0.5, 0.9, 1.0]))).astype(np.int64)
    levels = draw(st.sampled_from([3, 1000]))  # few levels: many tied loads
    load = rng.integers(-levels, levels, B).astype(np.float64) / 4
    lens = rng.integers(1, cap + 1, n).astype(np.int64)
    if draw(st.booleans()):
        lens = np.sort(lens)[::-1].copy()  # LPT's usual order: descending
    costs = (lens * rng.choice([0.0, 0.25, 1.0], n) + rng.integers(0, 3, n)).astype(np.float64)
    tok_w = rng.random(B) if draw(st.booleans()) else None
    inv_w = 1.0 / width
    rest = rng.permutation(n) if draw(st.booleans()) else np.arange(n)
    return lens, costs, load, tokens, room, inv_w, tok_w, rest


def _run(fn, state):
    lens, costs, load, tokens, room, inv_w, tok_w, rest = state
    load_c, load_t, bin_of = load.copy(), tokens.copy(), np.full(lens.size, -1)
    if fn is _place_rest_one_by_one:
        ok = fn(rest, bin_of, lens, costs, load_c, load_t, room, inv_w, tok_w, None, load_t, 0)
    else:
        ok = fn(rest, bin_of, lens, costs, load_c, load_t, room, inv_w, tok_w)
    return ok, bin_of, load_c, load_t


@given(states())
def test_batched_rest_placement_equals_one_by_one(state):
    ok_ref, bins_ref, lc_ref, lt_ref = _run(_place_rest_one_by_one, state)
    ok, bins, lc, lt = _run(_place_rest_batched, state)
    assert ok == ok_ref
    if ok:
        np.testing.assert_array_equal(bins, bins_ref)
        assert lc.tobytes() == lc_ref.tobytes()  # bit for bit: same additions in the same order
        np.testing.assert_array_equal(lt, lt_ref)


def test_negative_increments_take_the_reference():
    """A negative cost could make a placed bin lighter again: the blocks' bound would not hold."""
    lens = np.array([5, 5, 5], dtype=np.int64)
    state = (lens, np.array([-3.0, 1.0, 1.0]), np.zeros(4), np.zeros(4, dtype=np.int64),
             np.full(4, 10, dtype=np.int64), np.ones(4), None, np.arange(3))
    ok_ref, bins_ref, _, _ = _run(_place_rest_one_by_one, state)
    ok, bins, _, _ = _run(_place_rest_batched, state)
    assert ok and ok_ref
    np.testing.assert_array_equal(bins, bins_ref)
    assert bins.tolist() == [0, 0, 1]  # the first bin got lighter, so it takes the second sample too


@given(st.integers(0, 2 ** 32 - 1), st.integers(2, 60), st.sampled_from([0.0, 1e-3, 1.0]),
       st.sampled_from([1.0, 1.02, 1.3]))
def test_lpt_pack_wide_equals_the_reference_packer(seed, B, quad, slack):
    """The whole packer, slot-target loads included, with and without the fast fallback."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 100, int(rng.integers(B, 8 * B))).astype(np.int64)
    costs = lens + quad * lens.astype(np.float64) ** 2
    cap = max(int(lens.max()), int(np.ceil(lens.sum() * slack / B)))
    load = -np.repeat(rng.random(max(B // 4, 1)) * costs.sum() / B, 4)[:B]
    load = np.concatenate([load, np.zeros(B - load.size)])
    width = np.ones(B, dtype=np.int64)
    fast = lpt_pack_wide(lens, costs, width, cap, load=load.copy())
    with pytest.MonkeyPatch.context() as mpatch:
        mpatch.setattr(pack, "_place_rest_batched", lambda rest, *a: _place_rest_one_by_one(
            rest, *a, None, a[4], 0))
        ref = lpt_pack_wide(lens, costs, width, cap, load=load.copy())
    assert (fast is None) == (ref is None)
    if fast is not None:
        np.testing.assert_array_equal(fast, ref)


@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 200), st.integers(1, 3 * 64), st.sampled_from([8, 50, 100]),
       st.sampled_from([1, 3, exact.FFD_SCAN]))
def test_first_fit_decreasing_equals_the_masked_search(seed, m, n, cap, scan):
    """First fit with stale-bound hints against the one masked search per sample (the ``extra``
    path with a resource that never binds runs the original loop); short scans reach the masked
    search after them."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, cap + 1, n).astype(np.int64)
    if rng.random() < 0.5:
        lens = np.minimum(lens, rng.integers(1, cap + 1))  # many equal lengths: ties
    with pytest.MonkeyPatch.context() as mpatch:
        mpatch.setattr(exact, "FFD_SCAN", scan)
        fast = first_fit_decreasing(lens, m, cap)
    ref = first_fit_decreasing(lens, m, cap, extra=(np.zeros(n, dtype=np.int64), 0))
    assert (fast is None) == (ref is None)
    if fast is not None:
        np.testing.assert_array_equal(fast, ref)


def test_non_finite_costs_take_the_reference():
    """A NaN or infinite cost breaks the (load, bin) order the blocks rely on: the reference runs."""
    lens = np.array([5, 5, 5], dtype=np.int64)
    for bad in (np.nan, np.inf):
        state = (lens, np.array([1.0, bad, 1.0]), np.zeros(4), np.zeros(4, dtype=np.int64),
                 np.full(4, 10, dtype=np.int64), np.ones(4), None, np.arange(3))
        ok_ref, bins_ref, lc_ref, _ = _run(_place_rest_one_by_one, state)
        ok, bins, lc, _ = _run(_place_rest_batched, state)
        assert ok == ok_ref
        np.testing.assert_array_equal(bins, bins_ref)
        assert lc.tobytes() == lc_ref.tobytes()


def _fill_empty_reference(bin_of, lens, load, count):
    """One masked search per empty bin: the fullest donor (two or more samples, lowest bin on ties)
    gives its shortest sample (lowest index on ties)."""
    for b in np.flatnonzero(count == 0).tolist():
        donors = np.flatnonzero(count >= 2)
        if not donors.size:
            return None
        d = int(donors[np.argmax(load[donors])])
        members = np.flatnonzero(bin_of == d)
        s = int(members[np.argmin(lens[members])])
        bin_of[s] = b
        load[d] -= lens[s]
        load[b] += lens[s]
        count[d] -= 1
        count[b] += 1
    return bin_of


@given(st.integers(0, 2 ** 32 - 1), st.integers(1, 60), st.integers(1, 80), st.sampled_from([3, 20, 1000]))
def test_fill_empty_equals_the_masked_search(seed, m, n, top):
    """The empty bins' fill (a heap of donors, each bin's samples sorted once) gives every empty bin
    the sample the per-bin masked search gives it, ties included, and the same loads and counts."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, top + 1, n).astype(np.int64)
    bin_of = rng.integers(0, m, n).astype(np.int64)
    load = np.bincount(bin_of, weights=lens, minlength=m).astype(np.int64)
    count = np.bincount(bin_of, minlength=m).astype(np.int64)
    ref = [a.copy() for a in (bin_of, load, count)]
    got = exact._fill_empty(bin_of, lens, load, count)
    want = _fill_empty_reference(ref[0], lens, ref[1], ref[2])
    assert (got is None) == (want is None)
    if got is not None:
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(load, ref[1])
        np.testing.assert_array_equal(count, ref[2])
