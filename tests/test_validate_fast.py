"""The vectorised Plan.validate (issue 17: 55 s at dp 1,024) names exactly the violation the
per-micro-batch loop it replaced named.

The reference is that loop, kept here: every micro-batch of a step checked in (rank, slot)
order with ``_check_micro`` / ``_check_pinned``, then the loss scales one micro-batch at a time.
Random plans (global and local placement, CP, layouts, forward plans) get random corruptions of
one to three micro-batches — indices out of range or moved to another rank, lengths, loss
scales (NaN, off by 1e-9 relative), CP fields, layout rules, arrays of unequal length, a tree
where none belongs — and both validators must raise the same message (or both accept).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, note
from hypothesis import strategies as st

import microplan as mp
import microplan.validate as V
from microplan.footprint import Footprint, Padding
from microplan.types import Micro
from reference import cases, configs, replace
from test_local import local_inputs


def _slow_screen(b, cfg, s, flat, fp):
    for f, micro in enumerate(flat.micros):
        r, m = flat.where(f)
        V._check_micro(b, cfg, s, r, m, micro, fp)
        if cfg.placement == "local":
            V._check_pinned(b.rank_of, s, r, m, micro)


def _slow_scales(b, cfg, step, flat, s):
    idx = step.samples
    coef = V.loss_coefficients(cfg.loss, b.loss_tokens[idx], b.prompt_codes[idx], b.rollout_codes[idx])
    want = V.loss_scales(cfg.loss, coef, grad_world=cfg.grad_world, micro_count=step.micro_count)
    scale_of = np.zeros(b.num_samples)
    scale_of[idx] = want
    for r, row in enumerate(step.micros):
        for m, micro in enumerate(row):
            if not np.allclose(micro.loss_scale, scale_of[micro.indices], rtol=1e-12, atol=0.0):
                V._fail(f"step {s}, rank {r}, micro {m}: loss_scale differs from the loss contract "
                        f"({cfg.loss.mode}, W={cfg.grad_world})")


def _message(plan: mp.Plan) -> str | None:
    try:
        plan.validate()
    except mp.PlanError as exc:
        return str(exc)
    return None


def _both(plan: mp.Plan) -> tuple[str | None, str | None]:
    fast = _message(plan)
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setattr(V, "_screen_micros", _slow_screen)
        mp_.setattr(V, "_check_scales", _slow_scales)
        slow = _message(plan)
    return fast, slow


def _mutate(micro: Micro, kind: str, n: int, D: int, rng: np.random.Generator) -> Micro:
    i, sl, lt, ls = (a.copy() for a in (micro.indices, micro.seq_lens, micro.loss_tokens, micro.loss_scale))
    cp = [micro.cp_size, micro.cp_rank, micro.cp_group]
    fp, tree = micro.footprint, micro.tree
    j = int(rng.integers(0, max(i.size, 1)))
    ok = all(j < a.size for a in (i, sl, lt, ls))  # an earlier "short" mutation may have cut loss_scale
    if kind == "index" and ok:
        i[j] = int(rng.choice([-1, n, n + 5, int(rng.integers(0, n))]))
    elif kind == "seq_len" and ok:
        sl[j] += 1
    elif kind == "loss_tokens" and ok:
        lt[j] = max(lt[j] - 1, 0) if lt[j] else 1
    elif kind == "nan" and ok:
        ls[j] = np.nan
    elif kind == "scale" and ok:
        ls[j] = ls[j] * (1 + 1e-9) + (1e-300 if ls[j] == 0 else 0.0)
    elif kind == "cp":
        k = int(rng.integers(0, 3))
        cp[k] = (cp[0] * 2 + 1) if k == 0 else (cp[1] + 1) if k == 1 else ((cp[2][0] + 1) % D,) + cp[2][1:]
    elif kind == "rules":
        fp = Footprint(Padding("varlen", 8, 1), np.ones(n, dtype=np.int64))
    elif kind == "short":
        ls = ls[:-1] if ls.size else np.zeros(1)
    for a in (i, sl, lt, ls):
        a.setflags(write=False)
    return Micro._trusted(i, sl, lt, ls, cp[0], cp[1], tuple(cp[2]), tree, footprint=fp)


KINDS = ["index", "seq_len", "loss_tokens", "nan", "scale", "cp", "rules", "short"]


def _tamper(plan: mp.Plan, data) -> mp.Plan:
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 31)))
    steps = list(plan.steps)
    for _ in range(data.draw(st.integers(1, 3))):
        s = data.draw(st.integers(0, len(steps) - 1))
        step = steps[s]
        r = data.draw(st.integers(0, step.dp_size - 1))
        m = data.draw(st.integers(0, step.micro_count - 1))
        kind = data.draw(st.sampled_from(KINDS))
        note(f"step {s} rank {r} micro {m}: {kind}")
        rows = [list(row) for row in step.micros]
        rows[r][m] = _mutate(rows[r][m], kind, plan.batch.num_samples, step.dp_size, rng)
        steps[s] = mp.Step(step.index, rows, step.samples, choice=step.choice)
    return mp.Plan(batch=plan.batch, config=plan.config, steps=steps, dropped=plan.dropped,
                   drop_reasons=plan.drop_reasons, kind=plan.kind)


@given(data=st.data(), case=cases(max_samples=60, max_cap=256))
def test_same_first_violation_as_the_loop_global(data, case):
    cfg = replace(data.draw(configs(case, max_dp=6)), short_step="pad")
    try:
        plan = mp.plan(case.batch(), cfg) if not data.draw(st.booleans()) else mp.plan_forward(case.batch(), cfg)
    except mp.PlanError:
        return
    if not plan.steps:
        return
    assert _both(plan) == (None, None)
    fast, slow = _both(_tamper(plan, data))
    event("caught" if fast else "tampering left the plan valid")
    assert fast == slow


@given(data=st.data(), inputs=local_inputs(max_samples=60, max_cap=512, max_dp=6))
def test_same_first_violation_as_the_loop_local(data, inputs):
    case, cfg, batch = inputs
    cfg = replace(cfg, short_step="pad")
    try:
        plan = mp.plan(batch, cfg)
    except mp.PlanError:
        return
    if not plan.steps:
        return
    assert _both(plan) == (None, None)
    bad = _tamper(plan, data)
    fast, slow = _both(bad)
    event("caught" if fast else "tampering left the plan valid")
    assert fast == slow
    # a sample moved to a micro-batch of another rank: caught by the pinned check
    step = plan.steps[0]
    real = [(r, m) for r, row in enumerate(step.micros) for m, x in enumerate(row) if x.indices.size]
    if step.dp_size > 1 and real:
        r, m = data.draw(st.sampled_from(real))
        other = (r + 1) % step.dp_size
        rows = [list(row) for row in step.micros]
        a, o = rows[r][m], rows[other][0]
        keep = a.indices[1:]
        moved = np.concatenate([o.indices, a.indices[:1]])
        b = plan.batch
        rows[r][m] = Micro(keep, b.seq_lens[keep], b.loss_tokens[keep], a.loss_scale[1:], a.cp_size, 0, a.cp_group)
        rows[other][0] = Micro(moved, b.seq_lens[moved], b.loss_tokens[moved],
                               np.concatenate([o.loss_scale, a.loss_scale[:1]]), o.cp_size, 0, o.cp_group)
        steps = [mp.Step(0, rows, step.samples, choice=step.choice), *plan.steps[1:]]
        moved_plan = mp.Plan(batch=b, config=cfg, steps=steps, dropped=plan.dropped, drop_reasons=plan.drop_reasons)
        fast, slow = _both(moved_plan)
        assert fast == slow and fast is not None


def test_local_dp_1024_one_loaded_rank_validates():
    """The issue's shape, small: every sample on rank 0 of 1,024 (placeholders everywhere else)."""
    rng = np.random.default_rng(0)
    lens = rng.integers(100, 4000, 400)
    b = mp.Batch(lens, rank_of=np.zeros(lens.size, dtype=np.int64))
    plan = mp.plan(b, mp.PlanConfig(dp_size=1024, max_tokens_per_micro=8192, placement="local"))
    plan.validate()
    assert plan.stats.num_placeholders > 1023 * (plan.steps[0].micro_count - 1)


def test_an_index_out_of_range_on_a_cp_member_is_named_not_an_index_error():
    """A micro-batch whose cp_rank was edited off 0 and whose index is out of range: the coverage
    check skips it (only cp_rank-0 members count) and used to mark its indices seen unchecked
    (IndexError); now the micro-batch checks name the index (found by HYPOTHESIS_PROFILE=dev)."""
    plan = mp.plan(mp.Batch([1, 1]), mp.PlanConfig(dp_size=1, max_tokens_per_micro=2))
    micro = plan.steps[0].micros[0][0]
    ix = micro.indices.copy()
    ix[0] = 7
    ix.setflags(write=False)
    bad = Micro._trusted(ix, micro.seq_lens, micro.loss_tokens, micro.loss_scale, micro.cp_size, micro.cp_rank + 1,
                         micro.cp_group, micro.tree, footprint=micro.footprint)
    steps = [replace(plan.steps[0], micros=((bad,),))]
    tampered = mp.Plan(batch=plan.batch, config=plan.config, steps=steps, dropped=plan.dropped,
                       drop_reasons=plan.drop_reasons)
    fast, slow = _both(tampered)
    assert fast is not None and fast == slow
