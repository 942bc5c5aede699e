"""``CostMeter``: learn the cost model online from the micro-batches the trainer actually runs.

Design note. Each record is one micro-batch run on one rank: its four features
x = [Σ L, Σ L², T², 1] (token terms ÷ the CP degree: a GPU of a c-wide group does 1/c of the
work) and the measured seconds y. :meth:`CostMeter.cost` returns the model to plan the next
step with — a maximum a posteriori fit of seconds ≈ θ·x, θ >= 0:

1. Scale. The prior (``from_hf_config`` in FLOPs, a profile in seconds, or none = tokens) is
   rescaled by the one factor s that best explains the records (relative least squares):
   one timed micro-batch already turns FLOPs into seconds.
2. Prior. θ ~ N(s·θ₀, τ²) per coefficient with relative widths (linear ±30 %, per_micro
   ±100 %, each attention term ±200 % of the prior's attention), a floor so a zero prior coefficient can still grow to explain ~5 % of a typical
   record, and one coupled direction: the attention of a *single* sample (quadratic +
   packed_quadratic, since a lone sample has T = L) keeps the prior's FLOP count within ±100 %,
   while the split between per-sample (varlen) and packed-row (dense kernel) attention is free.
   This is what keeps the fit sane on the nearly collinear rows a balanced plan produces
   (every micro-batch near the cap): directions the records do not identify stay at the prior.
3. Likelihood. Records weigh 1/(σ·y) (relative timing noise σ, default 5 %) times an
   exponential decay by age (``half_life`` records), over a bounded window of the last
   ``window`` records — memory is O(window) whatever the run length.
4. Solve the augmented nonnegative least squares exactly (``calibrate.nnls``).

Drift: every record is also scored against the model the meter last handed out (the one the
planner used), so :meth:`CostMeter.report` shows predicted-vs-measured error over the recent
window — a rising error means the machine changed (another job, thermal throttling, a new
sequence-length regime).

Trade-off (``tests/test_meter.py``): from one step of near-identical micro-batches a plain fit
misses quadratic/linear by up to 2.3x; the MAP fit stays within the prior's band there and
converges to the truth once records vary (3 steps of a long-tailed family at dp 8: < 5 %).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._checks import float_field, int_field
from ..errors import PlanError
from .calibrate import nnls
from .models import CostModel, FlopsCost, TokenCost

__all__ = ["CostMeter", "MeterReport"]

_REL_WIDTH = np.array([0.3, 1.0, 1.0, 1.0])   # prior width, relative to the prior coefficient
_FLOOR = 0.05                                  # a zero prior may still explain 5 % of a typical record
_ATTN_WIDTH = 1.0                              # single-sample attention (q + q_packed): ±100 %
_SPLIT_WIDTH = 2.0                             # q alone: ±200 % of that attention
_PACKED_WIDTH = 0.5                            # q_packed alone: ±50 % (a dense kernel must show in the data)


@dataclass(frozen=True, kw_only=True)
class MeterReport:
    """What the meter knows and how well the model it handed out predicted the machine.

    Attributes:
        num_records: records ever made; window_records: records in the window now.
        cost: the current fit (what :meth:`CostMeter.cost` returns).
        recent_median_error / recent_max_error: ``|predicted/measured - 1|`` of the records made
            since the meter last handed out a model, predicted by that model (None before the
            first ``cost()`` call or when no record followed it).
        fit_median_error: the same for the current fit, in-sample over the window.
        scale: seconds per prior unit (e.g. per FLOP) the records imply.
    """

    num_records: int
    window_records: int
    cost: CostModel
    recent_median_error: float | None
    recent_max_error: float | None
    fit_median_error: float | None
    scale: float | None

    def __str__(self) -> str:
        rec = "n/a" if self.recent_median_error is None else \
            f"{self.recent_median_error:.1%} median, {self.recent_max_error:.1%} worst"
        fit = "n/a" if self.fit_median_error is None else f"{self.fit_median_error:.1%}"
        return (f"CostMeter: {self.num_records} records ({self.window_records} in window); planned-model error "
                f"{rec}; refit error {fit}; {getattr(self.cost, 'describe', lambda: repr(self.cost))()}")


def _prior_coefficients(prior: CostModel | None) -> np.ndarray:
    if prior is None:
        return np.array([1.0, 0.0, 0.0, 0.0])
    if isinstance(prior, (FlopsCost, TokenCost)):
        return prior.coefficients()
    try:
        return np.array([float(getattr(prior, a, 0.0)) for a in
                         ("linear", "quadratic", "packed_quadratic", "per_micro")])
    except (TypeError, ValueError):  # pragma: no cover - defensive
        raise PlanError(f"CostMeter(prior={prior!r}) needs a TokenCost or FlopsCost (or a model with linear, "
                        "quadratic, packed_quadratic and per_micro attributes).") from None


class CostMeter:
    """Online cost model: record micro-batch timings, plan the next step with :meth:`cost` (binding).

    Args:
        prior: the model to start from and to fall back on where the records are silent:
            ``FlopsCost.from_hf_config(...)`` (FLOPs; rescaled to seconds from the first record),
            a profile (``microplan.torch.profile_cost(...).cost``), or None (cost = tokens).
        noise: relative timing noise of one record (default 0.05 = 5 %).
        window: records kept (the oldest are forgotten first).
        half_life: records after which an old record weighs half as much (None: no decay).

    Usage, once per step on every rank (or on the driver, with every rank's timings)::

        meter = CostMeter(prior=FlopsCost.from_hf_config(cfg))
        for step in training:
            plan = mp.plan(batch, replace(config, cost=meter.cost()))
            for micro in plan.rank(rank)[0]:
                seconds = run_and_time(micro)          # the rank's compute, not its wait
                meter.record(micro, seconds)           # gather all ranks' records for one model
    """

    def __init__(self, prior: CostModel | None = None, *, noise: float = 0.05, window: int = 4096,
                 half_life: int | None = 2048) -> None:
        if prior is not None and not isinstance(prior, CostModel):
            raise PlanError(f"CostMeter(prior={prior!r}) must be a cost model (FlopsCost.from_hf_config(...), a "
                            "profile's .cost) or None.")
        self.prior = prior
        self.noise = float_field("CostMeter(noise)", noise, positive=True)
        self.window = int_field("CostMeter(window)", window, minimum=8)
        self.half_life = None if half_life is None else int_field("CostMeter(half_life)", half_life, minimum=1)
        self._theta0 = _prior_coefficients(prior)
        if not np.all(np.isfinite(self._theta0)) or self._theta0[:3].sum() <= 0:
            raise PlanError("CostMeter prior has no positive token term; pass a model whose linear, quadratic or "
                            "packed_quadratic is > 0.")
        self._x: deque[np.ndarray] = deque(maxlen=self.window)
        self._y: deque[float] = deque(maxlen=self.window)
        self._recent: list[float] = []       # errors of records since the last cost() call
        self._last_recent: list[float] = []  # ... of the interval before (kept for report())
        self._issued: FlopsCost | None = None
        self._fit: CostModel | None = None
        self._scale: float | None = None
        self.num_records = 0

    # -- recording ------------------------------------------------------------------------------
    def record(self, seq_lens: Any, seconds: float, *, cp_size: int | None = None) -> None:
        """Add one micro-batch run on one rank: its samples' lengths (or a ``Micro``) and its seconds.

        A placeholder (no sample) counts as one dummy token. ``cp_size``: the micro-batch's CP
        degree (read from a ``Micro``; default 1) — each GPU did 1/cp_size of the token work.
        """
        c = int(getattr(seq_lens, "cp_size", 1)) if cp_size is None else int_field("cp_size", cp_size, minimum=1)
        raw = getattr(seq_lens, "seq_lens", seq_lens)
        try:
            L = np.asarray(raw, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            raise PlanError(f"CostMeter.record needs the micro-batch's sample lengths (or its Micro), got "
                            f"{type(seq_lens).__name__}.") from None
        if L.size == 0:
            L = np.ones(1)
        if not np.all(np.isfinite(L)) or L.min() < 1:
            raise PlanError("CostMeter.record: sample lengths must be finite and >= 1.")
        s = float_field("CostMeter.record(seconds)", seconds, positive=True)
        T = float(L.sum())
        x = np.array([T / c, float((L * L).sum()) / c, T * T / c, 1.0])
        if self._issued is not None:
            self._recent.append(abs(float(self._issued.coefficients() @ x) / s - 1.0))
        self._x.append(x)
        self._y.append(s)
        self._fit = None
        self.num_records += 1

    def record_step(self, micros: Sequence[Any], seconds: Sequence[float]) -> None:
        """Record several micro-batches at once (e.g. ``plan.rank(r)[s]`` and their timings)."""
        if len(micros) != len(seconds):
            raise PlanError(f"record_step got {len(micros)} micro-batches but {len(seconds)} timings.")
        for m, t in zip(micros, seconds):
            self.record(m, t)

    # -- the model ---------------------------------------------------------------------------
    def cost(self) -> CostModel:
        """The cost model to plan the next step with (the prior until a record arrives)."""
        fit = self._current()
        if isinstance(fit, FlopsCost):
            self._issued = fit
        self._last_recent, self._recent = self._recent, []
        return fit

    def report(self) -> MeterReport:
        """Drift and fit quality over the window (see :class:`MeterReport`)."""
        fit = self._current()
        errs = self._recent or self._last_recent
        fit_err = None
        if self._y and isinstance(fit, FlopsCost):
            X, y = np.array(self._x), np.array(self._y)
            fit_err = float(np.median(np.abs(X @ fit.coefficients() / y - 1.0)))
        return MeterReport(num_records=self.num_records, window_records=len(self._y), cost=fit,
                           recent_median_error=float(np.median(errs)) if errs else None,
                           recent_max_error=float(np.max(errs)) if errs else None,
                           fit_median_error=fit_err, scale=self._scale)

    def _current(self) -> CostModel:
        if not self._y:
            return self.prior if self.prior is not None else TokenCost()
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> FlopsCost:
        X, y = np.array(self._x), np.array(self._y)
        m = y.size
        age = np.arange(m - 1, -1, -1, dtype=np.float64)
        decay = np.ones(m) if self.half_life is None else 0.5 ** (age / self.half_life)
        w = np.sqrt(decay) / (self.noise * y)
        base = X @ self._theta0
        s = float(np.sum(w * w * base * y) / np.sum(w * w * base * base))
        self._scale = s
        mu = s * self._theta0
        typical = np.median(X, axis=0)
        yt = float(np.median(y))
        floor = _FLOOR * yt / np.maximum(typical, 1e-300)
        tau = np.maximum(_REL_WIDTH * mu, floor)
        mu_u = mu[1] + mu[2]  # a lone sample's attention: quadratic + packed_quadratic (T = L)
        # the varlen/packed split moves only where the records show it: each term ±(width·attention)
        tau[1] = max(_SPLIT_WIDTH * mu_u, float(floor[1]))
        tau[2] = max(_PACKED_WIDTH * mu_u, float(floor[2]))
        rows = [X * w[:, None]]
        rhs = [y * w]
        eye = np.eye(4)
        for j in range(4):
            rows.append(eye[j][None] / tau[j])
            rhs.append(np.array([mu[j] / tau[j]]))
        u = np.array([0.0, 1.0, 1.0, 0.0])
        tau_u = max(_ATTN_WIDTH * mu_u, float(floor[1]))
        rows.append(u[None] / tau_u)
        rhs.append(np.array([mu_u / tau_u]))
        A = np.vstack(rows)
        b = np.concatenate(rhs)
        norms = np.linalg.norm(A, axis=0)
        theta = nnls(A / norms, b) / norms
        if theta[:3].sum() <= 0 or not np.all(np.isfinite(theta)):
            theta = mu
        return FlopsCost(linear=float(theta[0]), quadratic=float(theta[1]), packed_quadratic=float(theta[2]),
                         per_micro=float(theta[3]))

    def __repr__(self) -> str:
        return f"CostMeter(records={self.num_records}, window={len(self._y)}/{self.window}, prior={self.prior!r})"

