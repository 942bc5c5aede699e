"""bench_planners' local-placement steps as tests pin them: a family's step at dp, pinned by verl's split."""

from __future__ import annotations

import microplan as mp


def bench_local_plan(family: str, dp: int, seed: int) -> tuple[mp.Plan, mp.Batch, mp.PlanConfig]:
    """The plan (validated), batch and config of bench_planners' ``microplan-local`` row for one case."""
    from benchmarks.bench_planners import FAMILIES, SPG, make_step, verl_split_owners
    from benchmarks.metrics import dense_7b_cost
    batch = make_step(family, dp, SPG[seed % len(SPG)], seed)
    batch = batch.with_rank_of(verl_split_owners(batch.seq_lens, dp))
    cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=FAMILIES[family][1], cost=dense_7b_cost(),
                        placement="local")
    plan = mp.plan(batch, cfg)
    plan.validate()
    return plan, batch, cfg
