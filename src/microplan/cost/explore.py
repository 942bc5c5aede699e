"""Exploration: warm-up steps with designed micro-batch sizes, so a ``CostMeter`` can identify its kernel.

Design note. A plan balanced at the token cap gives micro-batches of nearly one size T ≈ cap,
and then the records cannot tell a dense kernel (``packed_quadratic·T²``) from a varlen one with
a larger ``per_micro`` or ``linear``: T² is a constant over the records. The meter therefore
asks, while the records leave the regime or the attention term unidentified
(``CostMeter.explore_config``), for a *probe*: the next warm-up step planned with a lower token
cap, ``fraction × level`` (level: the most tokens a micro-batch of the unexplored plan holds),
so its micro-batches hold fewer tokens (a designed spread of K across
steps; lowering the cap never breaks a memory limit the cap stands for).

1. Which steps. Only steps 2 .. ``steps`` of those planned through ``explore_config`` (the
   first one gives the reference level, at the config's cap), only while the meter names a
   reason, only with a token cap (``max_tokens_per_micro``).
2. Which fraction. Of ``PROBE_FRACTIONS``, the one farthest from the levels already recorded
   (1 and earlier probes: first 0.5, then 0.75 — three levels tell a parabola from a line even
   without a prior) whose cost fits the budget; none fits: no probe this step.
3. Its cost. The step is planned at the cap and at the probe cap (the meter's model without its
   hedge), and both plans' lockstep times are priced under *each* regime's fit of the records
   (varlen and dense): the probe is taken only if its extra time is at most ``budget`` (default
   2 %) of the unexplored plan's under every one of them, so whichever regime is true the probe
   costs at most that (under a dense kernel smaller micro-batches are usually faster: a negative
   cost). Each probe is logged (:class:`Probe`) for ``CostMeter.report``.

Guarantees: the returned config differs from ``replace(config, cost=cost)`` only in
``max_tokens_per_micro`` (lower), so the probe plan is a valid plan of the user's config; the
core planner never imports this module (it is called from the meter, which calls the planner).
Cost: during a probe step, up to ``len(PROBE_FRACTIONS) + 1`` extra plans of the step.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from ..errors import PlanError
from .models import CostModel, FlopsCost

if TYPE_CHECKING:
    from ..batch import Batch
    from ..config import PlanConfig
    from ..plan import Plan

__all__ = ["Probe", "Explorer", "PROBE_FRACTIONS", "DEFAULT_EXPLORE_BUDGET", "lockstep_seconds", "hypotheses_of"]

#: caps a probe may plan with, as fractions of the config's cap
PROBE_FRACTIONS = (0.5, 0.6, 0.75, 0.9)
#: the most a probe may add to a step's predicted lockstep time, under every regime's fit
DEFAULT_EXPLORE_BUDGET = 0.02


class Probe(NamedTuple):
    """One explored warm-up step (``CostMeter.report().probes``).

    Attributes:
        step: which ``explore_config`` call (1 = the first step planned through it).
        cap: the token cap the step was planned with; fraction: ``cap`` / the most tokens a
            micro-batch of the unexplored plan holds (its level).
        extra_seconds: predicted lockstep time of the probe plan minus the unexplored plan's, under
            the regime fit for which that is largest (negative: the probe is faster under every fit).
        step_seconds: the unexplored plan's predicted lockstep time under that fit.
        reason: why the meter explored (what the records had not identified).
    """

    step: int
    cap: int
    fraction: float
    extra_seconds: float
    step_seconds: float
    reason: str

    @property
    def extra_share(self) -> float:
        """``extra_seconds / step_seconds``: at most the budget."""
        return self.extra_seconds / self.step_seconds if self.step_seconds > 0 else 0.0


def lockstep_seconds(plan: Plan, cost: CostModel) -> float:
    """The plan's time under ``cost``: Σ over steps of Σ_m max_r (``sync="micro"``) or max_r Σ_m (``"step"``)."""
    from ..stats import step_cost_grid
    cfg = replace(plan.config, cost=cost)
    total = 0.0
    for step in plan.steps:
        grid = step_cost_grid(plan.batch, cfg, step)
        total += float(grid.max(axis=0).sum() if cfg.sync == "micro" else grid.sum(axis=1).max())
    return total


class Explorer:
    """The meter's exploration state: steps seen, probes taken (module note)."""

    def __init__(self, *, budget: float = DEFAULT_EXPLORE_BUDGET, steps: int = 3) -> None:
        self.budget = budget
        self.steps = steps
        self.calls = 0
        self.probes: list[Probe] = []

    def next_config(self, config: PlanConfig, batch: Batch, reason: str, hypotheses: list[FlopsCost]) -> PlanConfig:
        """``config`` (already carrying the meter's cost), or its probe variant (module note)."""
        self.calls += 1
        cap = config.max_tokens_per_micro
        if not reason or not hypotheses or cap is None or not 2 <= self.calls <= self.steps:
            return config
        from ..planner import plan as make_plan  # the planner never imports the meter
        cost = config.cost
        flat = replace(config, cost=replace(cost, attention_rel_sd=0.0)) if isinstance(cost, FlopsCost) else config
        normal = make_plan(batch, flat)
        base = [lockstep_seconds(normal, h) for h in hypotheses]
        level = min(cap, max((m.num_tokens for s in normal.steps for row in s.micros for m in row), default=cap))
        done = [1.0] + [p.fraction for p in self.probes]
        order = sorted(PROBE_FRACTIONS, key=lambda f: (-min(abs(f - d) for d in done), f))
        for f in order:
            c = int(round(level * f))
            if c < 1:
                continue
            try:
                probe = make_plan(batch, replace(flat, max_tokens_per_micro=c))
            except PlanError:  # a sample longer than the probe cap: try a larger fraction
                continue
            extra = [lockstep_seconds(probe, h) - t for h, t in zip(hypotheses, base)]
            worst = int(np.argmax([e / t if t > 0 else np.inf for e, t in zip(extra, base)]))
            if base[worst] > 0 and extra[worst] <= self.budget * base[worst]:
                self.probes.append(Probe(step=self.calls, cap=c, fraction=f, extra_seconds=float(extra[worst]),
                                         step_seconds=float(base[worst]), reason=reason))
                return replace(config, max_tokens_per_micro=c)
        return config


def hypotheses_of(thetas: tuple[np.ndarray, ...], like: Any) -> list[FlopsCost]:
    """The regimes' fits (coefficients in seconds) as cost models carrying ``like``'s CP term."""
    out = []
    for th in thetas:
        if np.all(np.isfinite(th)) and th[:3].sum() > 0 and np.all(th >= 0):
            out.append(FlopsCost(linear=float(th[0]), quadratic=float(th[1]), packed_quadratic=float(th[2]),
                                 per_micro=float(th[3]), cp=getattr(like, "cp", None)))
    return out
