"""A CP group of c GPUs holds c × ``max_tokens_per_micro`` tokens (DESIGN.md invariant 3).

``PackedMicro.cp_shard`` computes a member's owned rows and nothing else (each owned row's
logits score the tokens after it), so a GPU of the group runs ⌈U/c⌉ rows of a U-token row and a
sample of exactly c × cap tokens — what users configure (max length = cap × cp) — plans under
``ContextParallel(size=c)`` and ``ContextParallel(max_size=c)``. These tests check the plan, and
that the planner's per-GPU count is the shard's, padding and the 2c-chunk zigzag included.
"""

from __future__ import annotations

import numpy as np
import pytest

import microplan as mp
from microplan.footprint import gpu_tokens

torch = pytest.importorskip("torch", reason="pip install torch==2.13.0")
from microplan.torch import pack_micro  # noqa: E402

CAP = 16384


def _cp(kind: str, c: int) -> mp.ContextParallel:
    return mp.ContextParallel(size=c) if kind == "fixed" else mp.ContextParallel(max_size=c)


def _micro_of(plan: mp.Plan, sample: int) -> mp.Micro:
    return next(m for s in plan.steps for row in s.micros for m in row if sample in m.indices.tolist())


@pytest.mark.parametrize("kind", ["fixed", "dynamic"])
@pytest.mark.parametrize("c", [2, 4])
def test_a_sample_of_exactly_c_times_cap_plans(kind, c):
    """32,768 tokens at a 16,384 cap over 2 GPUs (65,536 over 4): planned on a group of c GPUs,
    each computing exactly the cap; one token more is refused, naming c × cap."""
    lens = [c * CAP, 3000, 900, 12000, 40]
    dp = 2 * c if kind == "dynamic" else 2  # dynamic: the plane's GPUs; fixed: 2 groups of c
    cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=CAP, context_parallel=_cp(kind, c))
    plan = mp.plan(mp.Batch(lens), cfg)
    plan.validate()
    m = _micro_of(plan, 0)
    assert m.cp_size == c and m.num_tokens >= c * CAP
    assert gpu_tokens(m.num_tokens, c) == CAP
    assert plan.stats.max_micro_tokens <= CAP
    with pytest.raises(mp.PlanError, match=f"{c * CAP + 1} tokens.*= {c * CAP}"):
        mp.plan(mp.Batch([c * CAP + 1] + lens[1:]), cfg)


def _tokens(lens: list[int], parent: list[int], shared: list[int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    for L, p, k in zip(lens, parent, shared):
        head = out[p][:k] if p >= 0 else torch.zeros(0, dtype=torch.int64)
        out.append(torch.cat([head, torch.randint(0, 100, (L - k,), generator=g)]))
    return out


ROWS = {  # (lens, prefix_parent, shared_prefix_lens) whose row is exactly 2 × 64 tokens after padding
    "flat": ([128], [-1], [0]),
    "flat-padded": ([125], [-1], [0]),                      # padded to 128 by pad_to_multiple_of=8
    "tree": ([68, 68, 68, 68], [-1, 0, 0, 0], [0, 48, 48, 48]),   # a 48-token prompt, 4 × 20: 128 trie tokens
}


@pytest.mark.parametrize("kind", ["fixed", "dynamic"])
@pytest.mark.parametrize("row", sorted(ROWS))
@pytest.mark.parametrize("c", [2, 4])
def test_planner_and_shard_count_the_same_rows_at_c_times_cap(kind, row, c):
    """The row (flat or tree, padding included) is exactly c × cap: the plan keeps it whole on c
    GPUs and every member's shard has exactly cap rows — the zigzag of 2c chunks gives equal
    shares, and no member computes a row it does not own."""
    lens, parent, shared = ROWS[row]
    scale = c // 2  # 2 × 64 rows at c = 2, 4 × 64 at c = 4
    lens = [L * scale for L in lens]
    shared = [k * scale for k in shared]
    cap = 64
    tree = row == "tree"
    cfg = mp.PlanConfig(dp_size=c if kind == "dynamic" else 1, max_tokens_per_micro=cap, share_prefixes=tree,
                        context_parallel=_cp(kind, c), pad_to_multiple_of=2 * c if row == "flat-padded" else 1,
                        pad_row_to_multiple_of=2 * c if row == "flat-padded" else 1)
    batch = mp.Batch(lens, prefix_parent=parent if tree else None, shared_prefix_lens=shared if tree else None)
    plan = mp.plan(batch, cfg)
    plan.validate()
    m = _micro_of(plan, 0)
    assert m.cp_size == c and m.indices.tolist() == list(range(len(lens)))
    p = pack_micro(m, _tokens(lens, parent, shared))
    assert p.num_tokens == m.num_tokens == c * cap
    shards = [p.cp_shard(q, cp_size=c) for q in range(c)]
    for s in shards:
        s.validate()  # a shard of a row padded to a row multiple too
    assert [s.num_tokens for s in shards] == [cap] * c == [gpu_tokens(m.num_tokens, c)] * c


def test_a_grpo_tree_of_c_times_cap_stays_whole_under_fixed_cp():
    """A 12k-token prompt with 8 completions of 2,560: 32,768 trie tokens, one micro-batch on a
    group of 2 at a 16k cap."""
    lens = [12288 + 2560] * 8
    parent, shared = [-1] + [0] * 7, [0] + [12288] * 7
    cfg = mp.PlanConfig(dp_size=1, max_tokens_per_micro=CAP, share_prefixes=True,
                        context_parallel=mp.ContextParallel(size=2))
    plan = mp.plan(mp.Batch(lens, prefix_parent=parent, shared_prefix_lens=shared), cfg)
    plan.validate()
    [[m]] = plan.steps[0].micros
    assert m.num_tokens == 2 * CAP and m.indices.size == 8 and np.isfinite(plan.stats.predicted_time)
