"""Vision tokens: a second resource per micro-batch with its own cap and its own cost term.

A mixed batch (text-only samples, single images, multi-image samples and videos — a video is one
long run of patches) is planned under both caps; every micro-batch is re-checked here from the
batch, the counts are equal across ranks, and the loss weights still give J exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import microplan as mp
from microplan import PlanError
from microplan.torch import pack_micro, pack_values, weighted_loss


def _mixed(n: int, seed: int) -> mp.Batch:
    """Text (no patches), images (256–1024 patches each, 1–4 per sample) and videos (4k–8k patches)."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(["text", "image", "video"], size=n, p=[0.4, 0.45, 0.15])
    imgs = np.where(kind == "image", rng.integers(1, 5, n), np.where(kind == "video", 1, 0))
    patches = np.where(kind == "image", imgs * rng.integers(256, 1025, n),
                       np.where(kind == "video", rng.integers(4096, 8193, n), 0))
    lens = rng.integers(64, 2048, n) + patches // 4  # the merged patches are LLM tokens too
    return mp.Batch(lens, vision_tokens=patches, num_images=imgs, prompt_ids=np.arange(n) // 4)


def _check_caps(plan: mp.Plan) -> None:
    plan.validate()
    b, cfg = plan.batch, plan.config
    for step in plan.steps:
        assert len({len(r) for r in step.micros}) == 1, "unequal micro-batch counts"
        for row in step.micros:
            for m in row:
                assert int(b.seq_lens[m.indices].sum()) <= cfg.max_tokens_per_micro * m.cp_size
                v = int(b.vision_tokens[m.indices].sum())
                assert m.vision_tokens == v
                if cfg.max_vision_tokens_per_micro is not None:
                    assert v <= cfg.max_vision_tokens_per_micro, "micro-batch over the vision cap"


@pytest.mark.parametrize("layout", ["varlen", "padded"])
@pytest.mark.parametrize("dp", [1, 4, 8])
def test_mixed_batch_keeps_both_caps_and_equal_counts(layout, dp):
    b = _mixed(96, seed=dp)
    vcap = int(b.vision_tokens.max()) + 100  # the largest video fits, with little beside it
    cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=8192, max_vision_tokens_per_micro=vcap, layout=layout,
                        cost=mp.FlopsCost(linear=1.0, quadratic=1e-4, per_micro=500.0),
                        vision_cost=mp.VisionCost(linear=0.5, quadratic=2e-4), steps=mp.Steps(prompts_per_step=8))
    plan = mp.plan(b, cfg)
    _check_caps(plan)
    # the vision cap binds: without it some micro-batch would hold more patches
    loose = mp.plan(b, mp.PlanConfig(**{**_kw(cfg), "max_vision_tokens_per_micro": None}))
    loose.validate()
    assert max(m.vision_tokens for s in loose.steps for r in s.micros for m in r) > vcap
    assert plan.stats.micro_count >= plan.stats.micro_count_lower_bound


def _kw(cfg: mp.PlanConfig) -> dict:
    import dataclasses
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def test_vision_cap_raises_the_micro_count_lower_bound():
    b = mp.Batch([10] * 8, vision_tokens=[100] * 8)
    plan = mp.plan(b, mp.PlanConfig(dp_size=2, max_tokens_per_micro=1000, max_vision_tokens_per_micro=200))
    _check_caps(plan)
    assert plan.steps[0].micro_count == 2 and plan.stats.micro_count_lower_bound == 2  # 800 patches / (2 × 200)


def test_text_only_samples_cost_nothing_extra():
    lens = np.random.default_rng(0).integers(10, 500, 64)
    cfg = mp.PlanConfig(dp_size=4, max_tokens_per_micro=2048, max_vision_tokens_per_micro=100)
    a = mp.plan(mp.Batch(lens), cfg)
    b = mp.plan(mp.Batch(lens, vision_tokens=np.zeros(64, dtype=np.int64)), cfg)
    assert [[m.indices.tolist() for m in r] for r in a.steps[0].micros] == \
        [[m.indices.tolist() for m in r] for r in b.steps[0].micros]
    assert a.stats.predicted_time == b.stats.predicted_time


def test_vision_cost_counts_patches_and_patches_squared_per_image():
    vc = mp.VisionCost(linear=2.0, quadratic=0.5)
    got = vc.sample_costs(np.array([0, 100, 100]), np.array([0, 1, 4]))
    assert got.tolist() == [0.0, 200 + 0.5 * 100 ** 2, 200 + 0.5 * 100 ** 2 / 4]
    # a micro-batch's predicted cost adds its samples' vision cost to the LLM cost of its tokens
    b = mp.Batch([10, 20], vision_tokens=[100, 0])
    plan = mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=100, vision_cost=vc,
                                    cost=mp.TokenCost(per_micro=7.0)))
    assert plan.stats.predicted_time == pytest.approx(30 + 7 + 200 + 5000)
    # default: a patch costs like an LLM token of the cost model, each image one sequence
    d = mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=100,
                                 cost=mp.FlopsCost(linear=1.0, quadratic=0.01)))
    assert d.stats.predicted_time == pytest.approx((10 + 1) + (20 + 4) + (100 + 100))


def test_heavy_images_are_spread_over_ranks():
    """Four samples with big images and equal LLM tokens: balancing on tokens alone could put two
    on one rank; with the vision cost each rank gets one."""
    lens = [100] * 8
    vis = [4000, 4000, 4000, 4000, 0, 0, 0, 0]
    plan = mp.plan(mp.Batch(lens, vision_tokens=vis),
                   mp.PlanConfig(dp_size=4, max_tokens_per_micro=1000, cost=mp.TokenCost()))
    per_rank = [sum(int(np.sum(np.asarray(vis)[m.indices])) for m in r) for r in plan.steps[0].micros]
    assert per_rank == [4000] * 4


@pytest.mark.parametrize("kw, match", [
    (dict(vision_tokens=[5, -1]), "vision_tokens\\[1\\]=-1"),
    (dict(vision_tokens=[5, 0], num_images=[0, 0]), "sample 0 has vision_tokens=5 but num_images=0"),
    (dict(num_images=[1, 1]), "without vision_tokens"),
    (dict(vision_tokens=[5]), "1 entries but seq_lens has 2"),
])
def test_bad_vision_input(kw, match):
    with pytest.raises(PlanError, match=match):
        mp.Batch([3, 4], **kw)


def test_sample_over_the_vision_cap_is_refused():
    with pytest.raises(PlanError, match="sample 1 has 900 vision tokens.*max_vision_tokens_per_micro=500"):
        mp.plan(mp.Batch([3, 4], vision_tokens=[10, 900]),
                mp.PlanConfig(dp_size=1, max_tokens_per_micro=64, max_vision_tokens_per_micro=500))


def test_vision_batch_round_trips_through_json():
    b = _mixed(24, seed=3)
    plan = mp.plan(b, mp.PlanConfig(dp_size=2, max_tokens_per_micro=8192, max_vision_tokens_per_micro=12000))
    back = mp.Plan.from_json(plan.to_json())
    assert back == plan and back.batch.vision_tokens.tolist() == b.vision_tokens.tolist()
    assert [m.vision_tokens for r in back.steps[0].micros for m in r] == \
        [m.vision_tokens for r in plan.steps[0].micros for m in r]


@given(st.integers(0, 2 ** 16), st.sampled_from([1, 2, 4, 8]), st.sampled_from(["token-mean", "seq-mean-token-mean",
                                                                                  "prompt-mean"]))
def test_mixed_batch_loss_is_exact(seed, dp, mode):
    """Σ over ranks and micro-batches of weighted_loss(ℓ), ÷ W, equals J of DESIGN.md for random ℓ."""
    b = _mixed(40, seed)
    plan = mp.plan(b, mp.PlanConfig(dp_size=dp, max_tokens_per_micro=8192, max_vision_tokens_per_micro=9000,
                                    loss=mp.Loss(mode)))
    _check_caps(plan)
    g = torch.Generator().manual_seed(seed)
    ell = {i: torch.rand(int(n), dtype=torch.float64, generator=g) for i, n in enumerate(b.seq_lens.tolist())}
    toks = [torch.zeros(int(n), dtype=torch.int64) for n in b.seq_lens.tolist()]
    total = torch.zeros((), dtype=torch.float64)
    for r in range(dp):
        for micro in plan.steps[0].micros[r]:
            p = pack_micro(micro, toks)
            total = total + weighted_loss(pack_values(p, ell), p)
    n = b.loss_tokens
    per = {i: ell[i][-int(n[i]):].sum() if n[i] else torch.zeros((), dtype=torch.float64) for i in range(b.num_samples)}
    if mode == "token-mean":
        want = sum(per.values()) / n.sum()
    elif mode == "seq-mean-token-mean":
        want = sum(per[i] / n[i] for i in range(b.num_samples) if n[i]) / b.num_samples
    else:
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(b.prompt_codes.tolist()):
            groups.setdefault(p, []).append(i)
        want = sum(sum(per[i] for i in g) / sum(n[i] for i in g) for g in groups.values()) / len(groups)
    assert torch.allclose(total / dp, torch.as_tensor(want, dtype=torch.float64), rtol=1e-12, atol=0)


def _gather_worker(rank: int, world: int) -> dict:
    from microplan.torch import gather_batch
    if rank == 1:  # a text-only rank: its samples get zero patches in the global batch
        local = mp.Batch([5, 6])
    else:
        local = mp.Batch([3 + rank, 4], vision_tokens=[100 * (rank + 1), 0], num_images=[2, 0])
    b = gather_batch(local)
    return {"lens": b.seq_lens.tolist(), "vis": b.vision_tokens.tolist(), "imgs": b.num_images.tolist()}


def test_gather_batch_carries_vision_tokens():
    from _gloo import run_gloo
    res = run_gloo(_gather_worker, 3, timeout_s=60)
    assert all(r == res[0] for r in res), res
    assert res[0] == {"lens": [3, 4, 5, 6, 5, 4], "vis": [100, 0, 0, 0, 300, 0], "imgs": [2, 0, 0, 0, 2, 0]}
