"""``plan(batch, config)``: the whole flow — steps, fit (K, pack), assign, weigh — as one pure call.

Design note. Steps are cut first (groups atomic), then each step independently: fit (choose K
by predicted time, pack under the cap, apply short_step), arrange the dp·K micro-batches into
the ranks × slots grid, and weigh every sample. No I/O, no collectives, no global state: any
process that holds the same batch and config computes the same plan, bit for bit. Measured: a
16,384-sample step at dp=128 plans in ~25 ms (benchmarks/bench_speed.py).

Layouts: one :class:`~microplan.footprint.Footprint` per plan says what a micro-batch occupies
(padding, padded rows, vision tokens); the packers, the arrangement and every Micro use it.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from .batch import Batch
from .config import PlanConfig
from .errors import PlanError
from .footprint import Footprint, check_fits, footprint_of, micro_footprint
from .plan import Plan
from .stats import step_cost_grid
from .stages.assign import arrange
from .stages.cp import plan_dynamic_cp_step
from .stages.fit import fit_step
from .stages.layout import step_layout
from .stages.local import plan_local_step
from .stages.micros import binned_micros
from .stages.share import plan_shared_step
from .stages.pipeline import order_step
from .stages.steps import split_steps
from .stages.weigh import loss_coefficients, loss_scales
from .types import Micro, Step

__all__ = ["plan", "build_plan"]


def plan(batch: Batch, config: PlanConfig) -> Plan:
    """Plan the layout of ``batch`` under ``config`` (binding API). Raises PlanError on bad input."""
    return build_plan(batch, config)


def build_plan(batch: Batch, config: PlanConfig, *, min_micro_count: int | None = None) -> Plan:
    """:func:`plan` with a minimum micro-batch count per rank and step (local placement only).

    ``min_micro_count`` defaults to ``config.pipeline_stages`` (K ≥ p). Integrations whose
    framework asks for a minimum count (verl's ``min_num_micro_batch``) pass it here.
    """
    if not isinstance(batch, Batch):
        raise PlanError(f"plan() takes a microplan.Batch, got {type(batch).__name__}; wrap lengths as Batch(seq_lens).")
    if not isinstance(config, PlanConfig):
        raise PlanError(f"plan() takes a microplan.PlanConfig, got {type(config).__name__}.")
    dynamic_cp = config.context_parallel is not None and config.context_parallel.dynamic
    fp = footprint_of(batch, config)
    if not config.share_prefixes:
        check_fits(fp, config)  # shared plans refuse a sample over the cap in stages/share.py
    step_planner = plan_shared_step if config.share_prefixes else \
        plan_dynamic_cp_step if dynamic_cp else partial(_plan_step, fp=fp)
    if config.placement == "local":
        if config.share_prefixes or micro_footprint(fp) is not None:
            raise PlanError("PlanConfig(placement='local') plans plain varlen rows for now: share_prefixes, padded "
                            "layouts, padding multiples and vision tokens are not supported with it yet; use "
                            "placement='global' for those.")
        min_k = _min_count(config, min_micro_count)
        _check_owners(batch, config)
        step_planner = lambda *a: plan_local_step(*a, min_micro_count=min_k)  # noqa: E731
    elif min_micro_count is not None and min_micro_count > 1:
        raise PlanError(f"min_micro_count={min_micro_count} is applied by placement='local' only; plan with "
                        "PlanConfig(placement='local', ...), or PlanConfig(pipeline_stages=...) for a global plan.")
    split = split_steps(batch, config.steps)
    assert config.cost is not None
    costs = fp.sample_costs(config.cost)
    reasons = {int(i): split.reason for i in split.dropped}
    steps: list[Step] = []
    for samples in split.steps:
        step, dropped, why = step_planner(len(steps), samples, batch, costs, config)
        if config.pipeline_stages > 1:  # run each rank's micro-batches in the order of least pipeline time
            step = order_step(step, step_cost_grid(batch, config, step, fp), config)
        reasons.update((int(i), why) for i in dropped)
        steps.append(step)
    return Plan(batch=batch, config=config, steps=steps, dropped=np.array(sorted(reasons), dtype=np.int64),
                drop_reasons=reasons)


def _plan_step(s: int, samples: np.ndarray, batch: Batch, costs: np.ndarray,
               cfg: PlanConfig, *, fp: Footprint) -> tuple[Step, np.ndarray, str]:
    lens = fp.sample_tokens[samples]  # what each sample occupies (padding included)
    fit = fit_step(s, samples, lens, costs[samples], batch.rollout_codes[samples], cfg,
                   step_layout(micro_footprint(fp), samples, cfg))
    kept = samples[fit.kept]
    D, K = cfg.dp_size, fit.micro_count
    bin_of = fit.bin_of
    grid = arrange(fp.bin_costs(cfg.cost, kept, bin_of, D * K), D, K)  # type: ignore[arg-type]
    assert cfg.loss is not None
    coef = loss_coefficients(cfg.loss, batch.loss_tokens[kept], batch.prompt_codes[kept], batch.rollout_codes[kept])
    scale = loss_scales(cfg.loss, coef, grad_world=cfg.grad_world, micro_count=K)
    bins = binned_micros(kept, bin_of, D * K, scale, batch)
    cp = cfg.static_cp_size
    trusted, mfp = Micro._trusted, micro_footprint(fp)
    micros = [[trusted(*bins[b], cp, 0, (r,), footprint=mfp) for b in grid[r].tolist()] for r in range(D)]
    dropped = samples[fit.dropped]
    why = (f"short_step='drop': trailing rollout dropped so step {s} aligns to dp_size × align "
           f"= {D} × {cfg.align} micro-batches")
    return Step(s, micros, np.sort(kept), choice=fit.choice), dropped, why


def _min_count(config: PlanConfig, given: int | None) -> int:
    """The minimum K hook: the explicit value, else ``config.pipeline_stages``."""
    value = given if given is not None else config.pipeline_stages
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise PlanError(f"min_micro_count={value!r} must be an int >= 1 (micro-batches per rank per step).")
    return int(value)


def _check_owners(batch: Batch, config: PlanConfig) -> None:
    if batch.rank_of is None:
        raise PlanError("PlanConfig(placement='local') keeps every sample on the rank that holds it, but the batch "
                        "has no owners: pass Batch(..., rank_of=<rank of each sample>) or plan with "
                        "microplan.torch.plan_distributed, which fills them from the gathering ranks.")
    if batch.num_samples and int(batch.rank_of.max()) >= config.dp_size:
        i = int(np.argmax(batch.rank_of))
        raise PlanError(f"rank_of[{i}]={int(batch.rank_of[i])} is not a rank of dp_size={config.dp_size}; owner "
                        f"ranks must be 0..{config.dp_size - 1}.")
