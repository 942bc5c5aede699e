"""Local placement over torch.distributed (gloo, CPU): plan_distributed pins every sample to the rank
that passed it, and every rank computes the same plan as the parent does from the gathered lengths."""

from __future__ import annotations

import numpy as np
import pytest
from _gloo import RankError, run_gloo

import microplan as mp
from microplan.torch.distributed import gather_batch, plan_distributed

CFG = mp.PlanConfig(dp_size=1, max_tokens_per_micro=1024, placement="local", loss=mp.Loss("seq-mean-token-mean"))


def local_lens(rank: int, world: int) -> np.ndarray:
    """Uneven local batches: rank r holds 8 + 3r samples (rank 0 the fewest, the last rank the most)."""
    rng = np.random.default_rng(7 * rank + world)
    return rng.integers(16, 256, 8 + 3 * rank)


def _rank(rank: int, world: int) -> dict:
    import dataclasses
    cfg = dataclasses.replace(CFG, dp_size=world)
    lens = local_lens(rank, world)
    plan = plan_distributed({"seq_lens": lens}, cfg, min_micro_count=2)
    gathered = gather_batch({"seq_lens": lens}, owners=True)
    return {"fp": plan.fingerprint(), "json": plan.to_json(), "rank_of": gathered.rank_of.tolist(),
            "mine": [m.indices.tolist() for m in plan.rank(rank)[0]]}


@pytest.mark.parametrize("world", [2, 4])
def test_plan_distributed_local_pins_samples(world):
    out = run_gloo(_rank, world, timeout_s=120)
    assert not any(isinstance(o, RankError) for o in out), out
    assert len({o["fp"] for o in out}) == 1, "ranks disagree"
    plan = mp.Plan.from_json(out[0]["json"])
    plan.validate()
    counts = [local_lens(r, world).size for r in range(world)]
    offsets = np.concatenate([[0], np.cumsum(counts)])
    assert out[0]["rank_of"] == np.repeat(np.arange(world), counts).tolist()
    import dataclasses
    want = mp.plan(mp.Batch(np.concatenate([local_lens(r, world) for r in range(world)]),
                            rank_of=out[0]["rank_of"]), dataclasses.replace(CFG, dp_size=world))
    K = plan.steps[0].micro_count
    assert K >= 2 and K == want.steps[0].micro_count  # the min_micro_count hook reached the planner
    for r, o in enumerate(out):
        mine = [i for m in o["mine"] for i in m]
        assert sorted(mine) == list(range(offsets[r], offsets[r + 1])), f"rank {r} runs samples it does not hold"
        assert len(o["mine"]) == K
        assert all(o["mine"]), f"rank {r} has an empty micro-batch"
