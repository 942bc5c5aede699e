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


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.int64, np.uint64])
@pytest.mark.parametrize("span", [1, 255, 256, 65535, 65536, 70000])
def test_narrow_int_ranges_take_the_radix_path(dtype, span):
    """Ranges under 2^16 (uint8/uint16 radix sort) and just past it (composite key), every int
    dtype, offsets near the dtype's limits: the stable order of the values (Python's sort of the
    ints; ``np.argsort(-x)`` itself wraps at a signed dtype's minimum), ties by index."""
    info = np.iinfo(dtype)
    span = min(span, int(info.max) - int(info.min))
    rng = np.random.default_rng(span)
    for lo in (int(info.min), min(0, int(info.max) - span), int(info.max) - span):
        vals = [lo, lo + span, lo] + [lo + int(v) for v in rng.integers(0, span + 1, 4997)]  # both ends present
        x = np.array(vals, dtype=dtype)
        for desc in (False, True):
            want = sorted(range(x.size), key=lambda i: -vals[i] if desc else vals[i])
            got = stable_argsort(x, descending=desc)
            assert got.dtype == np.int64 and got.tolist() == want
