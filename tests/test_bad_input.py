"""DESIGN.md "Bad input": every case is a PlanError whose message names the value and a fix.

Each assertion checks the exception type (PlanError, a ValueError) AND that the message
names the offending field/value AND proposes something to do about it. Planning an empty batch
is refused (DESIGN: never an empty plan); the empty Batch itself is valid (a rank's local shard).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import microplan as mp

FIX = re.compile(r"\b(pass|set|use|raise|lower|drop|fix|give|change|choose|remove|truncate|enable|leave|ask|"
                 r"wrap|re-plan)\b", re.IGNORECASE)


def refused(fn, *names: str) -> str:
    """Run fn, assert it raises PlanError naming every string in ``names`` and a fix."""
    with pytest.raises(mp.PlanError) as exc:
        fn()
    assert type(exc.value) is mp.PlanError and isinstance(exc.value, ValueError)
    msg = str(exc.value)
    for name in names:
        assert name in msg, f"message does not name {name!r}: {msg}"
    assert FIX.search(msg), f"message proposes no fix: {msg}"
    return msg


def cfg(**kw) -> mp.PlanConfig:
    kw.setdefault("dp_size", 2)
    if "micro_batch_size" not in kw:
        kw.setdefault("max_tokens_per_micro", 100)
    return mp.PlanConfig(**kw)


# -- lengths ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, -1000])
def test_negative_length(bad):
    refused(lambda: mp.Batch([5, bad, 7]), "seq_lens[1]", str(bad))


def test_zero_length():
    refused(lambda: mp.Batch([5, 6, 0]), "seq_lens[2]", "=0", ">= 1")


@pytest.mark.parametrize("bad", [1.5, 2.25, np.float32(3.5)])
def test_non_integer_length(bad):
    refused(lambda: mp.Batch([5, bad]), "seq_lens[1]", str(float(bad)), "whole number")


@pytest.mark.parametrize("values", [["a", "b"], [object(), 1]])
def test_non_numeric_lengths(values):
    refused(lambda: mp.Batch(values), "seq_lens")


def test_nested_lengths():
    refused(lambda: mp.Batch([[1, 2], [3]]), "seq_lens")
    refused(lambda: mp.Batch(np.ones((2, 2), dtype=np.int64)), "seq_lens", "1-D")


def test_huge_lengths_do_not_wrap_around():
    refused(lambda: mp.Batch(np.array([3, 2 ** 63 + 5], dtype=np.uint64)), "seq_lens[1]", "too large")


def test_loss_tokens_over_seq_lens():
    refused(lambda: mp.Batch([5, 6, 7], loss_tokens=[5, 7, 0]), "loss_tokens[1]=7", "seq_lens[1]=6")


def test_negative_or_fractional_loss_tokens():
    refused(lambda: mp.Batch([5, 6], loss_tokens=[1, -2]), "loss_tokens[1]", "-2")
    refused(lambda: mp.Batch([5, 6], loss_tokens=[1, 0.5]), "loss_tokens[1]", "0.5")


def test_prompt_lens_over_seq_lens():
    refused(lambda: mp.Batch([5, 6], prompt_lens=[2, 9]), "prompt_lens[1]=9", "seq_lens[1]=6")


# -- array lengths and ids ----------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("loss_tokens", [1, 2]), ("prompt_lens", [1, 2, 3, 4]),
    ("prompt_ids", [0, 0]), ("rollout_ids", ["a", "b", "c", "d"]),
])
def test_mismatched_array_lengths(field, value):
    msg = refused(lambda: mp.Batch([5, 6, 7], **{field: value}), field, str(len(value)), "3")
    assert "per sample" in msg


def test_scalar_ids():
    refused(lambda: mp.Batch([5, 6], prompt_ids=7), "prompt_ids", "7")


@pytest.mark.parametrize("bad", [None, 1.5, float("nan"), True])
def test_bad_id_values(bad):
    refused(lambda: mp.Batch([5, 6], rollout_ids=[bad, 1]), "rollout_ids[0]")


def test_rollout_spread_over_two_prompts():
    msg = refused(lambda: mp.Batch([5, 6, 7, 8], prompt_ids=["p", "p", "q", "q"], rollout_ids=["a", "b", "b", "c"]),
                  "'b'", "prompt_ids", "rollout_ids")
    assert "two prompts" in msg
    # interleaved order: the rollout's samples are not adjacent
    refused(lambda: mp.Batch([5, 6, 7], prompt_ids=[1, 2, 2], rollout_ids=[9, 8, 9]), "9", "rollout")


# -- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dp", [0, -1, -256])
def test_dp_size_below_one(dp):
    refused(lambda: cfg(dp_size=dp), "dp_size", str(dp))


@pytest.mark.parametrize("dp", [1.5, float("nan"), float("inf"), "4"])
def test_dp_size_not_an_int(dp):
    refused(lambda: cfg(dp_size=dp), "dp_size")


def test_both_cap_and_micro_batch_size():
    msg = refused(lambda: mp.PlanConfig(dp_size=2, max_tokens_per_micro=100, micro_batch_size=4),
                  "max_tokens_per_micro", "micro_batch_size")
    assert "both" in msg


def test_neither_cap_nor_micro_batch_size():
    msg = refused(lambda: mp.PlanConfig(dp_size=2), "max_tokens_per_micro", "micro_batch_size")
    assert "neither" in msg


@pytest.mark.parametrize("field", ["max_tokens_per_micro", "micro_batch_size", "align"])
@pytest.mark.parametrize("bad", [0, -3, 2.5, float("nan"), float("inf")])
def test_bad_sizes(field, bad):
    kw = {"dp_size": 2, field: bad}
    if field == "align":
        kw["max_tokens_per_micro"] = 100
    refused(lambda: mp.PlanConfig(**kw), field)


def test_absurd_cap_is_refused_not_overflowed():
    refused(lambda: cfg(max_tokens_per_micro=10 ** 30), "max_tokens_per_micro")


@pytest.mark.parametrize("kw", [{}, {"num_steps": 1, "prompts_per_step": 2}, {"num_steps": 0},
                                {"prompts_per_step": -1}, {"rollouts_per_step": float("nan")}])
def test_bad_steps(kw):
    refused(lambda: mp.Steps(**kw), "Steps")


def test_more_steps_than_prompts():
    refused(lambda: mp.plan(mp.Batch([3, 4, 5]), cfg(steps=mp.Steps(num_steps=4))), "num_steps=4", "3")


def test_rollouts_per_step_cutting_a_prompt_group():
    b = mp.Batch([3, 4, 5, 6], prompt_ids=[0, 0, 1, 1], rollout_ids=[0, 1, 2, 3])
    refused(lambda: mp.plan(b, cfg(steps=mp.Steps(rollouts_per_step=3))), "rollouts_per_step=3", "sample")


@pytest.mark.parametrize("field,value", [("short_step", "skip"), ("sync", "rank"), ("steps", 4), ("loss", "token-mean"),
                                         ("cost", 1.0)])
def test_bad_config_choices(field, value):
    refused(lambda: cfg(**{field: value}), field)


# -- a sample no micro-batch can hold -----------------------------------------------------------


def test_sample_longer_than_the_cap():
    msg = refused(lambda: mp.plan(mp.Batch([30, 101, 50]), cfg(max_tokens_per_micro=100)),
                  "sample 1", "101", "100", "max_tokens_per_micro")
    assert "context_parallel" in msg or "truncate" in msg


def test_sample_longer_than_the_cap_in_a_later_step():
    """The message names the global sample index, not its position within its step."""
    b = mp.Batch([10, 20, 30, 40, 50, 500])
    refused(lambda: mp.plan(b, cfg(steps=mp.Steps(num_steps=3))), "sample 5", "500", "100")


def test_sample_longer_than_cap_times_static_cp():
    cp = mp.ContextParallel(size=4)
    ok = mp.plan(mp.Batch([10, 400]), cfg(context_parallel=cp))  # 400 = 4 × 100: a group of 4 holds it
    ok.validate()
    refused(lambda: mp.plan(mp.Batch([10, 401]), cfg(context_parallel=cp)), "sample 1", "401", "400", "cp size 4")


# -- loss ---------------------------------------------------------------------------------------


def test_norm_mode_without_norm_constant():
    refused(lambda: mp.Loss("seq-mean-token-sum-norm"), "norm_constant", "seq-mean-token-sum-norm")


@pytest.mark.parametrize("H", [0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_bad_norm_constant(H):
    refused(lambda: mp.Loss("seq-mean-token-sum-norm", norm_constant=H), "norm_constant")


def test_norm_constant_for_another_mode():
    refused(lambda: mp.Loss("token-mean", norm_constant=4.0), "norm_constant", "token-mean")


@pytest.mark.parametrize("kw", [{"mode": "mean"}, {"grad_reduction": "avg"}, {"engine_divides_by_micro_count": 1}])
def test_bad_loss_fields(kw):
    refused(lambda: mp.Loss(**kw), "Loss")


# -- NaN and inf anywhere -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("field", ["seq_lens", "loss_tokens", "prompt_lens"])
def test_nan_inf_in_lengths(field, bad):
    lens = [5, 6, 7]
    if field == "seq_lens":
        refused(lambda: mp.Batch([5.0, bad, 7.0]), "seq_lens[1]")
    else:
        refused(lambda: mp.Batch(lens, **{field: [1.0, 2.0, bad]}), f"{field}[2]")


def test_nan_in_numpy_lengths():
    refused(lambda: mp.Batch(np.array([1.0, np.nan, 3.0], dtype=np.float32)), "seq_lens[1]", "nan")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("make,field", [
    (lambda v: mp.FlopsCost(linear=v), "FlopsCost.linear"),
    (lambda v: mp.FlopsCost(linear=1.0, quadratic=v), "FlopsCost.quadratic"),
    (lambda v: mp.FlopsCost(linear=1.0, per_micro=v), "FlopsCost.per_micro"),
    (lambda v: mp.TokenCost(per_micro=v), "TokenCost.per_micro"),
])
def test_nan_inf_in_costs(make, field, bad):
    refused(lambda: make(bad), field, str(bad))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_inf_in_model_config(bad):
    hf = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
          "vocab_size": 100, "hidden_act": "silu"}
    hf["hidden_size"] = bad
    refused(lambda: mp.FlopsCost.from_hf_config(hf), "hidden_size")


@pytest.mark.parametrize("field", ["dp_size", "max_tokens_per_micro", "align", "seed"])
def test_nan_inf_in_config_ints(field):
    for bad in (float("nan"), float("inf")):
        refused(lambda: cfg(**{field: bad}), field)


# -- empty batch --------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [None, mp.Steps(num_steps=2), mp.Steps(prompts_per_step=3),
                                   mp.Steps(rollouts_per_step=1)])
@pytest.mark.parametrize("short_step", ["pad", "drop", "error"])
@pytest.mark.parametrize("size", [{"max_tokens_per_micro": 64}, {"micro_batch_size": 2}])
def test_empty_batch_is_refused(steps, short_step, size):
    """issue 21: ``Batch([])`` planned to zero steps; DESIGN: an empty batch is a clear error.
    The Batch itself stays valid (a rank's local shard may be empty before gathering)."""
    batch = mp.Batch([], prompt_ids=[], rollout_ids=[])
    assert batch.num_samples == 0 and batch.total_tokens == 0
    refused(lambda: mp.plan(batch, mp.PlanConfig(dp_size=4, steps=steps, short_step=short_step, **size)),
            "empty", "0 samples")


def test_not_a_batch_or_config():
    refused(lambda: mp.plan([1, 2, 3], cfg()), "Batch")
    with pytest.raises(mp.PlanError, match="PlanConfig"):
        mp.plan(mp.Batch([1]), {"dp_size": 1})


def test_rank_out_of_range():
    plan = mp.plan(mp.Batch([1, 2]), cfg())
    refused(lambda: plan.rank(2), "rank 2", "dp_size=2")


# -- issue 21: types a reader got wrong; issue 17: absurd sizes --------------------------------


@pytest.mark.parametrize("field", ["seq_lens", "loss_tokens", "prompt_lens", "rank_of", "shared_prefix_lens"])
def test_whole_number_float_lengths_refused(field):
    """200.0 is refused like 200.5 (DESIGN: ints); the message names the field and the index."""
    kw = {"seq_lens": [300, 400], field: [0.0, 1.0] if field != "seq_lens" else [300.0, 400.0]}
    if field == "shared_prefix_lens":
        kw["prefix_parent"] = [-1, 0]
    refused(lambda: mp.Batch(**kw), f"{field}[0]", "float")
    refused(lambda: mp.Batch(np.array([300, 400], dtype=np.float64)), "seq_lens[0]=300.0", "float")


@pytest.mark.parametrize("lens,where", [(["200", "300"], "seq_lens[0]='200'"), ([200, "300"], "seq_lens[1]='300'"),
                                        (np.array(["200"]), "seq_lens[0]='200'")])
def test_string_lengths_refused(lens, where):
    refused(lambda: mp.Batch(lens), where, "str")


def test_ids_mixing_ints_and_strings_are_one_group():
    """issue 21: 1 and "1" in one id array were two prompts; a mixed array is normalised to strings."""
    b = mp.Batch([5, 6, 7, 8], prompt_ids=[1, "1", np.int64(1), "x"])
    assert b.num_prompts == 2 and b.prompt_codes.tolist() == [0, 0, 0, 1]
    assert b.prompt_ids == ["1", "1", "1", "x"] and mp.Batch.from_dict(b.to_dict()) == b
    b = mp.Batch([5, 6], rollout_ids=np.array([1, "1"], dtype=object))
    assert b.num_rollouts == 1 and b.rollout_ids == ["1", "1"]
    assert mp.Batch([5, 6], prompt_ids=[1, 1]).prompt_ids == [1, 1]  # pure ints stay ints


def test_ids_normalised_to_plain_python_values():
    b = mp.Batch([5, 6, 7], prompt_ids=[np.int64(4), 4, np.int32(9)], rollout_ids=np.array(["x", "y", "z"]))
    assert b.prompt_ids == [4, 4, 9] and all(type(v) is int for v in b.prompt_ids)
    assert b.rollout_ids == ["x", "y", "z"] and all(type(v) is str for v in b.rollout_ids)
    assert b.prompt_codes.tolist() == [0, 0, 1]
    assert mp.Batch.from_dict(b.to_dict()) == b


@pytest.mark.parametrize("field,value", [("dp_size", 2.0), ("dp_size", np.float64(4.0)), ("align", 2.0),
                                         ("max_tokens_per_micro", 100.0), ("pipeline_stages", 1.0)])
def test_whole_number_float_counts_refused(field, value):
    refused(lambda: cfg(**{field: value}), f"PlanConfig.{field}={value!r}", "not an int")


@pytest.mark.parametrize("field", ["dp_size", "align", "pipeline_stages"])
def test_absurd_counts_refused_before_any_allocation(field):
    """issue 17: dp_size=2**40 raised MemoryError inside the planner."""
    refused(lambda: cfg(**{field: 2 ** 40}), f"PlanConfig.{field}=1099511627776", "1,048,576")
    refused(lambda: mp.ContextParallel(size=2 ** 40), "ContextParallel.size")
    refused(lambda: cfg(dp_size=2 ** 20, align=32), "dp_size=1048576", "align=32", "2**24")
    assert cfg(dp_size=2 ** 20).dp_size == 2 ** 20  # the bound itself is allowed


def test_huge_dp_plans_a_tiny_batch_without_memory_error():
    plan = mp.plan(mp.Batch([5, 6, 7]), cfg(dp_size=2 ** 14))
    assert plan.steps[0].micro_count == 1 and plan.stats.num_placeholders == 2 ** 14 - 3
