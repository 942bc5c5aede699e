"""The padded-layout benchmark: metrics by hand on tiny plans, the padded peers' documented shapes,
and one real case end to end (microplan never over the cap counting padding)."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: ``benchmarks``

import microplan as mp  # noqa: E402
from benchmarks import bench_layouts  # noqa: E402
from benchmarks.metrics import dense_7b_cost, padded_step_metrics  # noqa: E402
from benchmarks.peers.padded import plan_fixed_mbs, plan_sorted_buckets, plan_unirl_2d  # noqa: E402

A = np.asarray


def plan_of(*ranks):
    return [[A(m, dtype=np.int64) for m in r] for r in ranks]


def test_padded_metrics_by_hand():
    # lens 4,3,2,1; cost = 1 + L; cap 8; dp 2.
    # rank0: [0,3] -> 2 rows of 4 = 8 tokens, cost 1 + 2·4 = 9; rank1: [1,2] -> 2 rows of 3 = 6, cost 7.
    cost = mp.FlopsCost(linear=1.0, per_micro=1.0)
    m = padded_step_metrics(plan_of([[0, 3]], [[1, 2]]), A([4, 3, 2, 1]), dp=2, cap=8, cost=cost)
    assert m.waste == 14 / 10 and m.over_cap == 0 and m.max_tokens_ratio == 1.0 and m.equal_counts
    assert m.lockstep == 9 and m.step_sync == 9
    assert m.lb_pad == max((8 + 6) / 2 + 1 * 1, 9)  # K_lb = ⌈14 / 16⌉ = 1
    assert m.lb_real == max(10 / 2 + 1, 4 + 1)
    # 2D, prompts 3,0,2,0: rank0 rows of max prompt 3 + max response 1 = 4 (8 tokens, cost 9);
    # rank1 rows of max prompt 2 + max response 3 = 5 (10 tokens, over the cap, cost 11)
    m2 = padded_step_metrics(plan_of([[0, 3]], [[1, 2]]), A([4, 3, 2, 1]), dp=2, cap=8, cost=cost,
                             prompt_lens=A([3, 0, 2, 0]))
    assert m2.over_cap == 1 and m2.max_tokens_ratio == 10 / 8 and m2.lockstep == 11 and m2.waste == 18 / 10


def test_sorted_buckets_share_boundaries_and_fit_the_budget():
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 1000, 97)
    plan = plan_sorted_buckets(lens, dp=4, cap=2000)
    assert len({len(r) for r in plan}) == 1  # the boundaries are computed once for all ranks
    flat = np.concatenate([m for r in plan for m in r])
    assert sorted(flat.tolist()) == list(range(97))
    for m in range(len(plan[0])):  # count × the longest at these positions on any rank fits
        k = max(len(r[m]) for r in plan)
        assert k * max(int(lens[r[m]].max()) for r in plan if len(r[m])) <= 2000 or k == 1


def test_fixed_mbs_and_unirl_shapes():
    lens = A([10, 9, 8, 7, 6, 5, 4, 3, 2, 1])
    plan = plan_fixed_mbs(lens, dp=2, cap=25, max_len=10)  # mbs = 2 on contiguous shares of 5
    assert [[m.tolist() for m in r] for r in plan] == [[[0, 1], [2, 3], [4]], [[5, 6], [7, 8], [9]]]
    plens = A([5, 0, 4, 0, 3, 0, 2, 0, 1, 0])
    u = plan_unirl_2d(lens, plens, dp=2, cap=20)
    assert len({len(r) for r in u}) == 1
    assert sorted(np.concatenate([m for r in u for m in r]).tolist()) == list(range(10))


def test_one_case_end_to_end():
    cost = dense_7b_cost()
    rows = bench_layouts.run_case("grpo-longtail", 8, 0, cost, list(bench_layouts.PLANNERS))
    by = {r["planner"]: r for r in rows}
    assert set(by) == set(bench_layouts.PLANNERS)
    for name in ("microplan", "microplan-2d"):
        assert by[name]["over_cap"] == 0 and by[name]["equal_counts"] and by[name]["lost"] == 0
    assert by["microplan"]["waste"] < by["sorted-buckets"]["waste"]
    assert by["microplan"]["real_ratio"] < by["fixed-mbs"]["real_ratio"]
    assert by["microplan-varlen"]["waste"] == 1.0
    summary = bench_layouts.summarise(rows)
    assert "padded/real" in bench_layouts.format_table(summary)
    assert bench_layouts.check_targets(summary)[0].startswith("grpo-longtail")


@pytest.mark.parametrize("family", ["stepwise-multiturn"])
def test_microplan_padded_pads_less_than_the_peers(family):
    cost = dense_7b_cost()
    rows = bench_layouts.run_case(family, 8, 1, cost, ["microplan", "sorted-buckets", "fixed-mbs"])
    by = {r["planner"]: r for r in rows}
    assert by["microplan"]["over_cap"] == 0
    assert by["microplan"]["real_ratio"] < min(by["sorted-buckets"]["real_ratio"], by["fixed-mbs"]["real_ratio"])


def test_small_steps_against_the_optimum():
    cost = dense_7b_cost()
    rows = bench_layouts.small_cases(["grpo-longtail"], cost, seeds=2)
    assert [r["seed"] for r in rows] == [0, 1]
    for r in rows:  # the optimum without placeholders is never below the one with them, nor the plan below it
        assert r["plan_opt"] >= r["plan_full"] * (1 - 1e-9) and r["plan_full"] >= 1 - 1e-9
        assert r["opt_bound"] >= 1 - 1e-9
    text = bench_layouts.format_small(rows)
    assert "plan/opt_full" in text and len(text.splitlines()) == 3 + 1 + 2 + len(rows)
    assert all(line.endswith(("ok", "MISS")) or "ok)" in line or "MISS)" in line
               for line in bench_layouts.check_small(rows))


def test_padded_anneal_scores_cuts_like_the_exact_module_and_keeps_the_cap():
    """benchmarks/padded_anneal.py: its lockstep of a cut is padded_exact.runs_lockstep's, the plan's
    refilled cut is never slower than the plan, K ± 1 starts have dp·(K ± 1) runs under the cap, and
    the search never returns worse than its start."""
    import benchmarks.padded_anneal as pa
    from benchmarks.padded_exact import runs_lockstep

    rng = np.random.default_rng(5)
    lens = rng.integers(20, 900, 40)
    cost = pa.dense_7b_cost()
    dp, cap = 4, 2048
    plan, _ = pa._plan_microplan(mp.Batch(lens.tolist()), dp, cap, cost, "padded")
    got = pa.padded_step_metrics(plan, lens, dp=dp, cap=cap, cost=cost).lockstep
    cuts = pa.Cuts(lens, dp, cap, cost)
    cut = pa.plan_cut(plan, lens)
    assert cuts.time(cut) == pytest.approx(runs_lockstep(lens, cut, dp=dp, cost=cost), rel=1e-12)
    assert cuts.time(cut) <= got * (1 + 1e-12)
    K = len(plan[0])
    for k in (K - 1, K + 1):
        s = pa.start_at(cut, dp * k, cuts)
        if s is not None:
            assert s.size - 1 == dp * k and s[0] == 0 and s[-1] == lens.size
    best = pa.anneal(cut, cuts, 0.2, np.random.default_rng(0))
    assert best <= cuts.time(cut) and np.isfinite(best)
    assert lens.size * int(lens.max()) > cap and cuts.time(np.array([0, lens.size])) == float("inf")  # over the cap
