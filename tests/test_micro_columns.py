"""Planner-built Micros (``types._micro_row``): ``indices`` up front, the other three arrays sliced from
the step's shared columns on first read. They must read exactly as eager arrays would, stay
read-only, and never drag the step's columns into a pickle or a copy."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import microplan as mp
from microplan.types import Micro


def _plan() -> mp.Plan:
    rng = np.random.default_rng(3)
    lens = rng.integers(50, 4000, 3000)
    batch = mp.Batch(lens, prompt_ids=np.repeat(np.arange(375), 8), prompt_lens=np.minimum(lens - 1, 40))
    return mp.plan(batch, mp.PlanConfig(dp_size=8, max_tokens_per_micro=16384, loss=mp.Loss("prompt-mean")))


def test_lazy_columns_read_as_eager_arrays():
    plan = _plan()
    b = plan.batch
    scales = {}
    for row in plan.steps[0].micros:
        for m in row:
            idx = m.indices
            assert np.array_equal(m.seq_lens, b.seq_lens[idx]) and np.array_equal(m.loss_tokens, b.loss_tokens[idx])
            assert m.seq_lens.dtype == np.int64 and m.loss_scale.dtype == np.float64 and m.loss_scale.size == idx.size
            for a in (m.indices, m.seq_lens, m.loss_tokens, m.loss_scale):
                assert not a.flags.writeable
            assert m.seq_lens is m.seq_lens  # sliced once, then kept
            scales.update(zip(idx.tolist(), m.loss_scale.tolist()))
    assert len(scales) == b.num_samples
    eager = Micro(m.indices, m.seq_lens, m.loss_tokens, m.loss_scale, cp_group=m.cp_group)
    assert eager == m and m == eager


def test_pickle_and_copy_carry_own_arrays_only():
    plan = _plan()
    m = plan.steps[0].micros[3][1]
    fresh = pickle.loads(pickle.dumps(m))
    assert fresh == m and "_cols" not in fresh.__dict__
    assert len(pickle.dumps(m)) < 20 * m.indices.nbytes + 2000  # not the step's 3,000-sample columns
    for dup in (copy.copy(m), copy.deepcopy(m), dataclasses.replace(m)):
        assert dup == m
    assert pickle.loads(pickle.dumps(plan)).steps[0].micros == plan.steps[0].micros


def test_placeholders_read_empty():
    batch = mp.Batch([30] * 3)
    plan = mp.plan(batch, mp.PlanConfig(dp_size=4, max_tokens_per_micro=60, short_step="pad"))
    ph = [m for row in plan.steps[0].micros for m in row if m.is_placeholder]
    assert ph and all(m.seq_lens.size == 0 and m.loss_scale.size == 0 and m.num_tokens == 0 for m in ph)


def test_a_ranks_placeholders_are_one_object():
    """Local placement with every sample on rank 0: the other ranks hold placeholders only, one
    shared Micro per rank (built once, not K times)."""
    batch = mp.Batch([40] * 24).with_rank_of(np.zeros(24, dtype=np.int64))
    plan = mp.plan(batch, mp.PlanConfig(dp_size=4, max_tokens_per_micro=100, placement="local"))
    rows = plan.steps[0].micros
    assert len(rows[0]) > 1 and not any(m.is_placeholder for m in rows[0])
    for r, row in enumerate(rows[1:], start=1):
        assert all(m is row[0] for m in row) and row[0].is_placeholder and row[0].cp_group == (r,)


def test_grid_pass_builds_the_row_pass_micros():
    """``_micro_grid`` (every rank at once, no placeholder) builds the Micros ``_micro_row`` builds
    rank by rank: same arrays, CP fields, footprint, and one cp_group tuple per rank."""
    from microplan.footprint import footprint_of
    from microplan.types import _micro_grid, _micro_row

    n, D, K = 60, 4, 3
    rng = np.random.default_rng(5)
    cols = [np.arange(n, dtype=np.int64), rng.integers(1, 99, n), rng.integers(0, 9, n), rng.random(n)]
    for a in cols:
        a.setflags(write=False)
    cuts = np.sort(rng.choice(np.arange(1, n), D * K - 1, replace=False)).tolist()
    spans = list(zip([0] + cuts, cuts + [n]))
    rng.shuffle(spans)
    los, his = [lo for lo, _ in spans], [hi for _, hi in spans]
    batch = mp.Batch(cols[1])
    for cp, fp in ((1, None), (2, footprint_of(batch, mp.PlanConfig(dp_size=D, max_tokens_per_micro=999,
                                                                        pad_to_multiple_of=8)))):
        grid = _micro_grid(cols, los, his, K, cp, fp)
        rows = [_micro_row(cols, los[r * K:(r + 1) * K], his[r * K:(r + 1) * K], (r,), cp, fp) for r in range(D)]
        assert [len(row) for row in grid] == [K] * D
        for r in range(D):
            assert grid[r] == rows[r] and all(m.cp_group is grid[r][0].cp_group == (r,) for m in grid[r])
            assert all(m.cp_size == cp and m.footprint is fp for m in grid[r])


def test_tree_rows_columns_read_as_eager_arrays_and_stay_read_only():
    """Shared-prefix micro-batches take their columns as slices of the step's once-gathered columns
    (``build.tree_columns``, sliced on first read as flat rows are: ``types._micro_tree_grid``): the
    same values as a per-sample gather, read-only, pickled and copied with their own arrays and
    trie only."""
    from microplan.traces import generate
    batch = generate("stepwise-multiturn", num_prompts=24, samples_per_prompt=4, seed=1)
    plan = mp.plan(batch, mp.PlanConfig(dp_size=4, share_prefixes=True, max_tokens_per_micro=24576,
                                        loss=mp.Loss("prompt-mean")))
    b, seen = plan.batch, []
    for row in plan.steps[0].micros:
        for m in row:
            if m.is_placeholder:
                continue
            assert m.tree is not None
            idx = m.indices
            assert np.array_equal(m.seq_lens, b.seq_lens[idx]) and np.array_equal(m.loss_tokens, b.loss_tokens[idx])
            assert m.loss_scale.dtype == np.float64 and m.loss_scale.size == idx.size
            for a in (m.indices, m.seq_lens, m.loss_tokens, m.loss_scale):
                assert not a.flags.writeable
                with pytest.raises(ValueError):
                    a.setflags(write=True)
            assert len(pickle.dumps(m.indices)) < m.indices.nbytes + 200
            fresh = pickle.loads(pickle.dumps(m))
            assert fresh == m and fresh.tree == m.tree and "_cols" not in fresh.__dict__
            for dup in (copy.copy(m), copy.deepcopy(m), dataclasses.replace(m)):
                assert dup == m and dup.tree == m.tree
            seen.extend(idx.tolist())
    assert sorted(seen) == list(range(b.num_samples))
    assert pickle.loads(pickle.dumps(plan)).steps[0].micros == plan.steps[0].micros


def test_tree_placeholders_read_empty_and_are_one_object_per_rank():
    """A sharing step with placeholders: each reads empty (no trie, no tokens) and a rank's are one
    object, as for flat rows."""
    batch = mp.Batch([30, 40, 35], prefix_parent=[-1, 0, 0], shared_prefix_lens=[0, 20, 20])
    plan = mp.plan(batch, mp.PlanConfig(dp_size=2, max_tokens_per_micro=60, short_step="pad", share_prefixes=True,
                                        align=2))
    plan.validate()
    rows = plan.steps[0].micros
    ph = [m for row in rows for m in row if m.is_placeholder]
    assert ph and all(m.seq_lens.size == 0 and m.loss_scale.size == 0 and m.num_tokens == 0 and m.tree is None
                      for m in ph)
    for row in rows:
        assert len({id(m) for m in row if m.is_placeholder}) <= 1
    assert all(m.tree is not None for row in rows for m in row if not m.is_placeholder)


def _tree_plan(multiple: int = 1) -> mp.Plan:
    from microplan.traces import generate
    batch = generate("stepwise-multiturn", num_prompts=24, samples_per_prompt=4, seed=1)
    pad = {} if multiple == 1 else {"pad_to_multiple_of": multiple, "pad_row_to_multiple_of": 16}
    return mp.plan(batch, mp.PlanConfig(dp_size=4, share_prefixes=True, max_tokens_per_micro=24576,
                                        loss=mp.Loss("prompt-mean"), **pad))


def _unread(plan: mp.Plan) -> list[Micro]:
    """The plan's tree Micros, asserting that none has computed its trie yet."""
    out = [m for step in plan.steps for row in step.micros for m in row if not m.is_placeholder]
    assert out and all("tree" not in m.__dict__ and m.__dict__["_tries"]._trees is None for m in out)
    return out


@pytest.mark.parametrize("multiple", [1, 8])
def test_tree_rows_tries_are_lazy_and_invisible(multiple):
    """A planner-built tree Micro computes its trie on first read of ``tree`` (the step's tries in one
    pass: ``build.StepTries``); until then nothing may tell: equality, pickling, copying, JSON, the
    fingerprint, validate() and stats read the same as on a plan whose tries were read, and each
    trie is ``prefix.micro_tree`` of the Micro's samples under the plan's row rules."""
    from microplan.footprint import footprint_of
    from microplan.prefix import forest_of, micro_tree
    eager = _tree_plan(multiple)
    micros = [m for step in eager.steps for row in step.micros for m in row if not m.is_placeholder]
    parent, shared = forest_of(eager.batch)
    rules = footprint_of(eager.batch, eager.config).row_rules()
    for m in micros:
        assert m.tree == micro_tree(parent, shared, eager.batch.seq_lens, m.indices, rules=rules)
    assert all(m.__dict__["tree"] is m.tree for m in micros)  # read once, then kept
    srcs = {id(m.__dict__["_tries"]) for m in micros}
    assert len(srcs) == len(eager.steps)  # one source per step, computed once for all its Micros

    lazy = _tree_plan(multiple)
    assert lazy.fingerprint() == eager.fingerprint() and lazy.to_json() == eager.to_json()
    _unread(lazy)
    back = pickle.loads(pickle.dumps(_tree_plan(multiple)))
    assert back == eager and all("_tries" not in m.__dict__ for step in back.steps for row in step.micros
                                 for m in row)
    for dup in (copy.copy, copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m)), dataclasses.replace):
        for a, b in zip(_unread(_tree_plan(multiple)), micros):
            c = dup(a)
            assert "_tries" not in c.__dict__ and c.tree == b.tree and c == b
    for a, b in zip(_unread(_tree_plan(multiple)), micros):
        assert a == b and a.tree == b.tree and a.num_tokens == b.num_tokens and repr(a) == repr(b)
    fresh = _tree_plan(multiple)
    assert fresh == eager and mp.Plan.from_json(fresh.to_json()) == eager
    fresh = _tree_plan(multiple)
    fresh.validate()
    assert _tree_plan(multiple).stats == eager.stats


@given(seed=st.integers(0, 2 ** 31))
def test_stats_of_a_shared_plan_read_no_trie_and_match_the_micros(seed):
    """``Plan.stats`` counts each tree micro-batch's tokens from the batch (``stats._step_grids``:
    ``trie.row_tries`` per bin, padding and row multiples, CP groups, placeholders) without reading
    a trie, and the counts equal the Micros' own ``num_tokens`` (fuzz_share's compositions)."""
    from benchmarks.fuzz_share import draw_case
    b, kw, _ = draw_case(np.random.default_rng(seed))
    try:
        plan = mp.plan(b, mp.PlanConfig(share_prefixes=True, **kw))
    except mp.PlanError:
        return
    stats = plan.stats
    micros = [m for step in plan.steps for row in step.micros for m in row]
    assert all("tree" not in m.__dict__ for m in micros if "_tries" in m.__dict__)  # stats read no trie
    for step, st_ in zip(plan.steps, stats.steps):
        flat = [m for row in step.micros for m in row]
        assert st_.tokens_with_sharing == sum(m.num_tokens for m in flat if not m.is_placeholder and m.cp_rank == 0)
        assert st_.max_micro_tokens == max((-(-m.num_tokens // m.cp_size) for m in flat), default=0)
