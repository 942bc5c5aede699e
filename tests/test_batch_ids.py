"""Batch id coding (issue 20 item 6: vectorised, no Python loop per sample) against a plain reference.

The reference is the per-sample dict pass the vectorised coder replaced: dense codes in order of
first appearance. Int ids (lists, numpy arrays of any int dtype) and string ids (lists, numpy
unicode arrays) must code identically, and a rollout spread over two prompts is still refused.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import microplan as mp


def reference_codes(ids: list) -> list[int]:
    seen: dict = {}
    return [seen.setdefault(v, len(seen)) for v in ids]


int_ids = st.lists(st.integers(-2 ** 63, 2 ** 63 - 1) | st.integers(-3, 3), min_size=1, max_size=60)
str_ids = st.lists(st.sampled_from(["a", "b", "c", "", "1", "é", "a" * 40]) | st.text(max_size=3), min_size=1,
                   max_size=60)


@given(int_ids)
def test_int_ids_code_in_first_appearance_order(ids):
    want = reference_codes(ids)
    for form in (ids, np.array(ids, dtype=np.int64)):
        b = mp.Batch([3] * len(ids), prompt_ids=form)
        assert b.prompt_codes.tolist() == want
        assert b.prompt_ids == ids and b.num_prompts == max(want) + 1
        assert not b.prompt_codes.flags.writeable


@given(str_ids)
def test_str_ids_code_in_first_appearance_order(ids):
    for form in (ids, np.array(ids, dtype=str)):
        # a numpy unicode array drops trailing NULs ('\x00' -> ''): the batch keeps what it was given
        given = ids if isinstance(form, list) else form.tolist()
        b = mp.Batch([3] * len(ids), rollout_ids=form)
        assert b.rollout_codes.tolist() == reference_codes(given) and b.rollout_ids == given


def test_str_ids_that_differ_only_by_nuls_stay_distinct():
    b = mp.Batch([3, 3, 3], rollout_ids=["\x00", "", "\x00"])
    assert b.rollout_codes.tolist() == [0, 1, 0] and b.num_rollouts == 2


@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.data())
def test_rollout_in_two_prompts_refused_else_kept(rollouts, data):
    prompts = data.draw(st.lists(st.integers(0, 2), min_size=len(rollouts), max_size=len(rollouts)))
    prompt_of: dict = {}
    consistent = all(prompt_of.setdefault(r, p) == p for r, p in zip(rollouts, prompts))
    if consistent:
        b = mp.Batch([2] * len(rollouts), prompt_ids=prompts, rollout_ids=rollouts)
        assert b.prompt_codes.tolist() == reference_codes(prompts)
    else:
        with pytest.raises(mp.PlanError, match="spans two prompts"):
            mp.Batch([2] * len(rollouts), prompt_ids=prompts, rollout_ids=rollouts)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint16, np.uint64])
def test_numpy_int_dtypes(dtype):
    ids = np.array([5, 5, 2, 7, 2], dtype=dtype)
    b = mp.Batch([3] * 5, prompt_ids=ids)
    assert b.prompt_codes.tolist() == [0, 0, 1, 2, 1] and b.prompt_ids == [5, 5, 2, 7, 2]
    assert all(type(v) is int for v in b.prompt_ids)


@given(st.lists(st.integers(-5, 5) | st.sampled_from(["1", "-2", "a", "5"]), min_size=1, max_size=40))
def test_mixed_ids_code_as_their_strings(ids):
    b = mp.Batch([3] * len(ids), prompt_ids=ids)
    kinds = {type(v) for v in ids}
    want = [str(v) for v in ids] if kinds == {int, str} else ids
    assert b.prompt_ids == want and b.prompt_codes.tolist() == reference_codes(want)


@pytest.mark.parametrize("make", ["dense", "shuffled", "wide", "negative", "uint64"])
def test_large_int_id_arrays_code_like_the_reference(make):
    """Above ~1k ids the coder takes its sort-key path (or the already-dense shortcut): same codes."""
    rng = np.random.default_rng(7)
    n = 5000
    group = np.repeat(np.arange(n // 8), 8)
    ids = {"dense": group,
           "shuffled": rng.permutation(n // 8)[group],
           "wide": rng.integers(-2 ** 62, 2 ** 62, n // 8)[group],
           "negative": group - 300,
           "uint64": (rng.permutation(n // 8).astype(np.uint64) + np.uint64(2 ** 63))[group]}[make]
    b = mp.Batch(np.full(n, 3), prompt_ids=ids, rollout_ids=ids)
    want = reference_codes(ids.tolist())
    assert b.prompt_codes.tolist() == want and b.rollout_codes.tolist() == want
    assert b.prompt_ids == ids.tolist() and all(type(v) is int for v in b.prompt_ids[:5])


def test_int_id_array_is_copied():
    """Int id arrays are listed lazily (on first read of prompt_ids): a later change to the caller's
    array must not reach the batch."""
    ids = np.array([4, 4, 9, 9] * 400)
    b = mp.Batch(np.full(ids.size, 3), prompt_ids=ids)
    ids[:] = 0
    assert b.prompt_ids[:4] == [4, 4, 9, 9] and b.num_prompts == 2
