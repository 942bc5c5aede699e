"""bench_prefix's pieces: the independent unique-token recount, the PrefixGrouper peer on hand
examples, the branching-agent family, and one case end to end (values worked out in comments)."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: ``benchmarks``

import microplan as mp  # noqa: E402
from benchmarks import bench_prefix as bp  # noqa: E402
from benchmarks.metrics import dense_7b_cost  # noqa: E402
from benchmarks.peers import PeerCrash  # noqa: E402
from benchmarks.peers.prefix_grouper import contiguous_groups, pg_micro_tokens, plan_prefix_grouper  # noqa: E402

A = np.asarray


def work(a: int, b: int) -> int:
    """Σ over positions a..b-1 of (2·position + 1) = b² − a²."""
    return b * b - a * a


# -- recount --------------------------------------------------------------------------------------

def test_realise_tokens_and_recount_by_hand():
    # 0: 5 tokens; 1 shares 3 with 0 (7 tokens); 2 lies inside 1 (its first 6); 3 a separate root
    b = mp.Batch([5, 7, 6, 2], prefix_parent=[-1, 0, 1, -1], shared_prefix_lens=[0, 3, 6, 0])
    t = bp.realise_tokens(b)
    assert np.array_equal(t.of(1)[:3], t.of(0)[:3]) and t.of(1)[3] not in t.of(0)
    assert np.array_equal(t.of(2), t.of(1)[:6])
    assert not set(t.of(3).tolist()) & set(t.flat[:t.offsets[3]].tolist())
    rc = bp.Recount(t)
    assert rc.count(A([0, 1])) == (5 + 4, work(0, 5) + work(3, 7))   # 1's positions 3..6 are its own
    assert rc.count(A([1, 2])) == (7, work(0, 7))                     # 2 adds nothing
    assert rc.count(A([2])) == (6, work(0, 6))
    assert rc.count(A([2, 0])) == (6 + 2, work(0, 6) + work(3, 5))    # 0's positions 3, 4 differ from 2's
    assert rc.count(A([0, 3])) == (7, work(0, 5) + work(0, 2))
    assert rc.count(A([], dtype=np.int64)) == (0, 0)


def test_random_vocab_tokens_still_realise_the_declared_prefixes():
    b = bp.family_batch("stepwise-edits", 6, seed=2)
    t = bp.realise_tokens(b, vocab=50, seed=0)
    assert t.flat.max() < 50
    for i in np.flatnonzero(b.prefix_parent >= 0).tolist():
        s = int(b.shared_prefix_lens[i])
        assert np.array_equal(t.of(i)[:s], t.of(int(b.prefix_parent[i]))[:s])


@pytest.mark.parametrize("family", ["stepwise-append", "stepwise-edits", "grpo-long", "branching-agent"])
def test_recount_equals_num_tokens_and_stats(family):
    b = bp.make_step(family, 2, 16, seed=0)
    rc = bp.Recount(bp.realise_tokens(b))
    cap = bp.FAMILIES[family].cap
    p = mp.plan(b, mp.PlanConfig(dp_size=2, max_tokens_per_micro=cap, cost=dense_7b_cost(), share_prefixes=True))
    total = 0
    for micro in (m for row in p.steps[0].micros for m in row if not m.is_placeholder):
        u, d = rc.count(micro.indices)
        assert (u, d) == (micro.num_tokens, micro.tree.depth_sq) and u <= cap
        total += u
    assert total == p.stats.tokens_with_sharing
    assert rc.count(np.arange(b.num_samples))[0] == p.stats.tokens_lower_bound < b.total_tokens


def test_find_shared_prefixes_recovers_the_realised_forest():
    b = bp.make_step("stepwise-edits", 2, 16, seed=0)
    t = bp.realise_tokens(b)  # fresh ids: no common prefix beyond the declared one
    parent, shared = mp.find_shared_prefixes([t.of(i) for i in range(b.num_samples)])
    assert np.array_equal(shared, b.shared_prefix_lens)
    assert np.array_equal(parent >= 0, b.shared_prefix_lens > 0)


def test_scaled_forest_and_find_timing_small():
    b = bp.scaled(bp.take(bp.family_batch("grpo-long", 8, seed=0), 40), 60_000)
    assert abs(b.total_tokens - 60_000) < 100 and b.num_samples == 40
    assert (b.shared_prefix_lens > 0).sum() == 40 - 5  # 5 groups: every non-first sample shares its prompt
    t = bp.time_find_shared_prefixes("grpo-long", samples=40, tokens=60_000, repeats=2)
    assert t["samples"] == 40 and len(t["times"]) == 2 and t["covers_declared"] and t["exact"] > 0.9


# -- PrefixGrouper peer ---------------------------------------------------------------------------

GROUPS = A([0, 0, 1, 1, 2, 2])            # n = 2: prompts 10, 5, 7; responses 3,4 | 1,2 | 2,2
PROMPTS = A([10, 10, 5, 5, 7, 7])
LENS = A([13, 14, 6, 7, 9, 9])


def test_pg_tokens_by_hand():
    # whole groups: 10+3+4 = 17, 5+1+2 = 8, 7+2+2 = 11 tokens, one row each
    plan = plan_prefix_grouper(LENS, GROUPS, dp=1, micro_batch_size=2)
    assert [m.tolist() for m in plan[0]] == [[0, 1], [2, 3], [4, 5]]
    got = [pg_micro_tokens(m, LENS, PROMPTS, GROUPS) for m in plan[0]]
    assert [(g.real, g.padded) for g in got] == [(17, 17), (8, 8), (11, 11)]
    assert got[0].depth_sq == work(0, 10) + work(10, 13) + work(10, 14)
    # micro_batch_size 3 cuts group 1: micro [0,1,2] = rows 17 and 5+1 (padded 2·17), micro [3,4,5] =
    # rows 5+2 and 11 (padded 2·11): 41 real tokens, group 1's prompt computed twice (36 + 5)
    plan = plan_prefix_grouper(LENS, GROUPS, dp=1, micro_batch_size=3)
    got = [pg_micro_tokens(m, LENS, PROMPTS, GROUPS) for m in plan[0]]
    assert [(g.real, g.padded) for g in got] == [(23, 34), (18, 22)]


def test_pg_tokens_equal_the_recount_of_a_grpo_forest():
    parent = A([-1, 0, -1, 2, -1, 4])
    b = mp.Batch(LENS, prompt_lens=PROMPTS, prompt_ids=GROUPS, prefix_parent=parent,
                 shared_prefix_lens=np.where(parent >= 0, PROMPTS, 0))
    rc = bp.Recount(bp.realise_tokens(b))
    for mbs in (1, 2, 3, 4, 6):
        for m in plan_prefix_grouper(LENS, GROUPS, dp=1, micro_batch_size=mbs)[0]:
            g = pg_micro_tokens(m, LENS, PROMPTS, GROUPS)
            assert (g.real, g.depth_sq) == rc.count(m)


def test_pg_refuses_group_counts_that_do_not_divide_dp():
    with pytest.raises(PeerCrash, match="% dp_size"):
        plan_prefix_grouper(LENS, GROUPS, dp=2, micro_batch_size=2)   # 3 groups on 2 ranks
    with pytest.raises(PeerCrash):
        plan_prefix_grouper(LENS, GROUPS, dp=6, micro_batch_size=2)   # fewer groups than ranks


def test_pg_keeps_whole_groups_per_rank_with_equal_counts():
    b = mp.traces.generate("grpo-longtail", num_prompts=8, samples_per_prompt=4, seed=1)
    plan = plan_prefix_grouper(b.seq_lens, b.prompt_codes, dp=4, micro_batch_size=4)
    assert {len(row) for row in plan} == {2}                           # 2 groups of 4 per rank
    for row in plan:
        for m in row:
            assert len(contiguous_groups(b.prompt_codes[m])) == 1      # one whole group per micro-batch
    flat = np.sort(np.concatenate([m for row in plan for m in row]))
    assert np.array_equal(flat, np.arange(32))


# -- families and cases ---------------------------------------------------------------------------

def test_branching_agent_is_an_append_only_branching_forest():
    b = bp.branching_agent(num_prompts=30, seed=3)
    assert b == bp.branching_agent(num_prompts=30, seed=3)
    par, sh, lens = b.prefix_parent, b.shared_prefix_lens, b.seq_lens
    assert (par < np.arange(b.num_samples)).all() and lens.max() <= 16384
    same_ep = (par >= 0) & (b.rollout_codes[np.maximum(par, 0)] == b.rollout_codes)
    assert same_ep.any() and np.array_equal(sh[same_ep], lens[par[same_ep]])   # a turn continues its parent whole
    assert (b.prompt_lens[same_ep] > sh[same_ep]).all()                         # ... plus a new observation
    cross = (par >= 0) & ~same_ep                                               # later episodes' first turns
    assert cross.any() and (b.prompt_codes[par[cross]] == b.prompt_codes[cross]).all()
    kids = np.bincount(par[same_ep], minlength=b.num_samples)
    assert (kids >= 2).sum() >= 5                                               # it forks
    assert np.all(np.diff(b.rollout_codes) >= 0)                                # episodes contiguous


def test_make_step_cuts_whole_prompts_and_drops_one_on_odd_seeds():
    even, odd = bp.make_step("grpo-long", 4, 16, seed=0), bp.make_step("grpo-long", 4, 16, seed=1)
    assert even.num_samples == 64 and even.num_prompts == 8
    assert odd.num_samples == 56 and odd.num_prompts == 7
    assert even.prefix_parent is not None and (even.shared_prefix_lens > 0).sum() == 64 - 8


def test_run_case_end_to_end():
    cost = dense_7b_cost()
    rows = {r["planner"]: r for r in bp.run_case("grpo-long", 2, 0, cost, list(bp.PLANNERS))}
    assert set(rows) == set(bp.PLANNERS)
    mpl, plain = rows["microplan"], rows["no-sharing"]
    assert mpl["over_cap"] == 0 and mpl["mismatch"] == 0 and mpl["lb_check"] == 0 and mpl["lockstep_check"] < 1e-9
    assert mpl["tokens"] <= plain["tokens"] == mpl["tokens_unshared"] and mpl["saving"] > 2
    assert mpl["tokens"] >= mpl["tokens_lb"] and mpl["speedup"] > 1
    for kind in bp.PG:
        assert rows[kind]["crash"] is None and rows[kind]["mismatch"] == 0 and rows[kind]["lb"] == mpl["lb"]
    odd = {r["planner"]: r for r in bp.run_case("grpo-long", 2, 1, cost, list(bp.PLANNERS))}   # 7 groups, dp 2
    assert all(odd[k]["crash"] for k in bp.PG) and odd["microplan"]["crash"] is None
    stepwise = bp.run_case("stepwise-append", 2, 0, cost, list(bp.PLANNERS))
    assert [r["planner"] for r in stepwise] == ["microplan", "no-sharing"]    # PrefixGrouper: GRPO only
    summary = bp.summarise(list(rows.values()) + stepwise)
    assert "recount" in bp.table(summary) and all(s["never_more"] for s in summary)
    targets = bp.check_targets(list(rows.values()) + stepwise, [])
    assert targets["over_cap"] == 0 and targets["recount_mismatches"] == 0 and targets["pass"]["never_more_tokens"]


def test_sharing_plan_is_never_predicted_slower_than_without():
    b = bp.make_step("grpo-short", 8, 16, seed=0)
    cfg = dict(dp_size=8, max_tokens_per_micro=32768, cost=dense_7b_cost())
    shared = mp.plan(b, mp.PlanConfig(**cfg, share_prefixes=True))
    plain = mp.plan(b, mp.PlanConfig(**cfg))
    assert shared.stats.lockstep_time <= plain.stats.lockstep_time * (1 + 1e-9)


# -- bench_prefix_measured: the branching agentic family and both timed passes ----------------------

def test_agentic_pairs_forest_by_hand():
    from benchmarks.bench_prefix_measured import agentic_pairs
    b = agentic_pairs(num_prompts=2, pairs=3, max_len=2048, seed=5)
    assert b.num_samples == 12 and np.array_equal(b.prompt_ids, np.repeat([0, 1], 6))
    par, sh, plen = b.prefix_parent, b.shared_prefix_lens, b.prompt_lens
    for p0 in (0, 6):                                 # each prompt's first rollout roots its tree
        assert par[p0] == -1 and sh[p0] == 0
        for k in range(3):
            a, c = p0 + 2 * k, p0 + 2 * k + 1         # c shares prompt + call (40-81) + result (102-204) with a
            assert par[c] == a and plen[a] + 142 <= sh[c] <= plen[a] + 285 and sh[c] < b.seq_lens[c]
            if k:                                     # a pair's first rollout shares the prompt only
                assert par[a] == p0 and sh[a] == plen[a]
    same = agentic_pairs(num_prompts=2, pairs=3, max_len=2048, seed=5)
    assert np.array_equal(same.seq_lens, b.seq_lens) and np.array_equal(same.shared_prefix_lens, sh)
    assert (b.seq_lens <= 2048).all()


def test_measured_bench_times_both_passes_on_a_tiny_model():
    import torch

    from benchmarks import bench_prefix_measured as bpm
    torch.set_num_threads(1)
    net = bpm.model(1, 32)
    b = bpm.agentic_pairs(num_prompts=1, pairs=2, max_len=256, seed=0)
    res = bpm.measure(net, b, bpm.tokens_for(b, seed=7), dp=2, cap=2048, repeats=1)
    assert res["unshared"]["tokens"] == int(b.seq_lens.sum()) > res["shared"]["tokens"]
    assert res["token_ratio"] == res["unshared"]["tokens"] / res["shared"]["tokens"]
    for ps in bpm.PASSES:
        for side in ("unshared", "shared"):
            assert 0 < res[side][ps]["lockstep_s"] <= res[side][ps]["total_s"]
        r = res[ps]
        assert r["efficiency"] == pytest.approx(r["speedup_total"] / res["token_ratio"])
        assert res["attention_ratio"] == res["unshared"]["attention_pairs"] / res["shared"]["attention_pairs"] > 1


def test_attention_pairs_of_a_tree_row_by_hand():
    from benchmarks import bench_prefix_measured as bpm
    b = mp.Batch([6, 5], prefix_parent=[-1, 0], shared_prefix_lens=[0, 4])   # trie: 4 shared, then 2 and 1
    toks = bpm.tokens_for(b, seed=0)
    [[flat]] = mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=64)).steps[0].micros
    [[tree]] = mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=64, share_prefixes=True)).steps[0].micros
    assert bpm.attention_pairs(flat, toks) == 21 + 15                 # Σ L(L+1)/2
    # root 4 (causal, 10 pairs), branch of 2 over 6 keys (5 + 6), branch of 1 over 5 keys (5)
    assert bpm.attention_pairs(tree, toks) == 10 + 11 + 5
