"""CostMeter exploration (issue 27 item 1) and tree records in the verl drop-in (item 2).

Records of micro-batches that all hold the cap's tokens cannot tell a dense kernel (T² of the
packed row) from a varlen one: T² is a constant over them. ``explore_config`` then plans the next
warm-up step at a lower cap, within a cost budget, and the next records decide the regime.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import microplan as mp
from microplan.traces import generate
from microplan.cost.explore import PROBE_FRACTIONS, lockstep_seconds
from microplan.cost.meter import EVIDENCE

CFG = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
       "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000, "hidden_act": "silu"}
CAP = 32768
_F = mp.FlopsCost.from_hf_config(CFG, attention="flops", per_micro=0.0)
# a dense kernel (every T² pair of a pack at GEMM speed; a lone sample its causal L²), in seconds
DENSE = mp.FlopsCost(linear=_F.linear * 1e-15, quadratic=_F.quadratic * 1e-15,
                     packed_quadratic=2 * _F.quadratic * 1e-15, per_micro=0.02 * _F.linear * CAP * 1e-15)
VARLEN = mp.FlopsCost(linear=_F.linear * 1e-15, quadratic=2 * _F.quadratic * 1e-15, per_micro=DENSE.per_micro)


def _at_cap(rng: np.random.Generator, n: int) -> list[np.ndarray]:
    """Micro-batches of short samples holding exactly CAP tokens each (a plan balanced at the cap)."""
    out = []
    for _ in range(n):
        lens = rng.integers(200, 3000, 40)
        lens = lens[np.cumsum(lens) < CAP]
        out.append(np.append(lens, CAP - lens.sum()))
    return out


def _batch(seed: int) -> mp.Batch:
    return generate("grpo-longtail", num_prompts=64, samples_per_prompt=8, max_len=8192, seed=seed)


def _feed(meter: mp.CostMeter, micros, truth: mp.FlopsCost, rng: np.random.Generator) -> None:
    for m in micros:
        meter.record(m, truth.micro_cost(m) * (1 + 0.03 * rng.standard_normal()))


def _plan_micros(plan: mp.Plan) -> list:
    return [m for s in plan.steps for row in s.micros for m in row]


def test_records_at_the_cap_leave_the_regime_open_and_one_probe_decides_it():
    rng = np.random.default_rng(0)
    meter = mp.CostMeter(prior=mp.FlopsCost.from_hf_config(CFG))
    base = mp.PlanConfig(dp_size=4, max_tokens_per_micro=CAP)
    first = meter.explore_config(base, _batch(0))
    assert first == replace(base, cost=meter.prior)          # no records: the prior, at the cap
    _feed(meter, _at_cap(rng, 64), DENSE, rng)
    rep = meter.report()
    assert abs(rep.regime_evidence) < EVIDENCE and rep.explore_reason  # T² is a constant over these records
    batch = _batch(1)
    cfg = meter.explore_config(base, batch)
    assert cfg.max_tokens_per_micro < CAP                    # a probe: the same config at a lower cap
    assert replace(cfg, max_tokens_per_micro=CAP) == replace(base, cost=cfg.cost)
    (probe,) = meter.report().probes
    assert probe.fraction in PROBE_FRACTIONS and probe.extra_share <= 0.02 and probe.step == 2
    plan = mp.plan(batch, cfg)
    plan.validate()
    _feed(meter, _plan_micros(plan), DENSE, rng)
    rep = meter.report()
    assert rep.regime == "dense" and rep.regime_evidence >= EVIDENCE, rep
    assert "regime dense" in str(rep) and "explored 1 step" in str(rep)
    batch = _batch(2)  # the next step, planned on the dense fit, packs fewer tokens: the K search does the rest
    plan = mp.plan(batch, meter.explore_config(base, batch))
    _feed(meter, _plan_micros(plan), DENSE, rng)
    fit = meter.report().cost
    assert fit.packed_quadratic / fit.linear == pytest.approx(DENSE.packed_quadratic / DENSE.linear, rel=0.1)


def test_without_a_probe_the_same_records_stay_undecided():
    """The failure the probe fixes: more records at the cap add no evidence about the regime."""
    rng = np.random.default_rng(0)
    meter = mp.CostMeter(prior=mp.FlopsCost.from_hf_config(CFG), explore_steps=0)
    base = mp.PlanConfig(dp_size=4, max_tokens_per_micro=CAP)
    for _ in range(3):
        assert meter.explore_config(base, _batch(1)).max_tokens_per_micro == CAP
        _feed(meter, _at_cap(rng, 64), DENSE, rng)
    rep = meter.report()
    assert abs(rep.regime_evidence) < EVIDENCE and rep.regime == "varlen" and not rep.probes


@pytest.mark.parametrize("truth", [DENSE, VARLEN], ids=["dense", "varlen"])
def test_a_probe_costs_at_most_the_budget_under_the_truth(truth):
    """The budget holds under each regime's fit, so under either truth: measured by the truth itself,
    the probe step costs at most 2 % more than the step planned at the cap (the dense truth: less)."""
    rng = np.random.default_rng(1)
    meter = mp.CostMeter(prior=mp.FlopsCost.from_hf_config(CFG))
    base = mp.PlanConfig(dp_size=4, max_tokens_per_micro=CAP)
    meter.explore_config(base, _batch(0))
    _feed(meter, _at_cap(rng, 64), truth, rng)
    batch = _batch(2)
    cfg = meter.explore_config(base, batch)
    assert cfg.max_tokens_per_micro < CAP
    probe, unexplored = mp.plan(batch, cfg), mp.plan(batch, replace(cfg, max_tokens_per_micro=CAP))
    assert lockstep_seconds(probe, truth) <= 1.02 * lockstep_seconds(unexplored, truth)


def test_probes_stop_after_the_warm_up_and_need_a_token_cap():
    rng = np.random.default_rng(2)
    meter = mp.CostMeter(prior=mp.FlopsCost.from_hf_config(CFG), explore_steps=2)
    base = mp.PlanConfig(dp_size=4, max_tokens_per_micro=CAP)
    static = mp.PlanConfig(dp_size=4, micro_batch_size=8)
    meter.explore_config(base, _batch(0))
    _feed(meter, _at_cap(rng, 64), DENSE, rng)
    assert meter.explore_config(static, _batch(1)) == replace(static, cost=meter.cost())  # step 2: no cap to lower
    assert meter.explore_config(base, _batch(1)).max_tokens_per_micro == CAP             # step 3 > explore_steps
    assert not meter.report().probes


def test_every_rank_gets_the_same_probe():
    """Pure in the records and the calls: two meters fed alike hand out equal configs and plans."""
    def run() -> list:
        rng = np.random.default_rng(3)
        meter = mp.CostMeter(prior=mp.FlopsCost.from_hf_config(CFG))
        base = mp.PlanConfig(dp_size=4, max_tokens_per_micro=CAP)
        out = []
        for s in range(3):
            batch = _batch(10 + s)
            cfg = meter.explore_config(base, batch)
            plan = mp.plan(batch, cfg)
            out.append((cfg, plan.fingerprint()))
            _feed(meter, _at_cap(rng, 16) + _plan_micros(plan), DENSE, rng)
        return out
    assert run() == run()


def test_a_decided_regime_survives_records_that_cannot_tell():
    """One-sample micro-batches (what a dense plan runs at small K) price alike in both regimes: the
    regime decided when a model was handed out is kept, not flipped back to the prior's."""
    rng = np.random.default_rng(4)
    meter = mp.CostMeter(prior=mp.FlopsCost.from_hf_config(CFG), window=300)
    packs = [rng.integers(500, 4000, k) for k in rng.integers(2, 12, 150)]  # varied T: decisive
    _feed(meter, packs, DENSE, rng)
    assert meter.cost().dense and meter.report().regime_evidence >= EVIDENCE
    _feed(meter, [rng.integers(500, 8000, 1) for _ in range(300)], DENSE, rng)  # the window now holds lone samples
    rep = meter.report()
    assert abs(rep.regime_evidence) < EVIDENCE and rep.regime == "dense"


@pytest.mark.parametrize("kwargs, match", [
    (dict(explore_budget=1.5), "below 1"),
    (dict(explore_budget=-0.1), ">= 0"),
    (dict(explore_steps=-1), ">= 0"),
])
def test_bad_exploration_settings(kwargs, match):
    with pytest.raises(mp.PlanError, match=match):
        mp.CostMeter(**kwargs)


def test_explore_config_needs_a_plan_config():
    with pytest.raises(mp.PlanError, match="PlanConfig"):
        mp.CostMeter().explore_config({"dp_size": 2}, _batch(0))  # type: ignore[arg-type]


# -- item 2: tree micro-batches in the verl drop-in ----------------------------------------------------

def test_verl_records_tree_micro_batches_by_their_trie():
    """``_verl_meter._record`` gets each rank's micro-batches: lengths for a flat one, the tree Micro
    for one that ran as a prefix-tree row. Both are recorded; the tree by its trie's work."""
    from microplan.integrations import _verl_meter as vm
    batch = mp.Batch([3000, 3200, 3400, 5000, 900, 4000], prefix_parent=[-1, 0, 0, -1, -1, 4],
                     shared_prefix_lens=[0, 2500, 2500, 0, 0, 800])
    plan = mp.plan(batch, mp.PlanConfig(dp_size=1, max_tokens_per_micro=9000, share_prefixes=True))
    trees = [m for m in plan.rank(0)[0] if m.tree is not None and m.num_tokens < int(m.seq_lens.sum())]
    assert trees
    prior = mp.FlopsCost(linear=6e9, quadratic=2e5, per_micro=1e11)
    vm.reset(cost=None, hf_config=None)
    vm.STATE["meter"] = mp.CostMeter(prior=prior)
    try:
        ranks = [[([1200, 800], 1e-14 * prior.micro_cost([1200, 800]))] +
                 [(m, 1e-14 * prior.micro_cost(m)) for m in trees]]
        vm._record(ranks, prior, {})
        meter = vm.STATE["meter"]
        assert meter.num_records == 1 + len(trees) and vm.STATE["tree_records"] == len(trees)
        assert meter.report().fit_median_error < 1e-6   # the trie's price, not the unshared lengths'
    finally:
        vm.reset()


@given(dp=st.integers(1, 4), n=st.integers(8, 120), max_len=st.integers(200, 6000), cap_mult=st.floats(1.0, 6.0),
       dense=st.booleans(), attn=st.floats(0.5, 3.0), seed=st.integers(0, 2**16))
def test_a_probe_only_lowers_the_cap_and_stays_in_budget(dp, n, max_len, cap_mult, dense, attn, seed):
    """Whatever the batch and the machine: ``explore_config`` returns the config with the meter's cost
    and a cap no higher than the config's; the plan validates; a probe's predicted extra time is at
    most the budget under the worse regime's fit."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, max_len + 1, n)
    cap = max(int(lens.max() * cap_mult), int(lens.max()))
    truth = mp.FlopsCost(linear=1e-6, quadratic=0.0 if dense else attn * 1e-10,
                         packed_quadratic=2 * attn * 1e-10 if dense else 0.0, per_micro=1e-6 * cap * 0.02)
    meter = mp.CostMeter(prior=mp.FlopsCost.from_hf_config(CFG))
    base = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap)
    for step in range(3):
        batch = mp.Batch(rng.permutation(lens))
        cfg = meter.explore_config(base, batch)
        assert cfg.max_tokens_per_micro <= cap
        assert replace(cfg, max_tokens_per_micro=cap) == replace(base, cost=cfg.cost)
        plan = mp.plan(batch, cfg)
        plan.validate()
        _feed(meter, _plan_micros(plan), truth, rng)
    for p in meter.report().probes:
        assert p.cap < cap and p.extra_share <= 0.02 + 1e-12 and 2 <= p.step <= 3
