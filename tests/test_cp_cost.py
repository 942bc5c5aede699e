"""The context-parallel term of the cost model (``microplan.cost.cp``) and the widths it chooses.

A CP micro-batch is priced by one function (``cp_micro_costs``) for every caller; with a CP term
dynamic CP splits a sample beyond its token need only where that is predicted faster, and is
never predicted slower than any fixed CP degree <= max_size, or no CP, that fits the step.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import microplan as mp
from microplan.cost import CPCost, cp_micro_costs
from microplan.cost.hf import kv_values_per_token
from microplan.stats import step_cost_grid
from test_dynamic_cp import dynamic_cases

BASE = mp.FlopsCost(linear=1.0, quadratic=0.05, per_micro=8.0)
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256}


@pytest.mark.parametrize("field,value,match", [
    ("comm_per_token", -1.0, "comm_per_token"), ("overlap", 1.5, "overlap"), ("efficiency", 0.0, "efficiency"),
    ("efficiency", 1.2, "efficiency"), ("split_overhead", float("nan"), "split_overhead"),
    ("comm_per_token", 1e300, "comm_per_token")])
def test_bad_cp_cost_is_refused_naming_the_field(field, value, match):
    args = {"comm_per_token": 1.0, field: value}
    with pytest.raises(mp.PlanError, match=match):
        CPCost(**args)


def test_price_formula_width_one_and_perfect_scaling():
    cp = CPCost(comm_per_token=0.5, overlap=0.25, efficiency=0.8, split_overhead=3.0)
    cost = replace(BASE, cp=cp)
    mc, T = np.array([108.0, 48.0]), np.array([40.0, 200.0])
    got = cp_micro_costs(cost, mc, T, 4)
    compute, comm = (mc - 8.0) / (4 * 0.8), 0.5 * T * 3 / 4
    want = compute + comm - 0.25 * np.minimum(compute, comm) + 3.0 + 8.0
    assert np.allclose(got, want)
    assert np.array_equal(cp_micro_costs(cost, mc, T, 1), mc)        # unsplit: unchanged
    assert np.allclose(cp_micro_costs(BASE, mc, T, 4), (mc - 8) / 4 + 8)  # no CP term: perfect scaling
    assert np.all(got >= cp_micro_costs(BASE, mc, T, 4))              # never below perfect scaling (bounds hold)
    full = replace(cost, cp=replace(cp, overlap=1.0, split_overhead=0.0))
    assert np.allclose(cp_micro_costs(full, mc, T, 4), np.maximum(compute, comm) + 8.0)


def test_cp_term_from_an_hf_config_and_bandwidth():
    # Llama-3-8B: 2 (K, V) · 8 kv heads · 128 head dim · 32 layers per token
    assert kv_values_per_token(LLAMA3_8B) == 2 * 8 * 128 * 32
    cost = mp.FlopsCost.from_hf_config(LLAMA3_8B, cp_bandwidth=3e11)
    per_pass = 2 * 8 * 128 * 32 * 2  # bf16 bytes per token
    assert cost.cp.comm_per_token == pytest.approx(2 * per_pass / 3e11 * 4e14)  # forward + backward, FLOP units
    fwd = mp.FlopsCost.from_hf_config(LLAMA3_8B, cp_bandwidth=3e11, backward_factor=0.0)
    assert fwd.cp.comm_per_token == pytest.approx(cost.cp.comm_per_token / 2)
    secs = CPCost.from_hf_config(LLAMA3_8B, bandwidth=1e11, units_per_second=1.0, passes=1)
    assert secs.comm_per_token == pytest.approx(per_pass / 1e11)
    assert mp.FlopsCost.from_hf_config(LLAMA3_8B).cp is None
    with pytest.raises(mp.PlanError, match="bandwidth"):
        CPCost.from_hf_config(LLAMA3_8B, bandwidth=0, units_per_second=1.0)


def test_a_group_wider_than_a_node_pays_the_cross_node_rate():
    cp = CPCost(comm_per_token=0.5, overlap=0.25, efficiency=0.8, split_overhead=3.0, node_size=4,
                cross_node_comm_per_token=4.0)
    one = replace(cp, node_size=None, cross_node_comm_per_token=None)
    mc, T = np.array([108.0, 48.0]), np.array([40.0, 200.0])
    for w in (2, 4):  # inside a node: the one-rate price
        assert np.array_equal(cp_micro_costs(replace(BASE, cp=cp), mc, T, w), cp_micro_costs(replace(BASE, cp=one), mc, T, w))
    compute, comm = (mc - 8.0) / (8 * 0.8), 4.0 * T * 7 / 8
    want = compute + comm - 0.25 * np.minimum(compute, comm) + 3.0 + 8.0
    assert np.allclose(cp_micro_costs(replace(BASE, cp=cp), mc, T, 8), want)
    assert np.array_equal(cp.comm_rates(np.array([1, 2, 4, 8, 16])), [0.5, 0.5, 0.5, 4.0, 4.0])
    assert "wider than 4 GPUs" in cp.describe() and cp.to_dict()["node_size"] == 4
    assert "node_size" not in one.to_dict()  # a one-rate term serialises as before
    for bad, match in (({"node_size": 4}, "go together"), ({"cross_node_comm_per_token": 2.0}, "go together"),
                       ({"node_size": 0, "cross_node_comm_per_token": 2.0}, "node_size"),
                       ({"node_size": 4, "cross_node_comm_per_token": 0.1}, "below comm_per_token")):
        with pytest.raises(mp.PlanError, match=match):
            CPCost(comm_per_token=0.5, **bad)
    per_pass = 2 * 8 * 128 * 32 * 2
    hf = mp.FlopsCost.from_hf_config(LLAMA3_8B, cp_bandwidth=3e11, cp_node_size=8, cp_cross_node_bandwidth=4e10)
    assert hf.cp.node_size == 8
    assert hf.cp.cross_node_comm_per_token == pytest.approx(2 * per_pass / 4e10 * 4e14)
    assert hf.cp.comm_per_token == pytest.approx(2 * per_pass / 3e11 * 4e14)
    with pytest.raises(mp.PlanError, match="cp_bandwidth"):
        mp.FlopsCost.from_hf_config(LLAMA3_8B, cp_node_size=8, cp_cross_node_bandwidth=4e10)


def test_dynamic_cp_keeps_groups_inside_a_node_when_crossing_is_slow():
    """A straggler that fits one GPU is split when communication is cheap. With 8-wide groups
    allowed on nodes of 4 GPUs, a one-rate model widens it past the node; when crossing nodes
    costs 4,000× more per token, its group stays inside a node (and is still split)."""
    lens = [64, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8]
    attn = mp.FlopsCost(linear=1.0, quadratic=1.0, per_micro=1.0)
    one = replace(attn, cp=CPCost(comm_per_token=0.01))
    tiers = replace(attn, cp=CPCost(comm_per_token=0.01, node_size=4, cross_node_comm_per_token=40.0))
    width = {}
    for name, cost in (("one", one), ("tiers", tiers)):
        plan = mp.plan(mp.Batch(lens), _cfg(8, 64, "micro", cost, mp.ContextParallel(max_size=8)))
        plan.validate()
        width[name] = max(m.cp_size for s in plan.steps for row in s.micros for m in row if 0 in m.indices)
    assert width["one"] == 8 and 1 < width["tiers"] <= 4


def test_cp_term_round_trips_through_the_plan_json():
    cost = replace(BASE, cp=CPCost(comm_per_token=0.3, overlap=0.5, efficiency=0.9, split_overhead=2.0))
    cfg = mp.PlanConfig(dp_size=4, max_tokens_per_micro=64, cost=cost, context_parallel=mp.ContextParallel(max_size=4))
    plan = mp.plan(mp.Batch([200, 30, 20, 10, 9, 8, 7, 6, 5, 4]), cfg)
    back = mp.Plan.from_json(plan.to_json())
    assert back.config.cost == cost and back.fingerprint() == plan.fingerprint()
    tiered = replace(cost, cp=replace(cost.cp, node_size=2, cross_node_comm_per_token=1.5))
    plan = mp.plan(mp.Batch([200, 30, 20, 10, 9, 8, 7, 6, 5, 4]), replace(cfg, cost=tiered))
    back = mp.Plan.from_json(plan.to_json())
    assert back.config.cost == tiered and back.fingerprint() == plan.fingerprint()
    assert "CP: comm" in cost.describe()
    assert mp.cost.cost_from_dict(BASE.to_dict()) == BASE and "cp" not in BASE.to_dict()


def test_stats_price_every_cp_micro_batch_with_the_one_function():
    cost = replace(BASE, cp=CPCost(comm_per_token=0.7, overlap=0.3, efficiency=0.85, split_overhead=1.5))
    cfg = mp.PlanConfig(dp_size=2, max_tokens_per_micro=64, cost=cost, context_parallel=mp.ContextParallel(size=2))
    plan = mp.plan(mp.Batch([100, 60, 40, 33, 20, 12, 9]), cfg)
    step = plan.steps[0]
    grid = step_cost_grid(plan.batch, cfg, step)
    for r, row in enumerate(step.micros):
        for m, micro in enumerate(row):
            whole = cost.micro_cost(micro.seq_lens) if micro.indices.size else cost.micro_cost([1])
            want = cp_micro_costs(cost, whole, max(micro.num_tokens, 1), 2)
            assert grid[r, m] == pytest.approx(float(want))


@st.composite
def priced_cases(draw):
    """test_dynamic_cp's plane, lengths and sync, priced with a random CP term."""
    D, cmax, cap, lens, sync = draw(dynamic_cases())
    comm = draw(st.sampled_from([0.0, 0.1, 1.0, 10.0]))
    node = draw(st.sampled_from([None, 1, 2, 4]))  # a group wider than a node pays a cross-node rate
    cp = CPCost(comm_per_token=comm,
                overlap=draw(st.sampled_from([0.0, 0.5, 1.0])), efficiency=draw(st.sampled_from([1.0, 0.9, 0.6])),
                split_overhead=draw(st.sampled_from([0.0, 4.0, 50.0])), node_size=node,
                cross_node_comm_per_token=None if node is None else comm * draw(st.sampled_from([1.0, 8.0])) + 0.5)
    return D, cmax, cap, lens, sync, replace(BASE, cp=cp)


def _cfg(D, cap, sync, cost, cp=None, short_step="pad"):
    return mp.PlanConfig(dp_size=D, max_tokens_per_micro=cap, cost=cost, sync=sync, short_step=short_step,
                         context_parallel=cp)


@given(priced_cases())
def test_priced_dynamic_cp_is_never_slower_than_fixed_cp_or_no_cp(case):
    D, cmax, cap, lens, sync, cost = case
    batch = mp.Batch(lens)
    dyn = mp.plan(batch, _cfg(D, cap, sync, cost, mp.ContextParallel(max_size=cmax)))
    dyn.validate()
    t_dyn = dyn.stats.predicted_time
    assert dyn.stats.time_lower_bound <= t_dyn * (1 + 1e-9)  # the bound counts a priced split's GPU-time
    others = [("no CP", _cfg(D, cap, sync, cost, short_step="error"))]
    others += [(f"CP {w}", _cfg(D // w, cap, sync, cost, mp.ContextParallel(size=w), short_step="error"))
               for w in (1, 2, 4, 8) if w <= cmax]
    for name, cfg in others:
        try:
            other = mp.plan(batch, cfg)
        except mp.PlanError:  # a sample longer than w·cap, or a step short at this width
            continue
        note(f"{name}: {other.stats.predicted_time} dynamic: {t_dyn}")
        assert other.stats.time_lower_bound <= other.stats.predicted_time * (1 + 1e-9)
        assert t_dyn <= other.stats.predicted_time * (1 + 1e-9)


def _split_unneeded(plan: mp.Plan, cap: int) -> int:
    need = -(-plan.batch.seq_lens // cap)
    return sum(int(need[i] == 1) for s in plan.steps for row in s.micros for m in row
               if m.cp_rank == 0 and m.cp_size > 1 for i in m.indices)


def test_a_sample_that_fits_is_not_split_when_splitting_is_slower():
    """Two samples need a 2-GPU group; the rest fit one GPU. Under perfect scaling (no CP term)
    dynamic CP splits short samples too (wider groups pool GPUs); with a CP term whose
    communication makes every split slower, no sample is split beyond its need."""
    lens = [60, 56, 30, 30, 29, 28, 27, 26, 25, 24, 20, 18, 16, 15]
    cap, D = 32, 4
    perfect = mp.plan(mp.Batch(lens), _cfg(D, cap, "micro", BASE, mp.ContextParallel(max_size=4)))
    assert _split_unneeded(perfect, cap) > 0
    slow = replace(BASE, cp=CPCost(comm_per_token=5.0, efficiency=0.7, split_overhead=20.0))
    plan = mp.plan(mp.Batch(lens), _cfg(D, cap, "micro", slow, mp.ContextParallel(max_size=4)))
    plan.validate()
    assert _split_unneeded(plan, cap) == 0
    assert {m.cp_size for s in plan.steps for row in s.micros for m in row} == {1, 2}


def test_a_straggler_that_fits_is_split_when_splitting_is_faster():
    """One long, attention-heavy sample that fits a GPU holds every slot back: with cheap CP
    communication it is split (predicted faster); with costly communication it stays whole."""
    lens = [64, 8, 8, 8, 8, 8, 8, 8]
    attn = mp.FlopsCost(linear=1.0, quadratic=1.0, per_micro=1.0)
    cheap = replace(attn, cp=CPCost(comm_per_token=0.1))
    dear = replace(attn, cp=CPCost(comm_per_token=2000.0))
    widths = {}
    for name, cost in (("cheap", cheap), ("dear", dear)):
        plan = mp.plan(mp.Batch(lens), _cfg(4, 64, "micro", cost, mp.ContextParallel(max_size=4)))
        widths[name] = max(m.cp_size for s in plan.steps for row in s.micros for m in row if 0 in m.indices)
    assert widths["cheap"] > 1 and widths["dear"] == 1


# -- fitted where CP micro-batches are timed (CostMeter) ------------------------------------------
TRUTH = mp.FlopsCost(linear=2e-7, quadratic=4e-12, per_micro=3e-3,
                     cp=CPCost(comm_per_token=3e-8, overlap=0.5, efficiency=0.85, split_overhead=2e-3))
PRIOR = mp.FlopsCost(linear=4.2e10, quadratic=4.4e5, per_micro=4.3e13,
                     cp=CPCost(comm_per_token=4.2e8, overlap=0.0, efficiency=0.95))


def _truth_seconds(micro, rng, noise=0.02):
    whole = TRUTH.micro_cost(micro.seq_lens if micro.indices.size else [1])
    return float(cp_micro_costs(TRUTH, whole, max(micro.num_tokens, 1), micro.cp_size)) * (1 + noise * rng.standard_normal())


def _cfg_dyn(cost):
    # 8,192 per GPU: a 32k sample fills 4 GPUs exactly
    return mp.PlanConfig(dp_size=8, max_tokens_per_micro=8192, cost=cost, context_parallel=mp.ContextParallel(max_size=4))


def _truth_time(plan):
    from microplan.stages.assign import grid_time
    cfg = replace(plan.config, cost=TRUTH)
    return sum(grid_time(step_cost_grid(plan.batch, cfg, s), "micro") for s in plan.steps)


def test_meter_fits_the_cp_term_from_timed_cp_micro_batches():
    """Three steps of dynamic-CP micro-batches (widths 1, 2, 4) timed under a hidden truth with 2 %
    noise: the metered model predicts a new step's micro-batches within 5 %, and plans it within
    0.5 % of the plan made with the true cost (the planner without a CP term: 8 % slower here)."""
    from microplan.traces import generate
    rng = np.random.default_rng(0)
    meter = mp.CostMeter(prior=PRIOR)
    for step in range(3):
        plan = mp.plan(generate("long-context", num_prompts=16, samples_per_prompt=8, max_len=32768, seed=step),
                       _cfg_dyn(meter.cost()))
        for m in (m for s in plan.steps for row in s.micros for m in row):
            meter.record(m, _truth_seconds(m, rng))
    fit = meter.cost()
    assert fit.cp is not None and "CP term fitted on" in meter.report().cp_note
    batch = generate("long-context", num_prompts=16, samples_per_prompt=8, max_len=32768, seed=10)
    plan = mp.plan(batch, _cfg_dyn(fit))
    errs = [abs(float(cp_micro_costs(fit, fit.micro_cost(m.seq_lens), m.num_tokens, m.cp_size))
                / float(cp_micro_costs(TRUTH, TRUTH.micro_cost(m.seq_lens), m.num_tokens, m.cp_size)) - 1)
            for s in plan.steps for row in s.micros for m in row if m.indices.size]
    assert max(errs) < 0.05, max(errs)
    best = _truth_time(mp.plan(batch, _cfg_dyn(TRUTH)))
    assert _truth_time(plan) <= best * 1.005
    assert _truth_time(mp.plan(batch, _cfg_dyn(replace(TRUTH, cp=None)))) > best * 1.02  # what the CP term buys


def test_meter_keeps_the_prior_cp_term_when_the_records_cannot_fit_it():
    rng = np.random.default_rng(1)
    meter = mp.CostMeter(prior=PRIOR)
    plan = mp.plan(mp.Batch([3000, 2500, 2000, 1500, 1000, 800, 600, 400, 300, 200, 100, 50] * 2),
                   mp.PlanConfig(dp_size=4, max_tokens_per_micro=4096, cost=PRIOR))
    for m in (m for s in plan.steps for row in s.micros for m in row):
        meter.record(m, _truth_seconds(m, rng))
    meter.record([6000], _truth_seconds(mp.plan(mp.Batch([6000]), mp.PlanConfig(
        dp_size=2, max_tokens_per_micro=4096, cost=PRIOR, context_parallel=mp.ContextParallel(size=2))).steps[0].micros[0][0], rng),
        cp_size=2)
    fit, rep = meter.cost(), meter.report()
    assert "CP term from the prior" in rep.cp_note and "1 split micro-batch" in rep.cp_note
    assert "CP term from the prior" in str(rep)
    scale = rep.scale  # seconds per prior unit: the prior's CP term rescaled like the base
    assert fit.cp.comm_per_token == pytest.approx(PRIOR.cp.comm_per_token * scale)
    assert fit.cp.efficiency == PRIOR.cp.efficiency


def test_meter_keeps_the_priors_cross_node_ratio():
    """Dynamic-CP micro-batches up to 4 wide on nodes of 2 GPUs, timed under a truth whose
    cross-node rate is 6× its node rate; the prior knows the ratio, not the scale. The fitted term
    carries the prior's ratio and prices a new step's micro-batches, 4-wide ones included, within 5 %."""
    from microplan.traces import generate
    truth_cp = replace(TRUTH.cp, node_size=2, cross_node_comm_per_token=6 * TRUTH.cp.comm_per_token)
    truth = replace(TRUTH, cp=truth_cp)
    prior = replace(PRIOR, cp=replace(PRIOR.cp, node_size=2, cross_node_comm_per_token=6 * PRIOR.cp.comm_per_token))
    rng = np.random.default_rng(3)
    meter = mp.CostMeter(prior=prior)

    def seconds(m):
        whole = truth.micro_cost(m.seq_lens if m.indices.size else [1])
        return float(cp_micro_costs(truth, whole, max(m.num_tokens, 1), m.cp_size)) * (1 + 0.02 * rng.standard_normal())
    for step in range(3):
        plan = mp.plan(generate("long-context", num_prompts=16, samples_per_prompt=8, max_len=32768, seed=step),
                       _cfg_dyn(meter.cost()))
        for m in (m for s in plan.steps for row in s.micros for m in row):
            meter.record(m, seconds(m))
    fit = meter.cost().cp
    assert fit.node_size == 2 and fit.cross_node_comm_per_token == pytest.approx(6 * fit.comm_per_token)
    plan = mp.plan(generate("long-context", num_prompts=16, samples_per_prompt=8, max_len=32768, seed=10),
                   _cfg_dyn(meter.cost()))
    micros = [m for s in plan.steps for row in s.micros for m in row if m.indices.size]
    assert any(m.cp_size == 4 for m in micros)
    cost = meter.cost()
    errs = [abs(float(cp_micro_costs(cost, cost.micro_cost(m.seq_lens), m.num_tokens, m.cp_size))
                / float(cp_micro_costs(truth, truth.micro_cost(m.seq_lens), m.num_tokens, m.cp_size)) - 1) for m in micros]
    assert max(errs) < 0.05, max(errs)


def test_meter_says_when_every_record_was_split():
    rng = np.random.default_rng(2)
    meter = mp.CostMeter(prior=PRIOR)
    cfg = mp.PlanConfig(dp_size=2, max_tokens_per_micro=2048, cost=PRIOR, context_parallel=mp.ContextParallel(size=2))
    plan = mp.plan(mp.Batch([4000, 3000, 2500, 2000, 1000, 900, 700, 500]), cfg)
    for m in (m for s in plan.steps for row in s.micros for m in row):
        meter.record(m, _truth_seconds(m, rng))
    assert "every timed micro-batch was split" in meter.report().cp_note


def test_profile_cost_fits_the_cp_term_on_timed_cp_micro_batches():
    """A fake machine whose CP micro-batches take the CP price of a hidden truth: profile_cost with
    cp_sizes=(2, 4) recovers a model that prices CP micro-batches it never timed within 2 %."""
    from microplan.torch import PackedMicro, profile_cost
    truth = mp.FlopsCost(linear=2e-4, quadratic=6e-8, per_micro=0.02,
                         cp=CPCost(comm_per_token=3e-5, overlap=0.0, efficiency=0.8, split_overhead=0.01))
    clock = {"t": 0.0}

    def run(p: PackedMicro) -> None:
        clock["t"] += truth.micro_cost(list(p.seq_lens))

    def run_cp(p: PackedMicro, c: int) -> None:
        L = list(p.seq_lens)
        clock["t"] += float(cp_micro_costs(truth, truth.micro_cost(L), sum(L), c))

    res = profile_cost(run, max_tokens_per_micro=1024, clock=lambda: clock["t"], cp_sizes=(2, 4), run_cp_micro=run_cp,
                       vocab_size=50, time_budget_s=None, repeats=1)
    assert res.cost.cp is not None and "CP term fitted" in res.cp_note and res.cp_note in res.describe()
    assert sum(1 for r in res.rows if r.get("cp_size")) == 12
    for lens, c in (([3000], 4), ([700, 700, 500], 2), ([1500, 400], 2)):
        want = float(cp_micro_costs(truth, truth.micro_cost(lens), sum(lens), c))
        got = float(cp_micro_costs(res.cost, res.cost.micro_cost(lens), sum(lens), c))
        assert got == pytest.approx(want, rel=0.02)
    with pytest.raises(mp.PlanError, match="run_cp_micro"):
        profile_cost(run, max_tokens_per_micro=1024, clock=lambda: clock["t"], cp_sizes=(2,))


def test_bench_cp_nodes_scores_the_tiers_under_the_truth():
    # benchmarks/bench_cp.py --nodes on one small straggler step: every plan valid and scored, and
    # the two-tier plan, which sees the node boundary, no slower under the truth than either one-rate plan
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.bench_cp import node_costs, run_nodes_case
    from benchmarks.metrics import dense_7b_cost
    costs, truth = node_costs(dense_7b_cost())
    lens = [120_000] + [500 + 250 * i for i in range(31)]
    rows = {r["config"]: r for r in run_nodes_case("straggler", mp.Batch(lens), 16, 0, costs, truth)}
    tiers = rows["dynamic <= 16, two tiers"]
    assert tiers["truth"] <= rows["dynamic <= 16, one rate, NVLink"]["truth"] * (1 + 1e-9)
    assert tiers["truth"] <= rows["dynamic <= 16, one rate, IB"]["truth"] * (1 + 1e-9)
    assert rows["fixed CP 16, two tiers"]["cross_node"] == 1.0 and min(r["truth_vs_best"] for r in rows.values()) == 1.0
    # at the node's rate the straggler's group spans two nodes; with the tiers it stays in one
    assert rows["dynamic <= 16, one rate, NVLink"]["cross_node"] > 0 and tiers["cross_node"] == 0
    assert tiers["truth"] < rows["dynamic <= 16, one rate, NVLink"]["truth"] * 0.9
