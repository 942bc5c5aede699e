"""Local placement's repair (step 4 of stages/local.py's note): differencing toward the slot
targets and pooled re-splits of two bins, per rank.

Properties over random ranks: caps kept, no bin emptied, atoms only permuted among the rank's
bins, the rank's overshoot of the targets never raised, deterministic. Instances: the rank that
two-bin exchanges cannot fix (two 16k-token samples in one micro-batch, K = 3) and the worst
dp-128 case bench_planners found (bimodal, verl's split, seed 0: 1.0159 of the split's bound).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: ``benchmarks``

import microplan as mp  # noqa: E402
from microplan.stages.local import _repair  # noqa: E402
from microplan.stages.local_refine import differencing_bins, overshoot, repartition_pairs  # noqa: E402
from microplan.stages.refine import refine_bins  # noqa: E402
from _local_cases import bench_local_plan  # noqa: E402


def _rank(seed: int, K: int, per: int, cap: int):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(K, K * per + 1))
    lens = np.minimum(rng.lognormal(7.0, 1.2, n).astype(np.int64) + 1, cap // 2)
    costs = lens + 1e-4 * lens.astype(np.float64) ** 2
    bins = np.r_[np.arange(K), rng.integers(0, K, n - K)]  # every bin non-empty (the cap: checked by the test)
    tau = np.sort(rng.uniform(0.9, 1.2, K))[::-1] * costs.sum() / K
    return lens, costs, bins, tau


def _check_bins(bins, lens, K: int, cap: int, before=None) -> None:
    assert bins.min() >= 0 and bins.max() < K
    assert (np.bincount(bins, minlength=K) >= 1).all(), "a bin was emptied"
    tok = np.bincount(bins, weights=lens, minlength=K)
    limit = cap if before is None else np.maximum(cap, np.bincount(before, weights=lens, minlength=K))
    assert (tok <= limit).all(), "the cap broke"


@given(seed=st.integers(0, 2 ** 31), K=st.integers(2, 8), per=st.integers(1, 8))
def test_repair_keeps_caps_and_bins_and_never_overshoots_more(seed, K, per):
    cap = 1 << 16
    lens, costs, bins, tau = _rank(seed, K, per, cap)
    if np.bincount(bins, weights=lens, minlength=K).max() > cap:
        bins = np.argsort(np.argsort(-lens)) % K  # round robin of the longest: under cap (each ≤ cap/2, n ≤ 8K)
        if np.bincount(bins, weights=lens, minlength=K).max() > cap:
            return
    over = lambda b: overshoot(np.bincount(b, weights=costs, minlength=K), tau)  # noqa: E731
    kk = differencing_bins(costs, lens, tau, cap)
    if kk is not None:
        _check_bins(kk, lens, K, cap)
        assert np.array_equal(kk, differencing_bins(costs, lens, tau, cap))  # deterministic
    got = repartition_pairs(bins, costs, lens, tau, cap, tol=0.0)
    _check_bins(got, lens, K, cap, bins)
    excess = lambda b: float((-np.sort(-np.bincount(b, weights=costs, minlength=K)) - tau).max())  # noqa: E731
    assert excess(got) <= excess(bins) + 1e-9 * tau.sum(), "a re-split raised the largest excess"
    fixed = _repair(bins, costs, lens, None, tau, cap, tau)
    _check_bins(fixed, lens, K, cap, bins)
    assert over(fixed) <= over(bins) * (1 + 1e-12)
    assert np.array_equal(fixed, _repair(bins, costs, lens, None, tau, cap, tau))


def test_repair_separates_two_long_samples_that_exchanges_cannot():
    """bimodal dp 128 seed 0, one rank at K = 3 as LPT and two-bin exchanges leave it: its two
    16k-token samples share a micro-batch (1.798e15 vs a mean of 1.730e15). No single exchange and
    no two-bin re-split separates them (each bin's other samples are too coarse); differencing
    does, to within 0.1% of the mean — a lower bound on any packing's heaviest micro-batch."""
    from benchmarks.metrics import dense_7b_cost
    cost = dense_7b_cost()
    lens = np.array([16384, 16384, 14672, 12223, 10384, 10181, 8542, 6427, 1490, 926, 691, 684, 562, 445, 322, 191])
    costs = cost.sample_costs(lens.astype(np.float64))
    bins = np.array([1, 1, 2, 2, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0])
    cap, K = 49152, 3
    tau = np.full(K, costs.sum() / K)
    top = lambda b: float(np.bincount(b, weights=costs, minlength=K).max())  # noqa: E731
    assert top(bins) > 1.039 * tau[0]
    assert top(refine_bins(bins, lens, costs, K, cap, offset=tau, rel_tol=1e-6, max_iters=100)) == top(bins)
    assert top(repartition_pairs(bins, costs, lens, tau, cap, tol=0.0)) == top(bins)
    fixed = _repair(bins, costs, lens, None, tau, cap, tau)
    _check_bins(fixed, lens, K, cap)
    assert top(fixed) <= 1.001 * tau[0], top(fixed) / tau[0]


def test_worst_dp128_instance_meets_the_split_bound():
    """bench_planners' worst local case at dp 128 (bimodal, verl's split, seed 0): 1.0159 of the
    split's bound at K = 4 before the repair; an annealing search (benchmarks/local_reference.py)
    found 1.0002 at K = 3, and the planner now finds K = 3 within 0.5%."""
    plan, batch, cfg = bench_local_plan("bimodal", 128, 0)
    st_ = plan.stats.steps[0]
    assert st_.micro_count == 3
    assert st_.lockstep_time <= 1.005 * st_.split_lower_bound, st_.lockstep_time / st_.split_lower_bound


def test_repair_keeps_the_busiest_ranks_profile_that_the_others_match():
    """long-context dp 32 seed 0, pinned round robin: the busiest rank's uneven profile is the
    envelope (lockstep == the split's bound) while another rank's lone long sample fills slot 0;
    flattening the busiest rank toward the targets lowered its overshoot of them but raised the
    step (1.0000 -> 1.0012, K 4 -> 5), so a repair is kept only if the lockstep time with the other
    ranks' slot maxima does not rise."""
    from benchmarks.bench_planners import FAMILIES, SPG, make_step
    from benchmarks.metrics import dense_7b_cost
    seed, dp = 0, 32
    batch = make_step("long-context", dp, SPG[seed % len(SPG)], seed)
    batch = batch.with_rank_of(np.arange(batch.num_samples) % dp)
    cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=FAMILIES["long-context"][1], cost=dense_7b_cost(),
                        placement="local")
    st_ = mp.plan(batch, cfg).stats.steps[0]
    assert st_.lockstep_time <= 1.0001 * st_.split_lower_bound, st_.lockstep_time / st_.split_lower_bound


def test_reference_annealing_returns_a_valid_packing_no_worse_than_its_start():
    """benchmarks/local_reference.py's search: moves and swaps within each rank under the cap, no
    bin emptied, the lockstep time it reports is the returned packing's and never above the start's."""
    import random

    from benchmarks.local_reference import anneal, lockstep
    rng = np.random.default_rng(3)
    K, cap, pm = 3, 20000, 50.0
    items, bins = [], []
    for _ in range(6):
        lens = rng.integers(200, 4000, 10)
        items.append(((lens + 1e-4 * lens.astype(np.float64) ** 2).tolist(), lens.tolist()))
        bins.append((np.arange(10) % K).tolist())
    grid = lambda b: np.array([np.bincount(b[r], weights=items[r][0], minlength=K) + pm  # noqa: E731
                               for r in range(len(items))])
    assert all(np.bincount(b, weights=items[r][1], minlength=K).max() <= cap for r, b in enumerate(bins))
    start = lockstep(grid(bins))
    got, best = anneal(items, [list(b) for b in bins], K, cap, pm, 0.3, random.Random(0))
    assert got <= start and abs(lockstep(grid(best)) - got) <= 1e-9 * got
    for r, b in enumerate(best):
        assert sorted(np.bincount(b, minlength=K).tolist())[0] >= 1
        assert np.bincount(b, weights=items[r][1], minlength=K).max() <= cap
