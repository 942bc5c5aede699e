"""``CostMeter``: learn the cost model online from the micro-batches the trainer actually runs.

Design note. Each record is one micro-batch run on one rank: its four features
x = [Σ L, Σ L², T²·[n ≥ 2], 1] (token terms ÷ the CP degree: a GPU of a c-wide group does 1/c of the
work) and the measured seconds y. :meth:`CostMeter.cost` returns the model to plan the next
step with — a maximum a posteriori fit of seconds ≈ θ·x, θ >= 0:

1. Scale. The prior (``from_hf_config`` in FLOPs, a profile in seconds, or none = tokens) is
   rescaled by the one factor s that best explains the records (relative least squares), per
   regime (under that regime's features): one timed micro-batch already turns FLOPs into seconds.
2. Prior. θ ~ N(s·θ₀, τ²) per coefficient with relative widths (linear ±30 %, per_micro and
   attention ±100 %), and a floor so a zero prior coefficient can still grow to explain ~5 % of a
   typical record. This is what keeps the fit sane on the nearly collinear rows a balanced plan
   produces (every micro-batch near the cap): directions the records do not identify stay at the
   prior.
3. Regime. Both kernel regimes of ``microplan.cost.models`` are fitted — varlen (Σ L² for every
   micro-batch) and dense (T² for packs of two or more samples, L² for a lone sample). The
   evidence is the log-likelihood ratio of the two MAP fits (half the difference of their
   objectives, residual + prior penalty, in units of the noise the records show when that is
   above the assumed one): at least ``EVIDENCE`` (3 nats) either way decides. Short of that the
   regime last decided at a ``cost()`` call is kept (records of one-sample micro-batches price
   alike in both), else the prior's unless the other explains the records 5 % better.
4. Likelihood. Records weigh 1/(σ·y) (relative timing noise σ, default 5 %) times an
   exponential decay by age (``half_life`` records), over a bounded window of the last
   ``window`` records — memory is O(window) whatever the run length.
5. Solve the augmented nonnegative least squares exactly (``calibrate.nnls``), in units of a
   typical record (any magnitude a float holds fits; a record more than ``MAX_SPREAD`` away from
   the window's typical one is refused at ``record``; degenerate records keep the prior).
6. Identifiability. A term whose posterior variance is still more than half its prior's is
   named in ``MeterReport.prior_terms``: the records do not identify it, it stays at the prior.
   ``MeterReport.attention_rel_std`` is the posterior sd of attention / linear (relative, delta
   method on the posterior covariance, scaled to the noise the records show): what balancing
   still has to guess. With ``hedge=True`` (default)
   the model handed out carries it as ``FlopsCost.attention_rel_sd`` (from ±2 %, at most ±50 %),
   and the planner balances for every machine within ±1 sd (``microplan.stages.hedge``).

Exploration (``cost/explore.py``). Records of micro-batches that all hold ~the cap's tokens leave
the regime open (T² is a constant over them). While the evidence is short of ``EVIDENCE``, the
attention term sits at its prior, or attention/linear is known worse than ``EXPLORE_SD``,
:meth:`CostMeter.explore_config` plans warm-up steps 2 .. ``explore_steps`` at a lower cap (a
probe) whose extra lockstep time is at most ``explore_budget`` under each regime's fit; the
report names the regime, its evidence, what is still unidentified and every probe's cost.

CP. A record of a micro-batch split over c > 1 GPUs (``cp_size``) is fitted separately: when the
window also holds unsplit records, the base model is fitted on those alone and the CP term
(:class:`CPCost`: K/V communication, overlap, split efficiency and overhead) on the split ones
against it (``cost/cpfit.py``); with too few split records, or none unsplit (then the base fit
takes the split records at 1/c of their token work), the CP term is the prior's,
rescaled to seconds, and :meth:`CostMeter.report` says so.

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
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .._checks import float_field, int_field
from ..errors import PlanError
from .cp import cp_micro_costs
from .cpfit import fit_cp
from .explore import DEFAULT_EXPLORE_BUDGET, Explorer, hypotheses_of
from .mapfit import TERMS, Fit, evidence, map_fit, ratio_sd, rescale
from .meter_report import MeterReport, errors
from .models import CostModel, FlopsCost, TokenCost, micro_features

if TYPE_CHECKING:
    from ..batch import Batch
    from ..config import PlanConfig

__all__ = ["CostMeter", "MeterReport", "EVIDENCE", "EXPLORE_SD"]

_REGIME_MARGIN = 0.05                          # the other regime must explain the records 5 % better
EVIDENCE = 3.0                                 # |log-likelihood ratio| of the regimes (nats) that decides them
EXPLORE_SD = 0.1                               # explore while attention/linear is known worse than ±10 %
HEDGE_MIN_SD = 0.02                            # hedge (attention_rel_sd) only when attention is known worse than ±2 %
HEDGE_MAX_SD = 0.5                             # ... and never over more than ±50 %
MAX_SPREAD = 1e9                               # record(): refuse a timing this far from the window's typical one


def _predict(cost: FlopsCost, x: np.ndarray, c: int) -> float:
    """A record's predicted seconds (``x``: its varlen and dense features at 1/c of the token work)."""
    f = x[4:] if cost.dense else x[:4]
    per = float(cost.coefficients() @ f)
    if c == 1 or cost.cp is None:
        return per
    whole = (per - cost.per_micro) * c + cost.per_micro
    return float(cp_micro_costs(cost, whole, f[0] * c, c))


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
        hedge: hand the planner the attention term's uncertainty (``FlopsCost.attention_rel_sd``,
            the posterior sd when it is at least ``HEDGE_MIN_SD``), so it balances for every
            machine within ±1 sd (``microplan.stages.hedge``). False: plan on the point estimate.
        explore_steps: :meth:`explore_config` may probe in steps 2 .. ``explore_steps`` of those
            planned through it (default 3: the warm-up); 0 never probes.
        explore_budget: the most a probe may add to a step's predicted lockstep time, under each
            regime's fit (default 0.02 = 2 %; ``microplan.cost.explore``).

    Usage, once per step on every rank (or on the driver, with every rank's timings)::

        meter = CostMeter(prior=FlopsCost.from_hf_config(cfg))
        for step in training:
            plan = mp.plan(batch, meter.explore_config(config, batch))  # = replace(config, cost=meter.cost()),
                                                                        # a lower cap while it explores
            for micro in plan.rank(rank)[0]:
                seconds = run_and_time(micro)          # the rank's compute, not its wait
                meter.record(micro, seconds)           # gather all ranks' records for one model
    """

    def __init__(self, prior: CostModel | None = None, *, noise: float = 0.05, window: int = 4096,
                 half_life: int | None = 2048, hedge: bool = True, explore_steps: int = 3,
                 explore_budget: float = DEFAULT_EXPLORE_BUDGET) -> None:
        if prior is not None and not isinstance(prior, CostModel):
            raise PlanError(f"CostMeter(prior={prior!r}) must be a cost model (FlopsCost.from_hf_config(...), a "
                            "profile's .cost) or None.")
        self.prior = prior
        self.noise = float_field("CostMeter(noise)", noise, positive=True)
        self.window = int_field("CostMeter(window)", window, minimum=8)
        self.half_life = None if half_life is None else int_field("CostMeter(half_life)", half_life, minimum=1)
        if not isinstance(hedge, bool):
            raise PlanError(f"CostMeter(hedge={hedge!r}) must be True or False.")
        self.hedge = hedge
        explore_steps = int_field("CostMeter(explore_steps)", explore_steps, minimum=0)
        explore_budget = float_field("CostMeter(explore_budget)", explore_budget, minimum=0.0)
        if explore_budget >= 1.0:
            raise PlanError(f"CostMeter(explore_budget={explore_budget!r}) is the most a probe may add to a step's "
                            "time, as a fraction (0.02 = 2 %); pass a value below 1, or explore_steps=0 for none.")
        self._theta0 = _prior_coefficients(prior)
        if not np.all(np.isfinite(self._theta0)) or self._theta0[:3].sum() <= 0:
            raise PlanError("CostMeter prior has no positive token term; pass a model whose linear, quadratic or "
                            "packed_quadratic is > 0.")
        self._x: deque[np.ndarray] = deque(maxlen=self.window)
        self._y: deque[float] = deque(maxlen=self.window)
        self._c: deque[int] = deque(maxlen=self.window)     # each record's CP degree
        self._cp_note = ""
        self._recent: list[tuple[float, float]] = []       # (predicted, measured) since the last cost()
        self._last_recent: list[tuple[float, float]] = []  # ... of the interval before (kept for report())
        self._issued: FlopsCost | None = None
        self._issued_prior = False   # the issued model is the prior: its units may not be seconds
        self._last_prior = False
        self._fit: CostModel | None = None
        self._scale: float | None = None
        self._prior_terms: tuple[str, ...] = ()
        self._attn_std: float | None = None
        self._evidence = 0.0                               # log-likelihood ratio dense : varlen (nats)
        self._dense = False                                # the regime of the current fit
        self._decided: bool | None = None                  # dense? as last decided by the evidence, at a cost() call
        self._regime_fits: tuple[Fit, Fit] | None = None
        self._hypotheses: tuple[np.ndarray, ...] = ()      # (varlen, dense) MAP coefficients in seconds
        self._explorer = Explorer(budget=explore_budget, steps=explore_steps)
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
            L = np.ones(1)  # a placeholder runs one dummy token
        if not np.all(np.isfinite(L)) or L.min() < 1:
            raise PlanError("CostMeter.record: sample lengths must be finite and >= 1.")
        s = float_field("CostMeter.record(seconds)", seconds, positive=True)
        if self._y:
            typical = float(np.exp(np.median(np.log(np.asarray(self._y)))))
            if not typical / MAX_SPREAD <= s <= typical * MAX_SPREAD:
                raise PlanError(f"CostMeter.record(seconds={s!r}) is more than {MAX_SPREAD:g}x away from the "
                                f"{len(self._y)} records the meter holds (typically {typical:.4g}): no micro-batch "
                                "runs that much faster or slower; pass the micro-batch's wall-clock seconds in the "
                                "same unit as before (not a sentinel), or start a new CostMeter for another machine.")
        what = seq_lens if getattr(seq_lens, "tree", None) is not None else L  # a tree Micro: its trie's work
        per_gpu = np.array([1.0 / c, 1.0 / c, 1.0 / c, 1.0])                     # each GPU of a CP group
        x = micro_features(what) * per_gpu                                        # varlen features
        xd = micro_features(what, dense=True) * per_gpu                           # dense-kernel features
        if self._issued is not None:
            self._recent.append((_predict(self._issued, np.concatenate([x, xd]), c), s))
        self._x.append(np.concatenate([x, xd]))
        self._y.append(s)
        self._c.append(c)
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
        if self._y and abs(self._evidence) >= EVIDENCE:  # only here, so the state follows the records and the
            self._decided = self._dense                   # cost() calls (once per step on every rank), not report()
        self._last_recent, self._recent = self._recent, []
        self._last_prior, self._issued_prior = self._issued_prior, not self._y
        return fit

    def explore_config(self, config: PlanConfig, batch: Batch) -> PlanConfig:
        """The config to plan the next step with: ``replace(config, cost=self.cost())``, or — in a
        warm-up step while the records leave the kernel's regime or its attention term unidentified
        — that config with a lower ``max_tokens_per_micro`` (a *probe*, ``microplan.cost.explore``),
        whose extra predicted time is at most ``explore_budget`` of the step's under each regime's
        fit. ``report()`` lists the probes (``probes``) and why (``explore_reason``). Pure in the
        records and the calls: every rank calling it with the same records gets the same config."""
        if not hasattr(config, "max_tokens_per_micro") or not hasattr(config, "dp_size"):
            raise PlanError(f"CostMeter.explore_config(config={type(config).__name__}) needs a PlanConfig.")
        planned = replace(config, cost=self.cost())
        reason = self._explore_reason()
        return self._explorer.next_config(planned, batch, reason, hypotheses_of(self._hypotheses, planned.cost)
                                          if self._y else [])

    def _explore_reason(self) -> str:
        """What the records leave unidentified ("" when the regime and attention term are identified)."""
        if not self._y:
            return "no records yet"
        self._current()
        e = self._evidence
        if abs(e) < EVIDENCE:
            return (f"the records do not tell the varlen and dense kernels apart (log-likelihood ratio {e:+.1f}, "
                    f"decided at ±{EVIDENCE:g})")
        term = "packed_quadratic" if self._dense else "quadratic"
        if term in self._prior_terms:
            return f"the attention term ({term}) sits at its prior"
        if self._attn_std is None or self._attn_std > EXPLORE_SD:
            known = "not at all" if self._attn_std is None else f"to ±{self._attn_std:.0%}"
            return f"attention/linear is known {known} (explore above ±{EXPLORE_SD:.0%})"
        return ""

    def report(self) -> MeterReport:
        """Drift and fit quality over the window (see :class:`MeterReport`)."""
        fit = self._current()
        errs = errors(self._recent, self._issued_prior) if self._recent else \
            errors(self._last_recent, self._last_prior)
        fit_err = None
        if self._y and isinstance(fit, FlopsCost):
            pred = [_predict(fit, x, c) for x, c in zip(self._x, self._c)]
            fit_err = float(np.median(np.abs(np.array(pred) / np.array(self._y) - 1.0)))
        return MeterReport(num_records=self.num_records, window_records=len(self._y), cost=fit,
                           recent_median_error=float(np.median(errs)) if errs.size else None,
                           recent_max_error=float(np.max(errs)) if errs.size else None,
                           fit_median_error=fit_err, scale=self._scale,
                           prior_terms=self._prior_terms if self._y else (),
                           cp_note=self._cp_note if self._y else "",
                           attention_rel_std=self._attn_std if self._y else None,
                           regime=("dense" if self._dense else "varlen") if self._y else None,
                           regime_evidence=self._evidence if self._y else None,
                           explore_reason=self._explore_reason() if self._y else "",
                           probes=tuple(self._explorer.probes))

    def _current(self) -> CostModel:
        if not self._y:
            return self.prior if self.prior is not None else TokenCost()
        if self._fit is None:
            self._fit = self._solve()
        return self._fit

    def _solve(self) -> FlopsCost:
        XX, y = np.array(self._x), np.array(self._y)
        split = np.array(self._c) > 1
        if split.any() and not split.all():  # the base from unsplit records, the CP term from the split ones
            XX, y = XX[~split], y[~split]
        unit = float(np.median(y))  # solve in units of a typical record: seconds of any magnitude stay well scaled
        y = y / unit
        m = y.size
        age = np.arange(m - 1, -1, -1, dtype=np.float64)
        decay = np.ones(m) if self.half_life is None else 0.5 ** (age / self.half_life)
        w = np.sqrt(decay) / (self.noise * y)
        t0 = self._theta0
        prior_dense = t0[2] > 0
        # one prior per regime: the lone-sample attention is the same physical term in both; a dense
        # kernel computes every pair of a pack (twice the causal half) unless the prior says otherwise.
        # Each is rescaled by the one factor that best explains the records under its own features.
        var0 = np.array([t0[0], t0[1], 0.0, t0[3]])
        den0 = np.array([t0[0], t0[1], t0[2] if prior_dense else 2.0 * t0[1], t0[3]])
        s_var, s_den = (rescale(XX[:, :4] @ var0, y, w), rescale(XX[:, 4:] @ den0, y, w))
        s = s_den if prior_dense else s_var
        self._scale = s * unit
        mu_var, mu_den = s_var * var0, s_den * den0
        fit, use_dense = self._regimes(XX, y, w, mu_var, mu_den, prior_dense)
        self._dense = use_dense
        self._hypotheses = tuple(f.theta * unit for f in self._regime_fits)  # both regimes' fits, in seconds
        theta, held = fit.theta, fit.held
        a = 2 if use_dense else 1
        dof = m - (4 if use_dense else 3)  # the noise the records show, not the one assumed (``noise``)
        seen = float(np.sqrt(fit.residual / dof)) if dof >= 3 and np.isfinite(fit.residual) else 1.0
        self._attn_std = ratio_sd(fit, a, seen)
        if theta[:3].sum() <= 0 or not np.all(np.isfinite(theta)):
            theta, held, self._attn_std = (mu_den if use_dense else mu_var), tuple(TERMS), None
        self._prior_terms = tuple(t for t in held if use_dense or t != "packed_quadratic")
        theta = theta * unit
        sd = self._attn_std if self.hedge and self._attn_std is not None and self._attn_std >= HEDGE_MIN_SD else 0.0
        base = FlopsCost(linear=float(theta[0]), quadratic=float(theta[1]), packed_quadratic=float(theta[2]),
                         per_micro=float(theta[3]), attention_rel_sd=min(sd, HEDGE_MAX_SD))
        return self._with_cp(base)

    def _with_cp(self, base: FlopsCost) -> FlopsCost:
        """``base`` with the CP term: fitted on the split records, or the prior's in seconds."""
        pc = getattr(self.prior, "cp", None)
        s = self._scale  # the prior's CP term in seconds: every cost-unit field rescaled like the base
        prior = None if pc is None else replace(
            pc, comm_per_token=pc.comm_per_token * s, split_overhead=pc.split_overhead * s,
            cross_node_comm_per_token=None if pc.cross_node_comm_per_token is None else pc.cross_node_comm_per_token * s)
        c = np.array(self._c)
        split = c > 1
        if not split.any():
            self._cp_note = "" if prior is None else "CP term from the prior (no split micro-batch timed)"
            return FlopsCost(linear=base.linear, quadratic=base.quadratic, per_micro=base.per_micro,
                             packed_quadratic=base.packed_quadratic, cp=prior, attention_rel_sd=base.attention_rel_sd)
        X = np.array(self._x)[split]
        X = X[:, 4:] if base.dense else X[:, :4]
        whole = X * np.array([1.0, 1.0, 1.0, 0.0]) * c[split][:, None]   # undo the 1/c of the features
        mc = whole @ base.coefficients() + base.per_micro
        tokens = X[:, 0] * c[split]
        if split.all():  # nothing unsplit: the base fit took the split records (at 1/c of their work)
            self._cp_note = ("CP term from the prior: every timed micro-batch was split, so the split's cost cannot be "
                             "told from the base cost (time some unsplit micro-batches)" if prior is not None else "")
            cp = prior
        else:
            got = fit_cp(mc, tokens, c[split], np.array(self._y)[split], base.per_micro, prior)
            cp, self._cp_note = got.cp, got.note
        return FlopsCost(linear=base.linear, quadratic=base.quadratic, per_micro=base.per_micro,
                         packed_quadratic=base.packed_quadratic, cp=cp, attention_rel_sd=base.attention_rel_sd)

    def _regimes(self, XX: np.ndarray, y: np.ndarray, w: np.ndarray, mu_var: np.ndarray, mu_den: np.ndarray,
                 prior_dense: bool) -> tuple[Fit, bool]:
        """Both regimes' MAP fits and the one kept, with whether it is the dense one."""
        try:
            fits = [map_fit(XX[:, :4], y, w, mu_var, free=(0, 1, 3)),
                    map_fit(XX[:, 4:], y, w, mu_den, free=(0, 1, 2, 3))]
        except (np.linalg.LinAlgError, ValueError, FloatingPointError):  # degenerate records: keep the prior
            nan = np.full(4, np.nan)
            fits = [Fit(mu_var, np.inf, TERMS, nan, np.full((4, 4), np.nan)),
                    Fit(mu_den, np.inf, TERMS, nan, np.full((4, 4), np.nan))]
        var, den = fits
        self._evidence = evidence(var, den, y.size)
        self._regime_fits = (var, den)
        # the dense regime only when the records say so clearly (and it keeps a packed term): decisive
        # evidence either way, else the prior's regime unless the other explains the records 5 % better
        if abs(self._evidence) >= EVIDENCE:
            use_dense = bool(self._evidence > 0 and den.theta[2] > 0)
        elif self._decided is not None:  # records that cannot tell (e.g. one sample per micro-batch) keep the
            use_dense = bool(self._decided and den.theta[2] > 0)   # regime last decided when a model was handed out
        elif prior_dense:
            use_dense = bool(not (var.residual < den.residual * (1 - _REGIME_MARGIN)) and den.theta[2] > 0)
        else:
            use_dense = bool(den.residual < var.residual * (1 - _REGIME_MARGIN) and den.theta[2] > 0)
        return (den, True) if use_dense else (var, False)

    def __repr__(self) -> str:
        return f"CostMeter(records={self.num_records}, window={len(self._y)}/{self.window}, prior={self.prior!r})"

