"""Fit a :class:`FlopsCost` in seconds to measured step or micro-batch times.

Each measured row is one timed unit of work (a micro-batch, or a whole step on one rank) and
says how much it did: ``tokens`` (Σ L over its samples), ``sum_sq_len`` (Σ L²), ``num_micros``
(micro-batches it ran), ``seconds``, and for a dense kernel ``packed_sq`` (Σ T² over its
micro-batches of two or more samples, T = the micro-batch's packed tokens) and ``lone_sq``
(Σ L² over its one-sample micro-batches, which run unmasked). :func:`calibration_row` builds
a row from the lengths (``cost.models.micro_features``). The two regimes::

    varlen:  seconds ≈ linear·tokens + quadratic·sum_sq_len + per_micro·num_micros
    dense:   seconds ≈ linear·tokens + quadratic·lone_sq + packed_quadratic·packed_sq + per_micro·num_micros

Design note:

1. Validate rows (finite, ``tokens > 0``, ``tokens ≤ sum_sq_len ≤ tokens²`` since every
   L ≥ 1, ``0 ≤ packed_sq ≤ tokens²``, ``0 ≤ lone_sq ≤ sum_sq_len``, ``num_micros ≥ 1``,
   ``seconds > 0``) and refuse fewer rows than coefficients.
2. Scale each column to unit norm (tokens and Σ L² differ by ~10 orders of magnitude) and refuse
   a design whose scaled columns are (near-)collinear: those coefficients are not identifiable.
   The dense regime is fitted when every row carries ``packed_sq`` and ``lone_sq`` and some
   micro-batch packs several samples, and kept when it explains the rows better;
   ``packed=True`` insists, ``packed=False`` leaves it out.
3. Solve nonnegative least squares exactly by enumerating the supports: least squares on each
   support, keep the feasible (all ≥ 0) solution with the smallest residual. The NNLS optimum is
   the least-squares solution on its own support (KKT), so the enumeration finds it; no scipy.

Guarantees: coefficients are ≥ 0 and optimal among nonnegative ones (for the chosen weighting);
degenerate input is a :class:`PlanError` naming the row/field and what to measure instead.
The exact enumeration costs ≤ 15 small lstsq solves.

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

from .models import FlopsCost, micro_features
from ..errors import PlanError

__all__ = ["FIELDS", "OPTIONAL_FIELDS", "CalibrationResult", "calibrate", "calibration_row", "nnls"]

FIELDS: tuple[str, ...] = ("tokens", "sum_sq_len", "num_micros", "seconds")
OPTIONAL_FIELDS: tuple[str, ...] = ("packed_sq", "lone_sq")
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
        terms: the coefficients fitted (``packed_quadratic`` only when the rows separate it).
        heldout_median_error / heldout_max_error: ``|predicted/measured - 1|`` over timed
            compositions the fit did not see (``microplan.torch.profile_cost``; None otherwise).
        regime: the attention regime the timings show: ``"varlen"`` (per-sample Σ L²),
            ``"packed"`` (T² of the packed row), ``"linear"`` (no attention term worth fitting);
            None when not assessed.
        rows: the measured rows (profile_cost: every composition timed, held-out ones marked).
        cp_note: profile_cost with ``cp_sizes``: how the CP term (``cost.cp``) was fitted; None otherwise.
    """

    cost: FlopsCost
    residual_rms: float
    r2: float
    num_rows: int
    max_relative_error: float
    terms: tuple[str, ...] = ("linear", "quadratic", "per_micro")
    heldout_median_error: float | None = None
    heldout_max_error: float | None = None
    regime: str | None = None
    rows: tuple[dict[str, Any], ...] = ()
    cp_note: str | None = None

    def describe(self) -> str:
        """A short multi-line report: the model, R², held-out error, regime."""
        lines = [self.cost.describe(), f"R² = {self.r2:.4f} over {self.num_rows} rows, worst relative error "
                 f"{self.max_relative_error:.1%}"]
        if self.heldout_median_error is not None:
            lines.append(f"held-out compositions: median error {self.heldout_median_error:.1%}, "
                         f"worst {self.heldout_max_error:.1%}")
        if self.regime is not None:
            lines.append(f"attention regime: {self.regime}")
        if self.cp_note is not None:
            lines.append(self.cp_note)
        return "\n".join(lines)


def calibration_row(micro_seq_lens: Sequence[int] | Sequence[Sequence[int]], seconds: float) -> dict[str, float]:
    """One row from what was timed: a micro-batch's sample lengths, or a list of micro-batches.

    >>> calibration_row([[1000, 3000], [4000]], 0.52)
    {'tokens': 8000.0, 'sum_sq_len': 26000000.0, 'num_micros': 2.0, 'seconds': 0.52, 'packed_sq': 16000000.0, 'lone_sq': 16000000.0}
    """
    items = list(micro_seq_lens)
    micros = items if items and all(isinstance(m, (Sequence, np.ndarray)) for m in items) else [items]
    if not any(len(m) for m in micros):
        raise PlanError("calibration_row got no sample lengths; pass the lengths of the samples that ran.")
    varlen = sum(micro_features(m) for m in micros)             # [Σ L, Σ L², 0, micro-batches]
    dense = sum(micro_features(m, dense=True) for m in micros)  # [Σ L, Σ lone L², Σ packed T², micro-batches]
    return {"tokens": float(varlen[0]), "sum_sq_len": float(varlen[1]), "num_micros": float(varlen[3]),
            "seconds": float(seconds), "packed_sq": float(dense[2]), "lone_sq": float(dense[1])}


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
        have = set(FIELDS) | {f for f in OPTIONAL_FIELDS if rows and all(f in r for r in rows)}
    else:
        raise PlanError(f"calibrate got {type(rows).__name__}; pass a list of dicts, a structured array, "
                        f"or a dict of columns with fields {FIELDS}.")
    missing = [f for f in FIELDS if f not in have]
    if missing:
        raise PlanError(f"calibrate input lacks field(s) {missing}; required: {FIELDS}.")
    out = {}
    for f in FIELDS + tuple(f for f in OPTIONAL_FIELDS if f in have):
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
                                 "<= tokens² (Σ L² ≤ (Σ L)²)" + swapped)) + _packed_rules(cols):
        bad = np.flatnonzero(~ok)
        if bad.size:
            i = int(bad[0])
            raise PlanError(f"calibrate row {i}: {name}={float(col[i])!r} must be {rule} "
                            f"(row: tokens={float(t[i])!r}, sum_sq_len={float(sq[i])!r}).")


def _packed_rules(cols: dict[str, np.ndarray]) -> tuple:
    if "packed_sq" not in cols:
        return ()
    t, sq, p = cols["tokens"], cols["sum_sq_len"], cols["packed_sq"]
    rules = (("packed_sq", p, p >= 0, ">= 0"),
             ("packed_sq", p, p <= t * t * (1 + 1e-12), "<= tokens² (Σ_m T_m² <= (Σ T_m)²)"))
    if "lone_sq" in cols:
        q = cols["lone_sq"]
        rules += (("lone_sq", q, (q >= 0) & (q <= sq * (1 + 1e-12)), "within [0, sum_sq_len] (lone samples' L²)"),)
    return rules


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a·x - b|| subject to x >= 0, exactly, by enumerating supports (see the module
    note): 2^k − 1 small least-squares solves, so ``a`` has a handful of columns (<= ~5)."""
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


_NAMES = {"tokens": "linear", "sum_sq_len": "quadratic", "lone_sq": "quadratic", "packed_sq": "packed_quadratic",
          "num_micros": "per_micro"}


def _separable(a: np.ndarray) -> bool:
    norms = np.linalg.norm(a, axis=0)
    if np.any(norms == 0):
        return False
    sv = np.linalg.svd(a / norms, compute_uv=False)
    return bool(sv[-1] >= _COND_LIMIT * sv[0])


def calibrate(rows: Any, *, relative: bool = True, packed: bool | None = None) -> CalibrationResult:
    """Fit the four-term cost model to timed rows (exact nonnegative least squares).

    Two regimes (``microplan.cost.models``): a *varlen* kernel, ``seconds ≈ linear·tokens +
    quadratic·sum_sq_len + per_micro·num_micros``; a *dense* masked kernel, where micro-batches
    of two or more samples pay ``packed_quadratic·packed_sq`` instead of per-sample attention and
    lone samples pay ``quadratic·lone_sq``.

    Args:
        rows: measured rows with fields ``tokens``, ``sum_sq_len``, ``num_micros``, ``seconds``
            and, for the dense regime, ``packed_sq`` (Σ T² over the row's micro-batches of >= 2
            samples) and ``lone_sq`` (Σ L² over its one-sample micro-batches): a list of dicts (see
            :func:`calibration_row`, which fills all of them), a numpy structured array, or a dict
            of columns. At least one row per coefficient, varied enough to separate the terms.
        relative: minimise relative errors, weighting each row by 1/seconds (default True: timing
            noise is roughly proportional to the work, and short rows, which pin down
            ``per_micro``, then count as much as long ones). False minimises absolute errors.
        packed: the regime: True dense, False varlen, None (default) both are fitted when the rows
            carry the dense fields and separate its terms, and the better fit wins (the dense one
            only if it explains the rows better and has a positive packed term).

    Returns:
        :class:`CalibrationResult` with the fitted :class:`FlopsCost` (in seconds), the residual
        RMS, R², the row count, the worst relative error and the terms fitted.

    Raises:
        PlanError: malformed rows, too few rows, collinear columns (e.g. every row has the same
            length mix, or one micro-batch per fixed token count), or a fit in which time does not
            grow with tokens at all.
    """
    if not isinstance(relative, bool):
        raise PlanError(f"calibrate(relative={relative!r}) must be True or False.")
    if packed is not None and not isinstance(packed, bool):
        raise PlanError(f"calibrate(packed={packed!r}) must be True, False or None (decide from the rows).")
    cols = _columns(rows)
    _check(cols)
    n = len(cols["seconds"])
    seconds = cols["seconds"]
    w = 1.0 / seconds if relative else np.ones(n)
    dense_ok = "packed_sq" in cols and "lone_sq" in cols
    if packed and not dense_ok:
        raise PlanError("calibrate(packed=True) needs 'packed_sq' and 'lone_sq' in every row (T² of the row's "
                        "multi-sample micro-batches, L² of its one-sample ones); calibration_row(lengths, seconds) "
                        "adds them.")
    fits = []
    if packed is not True:
        fits.append(_fit(cols, ["tokens", "sum_sq_len", "num_micros"], w, n, required=True))
    if packed is not False and dense_ok:
        dense = _fit(cols, ["tokens", "lone_sq", "packed_sq", "num_micros"], w, n, required=bool(packed))
        if dense is not None and (packed or dense[1]["packed_sq"] > 0):
            fits.append(dense)
    fits = [f for f in fits if f is not None]
    x_names, coef, pred = min(fits, key=lambda f: float(((seconds - f[2]) * w) @ ((seconds - f[2]) * w)))
    linear, per_micro = coef["tokens"], coef["num_micros"]
    quadratic = coef.get("sum_sq_len", coef.get("lone_sq", 0.0))
    packed_q = coef.get("packed_sq", 0.0)
    if linear == 0.0 and quadratic == 0.0 and packed_q == 0.0:
        raise PlanError("calibrate: the best nonnegative fit has no token term (linear = quadratic = 0), i.e. time "
                        "does not grow with tokens in these rows; time larger batches (overheads dominate these).")
    resid = seconds - pred
    ss_res = float(resid @ resid)
    centred = seconds - seconds.mean()
    ss_tot = float(centred @ centred)
    if ss_tot > 0:
        r2 = 1.0 - ss_res / ss_tot
    else:
        r2 = 1.0 if ss_res <= 1e-24 * float(seconds @ seconds) else 0.0
    return CalibrationResult(cost=FlopsCost(linear=linear, quadratic=quadratic, per_micro=per_micro,
                                            packed_quadratic=packed_q),
                             residual_rms=math.sqrt(ss_res / n), r2=r2, num_rows=n,
                             max_relative_error=float(np.max(np.abs(resid) / seconds)),
                             terms=tuple(_NAMES[f] for f in x_names))


def _fit(cols: dict[str, np.ndarray], names: list[str], w: np.ndarray, n: int,
         required: bool) -> tuple[list[str], dict[str, float], np.ndarray] | None:
    """(names, coefficients, predictions) of the NNLS fit on these columns; None (or PlanError when
    ``required``) if the rows cannot separate them."""
    k = len(names)
    terms = ", ".join(_NAMES[f] for f in names)
    if n < k:
        if not required:
            return None
        raise PlanError(f"calibrate got {n} row(s) but fits {k} coefficients ({terms}); time at least {k} — "
                        f"better 20+ — steps with different lengths and micro counts.")
    design = np.column_stack([cols[f] for f in names])
    a = design * w[:, None]
    if not _separable(a):
        if not required:
            return None
        if "packed_sq" in names:
            raise PlanError("calibrate rows cannot separate the dense kernel's terms (packed_quadratic over micro-"
                            "batches of several samples, quadratic over one-sample ones) from the others: time "
                            "micro-batches that pack several samples as well as single long samples, at different "
                            "totals.")
        raise PlanError("calibrate rows cannot separate linear, quadratic and per_micro: the columns tokens, "
                        "sum_sq_len and num_micros are (nearly) proportional across rows. Time rows that differ "
                        "in sequence lengths (short and long samples) and in micro-batches per row.")
    norms = np.linalg.norm(a, axis=0)
    x = nnls(a / norms, cols["seconds"] * w) / norms
    return names, dict(zip(names, (float(v) for v in x))), design @ x
