"""CostMeter: the online cost model — prior until records arrive, MAP fit, bounded memory, drift."""

from __future__ import annotations

import numpy as np
import pytest

import microplan as mp
from microplan.cost.calibrate import calibrate, calibration_row

# A 7B-like truth in seconds: attention 2x slower per FLOP than the prior assumes, a per-micro cost.
PRIOR = mp.FlopsCost(linear=4.2e10, quadratic=7.9e5 * 1.0, per_micro=0.0)          # FLOPs, attention at 1x
TRUTH = mp.FlopsCost(linear=4.2e10 * 1e-15, quadratic=7.9e5 * 2.0 * 1e-15, per_micro=0.03)


def _micros(rng: np.random.Generator, n: int, cap: int = 32768) -> list[np.ndarray]:
    """Micro-batches of a long-tailed mix, filled toward the cap (what a planner produces)."""
    out = []
    for _ in range(n):
        lens, tot = [], 0
        while True:
            L = int(np.clip(rng.lognormal(np.log(1500), 1.0), 16, 16384))
            if tot + L > cap:
                break
            lens.append(L)
            tot += L
        out.append(np.array(lens or [cap // 2]))
    return out


def _feed(meter: mp.CostMeter, truth: mp.FlopsCost, micros, rng, noise=0.03) -> None:
    for m in micros:
        meter.record(m, truth.micro_cost(m) * (1 + noise * rng.standard_normal()))


def test_prior_until_records_then_seconds():
    meter = mp.CostMeter(prior=PRIOR)
    assert meter.cost() is PRIOR                      # nothing measured: the prior itself
    assert isinstance(mp.CostMeter().cost(), mp.TokenCost)
    meter.record([1000, 3000], 0.5)
    fit = meter.cost()
    assert isinstance(fit, mp.FlopsCost)
    # one record: the prior's shape, rescaled to explain it
    assert fit.micro_cost([1000, 3000]) == pytest.approx(0.5, rel=0.05)
    assert fit.quadratic / fit.linear == pytest.approx(PRIOR.quadratic / PRIOR.linear, rel=0.05)


def test_learns_the_attention_slowdown_and_per_micro():
    rng = np.random.default_rng(0)
    meter = mp.CostMeter(prior=PRIOR)
    _feed(meter, TRUTH, _micros(rng, 200), rng)
    fit = meter.cost()
    ratio = (fit.quadratic / fit.linear) / (TRUTH.quadratic / TRUTH.linear)
    assert 0.9 < ratio < 1.1, ratio                     # the prior said 0.5x
    held = _micros(rng, 50)
    err = [abs(fit.micro_cost(m) / TRUTH.micro_cost(m) - 1) for m in held]
    assert np.median(err) < 0.01 and max(err) < 0.03


def test_collinear_rows_stay_near_the_prior():
    """Every micro-batch alike (the rows a balanced plan produces): a plain fit cannot separate the
    terms (calibrate refuses); the meter keeps the prior's shape, rescaled, and predicts those rows."""
    rng = np.random.default_rng(1)
    same = [np.array([2048] * 16)] * 40
    with pytest.raises(mp.PlanError, match="cannot separate"):
        calibrate([calibration_row(m, TRUTH.micro_cost(m)) for m in same], packed=False)
    meter = mp.CostMeter(prior=PRIOR)
    _feed(meter, TRUTH, same, rng, noise=0.01)
    fit = meter.cost()
    ratio = (fit.quadratic / fit.linear) / (PRIOR.quadratic / PRIOR.linear)
    assert 0.5 < ratio < 2.0                           # not thrown off by the unidentified direction
    assert fit.micro_cost(same[0]) == pytest.approx(TRUTH.micro_cost(same[0]), rel=0.02)


def test_detects_a_packed_row_kernel():
    """A dense kernel (T² of the packed row): single-sample micro-batches cost like the prior's
    attention, packed ones do not scale with Σ L² — the fit moves attention to packed_quadratic."""
    rng = np.random.default_rng(2)
    truth = mp.FlopsCost(linear=TRUTH.linear, packed_quadratic=2 * TRUTH.quadratic, per_micro=0.03)
    meter = mp.CostMeter(prior=PRIOR)
    micros = _micros(rng, 150, cap=16384) + [np.array([L]) for L in (2048, 4096, 8192, 16384)] * 5
    _feed(meter, truth, micros, rng, noise=0.02)
    fit = meter.cost()
    assert fit.packed_quadratic > 5 * fit.quadratic
    for m in (np.array([16384]), np.array([512] * 32), np.array([8192, 4096, 4096])):
        assert fit.micro_cost(m) == pytest.approx(truth.micro_cost(m), rel=0.05)


def test_window_bounds_memory_and_decay_follows_drift():
    rng = np.random.default_rng(3)
    meter = mp.CostMeter(prior=PRIOR, window=64, half_life=32)
    _feed(meter, TRUTH, _micros(rng, 200), rng)
    slower = mp.FlopsCost(linear=TRUTH.linear * 1.5, quadratic=TRUTH.quadratic * 1.5, per_micro=TRUTH.per_micro * 1.5)
    probe = _micros(rng, 1)[0]
    meter.cost()                                        # the model handed out before the drift
    _feed(meter, slower, _micros(rng, 64), rng)
    rep = meter.report()
    assert rep.window_records == 64 and rep.num_records == 264
    assert rep.recent_median_error > 0.3                # the planned-with model is visibly off
    assert meter.cost().micro_cost(probe) == pytest.approx(slower.micro_cost(probe), rel=0.05)
    assert "CostMeter" in str(rep) and "records" in str(rep)


def test_report_before_and_after():
    meter = mp.CostMeter(prior=PRIOR)
    rep = meter.report()
    assert rep.num_records == 0 and rep.recent_median_error is None and rep.fit_median_error is None
    rng = np.random.default_rng(4)
    meter.cost()
    _feed(meter, TRUTH, _micros(rng, 30), rng, noise=0.0)
    refit = meter.cost()
    _feed(meter, TRUTH, _micros(rng, 30), rng, noise=0.0)
    rep = meter.report()
    assert rep.recent_median_error < 0.05               # predicted by the refit model
    assert rep.fit_median_error < 0.02 and rep.scale > 0
    assert refit is not None


def test_records_micro_objects_and_cp():
    batch = mp.Batch([3000, 1000, 500, 20000])
    plan = mp.plan(batch, mp.PlanConfig(dp_size=2, max_tokens_per_micro=12000,
                                        context_parallel=mp.ContextParallel(size=2)))
    meter = mp.CostMeter(prior=mp.FlopsCost(linear=1.0, quadratic=1e-4))
    for micro in plan.rank(0)[0]:
        meter.record(micro, 0.1)                        # cp_size read from the Micro
    meter.record_step(plan.rank(1)[0], [0.1] * len(plan.rank(1)[0]))
    assert meter.num_records == 2 * plan.steps[0].micro_count
    placeholder = mp.Micro.placeholder()
    meter.record(placeholder, 0.001)                    # a placeholder: one dummy token
    assert meter.num_records == 2 * plan.steps[0].micro_count + 1
    twin = mp.CostMeter(prior=mp.FlopsCost(linear=1.0, quadratic=1e-4))   # the same records, the
    for micro in plan.rank(0)[0]:                                          # placeholder as [1]
        twin.record(micro, 0.1)
    twin.record_step(plan.rank(1)[0], [0.1] * len(plan.rank(1)[0]))
    twin.record([1], 0.001)
    assert meter.cost() == twin.cost()
    other = mp.CostMeter(prior=mp.FlopsCost(linear=1.0, quadratic=1e-4))  # ... and it is not ignored
    for micro in plan.rank(0)[0]:
        other.record(micro, 0.1)
    other.record_step(plan.rank(1)[0], [0.1] * len(plan.rank(1)[0]))
    assert other.cost() != meter.cost()


@pytest.mark.parametrize("call, match", [
    (lambda m: m.record([100], 0.0), "must be > 0"),
    (lambda m: m.record([100], float("nan")), "finite"),
    (lambda m: m.record([0, 5], 1.0), ">= 1"),
    (lambda m: m.record("abc", 1.0), "lengths"),
    (lambda m: m.record_step([[1]], [1.0, 2.0]), "2 timings"),
    (lambda m: mp.CostMeter(prior="flops"), "cost model"),
    (lambda m: mp.CostMeter(noise=0.0), "> 0"),
    (lambda m: mp.CostMeter(window=2), ">= 8"),
])
def test_bad_input(call, match):
    with pytest.raises(mp.PlanError, match=match):
        call(mp.CostMeter())


def test_planning_with_the_meter_end_to_end():
    """The loop of docs/cost.md: plan with meter.cost(), time, record, plan again."""
    from dataclasses import replace
    rng = np.random.default_rng(5)
    batch = mp.Batch(rng.integers(100, 8000, 256))
    cfg = mp.PlanConfig(dp_size=4, max_tokens_per_micro=16384, cost=PRIOR)
    meter = mp.CostMeter(prior=PRIOR)
    for _ in range(3):
        plan = mp.plan(batch, replace(cfg, cost=meter.cost()))
        plan.validate()
        for r in range(4):
            for micro in plan.rank(r)[0]:
                meter.record(micro, TRUTH.micro_cost(micro.seq_lens))
    fit = meter.cost()
    assert meter.report().fit_median_error < 0.02
    held = rng.integers(100, 8000, 8)  # a micro-batch like those the plan runs (~16k tokens)
    assert fit.micro_cost(held) == pytest.approx(TRUTH.micro_cost(held), rel=0.05)
    plan = mp.plan(batch, replace(cfg, cost=fit))
    assert mp.Plan.from_json(plan.to_json()) == plan  # the fitted model serialises with the plan


def test_first_step_error_is_scale_free_against_a_flops_prior():
    """Before any record the meter hands out its prior, which may be in FLOPs: the first step's
    drift report measures its shape (after one rescale), not the FLOPs-vs-seconds unit gap."""
    prior = mp.FlopsCost(linear=6e9, quadratic=2e5, per_micro=0.0)
    meter = mp.CostMeter(prior=prior)
    meter.cost()
    lens = [[512], [1024, 300], [2048], [100, 100, 100]]
    for L in lens:                                   # the machine: exactly the prior at 1e-14 s per FLOP
        meter.record(L, 1e-14 * prior.micro_cost(L))
    rep = meter.report()
    assert rep.recent_median_error is not None and rep.recent_median_error < 1e-9
    meter.cost()                                     # a fitted model, in seconds, from now on
    for L in lens:                                   # attention now 3x dearer: the shape error shows
        meter.record(L, 1e-14 * mp.FlopsCost(linear=6e9, quadratic=6e5, per_micro=0.0).micro_cost(L))
    assert meter.report().recent_max_error > 0.05


def test_a_prefix_tree_micro_is_recorded_as_the_work_it_ran():
    """A shared-prefix Micro runs its trie (unique tokens, depth-priced attention), not its samples
    unshared: the meter prices it with the same features as the planner (micro_cost)."""
    batch = mp.Batch([300, 320, 340, 500, 90, 400], prefix_parent=[-1, 0, 0, -1, -1, 4],
                     shared_prefix_lens=[0, 250, 250, 0, 0, 80])
    plan = mp.plan(batch, mp.PlanConfig(dp_size=1, max_tokens_per_micro=900, share_prefixes=True))
    micros = [m for m in plan.rank(0)[0]]
    assert any(m.tree is not None and m.num_tokens < int(m.seq_lens.sum()) for m in micros)
    prior = mp.FlopsCost(linear=6e9, quadratic=2e5, per_micro=1e11)
    meter = mp.CostMeter(prior=prior)
    meter.cost()
    for m in micros:                                 # the machine is exactly the prior, in seconds
        meter.record(m, 1e-14 * prior.micro_cost(m))
    assert meter.report().recent_max_error < 1e-9


def test_a_packed_tree_row_is_refused_by_micro_cost():
    from microplan.torch import pack_micro
    batch = mp.Batch([6, 7], prefix_parent=[-1, 0], shared_prefix_lens=[0, 4])
    plan = mp.plan(batch, mp.PlanConfig(dp_size=1, max_tokens_per_micro=20, share_prefixes=True))
    toks = [np.arange(6), np.concatenate([np.arange(4), [50, 51, 52]])]
    packed = pack_micro(plan.rank(0)[0][0], toks)
    with pytest.raises(mp.PlanError, match="pass the plan's Micro"):
        mp.FlopsCost(linear=1.0, quadratic=1e-3).micro_cost(packed)


@pytest.mark.parametrize("seconds", [1e200, 1e-200, 1e-300])
def test_extreme_timings_fit_or_are_refused(seconds):
    """Issue 17: record([3, 4], 1e200) then cost() raised LinAlgError. The fit runs in units of a
    typical record (any magnitude a float holds fits), and a timing more than 1e9x away from the
    records already held is refused with a PlanError naming it."""
    meter = mp.CostMeter()
    meter.record([3, 4], seconds)
    fit = meter.cost()
    assert np.isfinite(fit.micro_cost([3, 4])) and fit.micro_cost([3, 4]) == pytest.approx(seconds, rel=0.3)
    meter.record([5, 2], seconds * 1.1)
    assert meter.cost().micro_cost([5, 2]) == pytest.approx(seconds, rel=0.3)
    with pytest.raises(mp.PlanError, match="1e\\+09x away"):
        meter.record([3, 4], 1.0 if seconds < 1e-100 else 1e-100)
    assert meter.num_records == 2


def test_report_names_the_terms_the_records_do_not_identify():
    """Issue 20: where the data cannot identify a term the fit stays at the prior, and report() says
    so. Micro-batches all holding the same tokens cannot tell per_micro from linear (nor attention,
    with one length); records that vary identify them."""
    rng = np.random.default_rng(0)
    flat = mp.CostMeter(prior=PRIOR)
    for _ in range(40):
        flat.record([4096, 4096], TRUTH.micro_cost([4096, 4096]) * (1 + 0.03 * rng.standard_normal()))
    rep = flat.report()
    assert "per_micro" in rep.prior_terms and "from the prior" in str(rep)
    varied = mp.CostMeter(prior=PRIOR, noise=0.01)
    for L in rng.integers(1, 16, 200):
        m = [int(L) * 1024] * int(rng.integers(1, 4))
        varied.record(m, TRUTH.micro_cost(m) * (1 + 0.01 * rng.standard_normal()))
    assert varied.report().prior_terms == ()
    assert "from the prior" not in str(varied.report())


def _attention_fit(noise: float, seed: int, records: int = 200) -> tuple[float, float]:
    """(relative error of the fitted attention-to-linear ratio, the reported relative sd)."""
    rng = np.random.default_rng(seed)
    truth = mp.FlopsCost(linear=1.0, quadratic=2e-5, per_micro=500.0)
    meter = mp.CostMeter(prior=mp.FlopsCost(linear=1.0, quadratic=4e-5, per_micro=1000.0))
    for _ in range(records):
        lens = rng.integers(100, 8000, size=int(rng.integers(1, 6)))
        meter.record(lens, truth.micro_cost(lens) * (1.0 + noise * rng.standard_normal()))
    rep = meter.report()
    got = rep.cost.quadratic / rep.cost.linear / (truth.quadratic / truth.linear) - 1.0
    assert rep.attention_rel_std is not None and "known to ±" in str(rep)
    return abs(got), rep.attention_rel_std


def test_attention_uncertainty_is_reported_and_calibrated():
    """The report's sd of the attention term follows the noise the records show (not the assumed
    5 %) and covers the real error of the fit: within 3 sd in nearly every run."""
    assert mp.CostMeter(prior=mp.FlopsCost(linear=1.0, quadratic=1e-5)).report().attention_rel_std is None
    quiet = [_attention_fit(0.01, s) for s in range(12)]
    loud = [_attention_fit(0.05, s) for s in range(12)]
    assert np.mean([sd for _, sd in loud]) > 3.0 * np.mean([sd for _, sd in quiet])
    covered = sum(err <= 3.0 * sd for err, sd in quiet + loud)
    assert covered >= 22, [(round(e, 3), round(sd, 3)) for e, sd in quiet + loud]
    more = [_attention_fit(0.05, s, records=800) for s in range(6)]
    assert np.mean([sd for _, sd in more]) < 0.7 * np.mean([sd for _, sd in loud[:6]])


def test_the_meter_hands_its_attention_doubt_to_the_planner():
    """Issue 20: the model cost() hands out carries the attention sd (from ±2 %) so the planner hedges
    (stages/hedge.py); hedge=False, or a well-identified attention term, plans on the point estimate."""
    from microplan.cost.meter import HEDGE_MAX_SD, HEDGE_MIN_SD
    rng = np.random.default_rng(1)
    truth = mp.FlopsCost(linear=1.0, quadratic=2e-5, per_micro=500.0)
    prior = mp.FlopsCost(linear=1.0, quadratic=4e-5, per_micro=1000.0)
    meters = {h: mp.CostMeter(prior=prior, hedge=h) for h in (True, False)}
    for _ in range(60):
        lens = rng.integers(100, 8000, size=int(rng.integers(1, 6)))
        t = truth.micro_cost(lens) * (1.0 + 0.05 * rng.standard_normal())
        for m in meters.values():
            m.record(lens, t)
    sd = meters[True].report().attention_rel_std
    assert sd is not None and HEDGE_MIN_SD <= sd < HEDGE_MAX_SD
    assert meters[True].cost().attention_rel_sd == pytest.approx(sd)
    assert "±" in meters[True].cost().describe()
    assert meters[False].cost().attention_rel_sd == 0.0
    assert meters[False].cost().quadratic == meters[True].cost().quadratic  # the point estimate is the same
    sharp = mp.CostMeter(prior=prior)
    for _ in range(400):
        lens = rng.integers(100, 8000, size=int(rng.integers(1, 6)))
        sharp.record(lens, truth.micro_cost(lens) * (1.0 + 0.002 * rng.standard_normal()))
    assert sharp.report().attention_rel_std < HEDGE_MIN_SD
    assert sharp.cost().attention_rel_sd == 0.0
    vague = mp.CostMeter(prior=prior)  # short samples barely show attention: its sd is far above ±50 %
    for _ in range(60):
        lens = rng.integers(100, 3000, size=int(rng.integers(1, 6)))
        vague.record(lens, truth.micro_cost(lens) * (1.0 + 0.05 * rng.standard_normal()))
    assert vague.report().attention_rel_std > HEDGE_MAX_SD
    assert vague.cost().attention_rel_sd == HEDGE_MAX_SD
    with pytest.raises(mp.PlanError, match="hedge"):
        mp.CostMeter(prior=prior, hedge="yes")
