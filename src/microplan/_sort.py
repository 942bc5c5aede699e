"""Stable argsort, bit-identical to ``np.argsort(x, kind="stable")``, at the speed of a plain sort.

Design note. numpy's stable argsort is a timsort for 32/64-bit keys (radix only for <= 16-bit),
several times slower than ``np.sort`` (a SIMD sort) on the 2k-16k element arrays the planner
orders. Stability is folded into the key instead: each element's value rank (an integer
offset, or the tie group of an unstable float argsort) is shifted left past its index bits, so
the keys are distinct, ``np.sort`` orders them, and the low bits are the stable order. Ints
whose range fits 16 bits (lengths up to 64k, bin ids of up to 65,536 micro-batches) take numpy's
own stable radix sort instead, on the offsets cast to uint16/uint8: O(n), no composite key. Falls
back to numpy's stable argsort when the keys would not fit 63 bits, for NaNs, small arrays
(numpy's timsort wins below ~1k ints / ~4k floats, and on nearly sorted data) and other dtypes.
"""

from __future__ import annotations

import numpy as np

__all__ = ["stable_argsort", "stable_argsort_via"]

_SMALL = {"i": 1024, "u": 1024, "f": 4096}  # below these sizes numpy's own stable argsort is as fast


def stable_argsort(x: np.ndarray, *, descending: bool = False) -> np.ndarray:
    """``np.argsort(-x if descending else x, kind="stable")`` for a 1-D int or float array."""
    n = x.size
    if x.ndim != 1 or n < _SMALL.get(x.dtype.kind, n + 1):
        return np.argsort(-x if descending else x, kind="stable")
    shift = (n - 1).bit_length()
    if x.dtype.kind in "iu":
        lo, hi = int(x.min()), int(x.max())
        if hi - lo < 1 << 16:  # numpy's stable sort is a radix sort for 8/16-bit ints
            rel = (hi - x) if descending else (x - lo)
            return np.argsort(rel.astype(np.uint8 if hi - lo < 1 << 8 else np.uint16), kind="stable")
        if hi - lo < 1 << (62 - shift):
            rel = (hi - x) if descending else (x - lo)
            return _low_bits(rel.astype(np.int64, copy=False), shift)
    elif x.dtype.kind == "f":
        y = -x if descending else x
        o = np.argsort(y)
        v = y[o]
        if not np.isnan(v[-1]):  # NaNs sort last; their order is numpy's business
            ties = v[1:] == v[:-1]
            if not ties.any():
                return o
            group = np.zeros(n, dtype=np.int64)
            np.cumsum(~ties, out=group[1:])
            key = (group << shift) | o
            key.sort()
            return key & ((1 << shift) - 1)
    return np.argsort(-x if descending else x, kind="stable")


def stable_argsort_via(x: np.ndarray, key: np.ndarray, *, descending: bool = False) -> np.ndarray:
    """:func:`stable_argsort` of ``x``, found by sorting the int ``key`` instead when ``x`` is an
    increasing function of it (sample costs of sample lengths): the key's order is kept when, along
    it, ``x`` never rises (falls, ascending) and ties in ``x`` are ties in ``key``; else ``x`` is
    sorted. The check is O(n); 16,384 float costs: ~0.3 ms instead of ~0.7 ms."""
    if x.ndim != 1 or key.shape != x.shape or key.dtype.kind not in "iu" or x.size < _SMALL["i"]:
        return stable_argsort(x, descending=descending)
    o = stable_argsort(key, descending=descending)
    v, k = x[o], key[o]
    step = (v[1:] < v[:-1]) if descending else (v[1:] > v[:-1])
    if (step | ((v[1:] == v[:-1]) & (k[1:] == k[:-1]))).all():
        return o
    return stable_argsort(x, descending=descending)


def _low_bits(rank: np.ndarray, shift: int) -> np.ndarray:
    key = (rank << shift) | np.arange(rank.size, dtype=np.int64)
    key.sort()
    return key & ((1 << shift) - 1)
