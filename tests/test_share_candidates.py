"""Which granularity candidates a sharing step lays out (stages/granularity.py, docs/prefix.md).

A candidate is skipped only when it cannot matter: a tree cut whose atoms equal an earlier
candidate's; the cuts and the per-sample candidate once a kept candidate is within SKIP_SLACK of
the sharing floor (a lower bound of every sharing candidate's predicted time: checked here against
whole trees, cuts and per-sample layouts); the per-sample candidate, whose duty is to match the
unshared plan, only when a kept candidate is also below the unshared plan's lower bound
(``stats.unshared_step_bound``, checked per step against real unshared plans over test_compose's
compositions and fuzz_share's draws). Skipping costs at most SKIP_SLACK against laying every
candidate out; sharing never hurts stays tests/test_share_never_hurts.py's property. Also: a
tree candidate's bin tries summed from its atoms equal ``trie.row_tries`` of its bins.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import event, given, note
from hypothesis import strategies as st
from test_compose import _config, batches, options

import microplan as mp
from benchmarks.fuzz_share import draw_case
from microplan.footprint import footprint_of
from microplan.stages import granularity
from microplan.stats import unshared_step_bound
from microplan.traces import generate

REL = 1e-9


def _check_bound(b: mp.Batch, cfg: mp.PlanConfig) -> None:
    """Every step of the unshared plan: its predicted time is at least the bound, which is the
    bound the plan's stats report for that step."""
    try:
        p = mp.plan(b, cfg)
    except mp.PlanError:
        event("refused unshared")
        return
    event("planned unshared")
    fp = footprint_of(b, cfg)
    for step, s in zip(p.steps, p.stats.steps):
        own = s.lockstep_time if cfg.sync == "micro" else s.step_sync_time
        lb, k_lb = unshared_step_bound(b, replace(cfg, share_prefixes=True), step.samples, fp)
        assert lb == s.time_lower_bound and k_lb == s.micro_count_lower_bound
        assert lb <= own * (1 + REL), (lb, own)
        quick, k_q = unshared_step_bound(b, replace(cfg, share_prefixes=True), step.samples, fp, slot=False)
        assert quick <= lb and k_q == k_lb  # the per-sample skip tries it first (granularity._skip_per_sample)


@given(bd=batches(), o=options())
def test_unshared_bound_is_below_every_unshared_step_over_compositions(bd, o):
    b, dp = bd
    o = dict(o, share=False, layout="varlen", static=False)  # where sharing plans (docs/planner.md's table)
    note(f"options: {o}")
    try:
        cfg = _config(o, dp)
        replace(cfg, share_prefixes=True)
    except mp.PlanError:
        return
    _check_bound(b, cfg)


@given(seed=st.integers(0, 2**31))
def test_unshared_bound_is_below_every_unshared_step_over_fuzz_share(seed):
    b, kw, o = draw_case(np.random.default_rng(seed), dynamic_cp=False)
    note(f"options: {o}")
    try:
        cfg = mp.PlanConfig(share_prefixes=False, **kw)
        replace(cfg, share_prefixes=True)
    except mp.PlanError:
        return  # refused either way
    _check_bound(b, cfg)


def _laid_out(monkeypatch, b: mp.Batch, cfg: mp.PlanConfig) -> tuple[mp.Plan, list]:
    seen = []
    real = granularity.lay_out

    def spy(s, atoms, ctx, **kw):
        seen.append(atoms)
        return real(s, atoms, ctx, **kw)
    monkeypatch.setattr(granularity, "lay_out", spy)
    return mp.plan(b, cfg), seen


@pytest.mark.parametrize("short_step", ["pad", "error", "drop"])
def test_per_sample_candidate_skipped_when_trees_beat_the_unshared_bound(monkeypatch, short_step):
    """GRPO groups sharing long prompts: whole trees are predicted below any unshared plan and
    within SKIP_SLACK of the least time any sharing layout could have, so the per-sample
    candidate is not laid out, and the plan is still faster than unshared."""
    b = generate("grpo-longtail", num_prompts=64, samples_per_prompt=8, max_len=8192, seed=3)
    kw = dict(dp_size=2, max_tokens_per_micro=16384, cost=mp.FlopsCost(linear=1.0, quadratic=1e-4, per_micro=256.0),
              short_step=short_step)
    flat = mp.plan(b, mp.PlanConfig(**kw))
    plan, seen = _laid_out(monkeypatch, b, mp.PlanConfig(share_prefixes=True, **kw))
    assert seen and not any(a.one_each for a in seen)
    assert plan.stats.predicted_time < flat.stats.time_lower_bound <= flat.stats.predicted_time


def test_per_sample_candidate_kept_where_it_could_win_by_more_than_the_slack(monkeypatch):
    """fuzz_share --seed 0 --case 2521: the trees beat the unshared bound, but sit more than
    SKIP_SLACK above the sharing floor; skipping on the unshared bound alone (slack
    unbounded) gave a plan 1.3 % slower than the per-sample candidate's."""
    b, kw, o = draw_case(np.random.default_rng([0, 2521]))
    cfg = mp.PlanConfig(share_prefixes=True, **kw)
    plan, seen = _laid_out(monkeypatch, b, cfg)
    assert any(a.one_each for a in seen)
    monkeypatch.setattr(granularity, "SKIP_SLACK", float("inf"))
    loose = mp.plan(b, cfg)
    assert loose.stats.predicted_time > plan.stats.predicted_time * (1 + 1e-3)


def test_cut_candidates_skipped_when_whole_trees_sit_near_the_floor(monkeypatch):
    """GRPO groups, whole trees within SKIP_SLACK of the sharing floor: no tree cut is laid out (nor
    the per-sample candidate), and the plan is within SKIP_SLACK of the plan that lays every
    candidate out."""
    b = generate("grpo-longtail", num_prompts=64, samples_per_prompt=8, max_len=8192, seed=3)
    cfg = mp.PlanConfig(dp_size=2, max_tokens_per_micro=16384, share_prefixes=True,
                        cost=mp.FlopsCost(linear=1.0, quadratic=1e-4, per_micro=256.0))
    plan, seen = _laid_out(monkeypatch, b, cfg)
    assert len(seen) == 1 and not seen[0].one_each
    slack = granularity.SKIP_SLACK
    monkeypatch.setattr(granularity, "SKIP_SLACK", -1.0)  # never reached: every candidate laid out
    every, seen = _laid_out(monkeypatch, b, cfg)
    assert len(seen) > 1
    assert plan.stats.predicted_time <= every.stats.predicted_time * (1 + slack)


@given(family=st.sampled_from(["grpo-longtail", "bimodal", "stepwise-multiturn"]), prompts=st.integers(4, 48),
       dp=st.integers(1, 8), cap=st.sampled_from([16384, 32768]), sync=st.sampled_from(["micro", "step"]),
       short=st.sampled_from(["pad", "drop", "error"]), seed=st.integers(0, 100))
def test_skipping_candidates_costs_at_most_the_slack(family, prompts, dp, cap, sync, short, seed):
    """The candidates the floor skips could each have been faster by at most SKIP_SLACK: the plan
    is within it of the plan that lays every candidate out, and still never slower than unshared."""
    b = generate(family, num_prompts=prompts, samples_per_prompt=4, max_len=8192, seed=seed)
    kw = dict(dp_size=dp, max_tokens_per_micro=cap, sync=sync, short_step=short,
              cost=mp.FlopsCost(linear=1.0, quadratic=1e-4, per_micro=256.0))
    try:
        flat = mp.plan(b, mp.PlanConfig(**kw))
    except mp.PlanError:
        return
    cfg = mp.PlanConfig(share_prefixes=True, **kw)
    plan = mp.plan(b, cfg)
    with pytest.MonkeyPatch.context() as mpatch:
        mpatch.setattr(granularity, "SKIP_SLACK", -1.0)
        every = mp.plan(b, cfg)
    event("same plan" if plan.fingerprint() == every.fingerprint() else "a skipped candidate would have won")
    assert plan.dropped.size == every.dropped.size <= flat.dropped.size
    assert plan.stats.predicted_time <= every.stats.predicted_time * (1 + granularity.SKIP_SLACK)
    if plan.dropped.size == flat.dropped.size:
        assert plan.stats.predicted_time <= flat.stats.predicted_time * (1 + REL)


def test_per_sample_candidate_laid_out_when_nothing_is_shared(monkeypatch):
    """No prefix shared: the tree candidates are the unshared plan at best, never below its bound,
    so the per-sample candidate is laid out (it is what matches the unshared plan)."""
    rng = np.random.default_rng(0)
    b = mp.Batch(rng.integers(100, 4000, 200))
    kw = dict(dp_size=4, max_tokens_per_micro=8192, cost=mp.FlopsCost(linear=1.0, quadratic=1e-4, per_micro=256.0))
    plan, seen = _laid_out(monkeypatch, b, mp.PlanConfig(share_prefixes=True, **kw))
    assert any(a.one_each for a in seen)
    assert plan.stats.predicted_time <= mp.plan(b, mp.PlanConfig(**kw)).stats.predicted_time * (1 + REL)


def test_a_tree_cut_equal_to_the_whole_trees_is_not_laid_out_again(monkeypatch):
    """Many small trees, several per micro-batch: the mean micro-batch load is below the largest
    bin, so cut limits are tried, but no tree exceeds them: the cuts are the whole trees, laid out
    once."""
    lens = np.tile([60, 70, 80, 90], 64)
    parent = np.where(np.arange(lens.size) % 4 == 0, -1, np.arange(lens.size) - np.arange(lens.size) % 4)
    shared = np.where(parent >= 0, 50, 0)
    b = mp.Batch(lens, prefix_parent=parent, shared_prefix_lens=shared)
    kw = dict(dp_size=2, max_tokens_per_micro=1000)
    plan, seen = _laid_out(monkeypatch, b, mp.PlanConfig(share_prefixes=True, **kw))
    trees = [a for a in seen if not a.one_each]
    assert len(trees) == 1 and int(trees[0].tokens.max()) < 200
    plan.validate()


def _check_floor(b: mp.Batch, cfg: mp.PlanConfig, frac: float) -> None:
    """The sharing floor is below every candidate's predicted time (run_time): whole trees, trees
    cut at a fraction of the cap, and one atom per sample (the last with the unshared plan's K)."""
    from microplan.planner import _context
    from microplan.stages.atoms import StepForest, sample_atoms, tree_atoms
    from microplan.stages.fit import effective_cap
    from microplan.stages.place import lay_out
    try:
        ctx = _context(b, cfg, None)
    except mp.PlanError:
        event("refused")
        return
    samples = np.arange(b.num_samples)
    forest = StepForest()
    cap = effective_cap(cfg)
    cands = [(tree_atoms(samples, ctx, cap, forest), None), (tree_atoms(samples, ctx, max(1, int(cap * frac)), forest),
                                                              None)]
    cands.append((sample_atoms(samples, ctx), unshared_step_bound(b, cfg, samples, ctx.fp)[1]))
    floor = granularity._SharingFloor(forest, samples, ctx)
    for atoms, k in cands:
        try:
            lay = lay_out(0, atoms, ctx, short_step="pad")
        except mp.PlanError:
            continue
        with_slack = floor.reached([lay], k)
        if floor.terms is None:
            event("no floor")
            return
        event("floor checked")
        share, k_share = floor.terms
        bound = share + max(k_share, k or 0) * float(cfg.cost.per_micro)
        assert bound <= lay.run_time * (1 + REL), (bound, lay.run_time)
        assert with_slack == (lay.run_time <= bound * (1 + granularity.SKIP_SLACK))


def test_floor_counts_a_prefix_shared_across_trees_once(monkeypatch):
    """Under local placement two trees of one owner may share the path of an ancestor held by
    another rank: a micro-batch holding both stores it once, so the floor is the trie of the
    owner's samples, not the sum of its trees' tries (which was above the plan: 61.9 vs 61.8 in
    fuzz_share's case 2210)."""
    monkeypatch.setattr(__import__(__name__), "event", lambda *a: None)
    lens = np.array([400, 420, 430, 410, 440])
    b = mp.Batch(lens, prefix_parent=[-1, 0, 0, 0, 0], shared_prefix_lens=[0, 300, 300, 300, 300],
                 rank_of=[1, 0, 0, 1, 1])
    cfg = mp.PlanConfig(dp_size=2, max_tokens_per_micro=2048, placement="local", sync="step",
                        cost=mp.FlopsCost(linear=1.0, quadratic=0.0), share_prefixes=True)
    _check_floor(b, cfg, 0.3)
    b, kw, _ = draw_case(np.random.default_rng(2210), dynamic_cp=False)
    _check_floor(b, mp.PlanConfig(share_prefixes=True, **{**kw, "steps": None}), 0.1)


@given(bd=batches(), o=options(), frac=st.sampled_from([0.1, 0.3, 0.7]))
def test_sharing_floor_is_below_every_candidate_over_compositions(bd, o, frac):
    b, dp = bd
    o = dict(o, share=True, layout="varlen", static=False, steps=None)
    note(f"options: {o}")
    try:
        cfg = _config(o, dp)
    except mp.PlanError:
        return
    _check_floor(b, cfg, frac)


@given(seed=st.integers(0, 2**31), frac=st.sampled_from([0.1, 0.3, 0.7]))
def test_sharing_floor_is_below_every_candidate_over_fuzz_share(seed, frac):
    b, kw, o = draw_case(np.random.default_rng(seed), dynamic_cp=False)
    note(f"options: {o}")
    try:
        cfg = mp.PlanConfig(share_prefixes=True, **{**kw, "steps": None})
    except mp.PlanError:
        return
    _check_floor(b, cfg, frac)


@given(seed=st.integers(0, 2**31), frac=st.sampled_from([0.3, 0.6, 1.0]), limit=st.integers(1, 200),
       bins=st.integers(1, 8))
def test_bin_tries_from_atoms_equal_the_bins_tries(seed, frac, limit, bins):
    """A bin's trie from its atoms' own tries (atoms of distinct forest roots add up, bins with two
    atoms of one root counted again) equals ``trie.row_tries`` of the bin's samples: any subset of
    the batch (ancestors outside the step shared by several trees), cut at any limit, any bins."""
    from microplan.planner import _context
    from microplan.stages.atoms import bin_tries, tree_atoms
    from microplan.trie import row_tries
    rng = np.random.default_rng(seed)
    b, kw, o = draw_case(rng, dynamic_cp=False)
    try:
        cfg = mp.PlanConfig(share_prefixes=True, **{**kw, "pad_to_multiple_of": 1, "pad_row_to_multiple_of": 1,
                                                     "steps": None})
        ctx = _context(b, cfg, None)
    except mp.PlanError:
        event("refused")
        return
    samples = np.flatnonzero(rng.random(b.num_samples) < frac)
    if not samples.size:
        return
    atoms = tree_atoms(samples, ctx, limit)
    kept = np.flatnonzero(rng.random(atoms.size) < 0.9)
    bin_of = rng.integers(0, bins, kept.size)
    got = bin_tries(atoms, kept, bin_of, bins, ctx)
    assert got is not None
    roots = atoms.component[kept] * bins + bin_of
    event("a bin holds two atoms of one root" if np.unique(roots).size < roots.size else "roots distinct per bin")
    members = atoms.samples_of(kept)
    set_of = np.repeat(bin_of, atoms.ptr[kept + 1] - atoms.ptr[kept])
    want = row_tries(ctx.parent, ctx.shared, b.seq_lens, members, set_of, bins, rules=ctx.fp.row_rules())
    assert got.tokens.dtype == want.tokens.dtype and got.depth_sq.dtype == want.depth_sq.dtype
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.depth_sq, want.depth_sq)
