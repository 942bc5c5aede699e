"""Property tests of the core planner: every plan of every random input keeps invariants 1–5.

The invariants are re-checked here sample by sample (tests/reference.py:check_plan), not only
through ``Plan.validate()``; the short_step policies are checked against each other: "error"
and "drop" must give the "pad" plan whenever "pad" needs no placeholder, "error" must raise
exactly when "pad" needs one, and "drop" must drop only whole trailing rollouts, and the fewest.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import event, given, note
from hypothesis import strategies as st

import microplan as mp
from reference import (ExpectedError, cases, check_num_steps, check_plan, configs, expected_split,
                       is_dynamic_cp, lockstep_sorted_blocks, micro_body, replace, sample_costs, step_times)


def _check_stats(plan: mp.Plan) -> None:
    st_ = plan.stats
    cfg = plan.config
    assert st_.num_steps == len(plan.steps)
    assert st_.num_dropped == plan.dropped.size
    assert st_.micro_count == sum(s.micro_count for s in plan.steps)
    assert st_.num_placeholders == sum(m.is_placeholder for s in plan.steps for row in s.micros for m in row)
    per_gpu = [-(-m.num_tokens // m.cp_size) for s in plan.steps for row in s.micros for m in row]
    assert st_.max_micro_tokens == max(per_gpu, default=0)
    if cfg.max_tokens_per_micro is not None:
        assert st_.max_micro_tokens <= cfg.max_tokens_per_micro
    lock = sync = 0.0
    for s in range(len(plan.steps)):
        a, b = step_times(plan, s)
        lock, sync = lock + a, sync + b
        assert plan.steps[s].micro_count >= st_.steps[s].micro_count_lower_bound
        if not is_dynamic_cp(cfg) and cfg.placement == "global":  # cp.py slots CP groups its own way;
            _check_arrangement(plan, s, a)  # local placement: per-rank order, checked in test_local.py
    assert st_.lockstep_time == pytest.approx(lock, rel=1e-9)
    assert st_.step_sync_time == pytest.approx(sync, rel=1e-9)
    assert st_.predicted_time == (st_.lockstep_time if cfg.sync == "micro" else st_.step_sync_time)
    assert st_.predicted_time >= st_.time_lower_bound * (1 - 1e-9), "time lower bound is not a lower bound"
    assert st_.rank_imbalance >= 1 - 1e-12
    assert st_.micro_count_lower_bound <= st_.micro_count


def _check_arrangement(plan: mp.Plan, s: int, lockstep: float) -> None:
    """assign.py's documented guarantees for the given micro-batches: the lockstep time is the
    minimum over all arrangements (sorted blocks of dp), and the ranks' totals differ by at most
    one micro-batch's cost."""
    cfg, step = plan.config, plan.steps[s]
    dummy = micro_body(cfg.cost, [1])
    grid = np.array([[(dummy if m.is_placeholder else micro_body(cfg.cost, m.seq_lens)) / m.cp_size
                      + cfg.cost.per_micro for m in row] for row in step.micros])
    best = lockstep_sorted_blocks(grid.ravel().tolist(), cfg.dp_size)
    assert lockstep <= best * (1 + 1e-9), f"step {s}: lockstep {lockstep} > best arrangement {best}"
    totals = grid.sum(axis=1)
    assert totals.max() - totals.min() <= grid.max() * (1 + 1e-9) + 1e-9, f"step {s}: rank totals {totals}"


def _check_pad_plan(plan: mp.Plan, case, cfg, split, step_dropped) -> None:
    """pad: nothing dropped by fit; steps hold exactly the contract's samples; placeholders minimal."""
    assert set(plan.dropped.tolist()) == step_dropped, "short_step='pad' dropped samples"
    if split is not None:
        assert len(plan.steps) == len(split)
        for step, want in zip(plan.steps, split):
            assert step.samples.tolist() == sorted(want.tolist())
    else:
        check_num_steps(plan, case.pc, cfg.steps.num_steps, fit_dropped_ok=False)
    if is_dynamic_cp(cfg):  # empty bins merge into wider CP groups instead: checked by check_plan only
        return
    for step in plan.steps:
        real = [m for row in step.micros for m in row if not m.is_placeholder]
        if step.num_placeholders:  # as many real micro-batches as there are samples
            assert len(real) == step.samples.size, "placeholders while a real micro-batch holds 2+ samples"
            assert step.samples.size < cfg.dp_size * step.micro_count
        else:
            assert len(real) == cfg.dp_size * step.micro_count


def _roundtrip(plan: mp.Plan) -> None:
    text = plan.to_json()
    back = mp.Plan.from_json(text)
    assert back == plan
    assert back.fingerprint() == plan.fingerprint()
    assert back.to_json() == text
    back.validate()


def _plan_or_expected_error(case, cfg):
    try:
        split, step_dropped = expected_split(case.pc, case.rc, cfg.steps)
    except ExpectedError as why:
        with pytest.raises(mp.PlanError):
            mp.plan(case.batch(), cfg)
        note(f"expected PlanError: {why}")
        event(f"expected PlanError: {why}")
        return None
    return split, step_dropped


@given(data=st.data(), case=cases())
def test_random_plans_keep_invariants(data, case):
    cfg = data.draw(configs(case))
    note(f"config: {cfg}")
    batch = case.batch()
    pad_cfg = replace(cfg, short_step="pad")
    expected = _plan_or_expected_error(case, pad_cfg)
    if expected is None:
        return
    split, step_dropped = expected
    pad = mp.plan(batch, pad_cfg)
    pad.validate()
    check_plan(pad, case.seq_lens, case.loss_tokens, case.pc, case.rc, pad_cfg)
    _check_pad_plan(pad, case, pad_cfg, split, step_dropped)
    _check_stats(pad)
    _roundtrip(pad)
    assert mp.plan(batch, pad_cfg).fingerprint() == pad.fingerprint(), "same input, different plan"
    event(f"placeholders: {bool(pad.stats.num_placeholders)}; dropped by steps: {bool(step_dropped)}")
    if cfg.short_step == "pad":
        return

    short = [s.index for s in pad.steps if s.num_placeholders]
    event(f"{cfg.short_step}: short step: {bool(short)}")
    if not short:  # no step is short: every policy gives the same layout
        p = mp.plan(batch, cfg)
        p.validate()
        assert p.steps == pad.steps and np.array_equal(p.dropped, pad.dropped)
        return
    if cfg.short_step == "error":
        with pytest.raises(mp.PlanError) as exc:
            mp.plan(batch, cfg)
        s = short[0]
        msg = str(exc.value)
        assert re.search(rf"\bstep {s}: {pad.steps[s].samples.size} samples?\b", msg), msg
        if not is_dynamic_cp(cfg):  # dynamic CP: see tests/test_seeds.py::test_dynamic_cp_error_names_the_target
            assert re.search(rf"\b{cfg.dp_size * pad.steps[s].micro_count} micro-batches\b", msg), msg  # target
        assert "short_step=" in msg, msg  # the setting to change
        return
    _check_drop(case, cfg, pad, short, step_dropped)


def _check_drop(case, cfg, pad: mp.Plan, short: list[int], step_dropped: set[int]) -> None:
    try:
        p = mp.plan(case.batch(), cfg)
    except mp.PlanError as exc:  # allowed only when no prefix of whole rollouts aligns
        event("drop: PlanError")
        msg = str(exc)
        step_m = count_m = re.search(r"\bstep (\d+): (\d+) samples?\b", msg)  # the step, then its sample count
        assert step_m and count_m and "short_step=" in msg, msg
        s = int(step_m.group(1))
        assert s in short, f"'drop' refused step {s}, which needs no placeholder under 'pad'"
        assert int(count_m.group(2)) == pad.steps[s].samples.size, msg
        _assert_no_prefix_aligns(case, cfg, pad.steps[s].samples, keep_from=0)
        return
    event("drop: dropped trailing rollouts")
    p.validate()
    check_plan(p, case.seq_lens, case.loss_tokens, case.pc, case.rc, cfg)
    _check_stats(p)
    _roundtrip(p)
    assert len(p.steps) == len(pad.steps)
    assert all(step.num_placeholders == 0 for step in p.steps), "short_step='drop' left placeholders"
    assert step_dropped <= set(p.dropped.tolist())
    for s, (got, full) in enumerate(zip(p.steps, pad.steps)):
        if s not in short:
            assert got == full, f"step {s} needed no drop but changed"
            continue
        kept, everything = set(got.samples.tolist()), full.samples.tolist()
        assert kept <= set(everything)
        if not is_dynamic_cp(cfg):  # under dynamic CP one wide sample may fill several GPUs
            assert len(kept) >= cfg.dp_size * cfg.align
        order = sorted({int(case.rc[i]) for i in everything})  # rollouts of the step, first appearance
        dropped_r = {int(case.rc[i]) for i in everything if i not in kept}
        assert dropped_r, f"step {s} had placeholders under 'pad' but dropped nothing"
        keep = len(order) - len(dropped_r)
        assert set(order[keep:]) == dropped_r, "dropped rollouts are not the trailing ones"
        for i in everything:
            if i not in kept:
                assert f"step {s}" in p.drop_reasons[i]
        _assert_no_prefix_aligns(case, cfg, full.samples, keep_from=keep + 1)


def _assert_no_prefix_aligns(case, cfg, step_samples: np.ndarray, keep_from: int, limit: int = 12) -> None:
    """Every prefix of >= keep_from whole rollouts of the step needs a placeholder (so 'drop'
    kept the longest prefix that works). Re-plans each prefix alone with short_step='pad'."""
    order = []
    for i in step_samples.tolist():
        if int(case.rc[i]) not in order:
            order.append(int(case.rc[i]))
    R = len(order)
    cand = list(range(max(keep_from, 1), R))
    for k in cand[-limit:] + cand[:limit]:
        keep = set(order[:k])
        sub = np.array([i for i in step_samples.tolist() if int(case.rc[i]) in keep])
        if sub.size < cfg.dp_size * cfg.align and not is_dynamic_cp(cfg):
            continue
        b = mp.Batch(case.seq_lens[sub], rollout_ids=case.rc[sub].tolist())
        q = mp.plan(b, replace(cfg, short_step="pad", steps=None))
        assert q.steps[0].num_placeholders > 0, f"a prefix of {k} rollouts aligns, but 'drop' kept fewer"


@given(data=st.data(), case=cases(max_samples=200, max_cap=64))
def test_pad_never_drops_and_error_iff_placeholders(data, case):
    """Tight caps: many singleton micro-batches, so short steps are frequent."""
    cfg = data.draw(configs(case, cp=False, max_dp=32))
    note(f"config: {cfg}")
    expected = _plan_or_expected_error(case, replace(cfg, short_step="pad"))
    if expected is None:
        return
    pad = mp.plan(case.batch(), replace(cfg, short_step="pad"))
    assert set(pad.dropped.tolist()) == expected[1]
    has_ph = any(s.num_placeholders for s in pad.steps)
    try:
        err = mp.plan(case.batch(), replace(cfg, short_step="error"))
    except mp.PlanError:
        assert has_ph, "short_step='error' raised although no step needs a placeholder"
    else:
        assert not has_ph and all(s.num_placeholders == 0 for s in err.steps)
        err.validate()


@given(data=st.data(), case=cases(max_samples=120, max_cap=64, lengths=("big", "cap", "bimodal")))
def test_drop_keeps_the_longest_aligning_prefix(data, case):
    """short_step='drop' on steps of long samples (mostly singleton micro-batches), as in slime #2065."""
    cfg = data.draw(configs(case, cp=False, max_dp=8))
    cfg = replace(cfg, short_step="drop", micro_batch_size=None, context_parallel=None,
                  max_tokens_per_micro=case.cap, align=data.draw(st.integers(1, 3)))
    note(f"config: {cfg}")
    expected = _plan_or_expected_error(case, replace(cfg, short_step="pad"))
    if expected is None:
        return
    pad = mp.plan(case.batch(), replace(cfg, short_step="pad"))
    short = [s.index for s in pad.steps if s.num_placeholders]
    event(f"short step: {bool(short)}")
    if short:
        _check_drop(case, cfg, pad, short, expected[1])


def test_placeholder_never_costs_more_than_a_real_micro_under_static_cp():
    """Regression: stats charged a placeholder's dummy token in full but a real sample / c under
    static CP, so a placeholder cost more than a 1-token micro-batch and the reported lockstep time
    of an optimal arrangement (7.0) came out as 7.5."""
    lens = [2] * 11 + [1] * 4
    plan = mp.plan(mp.Batch(lens), mp.PlanConfig(dp_size=2, max_tokens_per_micro=1, align=2,
                                                 context_parallel=mp.ContextParallel(size=2)))
    step = plan.steps[0]
    assert step.num_placeholders == 1
    grid = [[(1 if m.is_placeholder else m.num_tokens) / 2 for m in row] for row in step.micros]
    real_min = min(x for row, mrow in zip(grid, step.micros) for x, m in zip(row, mrow) if not m.is_placeholder)
    ph = [x for row, mrow in zip(grid, step.micros) for x, m in zip(row, mrow) if m.is_placeholder]
    assert max(ph) <= real_min
    assert plan.stats.lockstep_time == lockstep_sorted_blocks([x for row in grid for x in row], 2) == 7.0


# ---------------------------------------------------------------------------------------------
# optimality against the brute-force reference (tests/reference.py:brute_force)
# ---------------------------------------------------------------------------------------------

OPT_FACTOR = 1.5  # planner time <= OPT_FACTOR × optimum; observed worst ≈ 1.37 (lockstep), 1.25 (step sync)


@pytest.mark.parametrize("seed", range(4))
def test_sorted_blocks_lemma_matches_full_enumeration(seed):
    """The reference's shortcut for lockstep (sort micro costs, cut into slots of dp) is the
    minimum over every arrangement of the grid — checked by enumerating all permutations."""
    from reference import lockstep_all_arrangements, lockstep_sorted_blocks
    rng = np.random.default_rng(seed)
    for dp, K in ((1, 3), (2, 2), (3, 2), (2, 3), (6, 1)):
        costs = rng.integers(0, 20, dp * K).astype(float).tolist()
        assert lockstep_sorted_blocks(costs, dp) == lockstep_all_arrangements(costs, dp)


def test_brute_force_by_hand():
    from reference import brute_force
    # dp=2, K=2: {42} {24,18} {2} + a placeholder (cost 1) -> slots (42, 42) and (2, 1): 44
    o = brute_force([2, 24, 42, 18], [2.0, 24.0, 42.0, 18.0], dp=2, align=2, cap=124, dummy=1.0)
    assert (o.k_min, o.lockstep, o.step_sync) == (2, 44.0, 44.0)
    # one rank, a perfect two-bin packing exists: {8,3} {2,3,2,4}
    o = brute_force([2, 3, 8, 2, 4, 3], [2.0, 3.0, 8.0, 2.0, 4.0, 3.0], dp=1, align=1, cap=11)
    assert o.k_min == 2 and o.k_min_full == 2
    assert o.lockstep == 22.0 and o.step_sync == 22.0
    # static: 5 unit samples, 2 per micro, dp=2: K=2, e.g. slots ({2}, {2}) and ({1}, placeholder)
    o = brute_force([1] * 5, [1.0] * 5, dp=2, align=1, mbs=2, dummy=0.5)
    assert (o.k_min, o.k_min_full, o.lockstep, o.step_sync) == (2, 2, 3.0, 3.0)
    # the idle-rank case: one sample, dp=3: two ranks run a placeholder
    o = brute_force([7], [7.0], dp=3, align=1, cap=7, per_micro=1.0, dummy=0.5)
    assert (o.k_min, o.k_min_full, o.lockstep, o.step_sync) == (1, None, 8.0, 8.0)


def test_plans_are_near_optimal_on_small_instances():
    """Random ≤ 8-sample instances: the planner's lockstep and step-sync times are within
    OPT_FACTOR of the brute-force optimum, never below it (which would mean a broken reference),
    and its K is the minimal feasible K (up to one align block: LPT may miss a perfect packing)."""
    from reference import brute_force, sample_costs
    rng = np.random.default_rng(2065)
    ratios = {"micro": [], "step": []}
    k_extra = []
    costs_models = [mp.TokenCost(), mp.TokenCost(per_micro=20.0), mp.FlopsCost(linear=1.0, quadratic=0.05, per_micro=5.0)]
    for it in range(300):
        n, dp, align = int(rng.integers(1, 9)), int(rng.integers(1, 5)), int(rng.integers(1, 3))
        lens = rng.integers(1, 100, n).tolist()
        cost = costs_models[it % 3]
        if rng.random() < 0.25:
            mbs, cap, size = int(rng.integers(1, 4)), None, {}
            size = {"micro_batch_size": mbs}
        else:
            mbs, cap = None, int(max(lens) + rng.integers(0, 150))
            size = {"max_tokens_per_micro": cap}
        c = sample_costs(cost, np.array(lens)).tolist()
        dummy = float(sample_costs(cost, np.ones(1))[0])
        opt = brute_force(lens, c, dp=dp, align=align, cap=cap, mbs=mbs, per_micro=cost.per_micro, dummy=dummy)
        where = f"lens={lens} dp={dp} align={align} cap={cap} mbs={mbs} cost={cost}"
        for sync, best in (("micro", opt.lockstep), ("step", opt.step_sync)):
            plan = mp.plan(mp.Batch(lens), mp.PlanConfig(dp_size=dp, align=align, cost=cost, sync=sync, **size))
            plan.validate()
            K = plan.steps[0].micro_count
            assert opt.k_min <= K <= opt.k_min + align, f"K={K}, minimal K={opt.k_min}: {where}"
            if sync == "micro":
                k_extra.append(K - opt.k_min)
            got = plan.stats.predicted_time
            lb = plan.stats.time_lower_bound
            assert lb <= best * (1 + 1e-9), f"time_lower_bound {lb} exceeds the optimum {best} ({sync}): {where}"
            r = got / best
            assert r >= 1 - 1e-9, f"planner beats the brute-force optimum ({sync}): reference broken? {where}"
            assert r <= OPT_FACTOR, f"{sync} time {got} is {r:.3f}× the optimum {best}: {where}"
            ratios[sync].append(r)
    for sync, rs in ratios.items():
        rs = np.array(rs)
        print(f"sync={sync}: worst {rs.max():.4f}, p99 {np.quantile(rs, .99):.4f}, p90 {np.quantile(rs, .9):.4f}, "
              f"median {np.median(rs):.4f}, optimal in {np.mean(rs < 1 + 1e-9):.0%}")
    print(f"K - minimal K: {np.bincount(k_extra).tolist()}")


def test_packed_row_costs_against_brute_force():
    """A non-additive cost (packed_quadratic·T² per micro-batch of >= 2 samples, DESIGN's dense-kernel
    case): on random ≤ 8-sample instances the planner's lockstep time is never below the exhaustive
    optimum over every K the contract allows (no placeholder by choice: K <= n/dp unless the cap
    forces more) and every partition, stays within OPT_FACTOR of it, its K has the lowest predicted
    time of the K it tried, and Plan.stats.time_lower_bound is below the optimum over every K."""
    from reference import brute_force
    rng = np.random.default_rng(9)
    ratios, beat_kmin = [], 0
    for it in range(200):
        n, dp, align = int(rng.integers(1, 9)), int(rng.integers(1, 4)), int(rng.integers(1, 3))
        lens = rng.integers(1, 100, n).tolist()
        cost = mp.FlopsCost(linear=1.0, quadratic=float(rng.choice([0.0, 2e-3])),
                            packed_quadratic=float(rng.choice([2e-3, 2e-2])), per_micro=float(rng.choice([0.0, 5.0, 50.0])))
        cap = int(max(lens) + rng.integers(0, 200))
        c = sample_costs(cost, np.array(lens)).tolist()
        kw = dict(dp=dp, align=align, cap=cap, per_micro=cost.per_micro, dummy=micro_body(cost, [1]),
                  packed=cost.packed_quadratic, linear=cost.linear)
        any_k = brute_force(lens, c, **kw)
        opt = brute_force(lens, c, **kw, k_max=(n // dp) // align * align)
        plan = mp.plan(mp.Batch(lens), mp.PlanConfig(dp_size=dp, align=align, cost=cost, max_tokens_per_micro=cap))
        plan.validate()
        where = f"lens={lens} dp={dp} align={align} cap={cap} cost={cost}"
        got, lb = plan.stats.predicted_time, plan.stats.time_lower_bound
        assert got >= opt.lockstep * (1 - 1e-9), f"beats the optimum: reference broken? {where}"
        assert lb <= any_k.lockstep * (1 + 1e-9), f"time_lower_bound {lb} > optimum {any_k.lockstep}: {where}"
        assert got <= OPT_FACTOR * opt.lockstep, f"{got / opt.lockstep:.3f}x the optimum: {where}"
        choice = plan.steps[0].choice
        assert choice is not None and choice.micro_count == plan.steps[0].micro_count
        times = dict(choice.candidates)
        assert times[choice.micro_count] == min(times.values()), where
        beat_kmin += plan.steps[0].micro_count > opt.k_min and opt.lockstep_at_k_min > opt.lockstep * (1 + 1e-9)
        ratios.append(got / opt.lockstep)
    rs = np.array(ratios)
    print(f"packed: worst {rs.max():.4f}, median {np.median(rs):.4f}, optimal in {np.mean(rs < 1 + 1e-9):.0%}, "
          f"more micro-batches than the minimum where that is optimal: {beat_kmin}")
    assert np.median(rs) < 1.05
    assert beat_kmin > 0  # the count is chosen by cost: some instances run more than the fewest micro-batches
