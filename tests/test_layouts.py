"""Layouts and padding rules in the core: what a micro-batch occupies, counted everywhere.

The footprint of every micro-batch is recomputed from the batch and the rules by hand
(``reference.held_tokens``), never through ``microplan.footprint``, and checked against the cap,
Micro.num_tokens, Plan.stats and Plan.validate.
"""

from __future__ import annotations

import numpy as np
import pytest

import microplan as mp
from microplan import PlanError
from microplan.traces import generate
from reference import held_tokens


def _held(micro: mp.Micro, batch: mp.Batch, cfg: mp.PlanConfig) -> int:
    """Tokens the GPU holds for ``micro``, from the rules of docs/layouts.md (tests/reference.py)."""
    return held_tokens(micro.indices.tolist(), batch.seq_lens, batch.prompt_lens, cfg)


def _check(plan: mp.Plan) -> None:
    plan.validate()
    cfg, b = plan.config, plan.batch
    worst = 0
    for step in plan.steps:
        for row in step.micros:
            for micro in row:
                held = _held(micro, b, cfg)
                assert micro.num_tokens == held
                assert held <= micro.cp_size * cfg.max_tokens_per_micro, "micro-batch over the cap counting padding"
                worst = max(worst, -(-held // micro.cp_size))
    assert plan.stats.max_micro_tokens == worst
    back = mp.Plan.from_json(plan.to_json())
    assert back == plan and back.fingerprint() == plan.fingerprint()
    assert [m.num_tokens for s in back.steps for r in s.micros for m in r] == \
        [m.num_tokens for s in plan.steps for r in s.micros for m in r]


# -- varlen with pad-to-multiple rules --------------------------------------------------------

def test_pad_to_multiple_counts_each_sample_padded():
    b = mp.Batch([5, 9, 3, 17, 8, 2, 6, 30, 12, 11])
    plan = mp.plan(b, mp.PlanConfig(dp_size=2, max_tokens_per_micro=40, pad_to_multiple_of=8))
    _check(plan)
    # 5 -> 8, 9 -> 16, 3 -> 8 ...: the sum of padded lengths is 144, real 103
    held = sum(m.num_tokens for r in plan.steps[0].micros for m in r)
    assert held == sum(-(-x // 8) * 8 for x in b.seq_lens.tolist()) == 144
    assert sum(m.real_tokens for r in plan.steps[0].micros for m in r) == 103


def test_row_multiple_is_counted_in_the_cap():
    """Three samples of 10 fit a cap of 32 as a plain row (30) and with the row rounded to 16
    (32), but not with a row multiple of 12 (30 -> 36 > 32): K grows instead."""
    b = mp.Batch([10, 10, 10, 10, 10, 10])
    plain = mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=32))
    assert plain.steps[0].micro_count == 2
    sp = mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=32, pad_row_to_multiple_of=12))
    _check(sp)
    assert sp.steps[0].micro_count == 3 and all(m.num_tokens == 24 for m in sp.steps[0].micros[0])
    assert sp.stats.micro_count_lower_bound == 3  # ⌈60 / (⌊32/12⌋·12 = 24)⌉
    ok = mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=32, pad_row_to_multiple_of=16))
    _check(ok)
    assert ok.steps[0].micro_count == 2 and all(m.num_tokens == 32 for m in ok.steps[0].micros[0])


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_multiples_keep_every_cp_rank_under_the_cap(cp):
    """Zigzag ring attention: every sample padded to 2·cp, so each CP rank holds num_tokens / cp
    tokens exactly, and that is <= the per-GPU cap."""
    rng = np.random.default_rng(cp)
    b = mp.Batch(rng.integers(1, 200, 300))
    cap = 256
    plan = mp.plan(b, mp.PlanConfig(dp_size=4, max_tokens_per_micro=cap, pad_to_multiple_of=2 * cp,
                                    context_parallel=mp.ContextParallel(size=cp)))
    _check(plan)
    for step in plan.steps:
        for row in step.micros:
            for m in row:
                assert m.num_tokens % (2 * cp) == 0 and m.num_tokens // cp <= cap
    assert plan.stats.max_micro_tokens <= cap


def test_sample_over_the_cap_only_after_padding_is_refused_with_the_rule_named():
    b = mp.Batch([30, 5])
    mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=30)).validate()
    with pytest.raises(PlanError, match=r"sample 0 occupies 32 tokens \(30 tokens padded to 32.*pad_to_multiple_of=16"):
        mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=30, pad_to_multiple_of=16))
    with pytest.raises(PlanError, match="occupies 40 tokens"):
        mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=30, pad_row_to_multiple_of=20))


def test_trivial_rules_give_the_plain_plan_bit_for_bit():
    b = generate("grpo-longtail", num_prompts=16, max_len=4096, seed=3)
    base = dict(dp_size=4, max_tokens_per_micro=8192, steps=mp.Steps(prompts_per_step=8))
    a = mp.plan(b, mp.PlanConfig(**base))
    c = mp.plan(b, mp.PlanConfig(**base, layout="varlen", pad_to_multiple_of=1, pad_row_to_multiple_of=1))
    assert a.fingerprint() == c.fingerprint()
    assert "layout" not in a.to_dict()["config"]  # old plans' JSON is unchanged


# -- padded layouts ---------------------------------------------------------------------------

def test_padded_layout_counts_rows_of_the_longest_sample():
    b = mp.Batch([5, 9, 3, 17, 8, 2, 6, 30, 12, 11])
    plan = mp.plan(b, mp.PlanConfig(dp_size=2, max_tokens_per_micro=40, layout="padded"))
    _check(plan)
    choice = plan.steps[0].choice
    assert choice is not None and "padded layout" in choice.reason
    assert choice.micro_count == plan.steps[0].micro_count
    assert any(k == choice.micro_count for k, _ in choice.candidates)


def test_padded_2d_pads_prompts_and_responses_apart():
    # prompt/response: (10, 1) and (1, 10) are both 11 long, but together need a row of 10 + 10
    # (a per-micro cost makes one micro-batch cheaper than two: 40 + 100 < 2 × (11 + 100))
    b = mp.Batch([11, 11], prompt_lens=[10, 1])
    cost = mp.TokenCost(per_micro=100.0)
    fp_1d = mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=40, layout="padded", cost=cost))
    fp_2d = mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=40, layout="padded-2d", cost=cost))
    _check(fp_1d)
    _check(fp_2d)
    assert [m.num_tokens for m in fp_1d.steps[0].micros[0]] == [22]
    assert [m.num_tokens for m in fp_2d.steps[0].micros[0]] == [40]
    assert fp_2d.stats.predicted_time == 140.0  # the cost sees the padded shape: 2 rows of 20
    cheap = mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=40, layout="padded-2d"))
    assert cheap.steps[0].micro_count == 2  # without a per-micro cost, two rows of 11 are cheaper
    tight = mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=39, layout="padded-2d", cost=cost))
    _check(tight)
    assert tight.steps[0].micro_count == 2  # 2 × 20 > 39: the planner splits them


def test_padded_2d_needs_prompt_lens():
    with pytest.raises(PlanError, match="prompt_lens"):
        mp.plan(mp.Batch([4, 5]), mp.PlanConfig(dp_size=1, max_tokens_per_micro=40, layout="padded-2d"))


def test_padded_width_multiple_is_lcm_of_the_rules():
    b = mp.Batch([5, 7, 9])
    plan = mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=64, layout="padded",
                                    pad_to_multiple_of=4, pad_row_to_multiple_of=6))
    _check(plan)
    for m in plan.steps[0].micros[0]:
        assert (m.num_tokens // m.num_samples) % 12 == 0


def test_static_batching_padded_groups_by_length():
    """micro_batch_size in a padded layout: counts are capped, and lengths sorted into runs pad
    far less than the arrival order would."""
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 1000, 64)
    b = mp.Batch(lens)
    plan = mp.plan(b, mp.PlanConfig(dp_size=4, micro_batch_size=4, layout="padded"))
    plan.validate()
    held = sum(_held(m, b, plan.config) for r in plan.steps[0].micros for m in r)
    naive = sum(len(c) * c.max() for c in np.array_split(lens, 16))
    assert all(m.num_samples <= 4 for r in plan.steps[0].micros for m in r)
    assert held / lens.sum() < 1.1 < naive / lens.sum()


def test_padded_plan_of_a_long_tailed_step_pads_little():
    b = generate("grpo-longtail", num_prompts=64, max_len=16384, seed=1)
    cfg = mp.PlanConfig(dp_size=8, max_tokens_per_micro=32768, layout="padded",
                        cost=mp.FlopsCost(linear=4.2e10, quadratic=786432.0, per_micro=1.08e13))
    plan = mp.plan(b, cfg)
    _check(plan)
    held = sum(m.num_tokens for s in plan.steps for r in s.micros for m in r)
    assert held / b.total_tokens < 1.05
    assert plan.stats.lockstep_time / plan.stats.time_lower_bound < 1.25


def test_padded_short_step_drop_keeps_a_prefix():
    b = mp.Batch([100, 100, 100, 3, 3], rollout_ids=[0, 1, 2, 3, 4])
    cfg = mp.PlanConfig(dp_size=2, max_tokens_per_micro=100, layout="padded", short_step="drop")
    plan = mp.plan(b, cfg)
    _check(plan)
    assert plan.steps[0].num_placeholders == 0


# -- config ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    (dict(layout="dense"), "layout='dense' is not a layout"),
    (dict(pad_to_multiple_of=0), "pad_to_multiple_of=0 must be >= 1"),
    (dict(pad_row_to_multiple_of=2.5), "whole number"),
    (dict(pad_row_to_multiple_of=128), "exceeds max_tokens_per_micro=64"),
    (dict(layout="padded", pad_to_multiple_of=48, pad_row_to_multiple_of=32), "multiple of 96"),
    (dict(pad_to_multiple_of=2 ** 21), "2\\*\\*20"),
    (dict(max_vision_tokens_per_micro=0), "max_vision_tokens_per_micro=0 must be >= 1"),
    (dict(vision_cost=3.0), "VisionCost"),
    (dict(layout="padded", context_parallel=mp.ContextParallel(max_size=2)), "dynamic context parallel"),
    (dict(pad_to_multiple_of=4, pad_row_to_multiple_of=6, context_parallel=mp.ContextParallel(size=2)),
     "must be a multiple of pad_to_multiple_of=4; use 12"),
])
def test_layout_config_refusals(kw, match):
    with pytest.raises(PlanError, match=match):
        mp.PlanConfig(dp_size=2, max_tokens_per_micro=64, **kw)


def test_layout_config_round_trips():
    cfg = mp.PlanConfig(dp_size=2, max_tokens_per_micro=64, layout="padded-2d", pad_to_multiple_of=8,
                        pad_row_to_multiple_of=2, max_vision_tokens_per_micro=100,
                        vision_cost=mp.VisionCost(linear=2.0, quadratic=0.5))
    assert mp.PlanConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("layout", ["padded", "padded-2d"])
@pytest.mark.parametrize("budget", [dict(max_tokens_per_micro=400), dict(micro_batch_size=2)])
def test_padded_layouts_keep_pipeline_stages_and_the_k_bound(layout, budget):
    """Padded K starts from the same minimum as varlen: >= pipeline_stages (a valid plan), and the
    long-sample term of the bins' lower bound (600-token samples under a 1,000 cap sit alone)."""
    batch = mp.Batch([100] * 16, prompt_lens=[40] * 16)
    plan = mp.plan(batch, mp.PlanConfig(dp_size=2, pipeline_stages=4, layout=layout, **budget))
    plan.validate()
    assert plan.steps[0].micro_count == 4
    long = mp.plan(mp.Batch([600] * 100, prompt_lens=[100] * 100),
                   mp.PlanConfig(dp_size=1, max_tokens_per_micro=1000, layout=layout))
    assert long.steps[0].micro_count == 100 and long.steps[0].choice.lower_bound == 100
