"""Splitting a batch into optimizer steps (``Steps``): whole groups, exact counts, reported drops."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import microplan as mp
from reference import ExpectedError, cases, check_num_steps, check_plan, expected_split


def _plan(batch: mp.Batch, steps, **kw) -> mp.Plan:
    kw.setdefault("dp_size", 1)
    kw.setdefault("max_tokens_per_micro", 10 ** 6)
    plan = mp.plan(batch, mp.PlanConfig(steps=steps, **kw))
    plan.validate()
    return plan


def _step_prompts(plan: mp.Plan, pids) -> list[list]:
    out = []
    for step in plan.steps:
        seen = []
        for i in step.samples.tolist():
            if pids[i] not in seen:
                seen.append(pids[i])
        out.append(seen)
    return out


def test_no_steps_is_one_step_with_everything():
    plan = _plan(mp.Batch([3, 4, 5, 6]), None)
    assert len(plan.steps) == 1 and plan.steps[0].samples.tolist() == [0, 1, 2, 3]
    assert plan.dropped.size == 0 and plan.steps[0].index == 0


@pytest.mark.parametrize("P,k", [(10, 1), (10, 3), (10, 4), (10, 10), (7, 2), (1, 1)])
def test_num_steps_deals_prompts_evenly_in_order(P, k):
    rng = np.random.default_rng(P * 100 + k)
    sizes = rng.integers(1, 6, P)  # variable samples per prompt
    pids = [f"p{p}" for p in range(P) for _ in range(sizes[p])]
    plan = _plan(mp.Batch(rng.integers(1, 100, len(pids)), prompt_ids=pids), mp.Steps(num_steps=k))
    assert len(plan.steps) == k and plan.dropped.size == 0
    groups = _step_prompts(plan, pids)
    assert [p for g in groups for p in g] == [f"p{p}" for p in range(P)]
    counts = [len(g) for g in groups]
    assert max(counts) - min(counts) <= 1 and sum(counts) == P


def test_num_steps_more_than_prompts_is_refused():
    with pytest.raises(mp.PlanError, match=r"num_steps=5.*only 4 prompt groups.*at most 4"):
        _plan(mp.Batch([1] * 8, prompt_ids=[0, 0, 1, 1, 2, 2, 3, 3]), mp.Steps(num_steps=5))


@pytest.mark.parametrize("p", [1, 2, 3, 5, 7, 8])
def test_prompts_per_step_exact_step_count_and_reported_tail(p):
    P = 7
    rng = np.random.default_rng(p)
    pids, rids = [], []
    for q in range(P):
        for r in range(int(rng.integers(1, 4))):
            for _ in range(int(rng.integers(1, 5))):
                pids.append(q * 11)
                rids.append(f"{q}-{r}")
    batch = mp.Batch(rng.integers(1, 100, len(pids)), prompt_ids=pids, rollout_ids=rids)
    if p > P:  # no step forms: every sample would be dropped, a PlanError naming the setting (DESIGN.md)
        with pytest.raises(mp.PlanError, match=rf"Steps\(prompts_per_step={p}\) forms no optimizer step.*at most {P}"):
            _plan(batch, mp.Steps(prompts_per_step=p))
        return
    plan = _plan(batch, mp.Steps(prompts_per_step=p))
    assert len(plan.steps) == P // p
    for s, g in enumerate(_step_prompts(plan, pids)):
        assert g == [q * 11 for q in range(s * p, (s + 1) * p)]
    tail = [i for i, q in enumerate(pids) if q // 11 >= (P // p) * p]
    assert plan.dropped.tolist() == tail
    for i in tail:
        assert "prompts_per_step" in plan.drop_reasons[i] and "trailing" in plan.drop_reasons[i]


def test_prompts_per_step_with_interleaved_ids_uses_first_appearance():
    pids = ["z", "a", "z", "m", "a", "m", "q", "w", "q"]
    plan = _plan(mp.Batch([1] * 9, prompt_ids=pids), mp.Steps(prompts_per_step=2))
    assert [s.samples.tolist() for s in plan.steps] == [[0, 1, 2, 4], [3, 5, 6, 8]]
    assert plan.dropped.tolist() == [7]


def test_rollouts_per_step_keeps_multi_turn_rollouts_whole():
    rids = [0, 0, 0, 1, 2, 2, 3, 4, 4, 4, 4]
    plan = _plan(mp.Batch([5] * 11, rollout_ids=rids), mp.Steps(rollouts_per_step=2))
    assert [s.samples.tolist() for s in plan.steps] == [[0, 1, 2, 3], [4, 5, 6]]
    assert plan.dropped.tolist() == [7, 8, 9, 10]
    assert all("rollouts_per_step=2" in plan.drop_reasons[i] for i in (7, 8, 9, 10))


def test_rollouts_per_step_multiple_of_group_size():
    pids = [p for p in range(6) for _ in range(4)]
    plan = _plan(mp.Batch([5] * 24, prompt_ids=pids), mp.Steps(rollouts_per_step=8))
    assert len(plan.steps) == 3 and plan.dropped.size == 0
    for s, step in enumerate(plan.steps):
        assert sorted({pids[i] for i in step.samples}) == [2 * s, 2 * s + 1]


def test_rollouts_per_step_cutting_a_group_is_refused():
    pids = [p for p in range(4) for _ in range(3)]
    with pytest.raises(mp.PlanError, match=r"rollouts_per_step=4.*sample 3.*prompts_per_step"):
        _plan(mp.Batch([5] * 12, prompt_ids=pids), mp.Steps(rollouts_per_step=4))


def test_rollouts_per_step_group_cut_by_the_dropped_tail_is_refused():
    """A group half in the last full step and half in the dropped tail would lose part of a group."""
    pids = [0, 0, 1, 1, 1]
    with pytest.raises(mp.PlanError, match="cuts the prompt group"):
        _plan(mp.Batch([5] * 5, prompt_ids=pids), mp.Steps(rollouts_per_step=3))


def test_fewer_groups_than_one_step_is_refused_naming_the_setting():
    """A step size no step can fill would drop every sample: a PlanError naming the setting, the
    groups the batch has and the CLI flag (was: a plan of zero steps, everything dropped)."""
    with pytest.raises(mp.PlanError, match=r"Steps\(prompts_per_step=3\) forms no optimizer step: the batch has only "
                                           r"2 prompt groups, so all 3 samples would be dropped; set prompts_per_step "
                                           r"\(CLI --prompts-per-step\) to at most 2"):
        _plan(mp.Batch([5, 6, 7], prompt_ids=[1, 1, 2]), mp.Steps(prompts_per_step=3))
    with pytest.raises(mp.PlanError, match=r"Steps\(rollouts_per_step=4\) forms no optimizer step: the batch has only "
                                           r"3 rollouts.*--rollouts-per-step"):
        _plan(mp.Batch([5, 6, 7]), mp.Steps(rollouts_per_step=4))
    plan = _plan(mp.Batch([5, 6, 7], prompt_ids=[1, 1, 2]), mp.Steps(prompts_per_step=2))  # one step: fine
    assert len(plan.steps) == 1 and plan.dropped.size == 0


def test_step_dropped_samples_are_not_in_the_loss():
    pids = [0, 0, 1, 1, 2]
    plan = _plan(mp.Batch([4] * 5, prompt_ids=pids), mp.Steps(prompts_per_step=2),
                 loss=mp.Loss("seq-mean-token-sum"))
    scales = [float(s) for row in plan.steps[0].micros for m in row for s in m.loss_scale]
    assert scales == [0.25] * 4  # |S| = 4: the dropped prompt does not count


@given(case=cases(max_samples=300), kind=st.sampled_from(["num", "prompts", "rollouts"]), data=st.data())
def test_steps_follow_the_contract(case, kind, data):
    P, R = case.num_prompts, case.num_rollouts
    if kind == "num":
        steps = mp.Steps(num_steps=data.draw(st.integers(1, P + 1)))
    elif kind == "prompts":
        steps = mp.Steps(prompts_per_step=data.draw(st.integers(1, P + 1)))
    else:
        steps = mp.Steps(rollouts_per_step=data.draw(st.integers(1, R + 1)))
    cfg = mp.PlanConfig(dp_size=1, max_tokens_per_micro=case.cap, steps=steps)
    try:
        split, dropped = expected_split(case.pc, case.rc, steps)
    except ExpectedError:
        with pytest.raises(mp.PlanError):
            mp.plan(case.batch(), cfg)
        return
    plan = mp.plan(case.batch(), cfg)
    plan.validate()
    check_plan(plan, case.seq_lens, case.loss_tokens, case.pc, case.rc, cfg)
    assert set(plan.dropped.tolist()) == dropped
    if split is None:
        check_num_steps(plan, case.pc, steps.num_steps, fit_dropped_ok=False)
    else:
        assert [s.samples.tolist() for s in plan.steps] == [sorted(x.tolist()) for x in split]
