"""Fit a :class:`MemoryModel` to measured peaks: ``fit_memory(rows) -> MemoryFit`` (core, numpy only).

Design note. A row is one micro-batch that ran: its sample lengths and the peak bytes it added.
The model is linear in the features of ``microplan.cost.models.micro_features`` — ``[T, Σ L²,
0, 1]`` per sample (varlen) or ``[T, lone L², packed T², 1]`` (dense mask) — so the fit is the
cost calibration's, in bytes:

1. Both regimes are fitted by nonnegative least squares on the relative error (each row divided
   by its measured bytes, so a small micro-batch counts as much as a big one), exactly
   (``cost.calibrate.nnls``, enumerated supports); the dense one only when the rows hold both
   packs and lone samples. The regime with the smaller worst relative error wins (ties: varlen,
   the simpler one).
2. Rows below ``min_tokens`` are not fitted: the peak is a maximum over the phases of the pass,
   and for a tiny micro-batch the weights' gradient phase dominates, not the activations. Their
   largest measured peak becomes ``floor`` (what any micro-batch adds at the least).
3. Phases. The peak is the largest over the phases of a pass (with full recomputation: the
   logits phase, linear in T, and a layer's recompute with its attention scores). When the best
   single fit is off by more than 2 %, a two-phase model ``max(A, B)`` is fitted (A: tokens and a
   constant; B: all four terms) by the max-affine fixed point (Magnani & Boyd 2009): rows start
   split by their attention share, each phase is refitted on the rows where it is the larger,
   until the split holds; it replaces the single fit when its worst error is under 0.7× that.
4. ``regime``: ``"packed"`` (a packed-row T² term), ``"varlen"`` (Σ L²), ``"linear"`` (neither).

Guarantees: coefficients >= 0, ``per_token`` > 0 (a fit in which bytes do not grow with tokens
is a PlanError naming the rows to measure instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations
from dataclasses import dataclass

import numpy as np

from ..cost.calibrate import nnls
from ..cost.models import micro_features
from ..errors import PlanError
from .model import MemoryModel

__all__ = ["MemoryFit", "fit_memory", "relative_errors"]


@dataclass(frozen=True, kw_only=True)
class MemoryFit:
    """A fitted model and how well it explains its rows.

    Attributes:
        model: the fit (margin 0: the caller states one).
        regime: ``"packed"``, ``"varlen"`` or ``"linear"``.
        max_relative_error: worst ``|predicted/measured − 1|`` over the fitted rows.
        under: worst under-prediction ``measured/predicted − 1`` over the fitted rows (>= 0).
    """

    model: MemoryModel
    regime: str
    max_relative_error: float
    under: float


def relative_errors(model: MemoryModel, comps: Sequence[Sequence[int]], measured: Sequence[float]) -> np.ndarray:
    """``predicted/measured − 1`` of each row (negative: under-predicted)."""
    pred = np.array([model.micro_bytes(list(c)) for c in comps], dtype=np.float64)
    return pred / np.asarray(measured, dtype=np.float64) - 1.0


def _solve(comps: list[list[int]], y: np.ndarray, dense: bool) -> np.ndarray:
    X = np.array([micro_features(c, dense=dense) for c in comps], dtype=np.float64)
    scale = np.where(X.max(axis=0) > 0, X.max(axis=0), 1.0)
    A = (X / scale) / y[:, None]
    x = nnls(A, np.ones_like(y)) / scale
    return x


def _predict(x: np.ndarray, comps: list[list[int]], dense: bool) -> np.ndarray:
    return np.array([x @ micro_features(c, dense=dense) for c in comps], dtype=np.float64)


def _two_phases(comps: list[list[int]], y: np.ndarray, dense: bool) -> tuple[float, np.ndarray, np.ndarray] | None:
    """(worst relative error, A, B) of the max-affine fit max(A, B), A linear (see the module note):
    every split of the rows by attention share as a start, then the fixed point from each."""
    X = np.array([micro_features(c, dense=dense) for c in comps], dtype=np.float64)
    share = (X[:, 1] + X[:, 2]) / X[:, 0]
    rank = np.argsort(np.argsort(share, kind="stable"), kind="stable")
    best = None
    for cut in range(2, len(comps) - 2):
        in_b = rank >= cut
        for _ in range(30):
            if in_b.sum() < 3 or (~in_b).sum() < 2:
                break
            a = np.zeros(4)
            a[[0, 3]] = _solve_cols([comps[i] for i in np.flatnonzero(~in_b)], y[~in_b], dense, [0, 3])
            pa = X @ a
            err, b = min(((float(np.max(np.abs(np.maximum(pa, X @ bb) / y - 1.0))), bb)
                          for bb in _supports(X[in_b], y[in_b])), key=lambda eb: eb[0])
            pb = X @ b
            if a[0] > 0 and (best is None or err < best[0]):
                best = (err, a, b)
            nxt = pb > pa
            if np.array_equal(nxt, in_b):
                break
            in_b = nxt
    return best


def _supports(X: np.ndarray, y: np.ndarray) -> list[np.ndarray]:
    """The nonnegative relative least-squares fit of every support of the columns: a phase fitted
    on few distinct totals has many exact fits, and the one that suits the OTHER rows is chosen
    by the caller (the worst error of the max)."""
    out = []
    scale = np.where(X.max(axis=0) > 0, X.max(axis=0), 1.0)
    A = (X / scale) / y[:, None]
    for size in range(1, X.shape[1] + 1):
        for cols in combinations(range(X.shape[1]), size):
            xs, *_ = np.linalg.lstsq(A[:, list(cols)], np.ones_like(y), rcond=None)
            if np.all(xs >= 0):
                x = np.zeros(X.shape[1])
                x[list(cols)] = xs / scale[list(cols)]
                out.append(x)
    return out or [np.zeros(X.shape[1])]


def _solve_cols(comps: list[list[int]], y: np.ndarray, dense: bool, cols: list[int]) -> np.ndarray:
    X = np.array([micro_features(c, dense=dense) for c in comps], dtype=np.float64)[:, cols]
    scale = np.where(X.max(axis=0) > 0, X.max(axis=0), 1.0)
    return nnls((X / scale) / y[:, None], np.ones_like(y)) / scale


def fit_memory(comps: Sequence[Sequence[int]], measured: Sequence[float], *, min_tokens: int = 0,
               packed: bool | None = None, note: str = "") -> MemoryFit:
    """Fit a :class:`MemoryModel` to micro-batches (sample lengths) and their measured peak bytes."""
    rows = [[int(x) for x in c] for c in comps]
    y_all = np.asarray(measured, dtype=np.float64)
    if len(rows) != y_all.size or not np.all(np.isfinite(y_all)) or np.any(y_all <= 0):
        raise PlanError("fit_memory needs one positive, finite peak (bytes) per micro-batch; got "
                        f"{len(rows)} micro-batches and {y_all.size} peaks.")
    big = np.array([sum(c) >= min_tokens for c in rows])
    small = ~big
    fit_rows = [c for c, b in zip(rows, big) if b]
    y = y_all[big]
    if len(fit_rows) < 4:
        raise PlanError(f"fit_memory: {len(fit_rows)} micro-batch(es) of at least {min_tokens} tokens; measure at "
                        "least 4 of different totals and sample counts (profile_memory's design measures ~18).")
    has_pack = any(len(c) >= 2 for c in fit_rows)
    has_lone = any(len(c) == 1 for c in fit_rows)
    options = [False] if packed is False or not (has_pack and has_lone) else ([True] if packed else [False, True])
    best: tuple[float, bool, np.ndarray] | None = None
    for dense in options:
        x = _solve(fit_rows, y, dense)
        if x[0] <= 0:
            continue
        m = MemoryModel(per_token=x[0], per_sample_sq=x[1], per_row_sq=x[2], per_micro=x[3])
        err = float(np.max(np.abs(relative_errors(m, fit_rows, y))))
        if best is None or err < best[0] * (1 - 1e-9):
            best = (err, dense, x)
    if best is None:
        raise PlanError("fit_memory: the measured peaks do not grow with tokens (no positive bytes per token); "
                        "measure micro-batches of very different totals (C/8 .. C) with run_micro doing the "
                        "forward and backward of your model.")
    err, dense, x = best
    floor = float(y_all[small].max()) if small.any() else 0.0
    model = MemoryModel(per_token=x[0], per_sample_sq=x[1], per_row_sq=x[2] if dense else 0.0, per_micro=x[3],
                        floor=floor, note=note)
    if err > 0.02:  # a second phase (module note, 3)
        two = [(d, _two_phases(fit_rows, y, d)) for d in options]
        two = [(d, t) for d, t in two if t is not None and t[2][:3].any()]
        if two:
            d, (err2, a, b) = min(two, key=lambda dt: dt[1][0])
            if err2 < 0.7 * err:
                model = MemoryModel(per_token=a[0], per_micro=a[3], floor=floor, note=note,
                                    phase2=MemoryModel(per_token=b[0], per_sample_sq=b[1],
                                                       per_row_sq=b[2] if d else 0.0, per_micro=b[3]))
    rel = relative_errors(model, fit_rows, y)
    ph = model.phases()
    regime = "packed" if model.dense else ("varlen" if any(p.per_sample_sq > 0 for p in ph) else "linear")
    return MemoryFit(model=model, regime=regime, max_relative_error=float(np.max(np.abs(rel))),
                     under=float(max(0.0, -float(np.min(rel / (1.0 + rel))))))

