"""Synthetic traces: determinism, argument checks, and each family's documented shape."""

from __future__ import annotations

import numpy as np
import pytest

import microplan as mp
from microplan.traces import FAMILIES, generate


def _groups_contiguous(codes: np.ndarray) -> bool:
    """Each code appears in one contiguous run, and runs come in order 0, 1, 2, ..."""
    starts = np.flatnonzero(np.diff(codes)) + 1
    runs = codes[np.concatenate(([0], starts))]
    return bool(np.array_equal(runs, np.arange(runs.size)))


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_determinism(family: str) -> None:
    a = generate(family, num_prompts=64, seed=3)
    b = generate(family, num_prompts=64, seed=3)
    c = generate(family, num_prompts=64, seed=4)
    assert a == b
    assert not np.array_equal(a.seq_lens, c.seq_lens) or a.num_samples != c.num_samples


@pytest.mark.parametrize("family", FAMILIES)
def test_common_invariants(family: str) -> None:
    L = 8192
    b = generate(family, num_prompts=96, samples_per_prompt=4, max_len=L, seed=1)
    assert isinstance(b, mp.Batch)
    assert b.prompt_lens is not None and b.prompt_ids is not None and b.rollout_ids is not None
    assert b.seq_lens.max() <= L and b.seq_lens.min() >= 2
    assert np.all(b.prompt_lens >= 1) and np.all(b.prompt_lens < b.seq_lens)
    np.testing.assert_array_equal(b.loss_tokens, b.seq_lens - b.prompt_lens)
    assert b.num_prompts == 96
    assert b.num_rollouts == 96 * 4
    assert _groups_contiguous(b.prompt_codes) and _groups_contiguous(b.rollout_codes)
    # every rollout lies within one prompt (Batch checks it too; this pins the id scheme)
    for r in range(b.num_rollouts):
        assert np.unique(b.prompt_codes[b.rollout_codes == r]).size == 1


@pytest.mark.parametrize("family", ["grpo-longtail", "bimodal", "long-context"])
def test_grpo_groups_share_their_prompt(family: str) -> None:
    b = generate(family, num_prompts=50, samples_per_prompt=6, seed=2)
    assert b.num_samples == 300
    np.testing.assert_array_equal(np.bincount(b.prompt_codes), np.full(50, 6))
    plens = b.prompt_lens.reshape(50, 6)
    assert np.all(plens == plens[:, :1])          # one prompt, one length
    assert b.num_rollouts == b.num_samples        # one sample per rollout


@pytest.mark.parametrize("family,lo,hi", [("grpo-longtail", 0.01, 0.10), ("bimodal", 0.05, 0.25)])
def test_truncation_spike(family: str, lo: float, hi: float) -> None:
    L = 16384
    s = generate(family, num_prompts=512, max_len=L, seed=0).seq_lens
    at_max = float((s == L).mean())
    assert lo < at_max < hi
    # a spike, not a smooth tail: far more samples sit exactly at L than in the bin just below
    just_below = float(((s >= L - 256) & (s < L)).mean())
    assert at_max > 3 * just_below


def test_longtail_is_long_tailed_and_difficulty_groups() -> None:
    b = generate("grpo-longtail", num_prompts=512, seed=0)
    s = b.seq_lens
    assert np.quantile(s, 0.9) > 3 * np.median(s)                 # right tail
    # prompt difficulty: group means of log response length vary far more than the per-sample
    # noise alone would make them (var within / group size)
    logs = np.log(b.loss_tokens.reshape(512, 8))
    assert logs.mean(axis=1).var() > 3 * logs.var(axis=1, ddof=1).mean() / 8


def test_bimodal_has_two_modes() -> None:
    L = 16384
    resp = generate("bimodal", num_prompts=512, max_len=L, seed=0).loss_tokens
    short = (resp < 0.08 * L).mean()
    long = (resp > 0.3 * L).mean()
    middle = ((resp >= 0.1 * L) & (resp <= 0.25 * L)).mean()
    assert short > 0.3 and long > 0.3 and middle < 0.1


def test_stepwise_context_grows_turn_by_turn() -> None:
    L = 16384
    b = generate("stepwise-multiturn", num_prompts=128, samples_per_prompt=4, max_len=L, seed=0)
    turns = np.bincount(b.rollout_codes)
    assert turns.min() >= 1 and turns.max() > 3 and b.num_samples > b.num_rollouts
    per_prompt = np.bincount(b.prompt_codes)
    assert per_prompt.min() >= 4 and per_prompt.max() > per_prompt.min()  # variable samples per prompt
    first = np.concatenate(([True], b.rollout_codes[1:] != b.rollout_codes[:-1]))
    later = np.flatnonzero(~first)
    # turn t's prompt part holds the whole of turn t-1 plus a new observation
    assert np.all(b.prompt_lens[later] > b.seq_lens[later - 1])
    assert np.all(b.seq_lens[later] > b.seq_lens[later - 1])
    # turn 1 of every rollout of a prompt starts from the same prompt
    for p in range(b.num_prompts):
        assert np.unique(b.prompt_lens[first & (b.prompt_codes == p)]).size == 1
    # a truncated turn (at the window) ends its rollout
    full = np.flatnonzero(b.seq_lens == L)
    last = np.concatenate((b.rollout_codes[1:] != b.rollout_codes[:-1], [True]))
    assert np.all(last[full])


def test_stepwise_samples_per_prompt_is_rollouts() -> None:
    b = generate("stepwise-multiturn", num_prompts=10, samples_per_prompt=3, seed=5)
    assert b.num_rollouts == 30
    for p in range(10):
        assert np.unique(b.rollout_codes[b.prompt_codes == p]).size == 3


def test_long_context_has_far_longer_minority() -> None:
    L = 131072
    s = generate("long-context", num_prompts=256, max_len=L, seed=0).seq_lens
    far = (s >= 32768).mean()
    assert 0.05 < far < 0.3                       # a minority, past any 16k per-GPU cap
    assert np.median(s) < 8192                    # the bulk stays short
    assert s.max() <= L and (s > 0.75 * L).any()


def test_prompt_len_fixed_and_range() -> None:
    b = generate("grpo-longtail", num_prompts=20, prompt_len=100, seed=0)
    assert np.all(b.prompt_lens == 100)
    b = generate("bimodal", num_prompts=200, prompt_len=(10, 20), seed=0)
    assert b.prompt_lens.min() >= 10 and b.prompt_lens.max() <= 20 and np.unique(b.prompt_lens).size > 3


def test_small_window_default_prompt_fits() -> None:
    for family in FAMILIES:
        b = generate(family, num_prompts=20, max_len=64, seed=0)
        assert b.seq_lens.max() <= 64 and np.all(b.loss_tokens >= 1)


@pytest.mark.parametrize("kwargs,match", [
    ({"family": "nope"}, "grpo-longtail, bimodal, stepwise-multiturn, long-context"),
    ({"num_prompts": 0}, "num_prompts"),
    ({"samples_per_prompt": -1}, "samples_per_prompt"),
    ({"max_len": 1}, "max_len"),
    ({"seed": -2}, "seed"),
    ({"prompt_len": (50, 10)}, "lo > hi"),
    ({"prompt_len": 16384}, "max_len"),
    ({"prompt_len": (1, 2, 3)}, "pair"),
    ({"num_prompts": 2.5}, "whole number"),
])
def test_bad_arguments_raise_plan_error(kwargs: dict, match: str) -> None:
    args = {"family": "grpo-longtail", **kwargs}
    with pytest.raises(mp.PlanError, match=match):
        generate(args.pop("family"), **args)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_plans_and_validates(family: str) -> None:
    L = 4 * 8192 if family == "long-context" else 8192  # long-context: up to 4 GPUs' worth, split over 4
    b = generate(family, num_prompts=32, max_len=L, seed=0)
    cp = mp.ContextParallel(max_size=4) if family == "long-context" else None
    p = mp.plan(b, mp.PlanConfig(dp_size=4, max_tokens_per_micro=8192, steps=mp.Steps(prompts_per_step=8),
                                 context_parallel=cp))
    p.validate()
    assert len(p.steps) == 4 and p.dropped.size == 0
