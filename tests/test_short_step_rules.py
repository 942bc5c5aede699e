"""The ``short_step`` rule and the placeholder order, for every placement of the flow, and their checks in validate.

``short_step="pad"`` plans the fastest layout, placeholders allowed; ``"drop"`` and ``"error"``
plan the fastest layout with no placeholder, so whenever the ``pad`` plan needs none all three
give the same micro-batches. Without a pipeline order every rank runs its real micro-batches
first and its placeholders after (``assign.arrange``; dynamic CP's slots the same way).
``Plan.validate`` re-checks both rules, and a tree micro-batch's footprint with its padding.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import microplan as mp
from microplan.traces import generate

PRICED = mp.TokenCost(cp=mp.CPCost(comm_per_token=0, split_overhead=2))


def _layout(plan: mp.Plan) -> list:
    """What a trainer runs: every step's micro-batches (indices, CP size and rank), and the drops."""
    return [plan.dropped.tolist()] + [[[(m.indices.tolist(), m.cp_size, m.cp_rank) for m in row] for row in s.micros]
                                      for s in plan.steps]


def _rebuilt(plan: mp.Plan, steps=None, **cfg) -> mp.Plan:
    from dataclasses import replace
    return mp.Plan(batch=plan.batch, config=replace(plan.config, **cfg), steps=plan.steps if steps is None else steps,
                   dropped=plan.dropped, drop_reasons=plan.drop_reasons)


@pytest.mark.parametrize("short_step", ["error", "drop"])
def test_priced_dynamic_cp_fills_the_plane_without_placeholders(short_step):
    """Three 1-token samples on 4 GPUs: a 2-wide group for one of them fills the plane, so "error"
    and "drop" plan it (no placeholder, nothing dropped); the priced packer used to leave a merged
    2-wide group empty and return it as a placeholder under every policy."""
    cfg = mp.PlanConfig(dp_size=4, max_tokens_per_micro=100, context_parallel=mp.ContextParallel(max_size=2),
                        cost=PRICED, short_step=short_step)
    plan = mp.plan(mp.Batch([1, 1, 1]), cfg)
    plan.validate()
    assert plan.dropped.size == 0
    assert plan.steps[0].num_placeholders == 0
    assert sorted(m.cp_size for row in plan.steps[0].micros for m in row) == [1, 1, 2, 2]


def test_priced_dynamic_cp_pad_takes_the_equally_fast_layout_without_placeholders():
    """The same step under "pad": its mixed-width layout (a 2-wide placeholder group) is predicted
    exactly as fast as the plane filled by a 2-wide group for one sample, and a tie used to keep the
    placeholder layout, so "pad" and "drop"/"error" disagreed where "pad" needed no placeholder."""
    base = dict(dp_size=4, max_tokens_per_micro=100, context_parallel=mp.ContextParallel(max_size=2), cost=PRICED)
    pad = mp.plan(mp.Batch([1, 1, 1]), mp.PlanConfig(**base))
    pad.validate()
    assert pad.steps[0].num_placeholders == 0
    assert _layout(pad) == _layout(mp.plan(mp.Batch([1, 1, 1]), mp.PlanConfig(**base, short_step="error")))


def test_priced_dynamic_cp_pad_runs_placeholders_last():
    """Two samples on an 8-GPU plane with groups of at most 2: "pad" needs placeholders, and they
    run after the real micro-batches: on the highest ranks of the slot."""
    cfg = mp.PlanConfig(dp_size=8, max_tokens_per_micro=100, context_parallel=mp.ContextParallel(max_size=2),
                        cost=PRICED)
    plan = mp.plan(mp.Batch([1, 1]), cfg)
    plan.validate()
    ph = [row[0].is_placeholder for row in plan.steps[0].micros]
    assert any(ph) and ph == sorted(ph)  # False (real) first


def test_sharing_dynamic_cp_error_plans_what_pad_plans():
    """Sharing × dynamic CP: the pad plan needs no placeholder, so "error" and "drop" give it too
    (they used to refuse, or drop sample 5, where one candidate layout was short and another full)."""
    b = mp.Batch([12, 8, 36, 29, 38, 31], prefix_parent=[-1, -1, -1, 2, 2, -1], shared_prefix_lens=[0, 0, 0, 11, 30, 0])
    cp = mp.ContextParallel(max_size=2)
    plans = {ss: mp.plan(b, mp.PlanConfig(dp_size=8, max_tokens_per_micro=26, share_prefixes=True, short_step=ss,
                                          context_parallel=cp)) for ss in ("pad", "drop", "error")}
    assert all(s.num_placeholders == 0 for s in plans["pad"].steps)
    assert _layout(plans["drop"]) == _layout(plans["pad"]) == _layout(plans["error"])


@st.composite
def _cp_cases(draw):
    D = draw(st.sampled_from([2, 4, 8]))
    cmax = draw(st.sampled_from([c for c in (2, 4) if c <= D]))
    n = draw(st.integers(1, 3 * D))
    lens = draw(st.lists(st.integers(1, 60), min_size=n, max_size=n))
    parent, shared = [-1] * n, [0] * n
    share = draw(st.booleans())
    if share:
        for i in range(1, n):
            p = draw(st.integers(-1, i - 1))
            if p >= 0 and min(lens[i], lens[p]) > 1:
                parent[i], shared[i] = p, draw(st.integers(1, min(lens[i], lens[p]) - 1))
    cost = draw(st.sampled_from([mp.TokenCost(), PRICED, mp.FlopsCost(linear=1.0, quadratic=0.05, per_micro=8.0),
                                 mp.TokenCost(cp=mp.CPCost(comm_per_token=0.1, split_overhead=0.5))]))
    cap = draw(st.integers(20, 80))
    return D, cmax, lens, parent, shared, share, cost, cap


@given(_cp_cases())
def test_dynamic_cp_short_step_policies_agree_and_order_placeholders(case):
    """Whenever the pad plan has no placeholder, drop and error give the same micro-batches; every
    plan validates (which checks the short-step rule and the placeholder order)."""
    D, cmax, lens, parent, shared, share, cost, cap = case
    b = mp.Batch(lens, prefix_parent=parent, shared_prefix_lens=shared) if share else mp.Batch(lens)
    got = {}
    for ss in ("pad", "drop", "error"):
        cfg = mp.PlanConfig(dp_size=D, max_tokens_per_micro=cap, context_parallel=mp.ContextParallel(max_size=cmax),
                            share_prefixes=share, cost=cost, short_step=ss)
        try:
            got[ss] = mp.plan(b, cfg)
        except mp.PlanError as exc:
            got[ss] = str(exc)
            continue
        got[ss].validate()
        for step in got[ss].steps:  # every step records why it runs K micro-batches per rank
            times = dict(step.choice.candidates)
            assert step.choice.micro_count == step.micro_count
            assert times[step.micro_count] <= min(times.values()) * (1 + 1e-9)
    pad = got["pad"]
    if isinstance(pad, str):
        return
    note(f"pad plan: {_layout(pad)}")
    if all(s.num_placeholders == 0 for s in pad.steps):
        for ss in ("drop", "error"):
            assert not isinstance(got[ss], str), got[ss]
            assert _layout(got[ss]) == _layout(pad)


def test_validate_refuses_a_placeholder_under_error():
    plan = mp.plan(mp.Batch([1, 1, 1]), mp.PlanConfig(dp_size=4, max_tokens_per_micro=100))
    assert plan.steps[0].num_placeholders == 1
    plan.validate()
    for ss in ("error", "drop"):
        with pytest.raises(mp.PlanError, match=f"placeholder micro-batch under short_step='{ss}'"):
            _rebuilt(plan, short_step=ss).validate()


def test_validate_refuses_a_placeholder_before_a_real_micro_batch():
    plan = mp.plan(mp.Batch([1] * 6), mp.PlanConfig(dp_size=4, max_tokens_per_micro=1))
    step = plan.steps[0]
    assert step.micro_count == 2 and step.num_placeholders == 2
    r = next(r for r, row in enumerate(step.micros) if row[1].is_placeholder)
    rows = [list(row) for row in step.micros]
    rows[r] = rows[r][::-1]
    swapped = mp.types.Step(step.index, rows, step.samples, choice=step.choice)
    with pytest.raises(mp.PlanError, match=f"rank {r}: placeholder micro 0 runs before the real micro-batch 1"):
        _rebuilt(plan, steps=[swapped]).validate()
    _rebuilt(plan, steps=[swapped], pipeline_stages=2).validate()  # a pipeline order may run it early


def test_validate_counts_a_tree_micro_batch_with_its_padding():
    """Three 5-token samples sharing 1 token: a trie of 5 + 4 + 4 = 13 unique tokens, each segment
    padded to 8: 24 tokens, over the 16 cap. A hand-edited JSON putting them in one micro-batch must
    not validate (it used to: validate counted the unpadded trie)."""
    b = mp.Batch([5, 5, 5], prefix_parent=[-1, 0, 0], shared_prefix_lens=[0, 1, 1])
    plan = mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=16, pad_to_multiple_of=8, share_prefixes=True))
    plan.validate()
    d = json.loads(plan.to_json())
    scale = plan.steps[0].micros[0][0].loss_scale[0]
    d["steps"] = [[[{"cp_group": [0], "cp_rank": 0, "cp_size": 1, "indices": [0, 1, 2], "loss_scale": [scale] * 3}]]]
    d["choices"] = [None]
    with pytest.raises(mp.PlanError, match="24 tokens"):
        mp.Plan.from_json(json.dumps(d)).validate()


@pytest.mark.parametrize("kw", [dict(), dict(pad_to_multiple_of=8), dict(context_parallel=mp.ContextParallel(size=2)),
                                dict(context_parallel=mp.ContextParallel(max_size=2)),
                                dict(context_parallel=mp.ContextParallel(max_size=4), share_prefixes=True),
                                dict(share_prefixes=True), dict(share_prefixes=True, pad_to_multiple_of=4)])
def test_too_long_refusals_advise_what_the_config_can_change(kw):
    """No "enable context parallel" when it is on, no "lower pad_to_multiple_of" when it is unset."""
    b = mp.Batch([201, 150, 5], prefix_parent=[-1, 0, -1], shared_prefix_lens=[0, 101, 0])
    with pytest.raises(mp.PlanError) as info:
        mp.plan(b, mp.PlanConfig(dp_size=4, max_tokens_per_micro=15, **kw))
    msg = str(info.value)
    cp = kw.get("context_parallel")
    assert ("enable context parallel" in msg) == (cp is None), msg
    if cp is not None:
        assert ("ContextParallel.max_size" if cp.dynamic else "raise ContextParallel.size from 2") in msg, msg
    assert ("lower pad_to_multiple_of" in msg) == ("pad_to_multiple_of" in kw), msg
    assert "raise max_tokens_per_micro" in msg and "truncate" in msg


@pytest.mark.parametrize("cap, cp", [(15, None), (7, mp.ContextParallel(max_size=2)), (7, mp.ContextParallel(size=2))])
def test_a_tree_refusal_says_what_its_tokens_count(cap, cp):
    """An 8-token sample whose trie path takes 16 tokens (two segments padded to 8) says so, under
    every CP mode (it used to read "sample 1 has 16 tokens")."""
    b = mp.Batch([8, 8], prefix_parent=[-1, 0], shared_prefix_lens=[0, 1])
    cfg = mp.PlanConfig(dp_size=2, max_tokens_per_micro=cap, pad_to_multiple_of=8, share_prefixes=True,
                        context_parallel=cp)
    try:
        mp.plan(b, cfg)
    except mp.PlanError as exc:  # (sharing that never refuses what plans unshared may plan it instead)
        assert "sample 1 (8 tokens) occupies 16 tokens with share_prefixes" in str(exc)
        assert "each trie segment padded to pad_to_multiple_of=8" in str(exc)
        assert "has 16 tokens" not in str(exc)


def test_a_short_dynamic_cp_step_names_what_it_needs():
    """One 1-token sample cannot fill 4 GPUs with groups of at most 2: the refusal asks for 2."""
    cfg = mp.PlanConfig(dp_size=4, max_tokens_per_micro=100, context_parallel=mp.ContextParallel(max_size=2),
                        short_step="error")
    with pytest.raises(mp.PlanError, match=r"step 0: 1 sample cannot give every GPU of the 4-GPU plane .* K=1 "
                                           r".*put at least 2 samples in each step"):
        mp.plan(mp.Batch([1]), cfg)
    assert mp.plan(mp.Batch([1, 1]), cfg).steps[0].num_placeholders == 0


def test_every_dynamic_cp_step_records_its_k_choice():
    """Dynamic CP chooses K inside the one flow: each step carries a KChoice naming the layouts
    tried, and the summary's why-K line reads it."""
    b = generate("long-context", num_prompts=16, samples_per_prompt=4, max_len=32768, seed=0)
    cfg = mp.PlanConfig(dp_size=8, max_tokens_per_micro=16384, context_parallel=mp.ContextParallel(max_size=4),
                        cost=mp.FlopsCost(linear=1.0, quadratic=1e-4, per_micro=50.0), steps=mp.Steps(num_steps=2))
    plan = mp.plan(b, cfg)
    plan.validate()
    assert len(plan.steps) == 2
    for step in plan.steps:
        assert step.choice is not None and step.choice.micro_count == step.micro_count
        assert step.choice.reason.startswith("dynamic CP: the ") and "layouts tried" in step.choice.reason
    assert mp.Plan.from_json(plan.to_json()) == plan
    assert "why K" in plan.summary()


@pytest.mark.parametrize("kw", [dict(micro_batch_size=3), dict(micro_batch_size=3, placement="local"),
                                dict(micro_batch_size=3, layout="padded"), dict(max_tokens_per_micro=100),
                                dict(max_tokens_per_micro=100, placement="local"),
                                dict(max_tokens_per_micro=100, share_prefixes=True),
                                dict(max_tokens_per_micro=60, context_parallel=mp.ContextParallel(max_size=2))])
def test_every_step_of_every_plan_records_a_k_choice(kw):
    """DESIGN: every step of every plan records Step.choice, a KChoice — static batching too (the K
    its count fixes), forward plans too."""
    b = mp.Batch(list(range(1, 40))).with_rank_of(np.arange(39) % 4)
    cfg = mp.PlanConfig(dp_size=4, **kw)
    for plan in (mp.plan(b, cfg), mp.plan_forward(b, cfg)):
        plan.validate()
        for step in plan.steps:
            assert step.choice is not None and step.choice.micro_count == step.micro_count
            assert step.micro_count in dict(step.choice.candidates)
    if "micro_batch_size" in kw:
        assert "static batching fixes it" in mp.plan(b, cfg).summary()
