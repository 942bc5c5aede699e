"""Fit a :class:`FlopsCost` in seconds to measured step or micro-batch times.

Each measured row is one timed unit of work (a micro-batch, or a whole step on one rank) and
says how much it did: ``tokens`` (Σ L over its samples), ``sum_sq_len`` (Σ L²), ``num_micros``
(micro-batches it ran) and ``seconds``. The model is linear in its three coefficients::

    seconds ≈ linear·tokens + quadratic·sum_sq_len + per_micro·num_micros

Design note:

1. Validate rows (finite, ``tokens > 0``, ``tokens ≤ sum_sq_len ≤ tokens²`` since every
   L ≥ 1, ``num_micros ≥ 1``, ``seconds > 0``) and refuse fewer rows than coefficients.
2. Scale each column to unit norm (tokens and Σ L² differ by ~10 orders of magnitude) and refuse
   a design whose scaled columns are (near-)collinear: those coefficients are not identifiable.
3. Solve nonnegative least squares exactly by enumerating the 2³ supports: least squares on each
   support, keep the feasible (all ≥ 0) solution with the smallest residual. The NNLS optimum is
   the least-squares solution on its own support (KKT), so the enumeration finds it; no scipy.

Guarantees: coefficients are ≥ 0 and optimal among nonnegative ones (for the chosen weighting);
degenerate input is a :class:`PlanError` naming the row/field and what to measure instead.
The exact enumeration costs ~0.3 ms for 1,000 rows (8 small lstsq solves).

Trade-off (measured in the setting of ``tests/test_cost.py``: 100 rows of 1-3 micro-batches
of 1-8 samples of 16 to 65,536 tokens, 2 % multiplicative timing noise, worst of 50 seeds):
minimising *relative* error (the default, rows weighted by 1/seconds) recovers
linear/quadratic/per_micro within 1.3 % / 3.5 % / 1.5 %; plain absolute least squares,
dominated by the longest rows, only within 7 % / 7 % / 44 %. GPU timing jitter is roughly
proportional to the work, hence the default.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Any

import numpy as np

from .cost import FlopsCost
from .errors import PlanError

__all__ = ["FIELDS", "CalibrationResult", "calibrate", "calibration_row"]

FIELDS: tuple[str, ...] = ("tokens", "sum_sq_len", "num_micros", "seconds")
_COND_LIMIT = 1e-9  # smallest/largest singular value of the unit-norm design below this: degenerate


@dataclass(frozen=True, kw_only=True)
class CalibrationResult:
    """The fitted cost model and how well it explains the rows.

    Attributes:
        cost: the fit, in seconds (linear: s/token, quadratic: s/token², per_micro: s/micro-batch).
        residual_rms: root-mean-square of ``seconds - predicted`` over the rows, in seconds.
        r2: coefficient of determination, ``1 - SS_res/SS_tot`` (1 = perfect; defined as 1.0 when
            every row took the same time and the fit is exact, 0.0 when it is not).
        num_rows: rows fitted.
        max_relative_error: the largest ``|seconds - predicted| / seconds`` over the rows.
    """

    cost: FlopsCost
    residual_rms: float
    r2: float
    num_rows: int
    max_relative_error: float


def calibration_row(micro_seq_lens: Sequence[int] | Sequence[Sequence[int]], seconds: float) -> dict[str, float]:
    """One row from what was timed: a micro-batch's sample lengths, or a list of micro-batches.

    >>> calibration_row([[1000, 3000], [4000]], 0.52)
    {'tokens': 8000.0, 'sum_sq_len': 26000000.0, 'num_micros': 2.0, 'seconds': 0.52}
    """
    items = list(micro_seq_lens)
    micros = items if items and all(isinstance(m, (Sequence, np.ndarray)) for m in items) else [items]
    lens = [float(x) for m in micros for x in m]
    if not lens:
        raise PlanError("calibration_row got no sample lengths; pass the lengths of the samples that ran.")
    arr = np.asarray(lens)
    return {"tokens": float(arr.sum()), "sum_sq_len": float((arr * arr).sum()),
            "num_micros": float(len(micros)), "seconds": float(seconds)}


def _columns(rows: Any) -> dict[str, np.ndarray]:
    """Rows as float64 columns from a structured array, a mapping of columns, or dicts."""
    if isinstance(rows, np.ndarray):
        if rows.dtype.names is None:
            raise PlanError(f"calibrate got a plain array of shape {rows.shape}; pass a structured array "
                            f"with fields {FIELDS}, a list of dicts, or a dict of columns.")
        get = lambda f: rows[f]  # noqa: E731
        have = set(rows.dtype.names)
    elif hasattr(rows, "keys") and not isinstance(rows, Sequence):  # dict of columns, DataFrame
        get = lambda f: rows[f]  # noqa: E731
        have = set(rows.keys())
    elif isinstance(rows, Iterable) and not isinstance(rows, (str, bytes)):
        rows = list(rows)
        for i, r in enumerate(rows):
            if not isinstance(r, Mapping):
                raise PlanError(f"calibrate rows[{i}] is a {type(r).__name__}; each row must be a dict with {FIELDS}.")
            missing = [f for f in FIELDS if f not in r]
            if missing:
                raise PlanError(f"calibrate rows[{i}] lacks {missing}; each row needs {FIELDS} "
                                f"(calibration_row(lengths, seconds) builds one).")
        get = lambda f: [r[f] for r in rows]  # noqa: E731
        have = set(FIELDS)
    else:
        raise PlanError(f"calibrate got {type(rows).__name__}; pass a list of dicts, a structured array, "
                        f"or a dict of columns with fields {FIELDS}.")
    missing = [f for f in FIELDS if f not in have]
    if missing:
        raise PlanError(f"calibrate input lacks field(s) {missing}; required: {FIELDS}.")
    out = {}
    for f in FIELDS:
        try:
            col = np.asarray(get(f), dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise PlanError(f"calibrate field {f!r} must hold numbers: {exc}") from None
        if col.ndim != 1:
            raise PlanError(f"calibrate field {f!r} must be 1-D, got shape {col.shape}.")
        out[f] = col
    return out


def _check(cols: dict[str, np.ndarray]) -> None:
    n = len(cols["seconds"])
    for f, col in cols.items():
        if len(col) != n:
            raise PlanError(f"calibrate field {f!r} has {len(col)} values but 'seconds' has {n}.")
        bad = np.flatnonzero(~np.isfinite(col))
        if bad.size:
            raise PlanError(f"calibrate row {bad[0]}: {f}={float(col[bad[0]])!r} is not finite; drop or re-measure it.")
    t, sq, m, s = (cols[f] for f in FIELDS)
    swapped = " — are the columns swapped?"
    for name, col, ok, rule in (("tokens", t, t > 0, "> 0; drop empty rows"),
                                ("num_micros", m, m >= 1, ">= 1; count the micro-batches the row ran"),
                                ("seconds", s, s > 0, "> 0; drop rows that were not timed"),
                                ("sum_sq_len", sq, sq >= t * (1 - 1e-12), "≥ tokens (every L ≥ 1)" + swapped),
                                ("sum_sq_len", sq, sq <= t * t * (1 + 1e-12),
                                 "<= tokens² (Σ L² ≤ (Σ L)²)" + swapped)):
        bad = np.flatnonzero(~ok)
        if bad.size:
            i = int(bad[0])
            raise PlanError(f"calibrate row {i}: {name}={float(col[i])!r} must be {rule} "
                            f"(row: tokens={float(t[i])!r}, sum_sq_len={float(sq[i])!r}).")


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a·x - b|| subject to x >= 0, exactly, by enumerating supports (k <= ~4 columns)."""
    k = a.shape[1]
    best, best_res = np.zeros(k), float(b @ b)
    for size in range(1, k + 1):
        for support in combinations(range(k), size):
            cols = list(support)
            xs, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(xs < 0):
                continue
            x = np.zeros(k)
            x[cols] = xs
            r = a @ x - b
            res = float(r @ r)
            if res < best_res * (1 - 1e-12):
                best, best_res = x, res
    return best


def calibrate(rows: Any, *, relative: bool = True) -> CalibrationResult:
    """Fit ``seconds ≈ linear·tokens + quadratic·sum_sq_len + per_micro·num_micros`` with all ≥ 0.

    Args:
        rows: measured rows with fields ``tokens``, ``sum_sq_len``, ``num_micros``, ``seconds``:
            a list of dicts (see :func:`calibration_row`), a numpy structured array, or a dict of
            columns. At least 3 rows, varied enough to separate the three terms (different
            lengths mixes and different micro-batch counts).
        relative: minimise relative errors, weighting each row by 1/seconds (default True: timing
            noise is roughly proportional to the work, and short rows, which pin down
            ``per_micro``, then count as much as long ones). False minimises absolute errors.

    Returns:
        :class:`CalibrationResult` with the fitted :class:`FlopsCost` (in seconds), the residual
        RMS, R², the row count and the worst relative error.

    Raises:
        PlanError: malformed rows, fewer than 3 rows, collinear columns (e.g. every row has the
            same length mix, or one micro-batch per fixed token count), or a fit in which time
            does not grow with tokens at all.
    """
    if not isinstance(relative, bool):
        raise PlanError(f"calibrate(relative={relative!r}) must be True or False.")
    cols = _columns(rows)
    _check(cols)
    n = len(cols["seconds"])
    if n < 3:
        raise PlanError(f"calibrate got {n} row(s) but fits 3 coefficients (linear, quadratic, per_micro); "
                        f"time at least 3 — better 20+ — steps with different lengths and micro counts.")
    design = np.column_stack([cols["tokens"], cols["sum_sq_len"], cols["num_micros"]])
    seconds = cols["seconds"]
    w = 1.0 / seconds if relative else np.ones(n)
    a = design * w[:, None]
    norms = np.linalg.norm(a, axis=0)
    a_unit = a / norms
    sv = np.linalg.svd(a_unit, compute_uv=False)
    if sv[-1] < _COND_LIMIT * sv[0]:
        raise PlanError("calibrate rows cannot separate linear, quadratic and per_micro: the columns tokens, "
                        "sum_sq_len and num_micros are (nearly) proportional across rows. Time rows that differ "
                        "in sequence lengths (short and long samples) and in micro-batches per row.")
    x = _nnls(a_unit, seconds * w) / norms
    linear, quadratic, per_micro = (float(v) for v in x)
    if linear == 0.0 and quadratic == 0.0:
        raise PlanError("calibrate: the best nonnegative fit has linear = quadratic = 0, i.e. time does not "
                        "grow with tokens in these rows; time larger batches (overheads dominate these).")
    pred = design @ x
    resid = seconds - pred
    ss_res = float(resid @ resid)
    centred = seconds - seconds.mean()
    ss_tot = float(centred @ centred)
    if ss_tot > 0:
        r2 = 1.0 - ss_res / ss_tot
    else:
        r2 = 1.0 if ss_res <= 1e-24 * float(seconds @ seconds) else 0.0
    return CalibrationResult(cost=FlopsCost(linear=linear, quadratic=quadratic, per_micro=per_micro),
                             residual_rms=math.sqrt(ss_res / n), r2=r2, num_rows=n,
                             max_relative_error=float(np.max(np.abs(resid) / seconds)))
