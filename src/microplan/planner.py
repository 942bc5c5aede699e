"""``plan(batch, config)``: the whole flow as one pure call — one stage per concern, every option a property of one.

Design note. Steps are cut first (groups atomic), then each step runs the same flow:

1. atoms      what is placed whole: samples, or prefix trees / tree parts (``stages/atoms.py``);
              with sharing, the granularity is chosen by predicted time (``stages/granularity.py``)
2. footprint  what a set of atoms occupies: padding multiples, padded rows, unique trie tokens,
              vision tokens — ``footprint.py``, the one function the cap, validate and stats use;
              its bytes under a memory model: ``memory/check.py`` (a byte budget chooses the
              token cap: ``memory/plan.py``)
3. placement  where an atom may go: any rank (global) or the rank that holds it (local)
4. fit        K by predicted time, pack under the cap, ``short_step`` (``stages/fit.py``, ``local.py``;
              under dynamic context parallel ``stages/cp.py``, which also gives each bin a CP width)
5. arrange    bins into the ranks × slots grid (``stages/place.py``, ``assign.py``; a CP group's ranks
              share its bin)
6. cp         static CP divides each bin over its group; dynamic CP's widths came with the fit
7. order      pipeline order of each rank's micro-batches (``stages/pipeline.py``)
8. weigh      loss scales that make the step's gradient exact (``stages/build.py``, ``weigh.py``)

No I/O, no collectives, no global state: any process that holds the same batch and config
computes the same plan, bit for bit. What cannot compose for a physical reason is refused in
``config.py`` and listed in docs/planner.md. Every step records its K choice (``Step.choice``).
"""

from __future__ import annotations

import numpy as np

from .batch import Batch
from .config import PlanConfig
from .errors import PlanError
from .footprint import check_fits
from .plan import Plan
from .stats import step_cost_grid
from .stages.build import build_step
from .stages.context import PlanContext, plan_context
from .stages.granularity import best_layout
from .stages.pipeline import order_step
from .stages.steps import split_steps
from .types import Step

__all__ = ["plan", "build_plan"]


def plan(batch: Batch, config: PlanConfig) -> Plan:
    """Plan the layout of ``batch`` under ``config`` (binding API). Raises PlanError on bad input."""
    if isinstance(batch, Batch) and batch.num_samples == 0:  # DESIGN: an empty batch is an error, never an empty plan
        raise PlanError("the batch is empty (0 samples): there is nothing to plan, and an empty plan would hide a "
                        "data-loading bug; pass the step's samples (at least one), or skip the step before planning.")
    return build_plan(batch, config)


def build_plan(batch: Batch, config: PlanConfig, *, min_micro_count: int | None = None) -> Plan:
    """:func:`plan` with a minimum micro-batch count per rank and step (local placement only).

    K is at least ``max(min_micro_count, config.pipeline_stages)``, aligned. Integrations whose
    framework asks for a minimum count (verl's ``min_num_micro_batch``) pass it here. With a
    memory budget (``PlanConfig.max_bytes_per_micro``) the token cap is chosen so every
    micro-batch's predicted bytes fit (``memory/plan.py``).
    """
    if isinstance(config, PlanConfig) and config.memory is not None:
        from .memory.plan import plan_with_memory
        return plan_with_memory(batch, config, lambda b, c, lone=None: _build_plan(b, c, min_micro_count, lone))
    return _build_plan(batch, config, min_micro_count)


def _build_plan(batch: Batch, config: PlanConfig, min_micro_count: int | None, lone_above: int | None = None) -> Plan:
    """:func:`build_plan` under the config's token cap (``lone_above``: samples longer than it
    run alone, ``memory/plan.py``)."""
    ctx = _context(batch, config, min_micro_count, lone_above)
    split = split_steps(batch, config.steps)                     # steps: groups never split
    reasons = {int(i): split.reason for i in split.dropped}
    steps: list[Step] = []
    for samples in split.steps:
        step, dropped = _plan_step(len(steps), samples, ctx)
        reasons.update((int(i), _drop_reason(step.index, config)) for i in dropped)
        steps.append(step)
    return Plan(batch=batch, config=config, steps=steps, dropped=np.array(sorted(reasons), dtype=np.int64),
                drop_reasons=reasons)


def _plan_step(s: int, samples: np.ndarray, ctx: PlanContext) -> tuple[Step, np.ndarray]:
    """One step through the flow of the module note."""
    lay = best_layout(s, samples, ctx)     # atoms → footprint → placement → K (CP widths) → pack → arrange
    step = build_step(s, lay, ctx)         # micro-batches, weigh
    if ctx.cfg.pipeline_stages > 1:        # order: least predicted pipeline time per rank
        step = order_step(step, step_cost_grid(ctx.batch, ctx.cfg, step, ctx.fp), ctx.cfg)
    return step, lay.dropped_samples


def _drop_reason(s: int, cfg: PlanConfig) -> str:
    if cfg.placement == "local":
        return (f"short_step='drop': trailing rollout dropped so every rank of step {s} fills its K micro-batches "
                "with its own samples (placement='local')")
    return (f"short_step='drop': trailing rollout dropped so step {s} aligns to dp_size × align "
            f"= {cfg.dp_size} × {cfg.align} micro-batches" + (" (whole prefix-tree components)" if cfg.share_prefixes
                                                              else ""))


def _context(batch: Batch, config: PlanConfig, min_micro_count: int | None,
             lone_above: int | None = None) -> PlanContext:
    """Check the arguments and derive what every stage reads (``stages/context.py``)."""
    if not isinstance(batch, Batch):
        raise PlanError(f"plan() takes a microplan.Batch, got {type(batch).__name__}; wrap lengths as Batch(seq_lens).")
    if not isinstance(config, PlanConfig):
        raise PlanError(f"plan() takes a microplan.PlanConfig, got {type(config).__name__}.")
    if config.placement == "local":
        _check_owners(batch, config)
    elif min_micro_count is not None and min_micro_count > 1:
        raise PlanError(f"min_micro_count={min_micro_count} is applied by placement='local' only; plan with "
                        "PlanConfig(placement='local', ...), or PlanConfig(pipeline_stages=...) for a global plan.")
    ctx = plan_context(batch, config, _min_count(config, min_micro_count))
    if lone_above is not None:  # a byte budget under a dense mask: long samples run alone (memory/plan.py)
        from .memory.plan import lone_context
        ctx = lone_context(ctx, lone_above)
    check_fits(ctx.fp, config)  # a lone sample's row is the same with sharing (one run, or flat)
    return ctx


def _min_count(config: PlanConfig, given: int | None) -> int:
    """The minimum K: at least ``config.pipeline_stages`` and the explicit value (both hold)."""
    value = 1 if given is None else given
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise PlanError(f"min_micro_count={value!r} must be an int >= 1 (micro-batches per rank per step).")
    return max(int(value), config.pipeline_stages)


def _check_owners(batch: Batch, config: PlanConfig) -> None:
    if batch.rank_of is None:
        raise PlanError("PlanConfig(placement='local') keeps every sample on the rank that holds it, but the batch "
                        "has no owners: pass Batch(..., rank_of=<rank of each sample>) or plan with "
                        "microplan.torch.plan_distributed, which fills them from the gathering ranks.")
    if batch.num_samples and int(batch.rank_of.max()) >= config.dp_size:
        i = int(np.argmax(batch.rank_of))
        raise PlanError(f"rank_of[{i}]={int(batch.rank_of[i])} is not a rank of dp_size={config.dp_size}; owner "
                        f"ranks must be 0..{config.dp_size - 1}.")
