"""Smoke tests of the benchmark: the peers run and keep their documented shapes, and the metrics
are right on hand-built tiny plans (values worked out by hand in the comments)."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: ``benchmarks``

import microplan as mp  # noqa: E402
from microplan.traces import generate  # noqa: E402
from benchmarks import bench_planners  # noqa: E402
from benchmarks.metrics import dense_7b_cost, from_microplan, step_metrics  # noqa: E402
from benchmarks.peers import (PEERS, PeerCrash, karmarkar_karp, plan_openrlhf, plan_skyrl,  # noqa: E402
                              plan_slime, plan_verl)

A = np.asarray


def plan_of(*ranks):
    return [[A(m, dtype=np.int64) for m in r] for r in ranks]


# -- metrics on hand-built plans -------------------------------------------------------------------

def test_metrics_unequal_counts():
    # lens 4,3,2,1; cost = 2 + L (+0 quadratic); cap 5; dp 2.
    # rank0: [0] (4 tok, cost 6), [3] (1 tok, cost 3); rank1: [1,2] (5 tok, cost 7).
    cost = mp.FlopsCost(linear=1.0, per_micro=2.0)
    m = step_metrics(plan_of([[0], [3]], [[1, 2]]), A([4, 3, 2, 1]), dp=2, cap=5, cost=cost)
    assert (m.over_cap, m.max_tokens_ratio, m.equal_counts, m.empties) == (0, 1.0, False, 0)
    assert (m.lost, m.duplicated, m.pad_rows, m.K, m.K_lb) == (0, 0, 0, 2, 1)
    assert m.lockstep == 7 + 3           # slot 0: max(6, 7); slot 1: max(3, missing = 0)
    assert m.step_sync == 9              # max(6 + 3, 7)
    assert m.lb == 10 / 2 + 1 * 2        # max(Σcost/dp + K_lb·per_micro = 7, 4 + 2 = 6)
    assert m.lockstep_ratio == pytest.approx(10 / 7) and m.step_sync_ratio == pytest.approx(9 / 7)


def test_metrics_overcap_empty_lost_duplicate_padding():
    # cost = 1 + L + 0.5·L²; lens 4,3,2,1; cap 5; dp 2.
    # rank0: [0,1] 7 tok (over cap), [] empty; rank1: [2, copy of 3] 3 tok, [2] 2 tok (duplicate).
    cost = mp.FlopsCost(linear=1.0, quadratic=0.5, per_micro=1.0)
    c = {L: L + 0.5 * L * L for L in (1, 2, 3, 4)}
    m = step_metrics(plan_of([[0, 1], []], [[2, ~3], [2]]), A([4, 3, 2, 1]), dp=2, cap=5, cost=cost)
    assert (m.over_cap, m.max_tokens_ratio, m.equal_counts, m.empties) == (1, 7 / 5, True, 1)
    assert (m.lost, m.duplicated, m.pad_rows) == (1, 1, 1)   # sample 3 only as a padding copy
    r0 = [1 + c[4] + c[3], 1.0]
    r1 = [1 + c[2] + c[1], 1 + c[2]]
    assert m.lockstep == pytest.approx(max(r0[0], r1[0]) + max(r0[1], r1[1]))
    assert m.step_sync == pytest.approx(max(sum(r0), sum(r1)))
    assert m.lb == pytest.approx(max(sum(c.values()) / 2 + 1 * 1, c[4] + 1))
    assert (m.K, m.K_lb) == (2, 1)


def test_metrics_microplan_plan():
    lens = A([900, 700, 500, 400, 300, 200, 100, 50])
    cost = mp.FlopsCost(linear=1.0, quadratic=1e-3, per_micro=10.0)
    p = mp.plan(mp.Batch(lens), mp.PlanConfig(dp_size=2, max_tokens_per_micro=1000, cost=cost))
    m = step_metrics(from_microplan(p), lens, dp=2, cap=1000, cost=cost)
    assert m.over_cap == 0 and m.equal_counts and m.lost == 0 and m.duplicated == 0
    assert m.K == p.steps[0].micro_count and m.K_lb == 2
    st = p.stats.steps[0]
    # microplan's bound adds the lockstep slot bound (stages/kchoice.py) to the PEERS.md one: never below it
    assert m.lb <= st.time_lower_bound * (1 + 1e-12) <= m.lockstep
    assert m.lockstep == pytest.approx(st.lockstep_time, rel=1e-6)   # placeholders aside, same model


def test_metrics_rejects_wrong_rank_count_and_bad_index():
    cost = mp.FlopsCost(linear=1.0)
    with pytest.raises(ValueError):
        step_metrics(plan_of([[0]]), A([1]), dp=2, cap=5, cost=cost)
    with pytest.raises(ValueError):
        step_metrics(plan_of([[0, 5]]), A([1, 1]), dp=1, cap=5, cost=cost)


# -- Karmarkar–Karp ------------------------------------------------------------------------------

def test_kk_equal_and_unequal():
    w = [8, 7, 6, 5, 4, 3, 2, 1]
    eq = karmarkar_karp(w, 2, equal_size=True)
    assert sorted(i for p in eq for i in p) == list(range(8)) and [len(p) for p in eq] == [4, 4]
    assert sorted(sum(w[i] for i in p) for p in eq) == [18, 18]
    # 2-way differencing on 8,7,6,5,4: 8-7=1, 6-5=1, 4-1=3, 3-1=2 -> sums 14/16 (optimum is 15/15)
    un = karmarkar_karp([8, 7, 6, 5, 4], 2, equal_size=False)
    assert sorted(i for p in un for i in p) == list(range(5))
    assert sorted(sum([8, 7, 6, 5, 4][i] for i in p) for p in un) == [14, 16]
    assert karmarkar_karp([1.0], 3, equal_size=False) == [[0], [], []]


# -- peers --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(PEERS))
def test_peer_runs_and_keeps_every_sample(name):
    lens = np.asarray(generate("grpo-longtail", num_prompts=24, samples_per_prompt=8,
                            max_len=4096, seed=3).seq_lens)
    plan = PEERS[name][0](lens, dp=8, cap=8192, cost=dense_7b_cost())
    m = step_metrics(plan, lens, dp=8, cap=8192, cost=dense_7b_cost())
    assert len(plan) == 8 and m.lost == 0 and m.duplicated == 0
    if m.K >= m.K_lb:  # LB assumes the cap; a plan breaking it with fewer micro-batches can beat it
        assert m.lockstep_ratio >= 1.0 - 1e-12 and m.step_sync_ratio >= 1.0 - 1e-12
    assert all(m_.dtype == np.int64 for row in plan for m_ in row)


def test_verl_pad_only_micro_is_empty():
    # [100, 1, 1] padded with one 2-token sample; KK equal: ranks {100, 1} and {1, pad}; k = 2,
    # so the pad sits alone in a micro-batch: empty once pads are dropped.
    m = step_metrics(plan_verl(A([100, 1, 1]), dp=2, cap=10), A([100, 1, 1]), dp=2, cap=10,
                     cost=mp.FlopsCost(linear=1.0))
    assert (m.empties, m.equal_counts, m.lost) == (1, True, 0)


def test_slime_singletons_cannot_reach_target():
    with pytest.raises(PeerCrash):  # first-fit: 3 singleton bins, target 4 at dp=2
        plan_slime(A([10, 10, 10]), dp=2, cap=10)


def test_skyrl_pads_with_copies_and_padding_micros():
    lens = A([9, 1, 1])                # pad 1 row (copy of row 0): slabs [9, 1] and [1, copy of 9]
    plan = plan_skyrl(lens, dp=2, cap=10)
    m = step_metrics(plan, lens, dp=2, cap=10, cost=mp.FlopsCost(linear=1.0))
    assert (m.pad_rows, m.lost, m.duplicated, m.equal_counts) == (1, 0, 0, True)


def test_openrlhf_round_down_breaks_cap():
    # first-fit: 3 bins of 6; rounded down to a multiple of dp=2 -> 2 micro-batches; KK -> [6,6] + [6].
    m = step_metrics(plan_openrlhf(A([6, 6, 6]), dp=2, cap=10), A([6, 6, 6]), dp=2, cap=10,
                     cost=mp.FlopsCost(linear=1.0))
    assert (m.over_cap, m.max_tokens_ratio) == (1, 1.2)


# -- the benchmark driver ---------------------------------------------------------------------

def test_bench_case_summary_and_table():
    rows = bench_planners.run_case("bimodal", 8, 0, dense_7b_cost(), ["microplan", "verl", "slime"])
    assert {r["planner"] for r in rows} == {"microplan", "verl", "slime"}
    assert all(r["crash"] is None for r in rows)
    mp_row = next(r for r in rows if r["planner"] == "microplan")
    assert mp_row["over_cap"] == 0 and mp_row["equal_counts"] and mp_row["samples"] >= 8 * 16
    text = bench_planners.format_table(bench_planners.summarise(rows))
    assert "microplan" in text and "lockstep/LB" in text


def test_bench_forward_rows_use_the_forward_cap_and_cost():
    from benchmarks.metrics import dense_7b_forward_cost
    rows = bench_planners.run_case("grpo-longtail", 8, 1, dense_7b_cost(), ["microplan", "microplan-forward",
                                                                           "verl-forward"])
    by = {r["planner"]: r for r in rows}
    train_cap = bench_planners.FAMILIES["grpo-longtail"][1]
    mult = bench_planners.FORWARD_CAP_MULT[1 % len(bench_planners.FORWARD_CAP_MULT)]
    assert by["microplan"]["cap"] == train_cap and by["microplan"]["passes"] == "train"
    for name in ("microplan-forward", "verl-forward"):
        assert by[name]["cap"] == mult * train_cap and by[name]["passes"] == "forward" and by[name]["crash"] is None
    fwd = by["microplan-forward"]
    assert fwd["equal_counts"] and fwd["over_cap"] == 0 and fwd["lost"] == 0 and fwd["K"] == fwd["K_lb"]
    assert fwd["K"] < by["microplan"]["K"]
    assert dense_7b_forward_cost().linear * 3 == dense_7b_cost().linear


def test_bench_pipeline_case():
    from benchmarks import bench_pipeline
    row = bench_pipeline.run_case("bimodal", 8, 0, 4, 1, dense_7b_cost())
    assert row["K"] >= 4 and 0 < row["bubble"] < 1
    for name in bench_pipeline.ORDERS:  # never slower than the usual orders of the same micro-batches
        assert row[name] >= 1 - 1e-12
    text = bench_pipeline.format_table(bench_pipeline.summarise([row]))
    assert "verl" in text and "bimodal" in text


def test_verl_min_num_micro_batch():
    lens = A([100, 90, 80, 70])
    assert len(plan_verl(lens, dp=2, cap=1000)[0]) == 1
    plan = plan_verl(lens, dp=2, cap=1000, min_num_micro_batch=2)
    assert [len(row) for row in plan] == [2, 2]
# -- bench_measured: the scoring pieces with a simulated machine ----------------------------------

from benchmarks import bench_measured as bm  # noqa: E402


class _SimModel:
    """Stands in for benchmarks/_timed_model.TimedModel: time = a known cost of the composition."""

    backend = "sim"

    def __init__(self, truth):
        self.truth = truth

    def time_plan(self, lens_plan):
        return [[self.truth.micro_cost(m if len(m) else [1]) for m in row] for row in lens_plan]


def test_measured_lockstep_and_step_sync_by_hand():
    t = [[3.0, 1.0], [2.0, 2.5, 0.5]]
    assert bm.lockstep(t) == 3.0 + 2.5 + 0.5 and bm.step_sync(t) == 5.0


def test_measured_steps_are_whole_prompts_and_peer_padding_copies_cost():
    steps = bm.make_steps("grpo-longtail", dp=4, spg=4, count=3, max_len=1024)
    assert len(steps) == 3 and all(s.num_samples >= 16 and s.num_samples % 8 == 0 for s in steps)
    lens = bm.peer_lens(lambda l, **kw: [[np.array([0, ~1])], [np.array([2], dtype=np.int64)]],
                        steps[0], 2, 4096, None)
    assert [list(m) for r in lens for m in r] == [[steps[0].seq_lens[0], steps[0].seq_lens[1]], [steps[0].seq_lens[2]]]


def test_measured_case_with_a_known_machine():
    """Profiled = the truth: its predictions are exact and it is never slower than the peers."""
    truth = mp.FlopsCost(linear=1e-4, quadratic=1e-7, per_micro=0.01)
    prior = mp.FlopsCost(linear=1.0, quadratic=1e-3)
    opts = dict(cap=2048, spg=4, warmup=2, scored=2, max_len=2048, seed=0)
    rows = bm.run_case(_SimModel(truth), "grpo-longtail", 4, opts, prior, truth, lambda msg: None)
    assert {r["planner"] for r in rows} == set(bm.MICROPLAN) | set(bm.PEERS) and len(rows) == 12
    summary = bm.summarise(rows)
    by = {s["planner"]: s for s in summary}
    assert by["microplan-profiled"]["errors"]["micro_max"] < 1e-12
    assert by["microplan-profiled"]["errors"]["step_max"] < 1e-12
    assert by["microplan-metered"]["errors"]["step_median"] < 0.05  # learned from 2 warm-up steps
    assert by["microplan-profiled"]["lockstep"] <= min(by[p]["lockstep"] for p in bm.PEERS) * (1 + 1e-9)
    assert by["microplan-flops"]["errors"]["scale"] > 0
    targets = bm.check_targets(summary)
    assert list(targets) == ["sim/grpo-longtail/4"] and targets["sim/grpo-longtail/4"]["lowest"]
    assert targets["sim/grpo-longtail/4"]["step_pred_error_median"] < 1e-12
    assert "microplan-metered" in bm.format_table(summary)


def test_bench_share_speed_row():
    """bench_share_speed: one small chain, both plans, the primitives timed, the sharing plan holding
    the chain's trie (its last sample) per micro-batch at most."""
    from benchmarks import bench_share_speed as bs
    row = bs.time_case("chain 40", bs.chain(40), 1, 1, dense_7b_cost())
    assert set(row["median_ms"]) == {"share", "no-share"} and row["ratio"] > 0
    assert set(row["primitives_ms"]) == {"cut_trees", "set_tries", "set_tries_x8", "micro_tree_all", "micro_trees"}
    assert row["tokens"]["share"] < row["tokens"]["no-share"]


def test_bench_meter_informed_estimator_is_exact_without_noise():
    """The grid's yardstick: told the truth's form and per-micro overhead, least squares on
    noise-free records recovers the truth, so its plans score exactly as the oracle's; with 5 %
    noise it is a real estimate (its plans may differ)."""
    from benchmarks import bench_meter as bmeter

    exact = bmeter.run_case("long-context", 8, 0, "attn2/over0.05", spec=(2.0, 0.05, False), noise=0.0,
                            informed=True)
    assert len(exact["informed"]) == bmeter.SCORED
    assert exact["informed"] == pytest.approx(exact["oracle"], rel=1e-9)
    noisy = bmeter.run_case("long-context", 8, 1, "attn1.2/over0.1", spec=(1.2, 0.1, False), noise=0.05,
                            informed=True, warmup=1)
    assert len(noisy["informed"]) == bmeter.SCORED and min(noisy["informed"]) >= 1.0
    assert len(noisy["point"]) == bmeter.SCORED and min(noisy["point"]) >= 1.0
    # without the hedge the meter's plan IS its point estimate's
    plain = bmeter.run_case("long-context", 8, 1, "attn1.2/over0.1", spec=(1.2, 0.1, False), noise=0.05,
                            warmup=1, hedge=False)
    assert plain["point"] == plain["metered"]


def test_bench_meter_probes_at_the_cap_and_meters_trees():
    """Issue 27: from the default prior, a dense truth at the cap (every warm-up micro-batch ~cap
    tokens) is identified and the probes cost at most 2 % under the truth; with shared prefixes the
    meter learns from tree micro-batches (the grid's gap to the oracle)."""
    from benchmarks import bench_meter as bmeter

    dense = bmeter.run_case("grpo-longtail", 8, 1, "dense-1x", shape="at-cap", sweep=False)
    assert dense["regime"] == "dense" and dense["explore_cost"] <= 0.02
    assert max(m - o for m, o in zip(dense["metered"], dense["oracle"])) < 0.005
    trees = bmeter.run_tree_case("grpo-longtail", 8, 0, "attn2.0/over0.05")
    assert len(trees["metered"]) == bmeter.SCORED and max(trees["shared"]) < 1.0  # tries share tokens
    assert np.median(np.subtract(trees["metered"], trees["oracle"])) <= 0.002


def test_plan_hashes_cover_valid_plans_and_see_a_change():
    """benchmarks/plan_hashes.py: every case plans and validates, a re-plan prints the same
    fingerprints (the plan is a pure function of its inputs), and one more token in one sample
    changes the plan JSON's."""
    from benchmarks import plan_hashes

    names = set()
    cases = plan_hashes.cases()
    for name, batch, cfg in cases:
        plan = mp.plan(batch, cfg)
        plan.validate()
        assert plan_hashes.fingerprint(plan) == plan_hashes.fingerprint(mp.plan(batch, cfg))
        names.add(name)
    assert len(names) == len(cases) == 18  # distinct names; the config-cost and 16k sharing cases included
    name, batch, cfg = plan_hashes.cases()[1]
    before = plan_hashes.fingerprint(mp.plan(batch, cfg))
    lens = np.asarray(batch.seq_lens).copy()
    lens[0] += 1  # one more token in one sample: other loss scales, maybe another packing
    changed = mp.Batch(lens, prompt_lens=batch.prompt_lens, prompt_ids=batch.prompt_codes,
                       rollout_ids=batch.rollout_codes)
    after = plan_hashes.fingerprint(mp.plan(changed, cfg))
    assert after[0] != before[0]


def test_bench_speed_config_rows(monkeypatch):
    """bench_speed on a small step: the config-cost rows (plan, user path, TokenCost) are timed with
    their ratios, on the CPU clock when asked; the config cost is the default from_hf_config."""
    from benchmarks import bench_speed as bsp
    from benchmarks.metrics import config_7b_cost
    monkeypatch.setattr(bsp, "_clock", bsp.CLOCK["cpu"])
    c = bsp.time_case(512, 8, 1, dense_7b_cost(), np.min)
    assert {"plan-config", "plan-token", "path-config", "path", "shared"} <= set(c["median_ms"])
    assert set(c["ratio_path_config"]) == {"slime", "verl", "verl-critical-path"}
    assert all(v >= 0 for v in c["median_ms"].values())
    cost = config_7b_cost()
    assert cost.attention_rel_sd == 0 and cost.quadratic > 0  # the default path: no hedge, not per token
