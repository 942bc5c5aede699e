"""Forward plans (``plan_forward``) and the logits-memory arithmetic.

Forward plans keep every core guarantee (re-checked sample by sample by reference.check_plan),
carry loss scale 0, hold every sample in one step, and ``like=`` reproduces a plan's geometry
exactly — every step, rank, slot and sample order — or refuses a plan of another batch.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

import microplan as mp
from reference import cases, check_plan, configs, replace


def _same_geometry(a: mp.Plan, b: mp.Plan) -> None:
    assert len(a.steps) == len(b.steps)
    for sa, sb in zip(a.steps, b.steps):
        assert sa.micro_count == sb.micro_count and np.array_equal(sa.samples, sb.samples)
        for ra, rb in zip(sa.micros, sb.micros):
            assert len(ra) == len(rb)
            for ma, mb in zip(ra, rb):
                assert ma.indices.tolist() == mb.indices.tolist()  # same samples, same order
                assert (ma.cp_size, ma.cp_rank, ma.cp_group) == (mb.cp_size, mb.cp_rank, mb.cp_group)


def _check_forward(fwd: mp.Plan, case) -> None:
    assert fwd.kind == "forward"
    fwd.validate()
    check_plan(fwd, case.seq_lens, case.loss_tokens, case.pc, case.rc, fwd.config)
    for step in fwd.steps:
        for row in step.micros:
            for m in row:
                assert m.loss_scale.dtype == np.float64 and not m.loss_scale.any()
                assert step.micro_count >= fwd.config.pipeline_stages
    back = mp.Plan.from_json(fwd.to_json())
    assert back == fwd and back.kind == "forward" and back.fingerprint() == fwd.fingerprint()
    back.validate()


@settings(deadline=None)
@given(data=st.data(), case=cases(max_samples=300))
def test_forward_plans_keep_every_guarantee(data, case):
    cfg = data.draw(configs(case, max_dp=64))
    if data.draw(st.booleans()):
        cfg = replace(cfg, pipeline_stages=data.draw(st.sampled_from([2, 4])))
    note(f"config: {cfg}")
    batch = case.batch()
    try:
        fwd = mp.plan_forward(batch, cfg)
    except mp.PlanError as exc:  # only a sample over the forward cap (or a CP group) may refuse
        assert "tokens" in str(exc) and ("cap" in str(exc) or "max_size" in str(exc)), exc
        return
    _check_forward(fwd, case)
    assert len(fwd.steps) == (1 if batch.num_samples else 0)
    assert fwd.dropped.size == 0 and not fwd.drop_reasons  # nothing dropped, whatever steps/short_step say
    assert fwd.config.steps is None and fwd.config.short_step == "pad"
    # the planner's own one-step plan (a forward 1F1B pipeline keeps the training order: its time is order-free)
    _same_geometry(fwd, mp.plan(batch, replace(cfg, steps=None, short_step="pad")))


@settings(deadline=None)
@given(data=st.data(), case=cases(max_samples=300))
def test_like_reproduces_every_step_rank_and_micro(data, case):
    cfg = data.draw(configs(case, max_dp=64))
    note(f"config: {cfg}")
    batch = case.batch()
    try:
        train = mp.plan(batch, cfg)
    except mp.PlanError:
        return
    fwd_cost = mp.FlopsCost(linear=1.0, quadratic=1e-4)
    other = (dict(max_tokens_per_micro=2 * cfg.max_tokens_per_micro) if cfg.max_tokens_per_micro else
             dict(micro_batch_size=cfg.micro_batch_size + 1))  # ignored: the geometry is the like plan's
    fwd = mp.plan_forward(batch, replace(cfg, cost=fwd_cost, steps=None, **other), like=train)
    _check_forward(fwd, case)
    _same_geometry(fwd, train)
    assert np.array_equal(fwd.dropped, train.dropped) and fwd.drop_reasons == train.drop_reasons
    assert fwd.config.cost == fwd_cost and fwd.config.steps == train.config.steps
    again = mp.plan_forward(batch, cfg, like=fwd)  # like a forward plan: the same geometry again
    _same_geometry(again, train)


def _batch(seed=0, n=96):
    rng = np.random.default_rng(seed)
    lens = rng.integers(8, 2048, n)
    return mp.Batch(lens, prompt_ids=np.arange(n) // 4)


def test_like_refuses_another_batch_and_names_the_fingerprints():
    b = _batch()
    train = mp.plan(b, mp.PlanConfig(dp_size=4, max_tokens_per_micro=4096))
    other = mp.Batch(b.seq_lens[::-1].copy(), prompt_ids=np.repeat(np.arange(24), 4))
    with pytest.raises(mp.PlanError) as exc:
        mp.plan_forward(other, train.config, like=train)
    msg = str(exc.value)
    assert b.fingerprint()[:12] in msg and other.fingerprint()[:12] in msg and "seq_lens[0]" in msg
    assert "Pass the Batch the training plan was made from" in msg
    fewer = mp.Batch(b.seq_lens[:-4], prompt_ids=np.repeat(np.arange(23), 4))
    with pytest.raises(mp.PlanError, match="92 samples"):
        mp.plan_forward(fewer, train.config, like=train)
    ids = mp.Batch(b.seq_lens, prompt_ids=np.arange(96))  # same lengths, other groups: another batch
    with pytest.raises(mp.PlanError, match="prompt_ids"):
        mp.plan_forward(ids, train.config, like=train)


@pytest.mark.parametrize("change", [dict(dp_size=8), dict(pipeline_stages=2),
                                    dict(context_parallel=mp.ContextParallel(size=2))])
def test_like_refuses_another_parallel_layout(change):
    b = _batch(1)
    train = mp.plan(b, mp.PlanConfig(dp_size=4, max_tokens_per_micro=4096))
    name = next(iter(change))
    with pytest.raises(mp.PlanError, match=rf"like plan has {name}=.*pass a config with {name}="):
        mp.plan_forward(b, replace(train.config, **change), like=train)


def test_like_takes_a_plan():
    with pytest.raises(mp.PlanError, match="takes a microplan.Plan"):
        mp.plan_forward(_batch(), mp.PlanConfig(dp_size=2, max_tokens_per_micro=4096), like="plan.json")


def test_forward_cap_below_the_longest_sample():
    b = mp.Batch([100, 5000, 300])
    with pytest.raises(mp.PlanError, match=r"sample 1 has 5000 tokens.*max_tokens_per_micro=4096.*at least 5000"):
        mp.plan_forward(b, mp.PlanConfig(dp_size=2, max_tokens_per_micro=4096))
    with pytest.raises(mp.PlanError, match=r"× cp size 2 = 4096"):
        mp.plan_forward(b, mp.PlanConfig(dp_size=2, max_tokens_per_micro=2048,
                                         context_parallel=mp.ContextParallel(size=2)))
    ok = mp.plan_forward(b, mp.PlanConfig(dp_size=2, max_tokens_per_micro=2500,  # 5,000 = 2 × 2,500
                                          context_parallel=mp.ContextParallel(size=2)))
    ok.validate()


def test_forward_ignores_steps_and_drops_nothing():
    b = _batch(2, 90)  # 23 prompts (the last of 2 samples): prompts_per_step=4 drops the trailing 3
    cfg = mp.PlanConfig(dp_size=4, max_tokens_per_micro=8192, steps=mp.Steps(prompts_per_step=4), short_step="drop")
    train = mp.plan(b, cfg)
    assert train.dropped.size > 0
    fwd = mp.plan_forward(b, cfg)
    assert len(fwd.steps) == 1 and fwd.steps[0].samples.tolist() == list(range(90)) and fwd.dropped.size == 0
    like = mp.plan_forward(b, cfg, like=train)  # the training geometry: its drops too
    assert np.array_equal(like.dropped, train.dropped)


def test_forward_plan_uses_fewer_micro_batches_at_a_larger_cap():
    b = _batch(3, 400)
    train = mp.plan(b, mp.PlanConfig(dp_size=4, max_tokens_per_micro=4096))
    fwd = mp.plan_forward(b, mp.PlanConfig(dp_size=4, max_tokens_per_micro=3 * 4096))
    assert fwd.steps[0].micro_count == fwd.stats.steps[0].micro_count_lower_bound
    assert fwd.steps[0].micro_count * 2 < train.steps[0].micro_count
    assert fwd.stats.max_micro_tokens <= 3 * 4096


def test_validate_refuses_a_forward_plan_with_loss():
    b = _batch(4)
    train = mp.plan(b, mp.PlanConfig(dp_size=2, max_tokens_per_micro=4096))
    lying = mp.Plan(batch=b, config=train.config, steps=train.steps, dropped=train.dropped,
                    drop_reasons=train.drop_reasons, kind="forward")
    with pytest.raises(mp.PlanError, match="forward plan carries loss_scale 0"):
        lying.validate()
    fwd = mp.plan_forward(b, train.config, like=train)
    as_train = mp.Plan(batch=b, config=fwd.config, steps=fwd.steps, dropped=fwd.dropped,
                       drop_reasons=fwd.drop_reasons)
    with pytest.raises(mp.PlanError, match="loss_scale differs from the loss contract"):
        as_train.validate()
    assert fwd != as_train  # kind is part of the plan's identity
    with pytest.raises(mp.PlanError, match="kind"):
        mp.Plan(batch=b, config=fwd.config, steps=fwd.steps, dropped=fwd.dropped, drop_reasons={}, kind="eval")


def test_json_kind_defaults_to_train_for_older_plans():
    import json
    b = _batch(5)
    train = mp.plan(b, mp.PlanConfig(dp_size=2, max_tokens_per_micro=4096))
    d = json.loads(train.to_json())
    assert d["kind"] == "train"
    del d["kind"], d["config"]["pipeline_stages"], d["config"]["virtual_stages"]
    assert mp.Plan.from_json(json.dumps(d)) == train
    d["kind"] = "eval"
    with pytest.raises(mp.PlanError, match="kind"):
        mp.Plan.from_json(json.dumps(d))


def test_empty_batch_is_refused_by_plan_forward():
    with pytest.raises(mp.PlanError, match="the batch is empty"):
        mp.plan_forward(mp.Batch([]), mp.PlanConfig(dp_size=2, max_tokens_per_micro=64))


def test_bad_arguments():
    with pytest.raises(mp.PlanError, match="takes a microplan.Batch"):
        mp.plan_forward([1, 2], mp.PlanConfig(dp_size=1, max_tokens_per_micro=8))
    with pytest.raises(mp.PlanError, match="takes a microplan.PlanConfig"):
        mp.plan_forward(mp.Batch([1, 2]), {"dp_size": 1})


# -- logits memory ---------------------------------------------------------------------------------

def test_logits_arithmetic_matches_the_slime_seed():
    # 205k tokens, Qwen vocab 151,936 over TP=2: 58 GiB of float32 logits (slime #1951)
    assert mp.logits_bytes(205_000, 151_936 // 2, log_softmax_copy=False) == 205_000 * 75_968 * 4
    assert round(mp.logits_bytes(205_000, 75_968, log_softmax_copy=False) / 2 ** 30) == 58
    assert mp.logits_bytes(10, 100) == 10 * 100 * 4 * 2


@given(st.integers(1, 2 ** 40), st.integers(1, 300_000), st.sampled_from([2, 4]), st.booleans())
def test_logits_cap_is_the_largest_that_fits(budget, vocab, b, copy):
    try:
        cap = mp.logits_token_cap(budget, vocab, bytes_per_element=b, log_softmax_copy=copy)
    except mp.PlanError as exc:
        assert mp.logits_bytes(1, vocab, bytes_per_element=b, log_softmax_copy=copy) > budget
        assert "no token" in str(exc)
        return
    assert mp.logits_bytes(cap, vocab, bytes_per_element=b, log_softmax_copy=copy) <= budget
    assert mp.logits_bytes(cap + 1, vocab, bytes_per_element=b, log_softmax_copy=copy) > budget


@pytest.mark.parametrize("kw", [dict(vocab_size=0), dict(memory_bytes=-1), dict(bytes_per_element=1.5),
                                dict(log_softmax_copy="yes")])
def test_logits_cap_bad_input(kw):
    args = dict(memory_bytes=2 ** 30, vocab_size=32000) | kw
    with pytest.raises(mp.PlanError):
        mp.logits_token_cap(**args)
