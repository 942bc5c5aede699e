"""Invariant 6: the loss scales make every step's reduced gradient exactly ∇J.

For random per-token losses ℓ (float64), J is computed per step straight from the DESIGN.md table
(tests/reference.py:objective, which never calls weigh.py). The engine side is simulated as
DESIGN.md describes it: each micro-batch on each rank computes L = Σ_j loss_scale_j Σ_t ℓ_jt,
the engine divides it by K when ``engine_divides_by_micro_count``, gradients are summed over
micro-batches and averaged over the W ranks (``grad_reduction="mean"``, W = dp × static CP, or
dp under dynamic CP where the GPUs of a CP group hold shards of one micro-batch) or summed (``"sum"``). Since J is linear in ℓ, agreement of the values for random ℓ is agreement of
the gradients; the per-sample coefficient is checked too (∂J/∂ℓ_it, by linearity).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, note, reject
from hypothesis import strategies as st

import microplan as mp
from reference import cases, configs, grad_world, objective, replace


def _engine_total(plan: mp.Plan, s: int, tok_sums: np.ndarray) -> float:
    """What the engine's reduced gradient corresponds to, for step s (see module docstring)."""
    cfg, step = plan.config, plan.steps[s]
    W = grad_world(cfg)
    K = step.micro_count
    total = 0.0
    for row in step.micros:
        for micro in row:
            if micro.is_placeholder:
                assert micro.loss_scale.size == 0  # contributes exactly 0
                continue
            if micro.cp_rank != 0:  # a CP group's GPUs hold shards of ONE micro-batch: count it once
                continue
            L = float(np.dot(micro.loss_scale, tok_sums[micro.indices]))
            if cfg.loss.engine_divides_by_micro_count:
                L /= K
            total += L
    return total / W if cfg.loss.grad_reduction == "mean" else total


def _token_losses(rng: np.random.Generator, loss_tokens: np.ndarray, signed: bool) -> list[np.ndarray]:
    flat = rng.random(int(loss_tokens.sum()))
    if signed:
        flat = flat * 2.0 - 1.0
    return np.split(flat, np.cumsum(loss_tokens)[:-1]) if loss_tokens.size else []


def _check_steps(plan: mp.Plan, case, losses: list[np.ndarray], signed: bool) -> None:
    mode, H = plan.config.loss.mode, plan.config.loss.norm_constant
    sums = np.array([float(x.sum()) for x in losses])
    for s, step in enumerate(plan.steps):
        S = step.samples.tolist()
        want = objective(mode, [losses[i] for i in S], [int(case.pc[i]) for i in S], [int(case.rc[i]) for i in S], H)
        got = _engine_total(plan, s, sums)
        # the scale of the sum: Σ_i |c_i| Σ_t |ℓ_it|, from the reference coefficients
        coef = _coefficients(mode, case, S, H)
        scale = sum(abs(coef[i]) * float(np.abs(losses[i]).sum()) for i in S)
        if signed:
            assert abs(got - want) <= 1e-12 * scale + 1e-300, f"step {s}: {got!r} != {want!r}"
        elif want == 0.0:
            assert got == 0.0
        else:
            assert abs(got - want) <= 1e-12 * abs(want), f"step {s}: {got!r} != {want!r}"


def _coefficients(mode: str, case, S: list[int], H) -> dict[int, float]:
    """c_i = ∂J/∂(Σ_t ℓ_it): J with a single unit loss on one token of sample i (J is linear)."""
    n = case.loss_tokens
    pcs, rcs = [int(case.pc[i]) for i in S], [int(case.rc[i]) for i in S]
    out = {}
    for pos, i in enumerate(S):
        if n[i] == 0:
            out[i] = 0.0
            continue
        tl = [np.zeros(int(n[j])) for j in S]
        tl[pos][0] = 1.0
        out[i] = objective(mode, tl, pcs, rcs, H)
    return out


@given(data=st.data(), case=cases(max_samples=150, max_cap=512), signed=st.booleans())
def test_summed_gradient_is_exactly_grad_j(data, case, signed):
    cfg = data.draw(configs(case, max_dp=64))
    cfg = replace(cfg, short_step=data.draw(st.sampled_from(["pad", "pad", "pad", "drop"])))
    note(f"config: {cfg}")
    try:
        plan = mp.plan(case.batch(), cfg)
    except mp.PlanError:
        reject()  # impossible configs are test_properties' business
    losses = _token_losses(np.random.default_rng(len(case.seq_lens)), case.loss_tokens, signed)
    _check_steps(plan, case, losses, signed)


@given(data=st.data(), case=cases(max_samples=40, max_cap=64))
def test_loss_scale_is_c_times_w_times_k(data, case):
    """Per sample: loss_scale = c_i · W · (K if the engine divides), c_i from the table."""
    cfg = data.draw(configs(case, max_dp=16))
    cfg = replace(cfg, short_step="pad")
    try:
        plan = mp.plan(case.batch(), cfg)
    except mp.PlanError:
        reject()
    W = grad_world(cfg)
    for step in plan.steps:
        coef = _coefficients(cfg.loss.mode, case, step.samples.tolist(), cfg.loss.norm_constant)
        w = W if cfg.loss.grad_reduction == "mean" else 1
        k = step.micro_count if cfg.loss.engine_divides_by_micro_count else 1
        for row in step.micros:
            for micro in row:
                for i, scale in zip(micro.indices.tolist(), micro.loss_scale.tolist()):
                    assert scale == pytest.approx(coef[i] * w * k, rel=1e-12, abs=0.0)


# -- deterministic cases: placeholders, drops, several steps -------------------------------------

MODES = [mp.Loss(m, norm_constant=(256.0 if m == "seq-mean-token-sum-norm" else None)) for m in mp.LOSS_MODES]


def _loss_variants():
    for loss in MODES:
        for red in ("mean", "sum"):
            for div in (False, True):
                yield mp.Loss(loss.mode, grad_reduction=red, engine_divides_by_micro_count=div,
                              norm_constant=loss.norm_constant)


def _case_from(lens, loss_tokens, prompt_ids, rollout_ids):
    from reference import Case, first_appearance_codes
    return Case(np.asarray(lens), np.asarray(loss_tokens), prompt_ids, rollout_ids,
                first_appearance_codes(prompt_ids), first_appearance_codes(rollout_ids), max(lens),
                dict(loss_tokens=loss_tokens, prompt_ids=prompt_ids, rollout_ids=rollout_ids))


@pytest.mark.parametrize("loss", list(_loss_variants()), ids=lambda l: f"{l.mode}-{l.grad_reduction}-"
                         f"{'div' if l.engine_divides_by_micro_count else 'nodiv'}")
def test_exact_with_placeholders_drops_and_steps(loss):
    # 3 prompts; prompt 1 has two 2-turn rollouts; some samples carry no loss tokens
    pids = ["a", "a", "b", "b", "b", "b", "c", "c", "d", "d", "d", "e"]
    rids = [0, 1, 2, 2, 3, 3, 4, 5, 6, 6, 7, 8]
    lens = [900, 800, 700, 600, 990, 520, 510, 700, 990, 530, 540, 600]
    lt = [800, 0, 650, 1, 900, 500, 0, 600, 700, 520, 539, 600]
    case = _case_from(lens, lt, pids, rids)
    rng = np.random.default_rng(7)
    losses = _token_losses(rng, case.loss_tokens, signed=False)
    # placeholders: 12 long samples over dp=5 with align=2
    pad = mp.plan(case.batch(), mp.PlanConfig(dp_size=5, max_tokens_per_micro=1000, align=2, loss=loss))
    assert pad.steps[0].num_placeholders > 0
    _check_steps(pad, case, losses, signed=False)
    # several steps, prompt-based, with a trailing prompt dropped by the step split
    multi = mp.plan(case.batch(), mp.PlanConfig(dp_size=3, max_tokens_per_micro=1000, loss=loss,
                                                steps=mp.Steps(prompts_per_step=2)))
    assert len(multi.steps) == 2 and multi.dropped.tolist() == [11]
    _check_steps(multi, case, losses, signed=False)
    # short_step="drop": the trailing rollout of a step is dropped; denominators exclude it
    drop = mp.plan(case.batch(), mp.PlanConfig(dp_size=5, max_tokens_per_micro=1000, align=2, loss=loss,
                                               short_step="drop"))
    assert drop.dropped.size > 0 and drop.steps[0].num_placeholders == 0
    _check_steps(drop, case, losses, signed=False)
    # static batching and static CP
    for cfg in (mp.PlanConfig(dp_size=2, micro_batch_size=3, loss=loss, steps=mp.Steps(num_steps=2)),
                mp.PlanConfig(dp_size=2, max_tokens_per_micro=500, loss=loss,
                              context_parallel=mp.ContextParallel(size=2))):
        p = mp.plan(case.batch(), cfg)
        _check_steps(p, case, losses, signed=True)


@pytest.mark.parametrize("mode", mp.LOSS_MODES)
def test_coefficients_do_not_depend_on_the_layout(mode):
    """c_i = scale / (W · K) is the same whatever dp, align, cap or step count says."""
    rng = np.random.default_rng(3)
    n = 40
    lens = rng.integers(1, 400, n)
    lt = rng.integers(0, lens + 1)
    pids = (np.arange(n) // 4).tolist()
    loss = mp.Loss(mode, norm_constant=(100.0 if mode == "seq-mean-token-sum-norm" else None),
                   engine_divides_by_micro_count=True)
    seen: list[np.ndarray] = []
    for dp, align, cap in ((1, 1, 400), (3, 2, 512), (8, 1, 1000), (64, 4, 400)):
        plan = mp.plan(mp.Batch(lens, loss_tokens=lt, prompt_ids=pids),
                       mp.PlanConfig(dp_size=dp, align=align, max_tokens_per_micro=cap, loss=loss))
        c = np.zeros(n)
        step = plan.steps[0]
        for row in step.micros:
            for m in row:
                c[m.indices] = m.loss_scale / (dp * step.micro_count)
        seen.append(c)
    for c in seen[1:]:
        np.testing.assert_allclose(c, seen[0], rtol=1e-13, atol=0)
    assert (seen[0][lt == 0] == 0).all()


def test_token_mean_by_hand():
    """3 samples, 2 + 0 + 6 loss tokens: J = Σ ℓ / 8; at dp=2, scale = 2/8 for carrying samples."""
    plan = mp.plan(mp.Batch([4, 3, 9], loss_tokens=[2, 0, 6]), mp.PlanConfig(dp_size=2, max_tokens_per_micro=9))
    scales = {int(i): float(s) for row in plan.steps[0].micros for m in row
              for i, s in zip(m.indices, m.loss_scale)}
    assert scales == {0: 0.25, 1: 0.0, 2: 0.25}


def test_prompt_mean_by_hand():
    """prompts {0,1} with 2+6 tokens and {2} with 4: J = ½(Σ_{0,1}/8 + Σ_2/4); dp=1, no K division."""
    plan = mp.plan(mp.Batch([5, 7, 4], loss_tokens=[2, 6, 4], prompt_ids=["x", "x", "y"]),
                   mp.PlanConfig(dp_size=1, max_tokens_per_micro=16, loss=mp.Loss("prompt-mean")))
    scales = {int(i): float(s) for row in plan.steps[0].micros for m in row
              for i, s in zip(m.indices, m.loss_scale)}
    assert scales == {0: 1 / 16, 1: 1 / 16, 2: 1 / 8}
