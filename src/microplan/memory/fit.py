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
3. ``regime``: ``"packed"`` (a packed-row T² term), ``"varlen"`` (Σ L²), ``"linear"`` (neither).

Guarantees: coefficients >= 0, ``per_token`` > 0 (a fit in which bytes do not grow with tokens
is a PlanError naming the rows to measure instead).
"""

from __future__ import annotations

from collections.abc import Sequence
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
    rel = relative_errors(model, fit_rows, y)
    regime = "packed" if model.per_row_sq > 0 else ("varlen" if model.per_sample_sq > 0 else "linear")
    return MemoryFit(model=model, regime=regime, max_relative_error=float(np.max(np.abs(rel))),
                     under=float(max(0.0, -float(np.min(rel / (1.0 + rel))))))

