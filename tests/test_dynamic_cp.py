"""Dynamic context parallel against its fixed-CP special cases and its own guarantees.

A fixed CP degree w is one point of the dynamic search space (every group w wide), so a dynamic
plan with ``max_size=c`` must never be predicted slower than the fixed-CP plan of any degree
w ≤ c that fits the same step without placeholders. Groups are never empty, every GPU stays
under the cap, and a slot's groups tile the plane with contiguous, width-aligned rank ranges.
"""

from __future__ import annotations

import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import microplan as mp
from microplan.traces import generate
from reference import check_plan

COST = mp.FlopsCost(linear=1.0, quadratic=0.05, per_micro=8.0)


@st.composite
def dynamic_cases(draw):
    D = draw(st.sampled_from([2, 4, 8]))
    cmax = draw(st.sampled_from([c for c in (2, 4, 8) if c <= D]))
    cap = draw(st.integers(4, 64))
    n = draw(st.integers(1, 6 * D))
    lens = draw(st.lists(st.integers(1, cap * cmax), min_size=n, max_size=n))  # a group of c holds c × cap
    sync = draw(st.sampled_from(["micro", "step"]))
    return D, cmax, cap, lens, sync


def _cfg(D, cap, sync, cp, short_step="pad"):
    return mp.PlanConfig(dp_size=D, max_tokens_per_micro=cap, cost=COST, sync=sync, short_step=short_step,
                         context_parallel=cp)


def _check_groups(plan: mp.Plan) -> None:
    """Invariants 1-5 (reference.check_plan: groups agree, cap, no loss or duplicate), plus the
    layout cp.py promises: contiguous, width-aligned groups that tile each slot's plane."""
    b = plan.batch
    check_plan(plan, b.seq_lens, b.loss_tokens, b.prompt_codes, b.rollout_codes, plan.config)
    for step in plan.steps:
        for m in range(step.micro_count):
            heads = [row[m] for row in step.micros if row[m].cp_rank == 0]
            for mi in heads:
                g = mi.cp_group
                assert g == tuple(range(g[0], g[0] + mi.cp_size)) and g[0] % mi.cp_size == 0
            assert sum(mi.cp_size for mi in heads) == step.dp_size  # the slot's groups tile the plane


@given(dynamic_cases())
def test_dynamic_cp_is_never_slower_than_any_fixed_cp_degree(case):
    D, cmax, cap, lens, sync = case
    batch = mp.Batch(lens)
    dyn = mp.plan(batch, _cfg(D, cap, sync, mp.ContextParallel(max_size=cmax)))
    dyn.validate()
    _check_groups(dyn)
    t_dyn = dyn.stats.predicted_time
    w = 1
    while w <= cmax:
        try:
            fixed = mp.plan(batch, _cfg(D // w, cap, sync, mp.ContextParallel(size=w), short_step="error"))
        except mp.PlanError:  # a sample longer than w·cap, or a step short at this width
            w *= 2
            continue
        note(f"w={w} fixed={fixed.stats.predicted_time} dynamic={t_dyn}")
        assert t_dyn <= fixed.stats.predicted_time * (1 + 1e-9)
        w *= 2


def test_mixed_widths_win_ties_against_the_uniform_layout():
    """The verl seed's 9 sequences on an 8-GPU plane: two 28-token samples need 2-GPU groups (14 rows
    per GPU), the short ones fit on single GPUs. Fixed CP 2 is predicted exactly as fast, and a tie keeps the
    narrower groups (less CP communication in practice); no group is empty, no placeholder."""
    lens = [28, 28, 9, 8, 7, 6, 5, 4, 3]
    plan = mp.plan(mp.Batch(lens), _cfg(8, 16, "micro", mp.ContextParallel(max_size=2), short_step="error"))
    plan.validate()
    _check_groups(plan)
    widths = sorted({m.cp_size for row in plan.steps[0].micros for m in row})
    assert widths == [1, 2], widths
    assert plan.stats.num_placeholders == 0


@pytest.mark.parametrize("cmax", [2, 4, 8])
def test_long_context_dynamic_cp_matches_or_beats_fixed_cp(cmax):
    batch = generate("long-context", num_prompts=32, samples_per_prompt=8, max_len=32768, seed=1)
    cap = 32768 // 2  # the longest sample fills 2 GPUs exactly
    dyn = mp.plan(batch, _cfg(16, cap, "micro", mp.ContextParallel(max_size=cmax)))
    _check_groups(dyn)
    best_fixed = min(mp.plan(batch, _cfg(16 // w, cap, "micro", mp.ContextParallel(size=w))).stats.predicted_time
                     for w in (2, 4, 8) if w <= cmax)
    assert dyn.stats.predicted_time <= best_fixed * (1 + 1e-9)
    assert dyn.stats.max_micro_tokens <= cap


def test_a_split_sample_keeps_every_gpu_under_a_tiny_cap():
    """Found by the thorough hypothesis profile: at cap 3 the balancing widening may split a
    3-token sample; every GPU then computes ⌈n/c⌉ ≤ 3 rows (footprint.gpu_tokens), and
    validate() accepts the plan."""
    cfg = mp.PlanConfig(dp_size=4, max_tokens_per_micro=3, context_parallel=mp.ContextParallel(max_size=4),
                        cost=mp.TokenCost(per_micro=64.0))
    plan = mp.plan(mp.Batch([2, 3]), cfg)
    plan.validate()
    for row in plan.steps[0].micros:
        for m in row:
            assert m.is_placeholder or -(-m.num_tokens // m.cp_size) <= 3


def test_a_lone_short_sample_takes_one_slot():
    """One 1-token sample on 2 GPUs at cap 3 with rows padded to 2: it runs in one slot (alone, or
    split over both GPUs) — at K = 1, not at a K grown in search of a second sample."""
    cfg = mp.PlanConfig(dp_size=2, max_tokens_per_micro=3, context_parallel=mp.ContextParallel(max_size=2),
                        pad_row_to_multiple_of=2)
    plan = mp.plan(mp.Batch([1]), cfg)
    plan.validate()
    assert plan.steps[0].micro_count == 1


def test_dynamic_cp_refuses_a_row_multiple_the_zigzag_split_cannot_take_at_config_time():
    with pytest.raises(mp.PlanError, match="split like a sample.*use 6"):
        mp.PlanConfig(dp_size=2, max_tokens_per_micro=64, context_parallel=mp.ContextParallel(max_size=2),
                      pad_to_multiple_of=2, pad_row_to_multiple_of=3)
