"""The hedged lockstep pass (stages/hedge.py) and ``FlopsCost.attention_rel_sd``."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import microplan as mp
import microplan.traces
from microplan.stages.assign import arrange
from microplan.stages.hedge import hedge_lockstep, hedge_scenarios
from microplan.stats import step_cost_grid


def _objective(bin_of, grid, lens, scen):
    nb = grid.size
    out = 0.0
    for m in scen:
        mc = np.array([m.micro_cost(lens[bin_of == i]) if np.any(bin_of == i) else 0.0 for i in range(nb)])
        out += float(mc[grid].max(axis=0).sum())
    return out


@settings(max_examples=60)
@given(st.integers(0, 2**31), st.integers(1, 6), st.integers(1, 4), st.sampled_from([0.0, 1e-3]),
       st.sampled_from([0.05, 0.3]), st.booleans())
def test_hedge_never_hurts_its_objective(seed, dp, K, packed, sd, same_rank):
    """The pass keeps every bin within the cap and non-empty, never raises Σ_s Σ_m max_r cost_s,
    never writes its input, and is deterministic; ``same_rank``: every item stays in its grid row."""
    rng = np.random.default_rng(seed)
    n = dp * K + int(rng.integers(0, 40))
    lens = rng.integers(1, 300, n)
    cost = mp.FlopsCost(linear=1.0, quadratic=1e-3, packed_quadratic=packed, per_micro=5.0, attention_rel_sd=sd)
    scen = hedge_scenarios(cost)
    assert len(scen) == 3 and all(m.attention_rel_sd == 0 for m in scen)
    nb = dp * K
    bin_of = np.concatenate([np.arange(nb), rng.integers(0, nb, n - nb)])
    cap = int(max(np.bincount(bin_of, weights=lens, minlength=nb).max(), lens.max() + rng.integers(0, 600)))
    mc = np.array([scen[1].micro_cost(lens[bin_of == i]) for i in range(nb)])
    grid = arrange(mc, dp, K)
    given_ = bin_of.copy()
    out = hedge_lockstep(given_, grid, lens, scen[1].sample_costs(lens), scen, cap, same_rank=same_rank)
    assert np.array_equal(given_, bin_of)
    if same_rank:
        row = np.empty(nb, dtype=np.int64)
        row[grid.reshape(-1)] = np.repeat(np.arange(dp), K)
        assert np.array_equal(row[out], row[bin_of])
    assert _objective(out, grid, lens, scen) <= _objective(bin_of, grid, lens, scen) * (1 + 1e-12)
    assert np.bincount(out, weights=lens, minlength=nb).max() <= cap
    assert np.bincount(out, minlength=nb).min() >= 1
    assert np.array_equal(hedge_lockstep(bin_of, grid, lens, scen[1].sample_costs(lens), scen, cap,
                                         same_rank=same_rank), out)


def test_no_scenarios_without_an_uncertain_attention_term():
    assert hedge_scenarios(mp.TokenCost()) == ()
    assert hedge_scenarios(mp.FlopsCost(linear=1.0, quadratic=1e-3)) == ()
    assert hedge_scenarios(mp.FlopsCost(linear=1.0, attention_rel_sd=0.2)) == ()  # no attention to doubt
    lo, mid, hi = hedge_scenarios(mp.FlopsCost(linear=1.0, quadratic=1e-3, attention_rel_sd=0.2))
    assert (lo.quadratic, mid.quadratic, hi.quadratic) == pytest.approx((0.8e-3, 1e-3, 1.2e-3))


def _machine_lockstep(plan, machine):
    """Σ over steps of Σ_m max_r cost on ``machine`` (the plan's micro-batches priced by it)."""
    cfg = replace(plan.config, cost=machine)
    return sum(float(step_cost_grid(plan.batch, cfg, st).max(axis=0).sum()) for st in plan.steps)


def _plans_and_worst(batch: mp.Batch, placement: str) -> tuple[dict, dict]:
    """Plans at dp 8 with attention known exactly (sd 0) and to ±15 %, each validated and at the same
    K, and each plan's lockstep time at the worse of two machines whose attention is 15 % off."""
    machines = [mp.FlopsCost(linear=1.0, quadratic=2.4e-4 * f, per_micro=500.0) for f in (0.85, 1.15)]
    plans = {}
    for sd in (0.0, 0.15):
        cfg = mp.PlanConfig(dp_size=8, max_tokens_per_micro=16384, placement=placement, cost=mp.FlopsCost(
            linear=1.0, quadratic=2.4e-4, per_micro=500.0, attention_rel_sd=sd))
        plans[sd] = mp.plan(batch, cfg)
        plans[sd].validate()
    assert plans[0.0].steps[0].micro_count == plans[0.15].steps[0].micro_count
    return plans, {sd: max(_machine_lockstep(p, m) for m in machines) for sd, p in plans.items()}


def test_a_hedged_plan_is_balanced_whichever_machine_it_meets():
    """Attention known to ±15 %: the hedged plan's lockstep time, on machines whose attention is 15 %
    off either way, is lower at the worse of the two than the plan that trusts the point estimate.
    Fails without the hedge (the same plan twice)."""
    trace = mp.traces.generate("grpo-longtail", num_prompts=32, samples_per_prompt=8, max_len=8192, seed=3)
    plans, worst = _plans_and_worst(mp.Batch(trace.seq_lens, prompt_ids=trace.prompt_ids), "global")
    assert worst[0.15] < worst[0.0] * (1 - 5e-4), worst
    point = mp.FlopsCost(linear=1.0, quadratic=2.4e-4, per_micro=500.0)
    # the plan's own predicted time is the point estimate's
    assert plans[0.15].stats.predicted_time == pytest.approx(_machine_lockstep(plans[0.15], point), rel=1e-9)


def test_local_placement_hedges_within_each_rank():
    """placement="local", samples pinned by a balanced split (sorted, dealt snake-wise): with attention
    known to ±15 % the hedged plan is faster at the worse of the two off-by-15 % machines than the
    plan that trusts the point estimate, and every sample still runs on its rank (validate)."""
    trace = mp.traces.generate("grpo-longtail", num_prompts=32, samples_per_prompt=8, max_len=8192, seed=3)
    n, dp = len(trace.seq_lens), 8  # dp as in _plans_and_worst
    owner = np.empty(n, dtype=np.int64)
    owner[np.argsort(-np.asarray(trace.seq_lens), kind="stable")] = np.r_[np.arange(dp), np.arange(dp)[::-1]][
        np.arange(n) % (2 * dp)]
    _, worst = _plans_and_worst(mp.Batch(trace.seq_lens, prompt_ids=trace.prompt_ids).with_rank_of(owner), "local")
    assert worst[0.15] < worst[0.0] * (1 - 1e-3), worst


def test_attention_rel_sd_round_trips_and_is_checked():
    cost = mp.FlopsCost(linear=2.0, quadratic=1e-4, attention_rel_sd=0.12)
    assert mp.cost.cost_from_dict(cost.to_dict()) == cost
    assert "attention_rel_sd" not in mp.FlopsCost(linear=2.0, quadratic=1e-4).to_dict()  # old JSON unchanged
    assert "±12.0%" in cost.describe()
    with pytest.raises(mp.PlanError, match="attention_rel_sd"):
        mp.FlopsCost(linear=1.0, quadratic=1e-4, attention_rel_sd=1.0)
    with pytest.raises(mp.PlanError, match="attention_rel_sd"):
        mp.FlopsCost(linear=1.0, quadratic=1e-4, attention_rel_sd=-0.1)
    plan = mp.plan(mp.Batch([300, 200, 900, 50, 700, 80, 120, 640]),
                   mp.PlanConfig(dp_size=2, max_tokens_per_micro=1000, cost=cost))
    assert mp.Plan.from_json(plan.to_json()).fingerprint() == plan.fingerprint()
