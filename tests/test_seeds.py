"""The seed bug reports (../shared/seeds/) reproduce exactly and are handled as DESIGN.md says.

* slime PR #2065: DP4 dynamic batching, long samples (one per micro-batch); the aligned
  micro-batch target exceeds the sample count. "drop" drops the fewest whole trailing rollouts,
  "error" names the step / count / target / setting, "pad" uses placeholders.
* slime PR #1860: ranks with fewer real micro-batches get explicit placeholders, never empty
  real micro-batches.
* SkyRL PR #1483: step-wise trajectories — a variable number of samples per prompt still gives
  exactly P/p optimizer steps with Steps(prompts_per_step=p); a mini-batch smaller than dp works.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import microplan as mp
from reference import check_plan, first_appearance_codes, objective

CAP = 32768
LONG = CAP // 2 + 1  # longer than half the cap: every micro-batch is a singleton


def _check(plan: mp.Plan, batch: mp.Batch, rollout_ids, prompt_ids=None) -> None:
    plan.validate()
    rc = first_appearance_codes(list(rollout_ids))
    pc = first_appearance_codes(list(prompt_ids)) if prompt_ids is not None else rc
    check_plan(plan, batch.seq_lens, batch.loss_tokens, pc, rc, plan.config)
    assert mp.Plan.from_json(plan.to_json()) == plan


def _rollouts(sizes: list[int]) -> list[int]:
    return [r for r, k in enumerate(sizes) for _ in range(k)]


# -- slime #2065 ------------------------------------------------------------------------------


def _slime_2065_batch(fan_out_at=(100, 300)) -> tuple[mp.Batch, list[int]]:
    """512 rollouts; two of them fan out to 2 samples (a GRPO-style group): 514 samples."""
    sizes = [2 if r in fan_out_at else 1 for r in range(512)]
    rids = _rollouts(sizes)
    lens = LONG + (np.arange(len(rids)) * 7919) % (CAP - LONG + 1)  # all > cap/2, all different
    return mp.Batch(lens, rollout_ids=rids), rids


@pytest.mark.parametrize("fan_out_at", [(100, 300), (0, 1), (509, 511)])
def test_slime_2065_drops_two_trailing_single_sample_rollouts(fan_out_at):
    batch, rids = _slime_2065_batch(fan_out_at)
    assert batch.num_samples == 514 and batch.num_rollouts == 512
    cfg = mp.PlanConfig(dp_size=4, max_tokens_per_micro=CAP, steps=mp.Steps(rollouts_per_step=512), short_step="drop")
    plan = mp.plan(batch, cfg)
    _check(plan, batch, rids)
    assert len(plan.steps) == 1
    step = plan.steps[0]
    kept_rollouts = sorted({rids[i] for i in step.samples})
    # 514 singletons need 516 to align at DP4: drop the fewest whole trailing rollouts
    if fan_out_at == (509, 511):
        # the last rollout has 2 samples: dropping it alone leaves 512 samples
        assert kept_rollouts == list(range(511))
    else:
        assert kept_rollouts == list(range(510))  # 510 rollouts kept, no holes
    assert step.samples.size == 512
    assert step.micro_count == 128
    assert sum(len(row) for row in step.micros) == 512
    assert step.num_placeholders == 0
    assert all(m.num_samples == 1 for row in step.micros for m in row)
    dropped = plan.dropped.tolist()
    assert dropped == [i for i in range(514) if rids[i] not in kept_rollouts]
    for i in dropped:
        why = plan.drop_reasons[i]
        assert "step 0" in why and "short_step" in why and "4" in why


def test_slime_2065_error_and_pad():
    batch, rids = _slime_2065_batch()
    base = dict(dp_size=4, max_tokens_per_micro=CAP, steps=mp.Steps(rollouts_per_step=512))
    with pytest.raises(mp.PlanError) as exc:
        mp.plan(batch, mp.PlanConfig(**base, short_step="error"))
    msg = str(exc.value)
    assert "step 0" in msg and "514" in msg and "516" in msg and "short_step" in msg, msg
    plan = mp.plan(batch, mp.PlanConfig(**base, short_step="pad"))
    _check(plan, batch, rids)
    step = plan.steps[0]
    assert step.micro_count == 129 and step.num_placeholders == 2 and plan.dropped.size == 0
    assert step.samples.size == 514


def test_slime_2065_ragged_rollouts_drop_past_the_dp_floor():
    """[3,2,3,1,2] = 11 long samples at DP4: keep 3 rollouts / 8 samples (not 4 / 9)."""
    sizes = [3, 2, 3, 1, 2]
    rids = _rollouts(sizes)
    batch = mp.Batch(np.full(11, LONG), rollout_ids=rids)
    plan = mp.plan(batch, mp.PlanConfig(dp_size=4, max_tokens_per_micro=CAP, short_step="drop"))
    _check(plan, batch, rids)
    step = plan.steps[0]
    assert sorted({rids[i] for i in step.samples}) == [0, 1, 2]
    assert step.samples.tolist() == list(range(8))
    assert step.micro_count == 2 and step.num_placeholders == 0
    assert plan.dropped.tolist() == [8, 9, 10]


@pytest.mark.parametrize("short_step", ["drop", "error"])
def test_slime_2065_unreachable_alignment_raises_actionable_error(short_step):
    """[1,1,4,1,3,1]: prefix sample counts 1,2,6,7,10,11 — none divisible by 4."""
    rids = _rollouts([1, 1, 4, 1, 3, 1])
    batch = mp.Batch(np.full(11, LONG), rollout_ids=rids)
    with pytest.raises(mp.PlanError) as exc:
        mp.plan(batch, mp.PlanConfig(dp_size=4, max_tokens_per_micro=CAP, short_step=short_step))
    msg = str(exc.value)
    assert "step 0" in msg, msg                         # the step
    assert "11 samples" in msg, msg                     # the sample count
    assert "12" in msg or "multiple of" in msg, msg     # the target
    assert "dp_size" in msg and "align" in msg, msg
    # the setting to change
    assert "short_step='pad'" in msg and ("Steps" in msg or "max_tokens_per_micro" in msg), msg


@pytest.mark.parametrize("sizes", [[1, 1, 4, 1, 3, 1], [3, 2, 3, 1, 2]])
def test_slime_2065_pad_gives_placeholders(sizes):
    rids = _rollouts(sizes)
    batch = mp.Batch(np.full(11, LONG), rollout_ids=rids)
    plan = mp.plan(batch, mp.PlanConfig(dp_size=4, max_tokens_per_micro=CAP, short_step="pad"))
    _check(plan, batch, rids)
    step = plan.steps[0]
    assert plan.dropped.size == 0 and step.samples.size == 11
    assert step.micro_count == 3 and step.num_placeholders == 1
    ph = [m for row in step.micros for m in row if m.is_placeholder]
    assert len(ph) == 1 and ph[0].indices.size == 0 and ph[0].loss_scale.size == 0


# -- slime #1860 ------------------------------------------------------------------------------


def test_slime_1860_lagging_ranks_get_explicit_placeholders():
    """Variable-length multi-turn rollouts under dynamic batching at DP>1: some ranks have fewer
    real micro-batches than others; they get placeholders, never an empty real micro-batch."""
    rng = np.random.default_rng(1860)
    turns = rng.integers(1, 6, size=7)
    rids = _rollouts(list(turns))
    n = len(rids)
    lens = np.where(rng.random(n) < 0.5, rng.integers(9000, 16000, n), rng.integers(200, 3000, n))
    batch = mp.Batch(lens, rollout_ids=rids, loss_tokens=lens // 2)
    cap = 16384
    found = False
    for dp in (2, 3, 4, 8, 16, 32):
        plan = mp.plan(batch, mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap))
        _check(plan, batch, rids)
        step = plan.steps[0]
        real_per_rank = [sum(not m.is_placeholder for m in row) for row in step.micros]
        for row in step.micros:
            assert len(row) == step.micro_count  # the same count on every rank, no MAX all-reduce needed
            for m in row:
                assert m.is_placeholder == (m.num_samples == 0)
                if m.is_placeholder:
                    assert m.num_tokens == 0 and m.loss_scale.size == 0
        if min(real_per_rank) < max(real_per_rank):
            found = True
            # a lagging rank's placeholders contribute exactly zero to the loss
            lagging = int(np.argmin(real_per_rank))
            assert any(m.is_placeholder for m in step.micros[lagging])
    assert found, "the fixture never produced ranks with unequal real micro-batch counts"


def test_slime_1860_placeholders_carry_no_loss_and_j_is_exact():
    rids = _rollouts([1, 2, 1, 1, 3])
    lens = np.array([9000, 15000, 9100, 12000, 9500, 9999, 10000, 16000])
    batch = mp.Batch(lens, rollout_ids=rids, loss_tokens=lens - 100)
    cfg = mp.PlanConfig(dp_size=3, max_tokens_per_micro=16384, loss=mp.Loss("seq-mean-token-mean"))
    plan = mp.plan(batch, cfg)
    _check(plan, batch, rids)
    step = plan.steps[0]
    assert step.num_placeholders == 3 * step.micro_count - 8
    rng = np.random.default_rng(0)
    tok = [rng.random(int(n)) for n in batch.loss_tokens]
    got = sum(float(m.loss_scale @ np.array([tok[i].sum() for i in m.indices])) if m.num_samples else 0.0
              for row in step.micros for m in row) / cfg.dp_size
    want = objective("seq-mean-token-mean", tok, list(range(8)), rids)
    assert got == pytest.approx(want, rel=1e-12)


# -- SkyRL #1483 ------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_skyrl_prompt_steps_whatever_the_turn_counts(p):
    """16 prompts × 4 trajectories, 1–7 turns each (one sample per turn): 16/p steps."""
    rng = np.random.default_rng(1483)
    pids, rids, lens = [], [], []
    for prompt in range(16):
        for traj in range(4):
            for _turn in range(int(rng.integers(1, 8))):
                pids.append(f"uid-{prompt}")
                rids.append(f"uid-{prompt}-{traj}")
                lens.append(int(rng.integers(50, 4000)))
    batch = mp.Batch(lens, prompt_ids=pids, rollout_ids=rids)
    assert len(set(batch.prompt_codes.tolist())) == 16 and batch.num_samples > 64  # multi-turn
    plan = mp.plan(batch, mp.PlanConfig(dp_size=4, max_tokens_per_micro=8192, steps=mp.Steps(prompts_per_step=p)))
    _check(plan, batch, rids, pids)
    assert len(plan.steps) == 16 // p
    assert plan.dropped.size == 0
    for s, step in enumerate(plan.steps):
        assert {pids[i] for i in step.samples} == {f"uid-{q}" for q in range(s * p, (s + 1) * p)}
    # the step count does not depend on the turn counts: collapse every trajectory to 1 turn
    firsts = sorted({rids.index(r) for r in rids})
    one_turn = mp.Batch([lens[i] for i in firsts], prompt_ids=[pids[i] for i in firsts])
    flat = mp.plan(one_turn, mp.PlanConfig(dp_size=4, max_tokens_per_micro=8192, steps=mp.Steps(prompts_per_step=p)))
    assert len(flat.steps) == len(plan.steps)


@pytest.mark.parametrize("dp", [2, 8, 64])
def test_skyrl_mini_batch_smaller_than_dp(dp):
    """One prompt per step with fewer samples than ranks: pad works, every rank gets K=1."""
    pids = ["a"] * 1 + ["b"] * 3 + ["c"] * 2
    rids = ["a0", "b0", "b0", "b1", "c0", "c1"]
    batch = mp.Batch([100, 200, 300, 400, 500, 600], prompt_ids=pids, rollout_ids=rids)
    plan = mp.plan(batch, mp.PlanConfig(dp_size=dp, max_tokens_per_micro=1000, steps=mp.Steps(prompts_per_step=1)))
    _check(plan, batch, rids, pids)
    assert [s.samples.tolist() for s in plan.steps] == [[0], [1, 2, 3], [4, 5]]
    for step in plan.steps:
        assert step.micro_count == 1
        assert step.num_placeholders == dp - sum(m.num_samples > 0 for row in step.micros for m in row)
        assert step.num_placeholders >= dp - step.samples.size


@pytest.mark.parametrize("short_step", ["drop", "error"])
def test_fewer_samples_than_ranks_without_pad_is_an_actionable_error(short_step):
    batch = mp.Batch([10, 20, 30])
    with pytest.raises(mp.PlanError) as exc:
        mp.plan(batch, mp.PlanConfig(dp_size=8, max_tokens_per_micro=100, short_step=short_step))
    msg = str(exc.value)
    assert "step 0" in msg and "3 samples" in msg and "8" in msg and "short_step='pad'" in msg, msg


def test_fewer_samples_than_ranks_static_batching_pads():
    batch = mp.Batch([10, 20, 30])
    plan = mp.plan(batch, mp.PlanConfig(dp_size=8, micro_batch_size=4, align=2))
    plan.validate()
    step = plan.steps[0]
    assert step.micro_count == 2 and step.num_placeholders == 13
    assert sorted(m.num_samples for row in step.micros for m in row)[-3:] == [1, 1, 1]


@pytest.mark.parametrize("short_step", ["drop", "error"])
def test_dynamic_cp_error_names_the_target(short_step):
    """verl DCP seed (#5869): fewer sequences than CP groups. 4 GPUs cut into groups of at most 2
    need at least 2 samples per micro slot; with 1 sample the refusal must name that target (2),
    like the non-CP message names its aligned micro-batch target."""
    batch = mp.Batch([1])
    cfg = mp.PlanConfig(dp_size=4, max_tokens_per_micro=1, short_step=short_step,
                        context_parallel=mp.ContextParallel(max_size=2))
    with pytest.raises(mp.PlanError) as exc:
        mp.plan(batch, cfg)
    msg = str(exc.value)
    assert "step 0" in msg and "1 sample " in msg and "short_step='pad'" in msg, msg
    assert re.search(r"\b2\b", msg), f"the target (at least 2 samples, one per CP group) is not named: {msg}"
    plan = mp.plan(batch, mp.PlanConfig(dp_size=4, max_tokens_per_micro=1, context_parallel=mp.ContextParallel(max_size=2)))
    plan.validate()
    assert plan.steps[0].micro_count == 1


@pytest.mark.parametrize("short_step", ["drop", "error"])
def test_dynamic_cp_policy_only_matters_for_short_steps(short_step):
    """verl DCP seed: 4 samples on a 16-GPU plane with CP groups of up to 4 fill it exactly (four
    groups of 4, as short_step='pad' finds, with no placeholder). The step is not short, so 'drop'
    and 'error' must give the same plan instead of refusing it."""
    batch = mp.Batch([1, 1, 2, 4])
    base = dict(dp_size=16, max_tokens_per_micro=1, context_parallel=mp.ContextParallel(max_size=4))
    pad = mp.plan(batch, mp.PlanConfig(**base))
    pad.validate()
    assert pad.steps[0].num_placeholders == 0 and pad.steps[0].micro_count == 1
    other = mp.plan(batch, mp.PlanConfig(short_step=short_step, **base))
    other.validate()
    assert other.steps == pad.steps and other.dropped.size == 0
