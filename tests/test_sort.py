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
