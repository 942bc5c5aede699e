"""``MeterReport``: what a :class:`~microplan.CostMeter` knows, how well its model predicted, what it explored."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .explore import Probe
from .models import CostModel

__all__ = ["MeterReport", "errors"]


@dataclass(frozen=True, kw_only=True)
class MeterReport:
    """What the meter knows and how well the model it handed out predicted the machine.

    Attributes:
        num_records: records ever made; window_records: records in the window now.
        cost: the current fit (what :meth:`CostMeter.cost` returns).
        recent_median_error / recent_max_error: ``|predicted/measured - 1|`` of the records made
            since the meter last handed out a model, predicted by that model (None before the
            first ``cost()`` call or when no record followed it). While that model is still the
            prior (no record had arrived), it may be in other units (FLOPs), so its predictions
            are first rescaled by the one factor that fits those records best (median ratio):
            the error of its *shape*.
        fit_median_error: the same for the current fit, in-sample over the window.
        scale: seconds per prior unit (e.g. per FLOP) the records imply.
        prior_terms: the fit's terms the records do not identify — their posterior variance is
            still more than half the prior's (e.g. ``per_micro`` when every micro-batch holds about
            the same tokens, so it cannot be told from ``linear``) — left at the (rescaled) prior.
        cp_note: how the CP term was obtained (fitted on how many split micro-batches, which of
            its terms the records leave at the prior, or why it is the prior's); "" without one.
        regime: ``"varlen"`` or ``"dense"``: the kernel regime of the current fit (None before any record).
        regime_evidence: log-likelihood ratio (nats) of the dense regime over the varlen one on the
            window's records (positive: dense); at least ``EVIDENCE`` either way decides the regime.
        explore_reason: what the records still leave unidentified ("" once the regime and the
            attention term are identified): while it is set, ``explore_config`` probes in warm-up.
        probes: the warm-up steps :meth:`CostMeter.explore_config` planned at a lower cap, each with
            its cap and predicted cost (:class:`microplan.cost.explore.Probe`);
            ``exploration_seconds`` is their sum.
        attention_rel_std: the posterior standard deviation of the fit's attention-to-linear ratio
            (``quadratic``, or ``packed_quadratic`` for a dense kernel, over ``linear``; their
            covariance included: near the cap ``per_micro`` trades off against ``linear``), relative
            to its value, scaled to the noise the records show — how well the records pin the ratio
            that balancing depends on (None before any record). At 5 % timing noise, three warm-up
            steps leave it at ~5-15 %; ``cost()`` hands it to the planner, which hedges against it
            (``FlopsCost.attention_rel_sd``).
    """

    num_records: int
    window_records: int
    cost: CostModel
    recent_median_error: float | None
    recent_max_error: float | None
    fit_median_error: float | None
    scale: float | None
    prior_terms: tuple[str, ...] = ()
    cp_note: str = ""
    attention_rel_std: float | None = None
    regime: str | None = None
    regime_evidence: float | None = None
    explore_reason: str = ""
    probes: tuple[Probe, ...] = ()

    @property
    def exploration_seconds(self) -> float:
        """What the probes cost: Σ of their predicted extra lockstep time (the worse regime's fit)."""
        return float(sum(p.extra_seconds for p in self.probes))

    def __str__(self) -> str:
        rec = "n/a" if self.recent_median_error is None else \
            f"{self.recent_median_error:.1%} median, {self.recent_max_error:.1%} worst"
        fit = "n/a" if self.fit_median_error is None else f"{self.fit_median_error:.1%}"
        held = (f"; from the prior (the records do not identify them): {', '.join(self.prior_terms)}"
                if self.prior_terms else "")
        if self.attention_rel_std is not None:
            held += f"; attention term (relative to linear) known to ±{self.attention_rel_std:.1%} (1 sd)"
        if self.regime is not None:
            held += (f"; regime {self.regime} (log-likelihood ratio dense:varlen {self.regime_evidence:+.1f})"
                     + (f", still exploring: {self.explore_reason}" if self.explore_reason else ""))
        if self.probes:
            held += (f"; explored {len(self.probes)} step(s) at caps {', '.join(str(p.cap) for p in self.probes)}, "
                     f"predicted cost {self.exploration_seconds:+.4g} s "
                     f"({sum(p.extra_seconds for p in self.probes) / sum(p.step_seconds for p in self.probes):+.2%})")
        return (f"CostMeter: {self.num_records} records ({self.window_records} in window); planned-model error "
                f"{rec}; refit error {fit}; {getattr(self.cost, 'describe', lambda: repr(self.cost))()}{held}"
                + (f"; {self.cp_note}" if self.cp_note else ""))


def errors(pairs: list[tuple[float, float]], scale_free: bool) -> np.ndarray:
    """``|predicted/measured - 1|`` per record; ``scale_free``: after the best single rescale."""
    if not pairs:
        return np.zeros(0)
    pred, meas = np.array(pairs).T
    ratio = pred / meas
    if scale_free:
        k = float(np.median(ratio))
        ratio = ratio / k if k > 0 else ratio
    return np.abs(ratio - 1.0)
