"""``microplan._sort.stable_argsort`` is numpy's stable argsort, bit for bit, on every path
(small arrays, int composite keys, float tie groups, wide int ranges, NaN fallback)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from microplan._sort import stable_argsort


def _check(x: np.ndarray) -> None:
    for desc in (False, True):
        want = np.argsort(-x if desc else x, kind="stable")
        got = stable_argsort(x, descending=desc)
        assert got.dtype == want.dtype and np.array_equal(got, want)


@given(st.integers(0, 9000), st.sampled_from(["small-int", "wide-int", "ties-float", "float", "uint"]),
       st.integers(0, 2 ** 32 - 1))
def test_matches_numpy_stable_argsort(n, kind, seed):
    rng = np.random.default_rng(seed)
    x = {"small-int": lambda: rng.integers(-40, 40, n),
         "wide-int": lambda: rng.integers(-2 ** 62, 2 ** 62, n),
         "ties-float": lambda: rng.integers(0, 25, n) * 0.5,
         "float": lambda: rng.random(n),
         "uint": lambda: rng.integers(0, 2 ** 63, n, dtype=np.uint64) * np.uint64(2)}[kind]()
    _check(x)


@pytest.mark.parametrize("n", [1023, 1024, 4095, 4096, 20000])
def test_thresholds_and_signed_zero(n):
    rng = np.random.default_rng(n)
    x = rng.integers(0, 9, n).astype(np.float64)
    x[::7] = -0.0
    x[1::7] = 0.0
    _check(x)
    _check(rng.integers(0, 3, n))


def test_nan_falls_back_to_numpy():
    x = np.random.default_rng(0).random(6000)
    x[::5] = np.nan
    _check(x)


@given(st.integers(0, 6000), st.sampled_from(["increasing", "with-noise", "flat", "decreasing"]), st.integers(0, 2 ** 32 - 1))
def test_via_key_matches_numpy(n, shape, seed):
    """Sorting costs through their int lengths gives numpy's stable order, whether or not the costs
    are an increasing function of the lengths (the O(n) check falls back to sorting the costs)."""
    from microplan._sort import stable_argsort_via

    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 300, n)
    x = {"increasing": lambda: 3.0 * lens + 0.01 * lens.astype(float) ** 2,
         "with-noise": lambda: lens + rng.integers(0, 2, n) * 0.5,
         "flat": lambda: np.minimum(lens, 150) * 1.0,
         "decreasing": lambda: -1.0 * lens}[shape]()
    for desc in (False, True):
        assert np.array_equal(stable_argsort_via(x, lens, descending=desc), np.argsort(-x if desc else x, kind="stable"))
