"""Predicted times and bounds of a plan under its cost model (see PlanStats for definitions).

A micro-batch of CP degree c costs Σ sample costs / c + per_micro on each of its GPUs; a
placeholder is one dummy token, split the same way: cost(1 token) / c + per_micro (so it never
costs more than a real micro-batch). Lower bound of a step (as in PEERS.md):
LB = max(Σ sample costs / (dp·c) + K_lb · per_micro, max sample cost / c_max + per_micro).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .types import PlanStats, StepStats

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["compute_stats", "micro_cost_grid"]


def micro_cost_grid(plan: Plan, step_index: int) -> np.ndarray:
    """``cost[r, m]`` of every micro-batch of one step, on the GPU(s) of rank r."""
    cfg, step = plan.config, plan.steps[step_index]
    cost = cfg.cost
    assert cost is not None
    lens = plan.batch.seq_lens
    sample_cost = cost.sample_costs(lens)
    dummy = float(cost.sample_costs(np.ones(1, dtype=np.int64))[0])
    grid = np.empty((step.dp_size, step.micro_count), dtype=np.float64)
    for r, row in enumerate(step.micros):
        for m, micro in enumerate(row):
            body = (dummy if micro.is_placeholder else float(sample_cost[micro.indices].sum())) / micro.cp_size
            grid[r, m] = body + cost.per_micro
    return grid


def _k_lower_bound(plan: Plan, n: int, tokens: int) -> int:
    cfg = plan.config
    if cfg.micro_batch_size is not None:
        return max(1, -(-n // (cfg.dp_size * cfg.micro_batch_size)))
    assert cfg.max_tokens_per_micro is not None
    return max(1, -(-tokens // (cfg.dp_size * cfg.static_cp_size * cfg.max_tokens_per_micro)))


def _max_cp(plan: Plan) -> int:
    cp = plan.config.context_parallel
    if cp is None:
        return 1
    return cp.size if cp.size is not None else int(cp.max_size)  # type: ignore[arg-type]


def compute_stats(plan: Plan) -> PlanStats:
    cfg = plan.config
    cost = cfg.cost
    assert cost is not None
    sample_cost = cost.sample_costs(plan.batch.seq_lens)
    lens = plan.batch.seq_lens
    per_step: list[StepStats] = []
    rank_total = np.zeros(cfg.dp_size)
    max_tokens = 0
    for s, step in enumerate(plan.steps):
        grid = micro_cost_grid(plan, s)
        rank_total += grid.sum(axis=1)
        idx = step.samples
        tokens, n = int(lens[idx].sum()), int(idx.size)
        k_lb = _k_lower_bound(plan, n, tokens)
        gpus = cfg.dp_size * cfg.static_cp_size
        lb = max(float(sample_cost[idx].sum()) / gpus + k_lb * cost.per_micro,
                 (float(sample_cost[idx].max()) / _max_cp(plan) if n else 0.0) + cost.per_micro)
        step_max = max((-(-m.num_tokens // m.cp_size) for row in step.micros for m in row), default=0)
        max_tokens = max(max_tokens, step_max)
        per_step.append(StepStats(
            num_samples=n, num_tokens=tokens, micro_count=step.micro_count, micro_count_lower_bound=k_lb,
            num_placeholders=step.num_placeholders, max_micro_tokens=step_max,
            lockstep_time=float(grid.max(axis=0).sum()), step_sync_time=float(grid.sum(axis=1).max()),
            time_lower_bound=lb, rank_costs=tuple(float(x) for x in grid.sum(axis=1))))
    lock = sum(p.lockstep_time for p in per_step)
    sync = sum(p.step_sync_time for p in per_step)
    mean = float(rank_total.mean()) if rank_total.size else 0.0
    return PlanStats(
        num_steps=len(plan.steps), num_samples=plan.batch.num_samples, num_dropped=int(plan.dropped.size),
        num_placeholders=sum(p.num_placeholders for p in per_step), max_micro_tokens=max_tokens,
        cap=cfg.max_tokens_per_micro, micro_count=sum(p.micro_count for p in per_step),
        micro_count_lower_bound=sum(p.micro_count_lower_bound for p in per_step),
        predicted_time=lock if cfg.sync == "micro" else sync, lockstep_time=lock, step_sync_time=sync,
        time_lower_bound=sum(p.time_lower_bound for p in per_step),
        rank_imbalance=float(rank_total.max()) / mean if mean > 0 else 1.0, steps=tuple(per_step))
