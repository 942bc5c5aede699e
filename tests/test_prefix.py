"""Shared prefixes: find_shared_prefixes, the declared forest, and planning with share_prefixes=True.

References are independent of microplan.prefix: tokens are generated to realise a random forest
(a child copies its parent's first s tokens, every other token is fresh), and the tokens a
micro-batch holds are counted from those token ids with a nested-dict trie (reference.trie_size).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import microplan as mp
from reference import cases, check_plan, configs, trie_size


def realise(rng: np.random.Generator, lens: np.ndarray, p_link: float = 0.7,
            same: np.ndarray | None = None) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Token ids realising a random prefix forest over samples of ``lens``; (tokens, parent, shared).

    Each sample links to an earlier one (preferably of the same group ``same``) with probability
    ``p_link`` and copies a random-length prefix of it; all other tokens are globally fresh, so the
    declared forest is exactly the sharing in the tokens."""
    n = lens.size
    fresh = iter(range(10, 10 ** 9))
    toks: list[np.ndarray] = []
    parent = np.full(n, -1, dtype=np.int64)
    shared = np.zeros(n, dtype=np.int64)
    for i in range(n):
        L = int(lens[i])
        cand = list(range(i))
        if same is not None:
            mine = [j for j in cand if same[j] == same[i]]
            cand = mine if mine and rng.random() < 0.8 else cand
        if cand and rng.random() < p_link:
            j = int(rng.choice(cand))
            s = int(rng.integers(0, min(L, int(lens[j])) + 1))
            if s:
                parent[i], shared[i] = j, s
        own = np.array([next(fresh) for _ in range(L - shared[i])], dtype=np.int64)
        toks.append(np.concatenate([toks[parent[i]][: shared[i]] if shared[i] else np.zeros(0, np.int64), own]))
    return toks, parent, shared


# -- find_shared_prefixes -------------------------------------------------------------------------

def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(a.size, b.size)
    d = np.flatnonzero(a[:m] != b[:m])
    return int(d[0]) if d.size else m


@given(st.integers(0, 2**31), st.integers(1, 30), st.integers(1, 4))
def test_find_shared_prefixes_matches_brute_force(seed, n, alphabet):
    """Small alphabets make accidental common prefixes likely: the longest LCP with any earlier
    sample, and a parent that attains it, exactly as a quadratic brute force finds."""
    rng = np.random.default_rng(seed)
    toks = [rng.integers(0, alphabet, int(rng.integers(1, 12))) for _ in range(n)]
    parent, shared = mp.find_shared_prefixes(toks)
    for i in range(n):
        best = max((_lcp(toks[i], toks[j]) for j in range(i)), default=0)
        assert shared[i] == best
        if best:
            assert 0 <= parent[i] < i and _lcp(toks[i], toks[parent[i]]) == best
        else:
            assert parent[i] == -1
    mp.Batch([t.size for t in toks], prefix_parent=parent, shared_prefix_lens=shared)  # always a valid forest


def test_find_shared_prefixes_forms_and_refusals():
    import torch
    toks = [[5, 6, 7], np.array([5, 6, 8]), torch.tensor([5, 6, 7, 9])]
    parent, shared = mp.find_shared_prefixes(toks)
    assert parent.tolist() == [-1, 0, 0] and shared.tolist() == [0, 2, 3]
    assert [a.tolist() for a in mp.find_shared_prefixes([[1, 2]])] == [[-1], [0]]
    for bad, match in (([[1, 2], [[1, 2]]], "1-D"), ([[1.5, 2]], "integer"), ([[1, -2]], "negative")):
        with pytest.raises(mp.PlanError, match=match):
            mp.find_shared_prefixes(bad)


# -- the declared forest --------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    (dict(prefix_parent=[-1, 1, 0]), "without shared_prefix_lens"),
    (dict(prefix_parent=[-1, 1, 0], shared_prefix_lens=[0, 1, 1]), "prefix_parent\\[1\\]=1 is not an earlier sample"),
    (dict(prefix_parent=[-1, 0, 0], shared_prefix_lens=[0, 6, 1]), "shared_prefix_lens\\[1\\]=6 exceeds sample 1"),
    (dict(prefix_parent=[-1, 0, 0], shared_prefix_lens=[0, 1, 5]), "or its parent sample 0"),
    (dict(prefix_parent=[-1, -1, 0], shared_prefix_lens=[0, 2, 1]), "prefix_parent\\[1\\] is -1"),
    (dict(prefix_parent=[-1, 0], shared_prefix_lens=[0, 1]), "has 2 entries"),
    (dict(prefix_parent=[-1, -2, 0], shared_prefix_lens=[0, 0, 1]), ">= -1"),
])
def test_bad_forest_is_refused(kw, match):
    with pytest.raises(mp.PlanError, match=match):
        mp.Batch([4, 5, 6], **kw)


def test_unsupported_combinations_are_refused():
    with pytest.raises(mp.PlanError, match="micro_batch_size"):
        mp.PlanConfig(dp_size=2, micro_batch_size=2, share_prefixes=True)
    for cp in (mp.ContextParallel(size=2), mp.ContextParallel(max_size=2)):  # CP composes with sharing
        mp.PlanConfig(dp_size=2, max_tokens_per_micro=100, share_prefixes=True, context_parallel=cp)


# -- planning -------------------------------------------------------------------------------------

@given(seed=st.integers(0, 2**31), n=st.integers(1, 40), limit=st.integers(1, 120),
       p_link=st.sampled_from([0.3, 0.7, 0.95]), multiple=st.sampled_from([1, 1, 4]))
def test_tree_atoms_partition_the_step_within_the_limit(seed, n, limit, p_link, multiple):
    """trie.cut_trees (the atoms of share_prefixes) against token-id tries: every sample in
    exactly one atom, each atom's token count is its members' trie (counted from the ids; each
    owner segment padded to the multiple: the packing bound, at least the row micro_tree lays
    out), and only a lone sample longer than the limit exceeds it."""
    from microplan.prefix import RowRules, micro_tree, owner_tree, sample_forest
    from microplan.trie import cut_trees
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 60, size=n)
    toks, parent, shared = realise(rng, lens, p_link=p_link)
    step = np.sort(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False))  # a step: any subset
    cut = cut_trees(parent, shared, lens, step, limit, multiple=multiple)
    assert cut.atom_of.shape == step.shape and set(cut.atom_of.tolist()) == set(range(cut.tokens.size))
    for a in range(cut.tokens.size):
        members = step[cut.atom_of == a]
        t = owner_tree(parent, shared, lens, members)   # the Σ depth² the cost sees, as the plan's trees count it
        padded = int((-(-(t.end - t.start) // multiple) * multiple).sum())
        assert (int(cut.tokens[a]), float(cut.depth_sq[a])) == (padded, float(t.depth_sq))
        row = micro_tree(parent, shared, lens, members, rules=RowRules(multiple))
        assert int((-(-(row.end - row.start) // multiple) * multiple).sum()) <= padded
        if multiple == 1:
            assert cut.tokens[a] == trie_size(toks, members.tolist())
        # a lone sample may exceed the limit: alone it is longer, or (with a multiple) its path's
        # segments pad to more (each segment of a tree row is padded on its own)
        assert cut.tokens[a] <= limit or members.size == 1
    whole = cut_trees(parent, shared, lens, step, 10**9)   # no limit: one atom per tree of the step
    roots, _ = sample_forest(parent, shared, step)
    firsts = [int(step[np.flatnonzero(whole.atom_of == a)[0]]) for a in range(whole.tokens.size)]
    assert sorted(firsts) == sorted(roots) and whole.tokens.size == len(roots)


@given(data=st.data(), case=cases(max_samples=60, max_cap=200))
def test_sharing_plans_keep_every_invariant(data, case):
    """Random forests over random batches and configs (steps, align, pad/drop/error, sync, loss):
    every invariant of DESIGN.md with the cap counting unique tokens, validate(), JSON, and never
    more tokens than the same samples unshared."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    toks, parent, shared = realise(rng, case.seq_lens, p_link=data.draw(st.sampled_from([0.0, 0.5, 0.9])),
                                   same=case.pc)
    cfg = data.draw(configs(case, cp=False, max_dp=8))
    cap = case.cap + data.draw(st.sampled_from([0, 0, 7, case.cap]))
    cfg = replace(cfg, micro_batch_size=None, max_tokens_per_micro=cap, context_parallel=None, share_prefixes=True)
    note(f"config: {cfg}")
    batch = mp.Batch(case.seq_lens, **case.kwargs, prefix_parent=parent, shared_prefix_lens=shared)
    try:
        plan = mp.plan(batch, cfg)
    except mp.PlanError as exc:  # only the refusals the contract allows
        msg = str(exc)
        assert any(k in msg for k in ("short_step", "Steps(", "num_steps", "cuts the prompt group")), msg
        return
    plan.validate()
    check_plan(plan, case.seq_lens, case.loss_tokens, case.pc, case.rc, cfg, token_ids=toks)
    st_ = plan.stats
    assert st_.tokens_lower_bound <= st_.tokens_with_sharing <= st_.tokens_without_sharing
    for step, ss in zip(plan.steps, st_.steps):
        assert ss.tokens_lower_bound == trie_size(toks, step.samples.tolist())   # the whole step's trie
    assert st_.predicted_time >= st_.time_lower_bound * (1 - 1e-9)
    back = mp.Plan.from_json(plan.to_json())
    assert back == plan and back.fingerprint() == plan.fingerprint()
    no_share = mp.plan(batch, replace(cfg, share_prefixes=False, short_step="pad"))
    assert st_.tokens_with_sharing <= no_share.stats.tokens_with_sharing
    try:  # the same step planned without sharing (same short_step): never predicted faster under lockstep
        plain = mp.plan(batch, replace(cfg, share_prefixes=False))
    except mp.PlanError:
        return  # whole trees need fewer micro-batches than the unshared samples: sharing may fill a step plain can't
    if cfg.sync == "micro" and plain.dropped.size == plan.dropped.size:
        assert st_.lockstep_time <= plain.stats.lockstep_time * (1 + 1e-9)


def _grpo(groups: int, n: int, prompt: int, response: tuple[int, int], rng) -> tuple[mp.Batch, list[np.ndarray]]:
    lens, pids, toks = [], [], []
    fresh = iter(range(10, 10 ** 9))
    for g in range(groups):
        p = np.array([next(fresh) for _ in range(prompt)])
        for _ in range(n):
            r = int(rng.integers(*response))
            toks.append(np.concatenate([p, [next(fresh) for _ in range(r)]]))
            lens.append(prompt + r)
            pids.append(g)
    parent, shared = mp.find_shared_prefixes(toks)
    return mp.Batch(lens, prompt_lens=[prompt] * len(lens), prompt_ids=pids, prefix_parent=parent,
                    shared_prefix_lens=shared), toks


def test_grpo_long_prompts_share_the_prompt_once():
    """GRPO, 4k prompts, ~1k responses, n = 8: the groups' prompts are held once per micro-batch."""
    rng = np.random.default_rng(0)
    batch, toks = _grpo(32, 8, 4000, (600, 1400), rng)
    cfg = mp.PlanConfig(dp_size=8, max_tokens_per_micro=16384, share_prefixes=True)
    plan = mp.plan(batch, cfg)
    plan.validate()
    st_ = plan.stats
    ratio = st_.tokens_without_sharing / st_.tokens_with_sharing
    assert ratio > 3.0, ratio                                        # 8 × 5k vs 4k + 8 × 1k
    assert st_.tokens_with_sharing == st_.tokens_lower_bound         # whole groups stay together
    unshared = mp.plan(batch, replace(cfg, share_prefixes=False))
    assert plan.stats.micro_count < unshared.stats.micro_count
    for micro in plan.steps[0].micros[0]:
        assert micro.num_tokens == trie_size(toks, micro.indices.tolist()) <= 16384


def test_trees_larger_than_the_cap_are_cut_where_they_branch():
    """One prompt (500 tokens), 4 step-wise rollouts of 6 append-only turns (+200 tokens each): the
    tree (5,300 unique tokens) exceeds the cap (2,000), so it is cut in depth-first order; each part
    holds whole turns of one rollout and recomputes only the prompt path it needs."""
    lens, parent, shared, rids = [], [], [], []
    for r in range(4):
        for t in range(6):
            i = len(lens)
            lens.append(500 + 200 * (t + 1))
            rids.append(r)
            if t:
                parent.append(i - 1)
                shared.append(lens[i - 1])
            elif r:
                parent.append(0)
                shared.append(500)
            else:
                parent.append(-1)
                shared.append(0)
    batch = mp.Batch(lens, rollout_ids=rids, prompt_ids=[0] * 24, prefix_parent=parent, shared_prefix_lens=shared)
    plan = mp.plan(batch, mp.PlanConfig(dp_size=1, max_tokens_per_micro=2000, share_prefixes=True))
    plan.validate()
    micros = plan.steps[0].micros[0]
    assert max(m.num_tokens for m in micros) <= 2000
    assert plan.stats.tokens_with_sharing == 4 * 1700 < 0.25 * plan.stats.tokens_without_sharing
    for m in micros:                                                   # one rollout's turns, in order
        assert len({rids[i] for i in m.indices.tolist()}) == 1 and np.all(np.diff(m.indices) == 1)


def test_forward_passes_use_the_same_trees():
    """Old/reference log-prob passes: plan_forward keeps sharing (its own plan, or like= the training
    plan micro-batch for micro-batch, trees included)."""
    from microplan.traces import generate
    batch = generate("grpo-longtail", num_prompts=16, max_len=4096, seed=0)
    cfg = mp.PlanConfig(dp_size=2, max_tokens_per_micro=8192, share_prefixes=True)
    train = mp.plan(batch, cfg)
    own = mp.plan_forward(batch, cfg)
    own.validate()
    assert own.stats.tokens_with_sharing < own.stats.tokens_without_sharing
    like = mp.plan_forward(batch, cfg, like=train)
    like.validate()
    for a, b in zip(train.steps, like.steps):
        for ra, rb in zip(a.micros, b.micros):
            for ma, mb in zip(ra, rb):
                assert np.array_equal(ma.indices, mb.indices) and ma.tree == mb.tree
                assert not mb.loss_scale.any()
    assert mp.Plan.from_json(like.to_json()) == like


def test_a_sharing_candidate_with_more_placeholders_is_priced_as_it_runs():
    """Found by the thorough hypothesis profile: five 1-token samples, one wholly the shared prefix
    of another, cap 1, K a multiple of 3. Whole trees need one fewer real micro-batch but one more
    placeholder, and a placeholder runs one dummy token; the candidates were compared with
    placeholders at per_micro alone, so the tree layout (predicted 246.001 by stats) beat the
    per-sample one (246.0). Now both are priced as stats price them."""
    batch = mp.Batch([1] * 5, prefix_parent=[-1, 0, -1, -1, -1], shared_prefix_lens=[0, 1, 0, 0, 0])
    cost = mp.FlopsCost(linear=1.0, per_micro=40.0, packed_quadratic=1e-3)
    shared = mp.plan(batch, mp.PlanConfig(dp_size=1, max_tokens_per_micro=1, align=3, cost=cost, share_prefixes=True))
    plain = mp.plan(batch, mp.PlanConfig(dp_size=1, max_tokens_per_micro=1, align=3, cost=cost))
    shared.validate()
    assert shared.stats.lockstep_time <= plain.stats.lockstep_time * (1 + 1e-12)
