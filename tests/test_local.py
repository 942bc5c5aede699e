"""Local placement (PlanConfig(placement="local")): every invariant of a plan, plus samples stay put.

Random batches and configs come from tests/reference.py; owners are drawn as round robin, random,
uneven contiguous blocks (a driver that dispatched unequal shares) or skewed (ranks without a
sample). Each plan is re-checked sample by sample (reference.check_plan, which also asserts that
every sample runs on its ``rank_of``), by ``Plan.validate()``, through JSON, and for exactness of
the loss scales against the DESIGN.md objective. The short_step policies are checked against
each other exactly as in test_properties.py, with "a rank holds fewer samples than K" as the
condition for placeholders.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import event, given, note, reject
from hypothesis import strategies as st

import microplan as mp
from microplan.planner import build_plan
from reference import (ExpectedError, cases, check_plan, configs, expected_split, replace,
                       micro_body, sample_costs, step_times)
from test_loss_weights import _check_steps, _token_losses
from test_properties import _check_stats, _roundtrip

OWNERS = ("round_robin", "random", "blocks", "skewed")


def owners(rng: np.random.Generator, n: int, dp: int, kind: str) -> np.ndarray:
    if kind == "round_robin":
        return np.arange(n) % dp
    if kind == "random":
        return rng.integers(0, dp, n)
    if kind == "blocks":  # contiguous uneven shares, in sample order
        cuts = np.sort(rng.integers(0, n + 1, dp - 1))
        return np.searchsorted(cuts, np.arange(n), side="right")
    return np.minimum(rng.geometric(0.5, n) - 1, dp - 1)  # skewed: low ranks hold most


@st.composite
def local_inputs(draw, max_samples: int = 300, max_cap: int = 4096, max_dp: int = 16):
    case = draw(cases(max_samples=max_samples, max_cap=max_cap))
    cfg = draw(configs(case, max_dp=max_dp))
    cp = cfg.context_parallel
    if cp is not None and cp.dynamic:  # local placement takes fixed CP only
        cfg = replace(cfg, context_parallel=mp.ContextParallel(size=cp.max_size))
    cfg = replace(cfg, placement="local")
    kind = draw(st.sampled_from(OWNERS))
    own = owners(np.random.default_rng(draw(st.integers(0, 2 ** 31))), case.seq_lens.size, cfg.dp_size, kind)
    event(f"owners: {kind}")
    return case, cfg, mp.Batch(case.seq_lens, **case.kwargs, rank_of=own)


def _plan(batch, cfg, case):
    try:
        expected_split(case.pc, case.rc, cfg.steps)
    except ExpectedError:
        with pytest.raises(mp.PlanError):
            mp.plan(batch, cfg)
        return None
    return mp.plan(batch, cfg)


def _check_local(plan: mp.Plan, case, cfg, batch) -> None:
    plan.validate()
    check_plan(plan, case.seq_lens, case.loss_tokens, case.pc, case.rc, cfg)  # includes: samples stay put
    _check_stats(plan)
    _roundtrip(plan)
    assert mp.plan(batch, cfg).fingerprint() == plan.fingerprint(), "same input, different plan"
    cost = cfg.cost
    for s, step in enumerate(plan.steps):
        K = step.micro_count
        own = batch.rank_of[step.samples]
        n = np.bincount(own, minlength=cfg.dp_size)
        # placeholders: exactly the missing samples of ranks holding fewer than K, none elsewhere
        for r, row in enumerate(step.micros):
            ph = sum(m.is_placeholder for m in row)
            assert ph == max(0, K - int(n[r])), f"step {s} rank {r}: {ph} placeholders, {n[r]} samples, K={K}"
            # heaviest first on every rank: the optimal slot arrangement for these micro-batches
            c = [(1.0 if m.is_placeholder else micro_body(cost, m.seq_lens)) / m.cp_size
                 for m in row]
            assert all(a >= b * (1 - 1e-12) - 1e-9 for a, b in zip(c, c[1:])), f"step {s} rank {r}: {c}"
        # K: at least what the busiest rank needs, aligned, and recorded in the choice
        if cfg.max_tokens_per_micro is not None:
            cap = cfg.max_tokens_per_micro * cfg.static_cp_size
            tok = np.bincount(own, weights=batch.seq_lens[step.samples], minlength=cfg.dp_size)
            assert K >= int(np.ceil(tok.max() / cap))
            assert step.choice is not None and step.choice.micro_count == K and step.choice.lower_bound <= K
        else:
            assert K >= int(np.ceil(n.max() / cfg.micro_batch_size))


@given(data=st.data(), inputs=local_inputs())
def test_local_plans_keep_every_invariant(data, inputs):
    case, cfg, batch = inputs
    note(f"config: {cfg}")
    pad_cfg = replace(cfg, short_step="pad")
    pad = _plan(batch, pad_cfg, case)
    if pad is None:
        return
    _check_local(pad, case, pad_cfg, batch)
    short = [s.index for s in pad.steps if s.num_placeholders]
    event(f"{cfg.short_step}: short step: {bool(short)}")
    if cfg.short_step == "pad":
        return
    if not short:  # nothing short: every policy gives the pad plan
        got = mp.plan(batch, cfg)
        assert got.steps == pad.steps and np.array_equal(got.dropped, pad.dropped)
        return
    if cfg.short_step == "error":
        with pytest.raises(mp.PlanError) as exc:
            mp.plan(batch, cfg)
        msg = str(exc.value)
        s = short[0]
        assert re.search(rf"\bstep {s}\b", msg) and f"K={pad.steps[s].micro_count}" in msg, msg
        assert "short_step=" in msg and "placement='local'" in msg, msg
        return
    _check_local_drop(batch, case, cfg, pad, short)


def _check_local_drop(batch, case, cfg, pad: mp.Plan, short: list[int]) -> None:
    try:
        p = mp.plan(batch, cfg)
    except mp.PlanError as exc:
        msg = str(exc)
        assert "short_step=" in msg and re.search(r"\bstep (\d+)\b", msg), msg
        assert int(re.search(r"\bstep (\d+)\b", msg).group(1)) in short
        event("drop: PlanError")
        return
    _check_local(p, case, cfg, batch)
    assert all(step.num_placeholders == 0 for step in p.steps), "short_step='drop' left placeholders"
    for s, (got, full) in enumerate(zip(p.steps, pad.steps)):
        if s not in short:
            assert got == full
            continue
        kept, everything = set(got.samples.tolist()), full.samples.tolist()
        order = list(dict.fromkeys(int(case.rc[i]) for i in everything))  # rollouts, first appearance
        dropped_r = {int(case.rc[i]) for i in everything if i not in kept}
        assert dropped_r and set(order[len(order) - len(dropped_r):]) == dropped_r, "not the trailing rollouts"
        # the longest such prefix: one more rollout would leave a rank short
        more = set(order[: len(order) - len(dropped_r) + 1])
        sub = np.array([i for i in everything if int(case.rc[i]) in more])
        q = mp.plan(mp.Batch(batch.seq_lens[sub], rank_of=batch.rank_of[sub]), replace(cfg, short_step="pad", steps=None))
        assert q.steps[0].num_placeholders > 0, "a longer prefix fills every rank, but 'drop' kept fewer"


@given(data=st.data(), case=cases(max_samples=150, max_cap=512), signed=st.booleans())
def test_local_loss_scales_are_exact(data, case, signed):
    """The loss stays global over the step: Σ over ranks and micro-batches of scale·Σℓ, reduced as
    the engine does, is J of the step (tests/test_loss_weights.py's check, unchanged)."""
    cfg = data.draw(configs(case, cp=False, max_dp=16))
    cfg = replace(cfg, placement="local", short_step=data.draw(st.sampled_from(["pad", "pad", "drop"])))
    own = owners(np.random.default_rng(len(case.seq_lens)), case.seq_lens.size, cfg.dp_size,
                 data.draw(st.sampled_from(OWNERS)))
    try:
        plan = mp.plan(mp.Batch(case.seq_lens, **case.kwargs, rank_of=own), cfg)
    except mp.PlanError:
        reject()
    losses = _token_losses(np.random.default_rng(7), case.loss_tokens, signed)
    _check_steps(plan, case, losses, signed)


@given(data=st.data(), case=cases(max_samples=200, max_cap=2048))
def test_one_rank_local_equals_global(data, case):
    """dp=1: nothing can move, and local placement reuses the global stages, so the plans agree —
    unless local placement found a larger K faster (it probes above the fewest micro-batches that
    fit, the global planner does not), in which case it is predicted strictly faster."""
    cfg = replace(data.draw(configs(case, cp=False, max_dp=1)), dp_size=1)
    try:
        glob = mp.plan(case.batch(), cfg)
    except mp.PlanError:
        with pytest.raises(mp.PlanError):
            mp.plan(mp.Batch(case.seq_lens, **case.kwargs, rank_of=np.zeros(case.seq_lens.size, int)),
                    replace(cfg, placement="local"))
        return
    loc = mp.plan(mp.Batch(case.seq_lens, **case.kwargs, rank_of=np.zeros(case.seq_lens.size, int)),
                  replace(cfg, placement="local"))
    assert np.array_equal(loc.dropped, glob.dropped)
    for a, b in zip(loc.steps, glob.steps):
        if a.micro_count == b.micro_count:
            assert a.micros == b.micros and np.array_equal(a.samples, b.samples)
        else:
            event("local probed a larger K")
            assert a.micro_count > b.micro_count and a.choice.candidates[0][0] == b.micro_count
            i = a.index
            assert loc.stats.steps[i].lockstep_time < glob.stats.steps[i].lockstep_time or cfg.sync == "step"


@given(data=st.data(), inputs=local_inputs(max_samples=120, max_dp=8), k=st.integers(1, 9))
def test_min_micro_count_hook(data, inputs, k):
    """The minimum-K hook (pipeline stages, verl's min_num_micro_batch): K >= the minimum, aligned."""
    case, cfg, batch = inputs
    cfg = replace(cfg, short_step="pad", steps=None)
    try:
        plan = build_plan(batch, cfg, min_micro_count=k)
    except mp.PlanError:
        reject()
    plan.validate()
    check_plan(plan, case.seq_lens, case.loss_tokens, case.pc, case.rc, cfg)
    for step in plan.steps:
        assert step.micro_count >= k and step.micro_count % cfg.align == 0


@pytest.mark.parametrize("p,v,align,k", [(4, 1, 1, 2), (4, 2, 4, 2), (3, 1, 1, 1), (2, 1, 1, 5), (4, 2, 4, 6)])
def test_min_micro_count_adds_to_pipeline_stages(p, v, align, k):
    """issue 17: min_micro_count=2 with pipeline_stages=4 planned K=2 (the minimum replaced K >= p)
    and the plan failed validate(); K is now >= max(min_micro_count, p), aligned."""
    b = mp.Batch([100] * 16, rank_of=np.arange(16) % 2)
    cfg = mp.PlanConfig(dp_size=2, max_tokens_per_micro=1000, placement="local", pipeline_stages=p,
                        virtual_stages=v, align=align)
    plan = build_plan(b, cfg, min_micro_count=k)
    plan.validate()
    K = plan.steps[0].micro_count
    assert K >= max(k, p) and K % align == 0 and K == -(-max(k, p, 1) // align) * align


def test_local_balances_slots_across_ranks():
    """Lockstep time within 1% of the busiest rank's work on a long-tail step pinned by a balanced split."""
    rng = np.random.default_rng(3)
    lens = np.minimum(np.ceil(rng.lognormal(7.5, 1.0, 512)), 16384).astype(int)
    order = np.argsort(-lens, kind="stable")
    own = np.empty(512, dtype=int)
    own[order] = np.r_[np.arange(8), np.arange(8)[::-1]][np.arange(512) % 16]  # snake deal by length
    cost = mp.FlopsCost(linear=1.0, quadratic=2e-5, per_micro=256.0)
    cfg = mp.PlanConfig(dp_size=8, max_tokens_per_micro=32768, cost=cost, placement="local")
    plan = mp.plan(mp.Batch(lens, rank_of=own), cfg)
    plan.validate()
    step = plan.steps[0]
    K = step.micro_count
    busiest = max(float(sample_costs(cost, lens[own == r]).sum()) for r in range(8)) + K * cost.per_micro
    lock, _ = step_times(plan, 0)
    assert step.num_placeholders == 0
    assert lock <= 1.01 * busiest, (lock, busiest)


def test_bad_local_input_is_refused_clearly():
    b = mp.Batch([5, 6, 7])
    with pytest.raises(mp.PlanError, match=r"placement=.*'global'.*'local'"):
        mp.PlanConfig(dp_size=2, max_tokens_per_micro=16, placement="nearby")
    with pytest.raises(mp.PlanError, match="rank_of"):
        mp.plan(b, mp.PlanConfig(dp_size=2, max_tokens_per_micro=16, placement="local"))
    with pytest.raises(mp.PlanError, match=r"rank_of\[2\]=2 .*dp_size=2"):
        mp.plan(mp.Batch([5, 6, 7], rank_of=[0, 1, 2]), mp.PlanConfig(dp_size=2, max_tokens_per_micro=16,
                                                                      placement="local"))
    with pytest.raises(mp.PlanError, match=r"rank_of\[1\]=-1"):
        mp.Batch([5, 6, 7], rank_of=[0, -1, 1])
    with pytest.raises(mp.PlanError, match="rank_of has 2 entries"):
        mp.Batch([5, 6, 7], rank_of=[0, 1])
    with pytest.raises(mp.PlanError, match="dynamic context parallel"):
        mp.PlanConfig(dp_size=4, max_tokens_per_micro=16, placement="local",
                      context_parallel=mp.ContextParallel(max_size=2))
    with pytest.raises(mp.PlanError, match="placement='local' only"):
        build_plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=16), min_micro_count=2)
    with pytest.raises(mp.PlanError, match="min_micro_count"):
        build_plan(mp.Batch([5], rank_of=[0]), mp.PlanConfig(dp_size=1, max_tokens_per_micro=16,
                                                             placement="local"), min_micro_count=0)


def test_error_names_the_short_ranks_and_validate_catches_a_moved_sample():
    # rank 0 needs 3 micro-batches for its long samples; rank 1 holds a single sample
    b = mp.Batch([10, 10, 10, 3], rank_of=[0, 0, 0, 1])
    cfg = mp.PlanConfig(dp_size=2, max_tokens_per_micro=12, placement="local", short_step="error")
    with pytest.raises(mp.PlanError, match=r"step 0: every rank runs K=3 .*rank 1 has 1 sample"):
        mp.plan(b, cfg)
    pad = mp.plan(b, replace(cfg, short_step="pad"))
    assert [sum(m.is_placeholder for m in row) for row in pad.steps[0].micros] == [0, 2]
    # a plan that moves sample 3 to rank 0 is refused by validate()
    moved = mp.Plan.from_json(pad.to_json().replace('"rank_of":[0,0,0,1]', '"rank_of":[0,0,0,0]'))
    with pytest.raises(mp.PlanError, match=r"sample 3 is pinned to rank 0 .* runs on rank 1"):
        moved.validate()
    # drop: the trailing rollout (sample 3) goes, and... rank 1 is then empty: no prefix fills every rank
    with pytest.raises(mp.PlanError, match="no prefix of whole rollouts"):
        mp.plan(b, replace(cfg, short_step="drop"))


def test_global_plans_ignore_owners_and_old_json_reads():
    b = mp.Batch([5, 6, 7, 8], rank_of=[1, 1, 1, 1])
    cfg = mp.PlanConfig(dp_size=2, max_tokens_per_micro=16)
    p = mp.plan(b, cfg)
    assert p.steps == mp.plan(mp.Batch([5, 6, 7, 8]), cfg).steps  # global placement moves samples freely
    d = mp.plan(mp.Batch([5, 6, 7, 8]), cfg).to_dict()
    assert "rank_of" not in d["batch"] and "placement" not in d["config"]  # unchanged format without owners
    loc = mp.plan(b, replace(cfg, placement="local"))
    assert loc.to_dict()["config"]["placement"] == "local" and loc.to_dict()["batch"]["rank_of"] == [1, 1, 1, 1]
    assert all(m.is_placeholder for m in loc.steps[0].micros[0])


@given(data=st.data(), case=cases(max_samples=120, max_cap=64, lengths=("big", "cap", "bimodal")))
def test_local_drop_keeps_the_longest_prefix(data, case):
    """short_step='drop' where ranks run mostly singleton micro-batches (long samples), owners dealt
    round robin or at random over few ranks, so a short rank is common and dropping can fix it."""
    cfg = data.draw(configs(case, cp=False, max_dp=4))
    cfg = replace(cfg, short_step="drop", micro_batch_size=None, context_parallel=None, placement="local",
                  max_tokens_per_micro=case.cap, align=data.draw(st.integers(1, 2)))
    own = owners(np.random.default_rng(case.seq_lens.size), case.seq_lens.size, cfg.dp_size,
                 data.draw(st.sampled_from(["round_robin", "random"])))
    batch = mp.Batch(case.seq_lens, **case.kwargs, rank_of=own)
    pad = _plan(batch, replace(cfg, short_step="pad"), case)
    if pad is None:
        return
    short = [s.index for s in pad.steps if s.num_placeholders]
    event(f"short step: {bool(short)}")
    if short:
        _check_local_drop(batch, case, cfg, pad, short)


@given(seed=st.integers(0, 2 ** 31), n=st.integers(2, 200), k=st.integers(2, 16))
def test_refine_swaps_only_keep_counts_and_never_raise_the_max(seed, n, k):
    """refine_bins(moves=False), used for equal-size splits (verl's driver side): counts unchanged,
    the heaviest bin never heavier, every sample still in exactly one bin."""
    from microplan.stages.pack import round_robin_pack
    from microplan.stages.refine import refine_bins
    rng = np.random.default_rng(seed)
    w = rng.integers(1, 10 ** 6, n).astype(np.int64)
    b = round_robin_pack(w.astype(float), min(k, n))
    r = refine_bins(b, w, w.astype(float), min(k, n), None, moves=False, rel_tol=1e-6, max_iters=8 * k)
    m = min(k, n)
    assert np.array_equal(np.bincount(r, minlength=m), np.bincount(b, minlength=m))
    assert np.bincount(r, weights=w, minlength=m).max() <= np.bincount(b, weights=w, minlength=m).max()


def test_one_rank_local_packs_a_cap_tight_step_as_global_does():
    """Found by the thorough hypothesis profile (test_one_rank_local_equals_global): a step whose
    micro-batches fill the cap to the last few tokens, where the slot-target LPT fails. The global
    packer retries it on costs tilted toward long samples; local placement skipped that retry (it
    passes shared targets) and fell to first-fit decreasing — a different packing. Both now tilt."""
    lens = np.array([29, 24, 46, 992, 94, 66, 83, 43, 74, 97, 65, 84, 33, 62, 24, 87, 31, 1, 57, 808, 90, 55, 39,
                     1024, 11, 29, 43, 38, 986, 10, 82, 74, 58, 87, 10, 22, 93, 28, 23, 11, 60, 971, 19, 46, 95, 98,
                     769, 48, 981, 20, 83, 933, 57, 57, 48, 14, 101, 19, 85, 71, 20, 839])
    pids = [0, 1, 2, 3, 4, 3, 5, 0, 6, 2, 5, 3, 7, 0, 8, 8, 4, 9, 5, 1, 10, 8, 10, 0, 5, 9, 7, 0, 11, 11, 7, 11, 1,
            7, 0, 12, 6, 3, 9, 7, 7, 1, 2, 7, 7, 5, 10, 1, 10, 8, 6, 0, 10, 9, 2, 10, 0, 9, 10, 1, 3, 5]
    cfg = mp.PlanConfig(dp_size=1, max_tokens_per_micro=1024, steps=mp.Steps(num_steps=2), cost=mp.TokenCost())
    glob = mp.plan(mp.Batch(lens, loss_tokens=lens - 1, prompt_ids=pids), cfg)
    loc = mp.plan(mp.Batch(lens, loss_tokens=lens - 1, prompt_ids=pids, rank_of=np.zeros(lens.size, int)),
                  replace(cfg, placement="local"))
    loc.validate()
    assert [s.micro_count for s in loc.steps] == [s.micro_count for s in glob.steps] == [7, 4]
    assert all(a.micros == b.micros for a, b in zip(loc.steps, glob.steps))
