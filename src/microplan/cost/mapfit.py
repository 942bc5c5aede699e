"""The meter's MAP fit of one kernel regime, and the numbers that compare and qualify fits.

Design note. ``map_fit`` solves seconds ≈ θ·x, θ >= 0, with a Gaussian prior per coefficient
(relative widths: linear ±30 %, per_micro and attention ±100 %, and a floor so a zero prior can
still explain ~5 % of a typical record) as one augmented nonnegative least-squares problem
(``calibrate.nnls``, exact); it returns the posterior covariance (Gaussian, ignoring θ >= 0), the
terms the records leave at the prior (posterior variance > half the prior's), the data residual
and the prior penalty. ``evidence`` compares two regimes' fits (log-likelihood ratio of their MAP
objectives), ``ratio_sd`` gives the relative sd of attention/linear (delta method), ``rescale``
the one factor that best explains the records by a prior's predictions. Used by
``cost/meter.py``; pure numpy.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .calibrate import nnls

__all__ = ["Fit", "TERMS", "map_fit", "evidence", "ratio_sd", "rescale"]

_REL_WIDTH = np.array([0.3, 1.0, 1.0, 1.0])   # prior width, relative to the prior coefficient
_FLOOR = 0.05                                  # a zero prior may still explain 5 % of a typical record
_ATTN_WIDTH = 1.0                              # each attention term: ±100 %
_PRIOR_SHARE = 0.5                             # a term whose posterior variance is > 50 % of its prior's: "from the prior"
TERMS = ("linear", "quadratic", "packed_quadratic", "per_micro")


class Fit(NamedTuple):
    """One regime's MAP fit."""

    theta: np.ndarray            # the coefficients (TERMS order), in units of a typical record
    residual: float              # its weighted data residual (sum of squares)
    held: tuple[str, ...]        # terms the records leave at the prior
    std: np.ndarray              # posterior standard deviation of each coefficient (0 where not free)
    cov: np.ndarray              # posterior covariance [4, 4] (0 where not free)
    penalty: float = 0.0         # its prior penalty (sum of squares): residual + penalty = the MAP objective


def rescale(base: np.ndarray, y: np.ndarray, w: np.ndarray) -> float:
    """The one factor that best explains the records ``y`` by the prior's predictions ``base`` (weighted)."""
    den = float(np.sum(w * w * base * base))
    return float(np.sum(w * w * base * y) / den) if den > 0 else 1.0


def evidence(var: Fit, den: Fit, m: int) -> float:
    """log-likelihood ratio (nats) of the dense regime over the varlen one: half the difference of
    their MAP objectives (data residual + prior penalty), in units of the noise the records show
    when that is above the assumed noise (never sharper than assumed); 0 when either fit failed."""
    jv, jd = var.residual + var.penalty, den.residual + den.penalty
    if not (np.isfinite(jv) and np.isfinite(jd)):
        return 0.0
    dof = m - 4
    seen2 = max(min(var.residual, den.residual) / dof, 1.0) if dof >= 3 else 1.0
    return float((jv - jd) / (2.0 * seen2))


def ratio_sd(fit: Fit, a: int, seen: float) -> float | None:
    """Relative posterior sd of attention / linear (what balancing depends on: per_micro and linear
    trade off on micro-batches near the cap, and that error moves the ratio too), by the delta
    method on the posterior covariance, scaled by the noise the records show; None when undefined."""
    th, C = fit.theta, fit.cov
    if th[a] <= 0 or th[0] <= 0 or not np.all(np.isfinite(C[np.ix_((0, a), (0, a))])):
        return None
    var = C[a, a] / th[a] ** 2 + C[0, 0] / th[0] ** 2 - 2.0 * C[0, a] / (th[0] * th[a])
    return float(np.sqrt(max(var, 0.0)) * seen)


def map_fit(X: np.ndarray, y: np.ndarray, w: np.ndarray, mu: np.ndarray, free: tuple[int, ...]) -> Fit:
    """MAP fit over the coefficients ``free`` (others 0), its weighted data residual, the terms
    the records leave at the prior (posterior variance > ``_PRIOR_SHARE`` of the prior's) and the
    posterior standard deviations (Gaussian, ignoring θ >= 0)."""
    typical = np.maximum(np.median(X, axis=0), X.mean(axis=0))
    with np.errstate(divide="ignore"):
        floor = np.where(typical > 0, _FLOOR * float(np.median(y)) / typical, 0.0)  # 0: no data on that term
    attn = max(mu[1], mu[2])
    tau = np.maximum(_REL_WIDTH * mu, floor)
    tau[1] = max(_ATTN_WIDTH * attn, float(floor[1]))
    tau[2] = max(_ATTN_WIDTH * attn, float(floor[2]))
    tau = np.where((tau > 0) & np.isfinite(tau), tau, np.maximum(np.abs(mu), 1.0))
    cols = list(free)
    rows = [X[:, cols] * w[:, None]]
    rhs = [y * w]
    for k, j in enumerate(cols):
        e = np.zeros(len(cols))
        e[k] = 1.0 / tau[j]
        rows.append(e[None])
        rhs.append(np.array([mu[j] / tau[j]]))
    A = np.vstack(rows)
    b = np.concatenate(rhs)
    norms = np.linalg.norm(A, axis=0)
    An = A / norms
    sol = nnls(An, b) / norms
    theta = np.zeros(4)
    theta[cols] = sol
    r = (X @ theta - y) * w
    pen = float(sum(((theta[j] - mu[j]) / tau[j]) ** 2 for j in cols))
    # posterior variance of each term (Gaussian, ignoring θ >= 0) against its prior variance τ²
    sub = np.linalg.pinv(An.T @ An) / np.outer(norms, norms)
    post = np.diag(sub)
    share = post / np.array([tau[j] for j in cols]) ** 2
    held = tuple(TERMS[j] for j, f in zip(cols, share) if f > _PRIOR_SHARE)
    std = np.zeros(4)
    std[cols] = np.sqrt(np.maximum(post, 0.0))
    cov = np.zeros((4, 4))
    cov[np.ix_(cols, cols)] = sub
    return Fit(theta, float(r @ r), held, std, cov, pen)
