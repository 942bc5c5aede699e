"""The granularity-aware bound on padded lockstep time (stages/padded_bound.py) against the
exhaustive optimum (benchmarks/padded_optimum.py), and the contiguity lemma both rest on."""

import sys
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: ``benchmarks``

import microplan as mp  # noqa: E402
from benchmarks.padded_optimum import brute_force_partitions, padded_optimum  # noqa: E402
from microplan.cost.models import row_costs  # noqa: E402
from microplan.stages.padded_bound import padded_lower_bound  # noqa: E402


@st.composite
def instances(draw, max_n: int = 8):
    n = draw(st.integers(1, max_n))
    lens = draw(st.lists(st.integers(1, 64), min_size=n, max_size=n))
    dp = draw(st.integers(1, 3))
    cap = draw(st.integers(max(lens), 320))
    dense = draw(st.booleans())
    cost = mp.FlopsCost(linear=draw(st.floats(0.01, 2.0)), quadratic=draw(st.floats(0.0, 0.1)),
                        per_micro=draw(st.floats(0.0, 40.0)),
                        packed_quadratic=draw(st.floats(0.01, 0.2)) if dense else 0.0)
    return np.array(lens), dp, cap, cost, draw(st.sampled_from([1, 1, 4]))


def _padded_cost(seq_lens, mult, cost) -> float:
    k = len(seq_lens)
    if k == 0:
        return float(cost.per_micro)
    w = float(-(-max(seq_lens) // mult) * mult)
    return float(cost.per_micro) + k * float(row_costs(cost, np.array([w]), k)[0])


@given(instances())
def test_bound_never_above_the_exhaustive_optimum(case):
    lens, dp, cap, cost, mult = case
    opt = padded_optimum(lens, dp=dp, cap=cap, cost=cost, width_multiple=mult)
    if not np.isfinite(opt.time):  # a sample over the cap once rounded up: no plan
        return
    b = padded_lower_bound(lens, dp=dp, cap=cap, cost=cost, width_multiple=mult)
    assert b.time <= opt.time * (1 + 1e-9)
    assert b.volume <= b.time


@given(instances(max_n=6))
def test_contiguous_runs_reach_the_set_partition_optimum(case):
    lens, dp, cap, cost, mult = case
    runs = padded_optimum(lens, dp=dp, cap=cap, cost=cost, width_multiple=mult).time
    every = brute_force_partitions(lens, dp=dp, cap=cap, cost=cost, width_multiple=mult)
    assert runs == every or abs(runs - every) <= 1e-9 * every


def test_bound_by_hand():
    # lens 4,4,1,1 on dp=2, row cost = W, per_micro 0, no cap. K=1: two runs, the best {4},{4,1,1}
    # = max(4, 12) or {4,4},{1,1} = max(8, 2): 8. K=2: {4},{4},{1},{1}: slots max(4,4) + max(1,1) = 5.
    cost = mp.FlopsCost(linear=1.0)
    lens = np.array([4, 4, 1, 1])
    assert padded_optimum(lens, dp=2, cap=None, cost=cost).time == 5.0
    b = padded_lower_bound(lens, dp=2, cap=None, cost=cost)
    assert b.time == 5.0  # K=1: the least padded cost of two runs is 8 + 2 = 10, over dp: 5; K=2: 10 / 2
    # per_micro 3: K=1 costs 3 + 8 = 11, K=2 costs 6 + 5 = 11; the bound at K=1 is 3 + (8 + 2)/2 = 8
    cost = mp.FlopsCost(linear=1.0, per_micro=3.0)
    assert padded_optimum(lens, dp=2, cap=None, cost=cost).time == 11.0
    assert padded_lower_bound(lens, dp=2, cap=None, cost=cost).time == 8.0


@given(instances(max_n=7))
def test_the_planner_is_never_below_the_bound(case):
    lens, dp, cap, cost, mult = case
    if int((-(-lens // mult) * mult).max()) > cap:
        return
    cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, cost=cost, layout="padded", pad_to_multiple_of=mult)
    plan = mp.plan(mp.Batch(lens.tolist()), cfg)
    b = padded_lower_bound(lens, dp=dp, cap=cap, cost=cost, width_multiple=mult)
    opt = padded_optimum(lens, dp=dp, cap=cap, cost=cost, width_multiple=mult)
    got = sum(max(_padded_cost(m.seq_lens, mult, cost) for m in col) for col in zip(*plan.steps[0].micros))
    assert b.time <= opt.time * (1 + 1e-9) <= got * (1 + 1e-9)


def _plan_lockstep(lens, dp, cap, cost, mult=1):
    cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, cost=cost, layout="padded", pad_to_multiple_of=mult)
    plan = mp.plan(mp.Batch(np.asarray(lens).tolist()), cfg)
    return plan, sum(max(_padded_cost(m.seq_lens, mult, cost) for m in col) for col in zip(*plan.steps[0].micros))


def test_the_k_search_reaches_the_optimum_k():
    # bench_layouts' small step grpo-longtail seed 5 (dp 3): the K walk stopped at K=3 with min-max
    # runs (1.20x the optimum); the optimum is K=2 with the two longest alone in slot 0 and the
    # tail cut fine in slot 1 — contiguous slots at two levels (stages/padded_levels.py)
    from benchmarks.metrics import dense_7b_cost
    cost = dense_7b_cost()
    lens = np.array([15862, 13548, 3517, 2906, 2678, 2267, 1727, 1221, 595, 560, 313, 310])
    opt = padded_optimum(lens, dp=3, cap=32768, cost=cost, placeholders=False)
    plan, got = _plan_lockstep(lens, 3, 32768, cost)
    assert opt.K == 2 and plan.steps[0].micro_count == 2
    assert got <= opt.time * 1.01


def test_slots_need_not_be_contiguous():
    # bimodal seed 5 (dp 3): the optimum puts 10528+7357 in one run beside the two 16384s, and the
    # three ~12k samples in slot 1 (slot 0's runs are not neighbours): a merge-and-cut move finds it
    from benchmarks.metrics import dense_7b_cost
    cost = dense_7b_cost()
    lens = np.array([16384, 16384, 12298, 11892, 11300, 10528, 7357, 1083, 892, 711, 678, 376])
    opt = padded_optimum(lens, dp=3, cap=49152, cost=cost, placeholders=False)
    _, got = _plan_lockstep(lens, 3, 49152, cost)
    assert got <= opt.time * 1.005


def _sorted_case(case):
    """(the planner's sorted view of a padded instance, lens, dp, cap, cost, mult), or None when a sample
    padded to its multiple breaks the cap (no plan exists)."""
    from microplan.footprint import Padding
    from microplan.stages import padded as P
    lens, dp, cap, cost, mult = case
    if int((-(-lens // mult) * mult).max()) > cap:
        return None
    s = P.PaddedSamples(lens.astype(np.int64), None, None, None, Padding(layout="padded", sample_multiple=mult))
    return P._Sorted(s, cost), lens, dp, cap, cost, mult


@given(instances(max_n=9))
def test_level_plans_are_achievable_and_full(case):
    from microplan.stages import padded as P
    from microplan.stages.padded_levels import level_plans
    if (got := _sorted_case(case)) is None:
        return
    srt, lens, dp, cap, cost, mult = got
    caps = (cap, None, None)
    bound = P._cap_bound(srt, *caps)
    Ks = list(range(1, lens.size // dp + 1))
    lv = level_plans(srt, caps, bound, dp=dp, Ks=Ks, per_micro=float(cost.per_micro), keep=len(Ks))
    for K, b in lv.runs.items():
        b = np.array(b)
        assert b[0] == 0 and b[-1] == lens.size and (np.diff(b) > 0).all() and b.size - 1 == dp * K
        widths = srt.width(b[:-1], np.diff(b))
        assert (np.diff(b) * widths <= cap).all()
        c = srt.run_cost(b[:-1], np.diff(b)) + float(cost.per_micro)
        assert P.predicted_time(c, dp, K, "micro") <= lv.times[K] * (1 + 1e-9)
        opt = padded_optimum(lens, dp=dp, cap=cap, cost=cost, width_multiple=mult, placeholders=False)
        assert lv.times[K] >= opt.time * (1 - 1e-9)


def test_heads_the_longest_samples_force():
    # three samples of 10 on dp=2, none may share a row pair (cap 10): three runs in two slots, the
    # heads are 10 + 10 = 20 — the padding volume alone says 30 / 2 = 15 (padded_bound fact 3)
    cost = mp.FlopsCost(linear=1.0)
    lens = np.array([10, 10, 10])
    assert padded_optimum(lens, dp=2, cap=10, cost=cost).time == 20.0
    b = padded_lower_bound(lens, dp=2, cap=10, cost=cost)
    assert b.time == 20.0 and b.volume == 15.0
    # with room for pairs (cap 20) slot 0 may hold [10, 10] (cost 20) beside [10]: still 20 in
    # one slot, and the bound may not claim more than the optimum
    assert padded_lower_bound(lens, dp=2, cap=20, cost=cost).time <= padded_optimum(lens, dp=2, cap=20, cost=cost).time


@given(instances(max_n=9))
def test_the_min_max_walk_stops_only_after_two_steps_without_improvement(case):
    # the walk counted a K as "worse" when it was merely the best so far (it compared the new time
    # with a minimum that included itself), so it stopped two K after the first that packed
    from microplan.stages import padded as P
    if (got := _sorted_case(case)) is None:
        return
    srt, lens, dp, cap, cost, mult = got
    tried, _ = P._walk(srt, 1, dp, 1, (cap, None, None), float(cost.per_micro), "micro")
    Ks = sorted(tried)
    last = Ks[-1]
    if min(lens.size, dp * last) == lens.size or len(tried) >= P.MAX_EVALS:
        return
    finite = [k for k in Ks if np.isfinite(tried[k])]
    assert len(finite) >= 3  # stopped on patience: the two last K are no better than every K before them
    best_before = min(tried[k] for k in finite[:-2])
    assert tried[finite[-1]] >= best_before * (1 - 1e-12) and tried[finite[-2]] >= best_before * (1 - 1e-12)


def test_the_walk_reaches_a_larger_k_while_the_time_falls():
    # bench_layouts' mid step long-context seed 0 (48 samples, dp 2): the walk stopped at K=5 while
    # the time still fell, the plan took K=7 at 1.0185x the best plan the exact solver
    # (benchmarks/padded_exact.py) finds in 30 s, 4.29283e15 at K=12; now K=11 at 1.0013x
    from benchmarks.metrics import dense_7b_cost
    cost = dense_7b_cost()
    lens = np.array([13140, 11526, 9453, 8691, 8655, 7021, 6231, 5382, 5297, 5136, 5115, 4738, 4439, 4396, 4010,
                     3819, 3797, 3220, 3215, 3081, 3026, 2858, 2813, 2570, 2423, 2396, 2357, 2234, 2231, 2229,
                     2218, 2141, 2076, 2040, 2020, 2015, 1980, 1957, 1864, 1582, 1566, 1554, 1177, 1156, 1035,
                     947, 859, 489])
    plan, got = _plan_lockstep(lens, 2, 49152, cost)
    assert plan.steps[0].micro_count >= 10
    assert got <= 4.29283e15 * 1.005


def test_interleaved_slots_are_reached():
    # bench_layouts' mid step bimodal (24 samples, dp 4): the optimum (K=4, proved by
    # benchmarks/padded_exact.py) pairs the mid-length samples so that they share slots 0 and 1
    # with the longest singles, and cuts the short tail into 8 runs — slots that interleave in the
    # sorted order, 4+ boundaries from any plan the boundary moves reach (the plan was 1.037x);
    # padded_levels.volume_cuts with power 0.5 (a few costly runs beside many cheap ones) starts there
    from benchmarks.metrics import dense_7b_cost
    cost = dense_7b_cost()
    lens = np.array([16384, 15828, 12907, 12549, 10045, 9075, 8196, 8122, 7158, 6934, 6867, 5270, 1381, 901, 698,
                     591, 477, 437, 426, 397, 390, 338, 326, 309])
    plan, got = _plan_lockstep(lens, 4, 49152, cost)
    assert plan.steps[0].micro_count == 4
    assert got <= 1813565340109824.0 * (1 + 1e-9)


@given(instances(max_n=9), st.integers(1, 9), st.sampled_from([None, 1, 2, 3]))
def test_volume_cuts_are_the_least_power_sum_of_every_cut(case, m, max_count):
    # padded_levels.volume_cuts (one DP for every m and power) against every cut of the sorted
    # samples into m runs within the caps: the same least Σ (run cost)^p, or None when no cut fits
    from itertools import combinations

    from microplan.stages import padded as P
    from microplan.stages.padded_levels import VOLUME_POWERS, volume_cuts
    from microplan.stages.padded_search import _fit_mask
    if (got := _sorted_case(case)) is None:
        return
    srt, lens, *_ = got
    caps = (case[2], max_count, None)
    bound = P._cap_bound(srt, *caps)
    n = lens.size
    cuts = volume_cuts(srt, [m, n + 1], caps, bound)
    assert all(mm <= n for mm, _ in cuts)  # an m past the samples has no cut
    if m > n:
        assert cuts == {}
        return
    scale = float(srt.run_cost(np.array([0]), np.array([1]))[0]) or 1.0
    for p in VOLUME_POWERS:
        best = None
        for inner in combinations(range(1, n), m - 1):
            b = np.array([0, *inner, n])
            if _fit_mask(srt, b[:-1], b[1:], caps).all():
                v = float(((srt.run_cost(b[:-1], np.diff(b)) / scale) ** p).sum())
                best = v if best is None else min(best, v)
        b = cuts[m, p]
        if best is None:
            assert b is None
            continue
        b = np.array(b)
        assert b[0] == 0 and b[-1] == n and b.size == m + 1 and (np.diff(b) > 0).all()
        assert _fit_mask(srt, b[:-1], b[1:], caps).all()
        assert float(((srt.run_cost(b[:-1], np.diff(b)) / scale) ** p).sum()) <= best * (1 + 1e-9)


@given(instances(max_n=9), st.sampled_from([None, 1, 2]))
def test_the_relocation_table_is_every_run_within_the_caps(case, max_count):
    # padded_search._run_table (vectorised) against the run-by-run check: the cost of [a, e) where
    # it keeps the caps, inf elsewhere (empty, reversed or over a cap)
    from microplan.stages.padded_search import _fits, _run_table
    if (got := _sorted_case(case)) is None:
        return
    srt, lens, *_ = got
    caps = (case[2], max_count, None)
    C = _run_table(srt, caps)
    n = lens.size
    for a in range(n + 1):
        for e in range(n + 1):
            if e > a and _fits(srt, a, e, caps):
                assert C[a, e] == srt.run_cost(np.array([a]), np.array([e - a]))[0]
            else:
                assert C[a, e] == np.inf


def _split_to_count_reference(srt, b, m):
    """padded_levels.split_to_count as first written: rescan every run, split the costliest
    multi-sample one (the earliest on ties) in half, until there are m runs."""
    b = list(b)
    while len(b) - 1 < m:
        starts, ends = np.array(b[:-1]), np.array(b[1:])
        k = ends - starts
        c = np.where(k > 1, srt.run_cost(starts, np.maximum(k, 1)), -1.0)
        j = int(np.argmax(c))
        b.insert(j + 1, int(starts[j] + k[j] // 2))
    return b


@given(instances(max_n=9), st.data())
def test_split_to_count_is_the_rescanning_reference(case, data):
    from microplan.stages.padded_levels import split_to_count
    if (got := _sorted_case(case)) is None:
        return
    srt, lens, *_ = got
    n = lens.size
    inner = data.draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=n - 1)) if n > 1 else set()
    b = sorted({0, n} | inner)
    m = data.draw(st.integers(len(b) - 1, n))
    assert split_to_count(srt, b, m) == _split_to_count_reference(srt, b, m)


@given(st.integers(1, 6), st.integers(1, 12), st.data())
def test_lockstep_with_two_changes_is_the_sorted_rows_time(D, K, data):
    # padded_search._lockstep_two_changed (slot heads read off one sorted base row) against sorting
    # every changed row (``_lockstep``), ties included: the same sums, bit for bit
    from microplan.stages.padded_search import _lockstep, _lockstep_two_changed
    M = D * K
    if M < 2:
        return
    vals = st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5]) | st.floats(0.0, 2.0, allow_nan=False)
    c = np.array(data.draw(st.lists(vals, min_size=M, max_size=M)))
    C = data.draw(st.integers(1, 8))
    i1 = np.array(data.draw(st.lists(st.integers(0, M - 1), min_size=C, max_size=C)))
    i2 = (i1 + np.array(data.draw(st.lists(st.integers(1, M - 1), min_size=C, max_size=C)))) % M
    v1 = np.array(data.draw(st.lists(vals, min_size=C, max_size=C)))
    v2 = np.array(data.draw(st.lists(vals, min_size=C, max_size=C)))
    V = np.tile(c, (C, 1))
    V[np.arange(C), i1], V[np.arange(C), i2] = v1, v2
    assert np.array_equal(_lockstep_two_changed(c, D, i1, v1, i2, v2), _lockstep(V, D))


@given(st.lists(st.integers(1, 64), min_size=1, max_size=30), st.data())
def test_warm_started_longest_runs_equal_a_cold_search(lens, data):
    # padded._max_run keeps the runs it found per τ and starts later searches between the nearest
    # ones (the longest run within τ is monotone in τ): every answer equals a fresh search's
    from microplan.footprint import Padding
    from microplan.stages import padded as P
    L = np.array(lens)
    prompts = np.array(data.draw(st.lists(st.integers(0, 63), min_size=L.size, max_size=L.size))) % L
    cap = data.draw(st.integers(int(L.max()), 400))
    cost = mp.FlopsCost(linear=1.0, quadratic=data.draw(st.sampled_from([0.0, 0.05])), per_micro=1.0)

    def fresh():
        return P._Sorted(P.PaddedSamples(L, prompts, None, None, Padding(layout="padded-2d")), cost)
    warm = fresh()
    bound = P._cap_bound(warm, cap, None, None)
    for tau in data.draw(st.lists(st.floats(1.0, 5000.0), min_size=1, max_size=12)):
        got = P._max_run(warm, tau, bound, cap)
        assert np.array_equal(got, P._max_run(fresh(), tau, bound, cap))
