"""share_prefixes × context parallel: a prefix-tree (or flat) row sharded over a CP group of c GPUs.

The planner counts what a GPU really computes under ``PackedMicro.cp_shard`` — ⌈U/c⌉ owned rows
of the U-token row, padding included, and nothing else (``footprint.gpu_tokens``). These tests
check the plans against the torch sharding itself (every member's shard is packed and measured),
not against the planner's own bound.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

import microplan as mp
from microplan.footprint import gpu_tokens
from test_prefix import realise

torch = pytest.importorskip("torch", reason="pip install torch==2.13.0")  # the README's test install has it
from microplan.torch import pack_micro  # noqa: E402


@settings(max_examples=40)  # each example packs and shards every micro-batch with torch
@given(seed=st.integers(0, 2**31), n=st.integers(1, 40), c=st.sampled_from([2, 4]), dp=st.sampled_from([1, 2, 3]),
       cap=st.integers(24, 90), p_link=st.sampled_from([0.5, 0.9]), row=st.sampled_from([1, 1, 4]),
       mult=st.sampled_from([1, 1, 2]), dynamic=st.booleans(), share=st.sampled_from([True, True, False]))
def test_every_gpu_of_a_cp_row_stays_under_the_cap(seed, n, c, dp, cap, p_link, row, mult, dynamic, share):
    """Tree rows (share_prefixes) and flat rows under fixed and dynamic CP: every member's
    ``cp_shard`` (what its GPU runs) is within the cap, the fullest has exactly the planner's
    ⌈U/c⌉ rows, and only a sample whose own row exceeds c × cap is refused."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 60, size=n)
    toks, parent, shared = realise(rng, lens, p_link=p_link)
    b = mp.Batch(lens, prefix_parent=parent, shared_prefix_lens=shared) if share else mp.Batch(lens)
    cp = mp.ContextParallel(max_size=c) if dynamic else mp.ContextParallel(size=c)
    cfg = mp.PlanConfig(dp_size=dp * c if dynamic else dp, max_tokens_per_micro=cap, share_prefixes=share,
                        short_step="pad", context_parallel=cp, pad_row_to_multiple_of=row, pad_to_multiple_of=mult)
    try:
        plan = mp.plan(b, cfg)
    except mp.PlanError as exc:  # only a sample whose own row fits no CP group may be refused
        from microplan.prefix import micro_tree
        need = []
        for i in range(n):
            t = micro_tree(parent if share else np.full(n, -1), shared if share else np.zeros(n, dtype=np.int64),
                           lens, np.array([i]))
            U = int((-(-(t.end - t.start) // mult) * mult).sum())
            need.append(gpu_tokens(-(-U // row) * row, c))
        assert max(need) > cap, exc
        return
    plan.validate()
    worst, computed = 0, 0
    for step in plan.steps:
        for r, micros in enumerate(step.micros):
            for micro in micros:
                p = pack_micro(micro, toks)
                w = micro.cp_size
                assert w == c or (dynamic and w in (1, 2, 4) and w <= c)
                if micro.cp_rank == 0:
                    computed += p.num_tokens
                for q in range(w):
                    held = p.cp_shard(q, cp_size=w).num_tokens  # the owned rows this GPU runs
                    worst = max(worst, held)
                    assert held <= cap, (step.index, r, q, held, cap)
                if w > 1:  # the planner's count is the real shard's, exactly (a placeholder: its dummy row)
                    assert max(p.cp_shard(q, cp_size=w).num_tokens for q in range(w)) == gpu_tokens(p.num_tokens, w)
                    assert micro.is_placeholder or p.num_tokens == micro.num_tokens
    note(f"worst GPU {worst} of cap {cap}")
    slots = sum(s.micro_count for s in plan.steps) * cfg.dp_size  # at most one row pad or padded placeholder each
    assert computed <= int((-(-lens // mult) * mult).sum()) + slots * max(row, mult)


def test_grpo_trees_stay_whole_over_a_cp_group_and_compute_fewer_tokens():
    """n = 8 completions of 2-8k-token prompts, cap 16k per GPU: without CP the trees (up to 40k
    tokens) must be cut, over CP 4 they stay whole — the trie's tokens, ≥ 2.5x fewer than unshared."""
    rng = np.random.default_rng(0)
    lens, parent, shared = [], [], []
    for _ in range(32):
        P, base = int(rng.integers(2000, 8000)), len(lens)
        for k in range(8):
            lens.append(P + int(rng.integers(200, 4000)))
            parent.append(-1 if k == 0 else base)
            shared.append(0 if k == 0 else P)
    b = mp.Batch(lens, prefix_parent=parent, shared_prefix_lens=shared)
    trie = int(sum(lens)) - int(sum(shared))
    base = dict(max_tokens_per_micro=16384, share_prefixes=True)
    flat = mp.plan(b, mp.PlanConfig(dp_size=8, **base))
    cp4 = mp.plan(b, mp.PlanConfig(dp_size=2, context_parallel=mp.ContextParallel(size=4), **base))
    cp4.validate()
    tokens = lambda plan: sum(m.num_tokens for s in plan.steps for row in s.micros for m in row)  # noqa: E731
    assert tokens(cp4) == trie                       # every tree whole: each prompt computed once
    assert tokens(flat) > trie                       # cut trees recompute their root paths
    assert sum(lens) / tokens(cp4) >= 2.5
    for s in cp4.steps:
        for row in s.micros:
            for m in row:
                assert gpu_tokens(m.num_tokens, 4) <= 16384


def test_a_lone_sample_is_one_segment_padded_as_unshared():
    """With pad_to_multiple_of a lone sample's trie runs through its ancestor's tokens without a
    branch, so it is one segment, padded once: 8 tokens, as unshared (it used to be one padded
    segment per owner, 3 → 4 then 5 → 8: 12 tokens, refused at cap 8). Every micro-batch stays
    under the cap as its packed row counts it (the regression test_compose found)."""
    b = mp.Batch([6, 8], prefix_parent=[-1, 0], shared_prefix_lens=[0, 3])
    plan = mp.plan(b, mp.PlanConfig(dp_size=2, max_tokens_per_micro=8, share_prefixes=True, pad_to_multiple_of=4))
    plan.validate()
    micros = [m for s in plan.steps for row in s.micros for m in row]
    assert sorted(m.num_tokens for m in micros) == [8, 8]
    assert all(m.tree.start.tolist() == [0] for m in micros)
    toks = [torch.arange(6), torch.cat([torch.arange(3), torch.arange(10, 15)])]
    assert all(pack_micro(m, toks).num_tokens == m.num_tokens for m in micros)
