"""microplan.torch.distributed on real gloo groups: gather, agreement, exchange, dynamic CP.

One spawn per world size (2, 4, 8) runs every check (a spawn costs ~0.3-1 s on 2 cores); each
rank returns what it saw and the parent compares ranks. Sample data is a pure function of the
global index, so every rank (and the parent) knows what each tensor must contain, bit for bit.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _examples import EXAMPLES_DIR, SELF_CHECKING, run_example
from _gloo import RankError, run_gloo

import microplan as mp
from microplan.torch.distributed import (
    exchange_outputs, exchange_samples, gather_batch, local_view, plan_distributed, routes, verify_agreement,
)

CAP = 256


# -- deterministic inputs ---------------------------------------------------------------------
def local_spec(rank: int, world: int) -> dict[str, Any]:
    """Rank r's local batch: 3..10 samples, pairs share a prompt; rank 0 uses string ids."""
    rng = np.random.default_rng(100 + rank + 17 * world)
    n = int(rng.integers(3, 11))
    lens = rng.integers(8, CAP, n)
    plens = np.minimum(lens - 1, rng.integers(1, 8, n))
    if rank == 0:
        pids = [f"p{rank}-{j // 2}" for j in range(n)]
    else:
        pids = [1000 * rank + j // 2 for j in range(n)]
    return {"seq_lens": lens, "prompt_lens": plens, "prompt_ids": pids}


def global_batch(world: int) -> mp.Batch:
    specs = [local_spec(r, world) for r in range(world)]
    cat = lambda k: np.concatenate([s[k] for s in specs])  # noqa: E731
    return mp.Batch(cat("seq_lens"), prompt_lens=cat("prompt_lens"),
                    prompt_ids=[p for s in specs for p in s["prompt_ids"]])


def sample_tensors(i: int, length: int) -> dict[str, torch.Tensor]:
    """The tensors of global sample i: int64 tokens, bfloat16 values (a NaN sometimes), bool mask."""
    g = torch.Generator().manual_seed(i)
    vals = torch.randn(length, generator=g).to(torch.bfloat16)
    if i % 5 == 0:
        vals[0] = float("nan")
    return {"tokens": torch.arange(length, dtype=torch.int64) * 7 + i, "values": vals,
            "mask": torch.arange(length) % 3 == (i % 3)}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# -- the per-rank scenario --------------------------------------------------------------------
def _exchange_round_trip(plan: mp.Plan, view: Any) -> dict[str, Any]:
    """Exchange three dtypes out and back; check contents bitwise on this rank."""
    lens = view.batch.seq_lens
    local = {k: [sample_tensors(int(i), int(lens[i]))[k] for i in view.indices] for k in ("tokens", "values", "mask")}
    need = sorted({int(i) for step in plan.rank(view.rank) for m in step for i in m.indices})
    out: dict[str, Any] = {"received": need}
    for name, tensors in local.items():
        got = exchange_samples(plan, view, tensors)
        assert sorted(got) == need, f"{name}: got {sorted(got)[:8]}..., need {need[:8]}..."
        assert all(same_bits(t, sample_tensors(i, int(lens[i]))[name]) for i, t in got.items()), name
        back = exchange_outputs(plan, view, got)
        dropped = set(plan.dropped.tolist())
        for j, i in enumerate(view.indices):
            assert (back[j] is None) if int(i) in dropped else same_bits(back[j], tensors[j]), (name, int(i))
    # outputs of another shape and dtype than the inputs: one float64 per sample
    got = exchange_samples(plan, view, local["tokens"])
    sums = {i: t.sum().reshape(1).double() for i, t in got.items()}
    back = exchange_outputs(plan, view, sums)
    out["sums_ok"] = all(b is None or b.item() == float(local["tokens"][j].sum()) for j, b in enumerate(back))
    return out


def scenario(rank: int, world: int) -> dict[str, Any]:
    spec = local_spec(rank, world)
    res: dict[str, Any] = {}
    # gather_batch: a dict (validated inside the guard), global ids incl. strings (JSON path)
    g = gather_batch(spec)
    res["batch"] = g.to_dict()
    res["batch_ok"] = g == global_batch(world)
    # local_ids: every rank numbers its prompts from 0; groups must not merge across ranks
    lb = mp.Batch(spec["seq_lens"], prompt_ids=[j // 2 for j in range(len(spec["seq_lens"]))])
    gl = gather_batch(lb, local_ids=True)
    res["local_ids_prompts"] = gl.num_prompts
    res["local_prompts"] = lb.num_prompts
    # plan_distributed + verify_agreement + exchange, two steps, short steps padded
    view = local_view(spec)
    cfg = mp.PlanConfig(dp_size=world, max_tokens_per_micro=CAP, steps=mp.Steps(num_steps=2))
    plan = plan_distributed(view, cfg)
    res["fp"] = plan.fingerprint()
    res["fp_matches_local_plan"] = res["fp"] == mp.plan(global_batch(world), cfg).fingerprint()
    res["verify"] = verify_agreement(plan)
    res["offsets"] = view.offsets.tolist()
    res["exchange"] = _exchange_round_trip(plan, view)
    cplan = plan_distributed(view, cp_config(world))  # dynamic CP over the whole plane
    res["cp_fp"] = cplan.fingerprint()
    res["cp_exchange"] = _exchange_round_trip(cplan, view)
    res["cp_collectives"] = _cp_group_collectives(cplan, view)
    return res


def _cp_group_collectives(plan: mp.Plan, view: Any) -> int:
    """The docs/integration.md recipe: one process group per distinct CP group, created by every
    rank in sorted order; then each wide micro's members all-reduce a checksum of what they got."""
    wide = sorted({m.cp_group for st in plan.steps for row in st.micros for m in row if m.cp_size > 1})
    pgs = {g: dist.new_group(list(g)) for g in wide}
    lens = view.batch.seq_lens
    got = exchange_samples(plan, view, [sample_tensors(int(i), int(lens[i]))["tokens"] for i in view.indices])
    done = 0
    for step in plan.rank(view.rank):
        for m in step:
            if m.cp_size > 1:
                t = torch.stack([got[int(i)].sum() for i in m.indices]).sum().reshape(1)
                dist.all_reduce(t, group=pgs[m.cp_group])
                want = sum(int(sample_tensors(int(i), int(lens[i]))["tokens"].sum()) for i in m.indices)
                assert int(t) == m.cp_size * want
                done += 1
    return done


def cp_config(world: int) -> mp.PlanConfig:
    """Dynamic CP: half the cap, so samples over CAP/2 tokens need CP groups of 2 (or 4)."""
    return mp.PlanConfig(dp_size=world, max_tokens_per_micro=CAP // 2,
                         context_parallel=mp.ContextParallel(max_size=min(world, 4)))


@pytest.fixture(scope="module", params=[2, 4, 8])
def world_results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    world = request.param
    results = run_gloo(scenario, world, timeout_s=90)
    errors = [r for r in results if isinstance(r, RankError)]
    assert not errors, errors[0].traceback
    return world, results


# -- assertions -------------------------------------------------------------------------------
def test_gather_batch_identical_and_in_rank_order(world_results: Any) -> None:
    world, res = world_results
    assert all(r["batch_ok"] for r in res)
    assert all(r["batch"] == res[0]["batch"] for r in res)
    counts = [len(local_spec(r, world)["seq_lens"]) for r in range(world)]
    assert res[0]["offsets"] == np.concatenate([[0], np.cumsum(counts)]).tolist()


def test_local_ids_keep_ranks_groups_apart(world_results: Any) -> None:
    _, res = world_results
    assert res[0]["local_ids_prompts"] == sum(r["local_prompts"] for r in res)


def test_plans_identical_on_all_ranks(world_results: Any) -> None:
    _, res = world_results
    assert len({r["fp"] for r in res}) == 1
    assert all(r["fp_matches_local_plan"] and r["verify"] == r["fp"] for r in res)


def test_exchange_delivers_every_sample_once_and_back(world_results: Any) -> None:
    world, res = world_results
    plan = mp.plan(global_batch(world), mp.PlanConfig(dp_size=world, max_tokens_per_micro=CAP,
                                                        steps=mp.Steps(num_steps=2)))
    received = [r["exchange"]["received"] for r in res]
    flat = sorted(i for rec in received for i in rec)
    assert flat == sorted(set(range(plan.batch.num_samples)) - set(plan.dropped.tolist()))  # each exactly once
    assert all(r["exchange"]["sums_ok"] for r in res)


def test_dynamic_cp_groups_receive_their_micro(world_results: Any) -> None:
    world, res = world_results
    assert len({r["cp_fp"] for r in res}) == 1
    plan = mp.plan(global_batch(world), cp_config(world))
    assert plan.fingerprint() == res[0]["cp_fp"]
    received = [set(r["cp_exchange"]["received"]) for r in res]
    wide = 0
    for step in plan.steps:
        for r, row in enumerate(step.micros):
            for m in row:
                assert m.num_tokens <= m.cp_size * CAP // 2  # the per-GPU cap holds
                assert len(m.cp_group) == m.cp_size and r in m.cp_group
                if m.cp_size > 1:
                    wide += 1
                    assert not m.is_placeholder, "empty CP group"
                for member in m.cp_group:
                    assert set(m.indices.tolist()) <= received[member]
    assert wide > 0, "the batch should exercise CP groups wider than 1"
    assert sum(r["cp_collectives"] for r in res) == wide  # every member ran its group's all-reduce


def test_routes_need_matching_dp_size() -> None:
    b = mp.Batch([5, 6, 7])
    plan = mp.plan(b, mp.PlanConfig(dp_size=2, max_tokens_per_micro=10))
    from microplan.torch.distributed import LocalView
    with pytest.raises(mp.PlanError, match="dp_size=2 but the group has 3 ranks"):
        routes(plan, LocalView(b, 0, (1, 1, 1)))
    rt = routes(plan, LocalView(b, 0, (2, 1)))  # rank 0 holds samples 0, 1; rank 1 holds 2
    assert sorted(np.concatenate(rt.needs).tolist()) == [0, 1, 2]
    for d in range(2):  # what d receives from all sources is exactly what d runs
        assert np.concatenate([rt.send(s, d) for s in range(2)]).tolist() == rt.needs[d].tolist()
    assert sorted(np.concatenate([rt.owned(r) for r in range(2)]).tolist()) == [0, 1, 2]


@pytest.mark.parametrize("script", SELF_CHECKING)
def test_examples_run_and_check_themselves(script: str) -> None:
    out = run_example(script, timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OK step 0" in out.stdout and "OK step 1" in out.stdout, out.stdout
    # the docstring quotes the run's OK lines as printed (float errors and fingerprints masked: they
    # vary in their last digits; a different K, CP size or count is a docstring to update)
    doc = ast.get_docstring(ast.parse((EXAMPLES_DIR / script).read_text())) or ""
    mask = lambda text: re.sub(r"\b[0-9a-f]{12}\b", "<fp>", re.sub(r"\d\.\de-\d+", "<err>", text))  # noqa: E731
    quoted = [line.strip() for line in mask(doc).splitlines() if line.strip().startswith("OK ")]
    printed = [line.strip() for line in mask(out.stdout).splitlines() if line.startswith("OK ")]
    assert quoted == printed, (quoted, printed)


def test_helpers_refuse_without_an_initialised_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(mp.PlanError, match="init_process_group"):
        gather_batch(mp.Batch([3, 4]))
    with pytest.raises(mp.PlanError, match="init_process_group"):
        plan_distributed(mp.Batch([3, 4]), mp.PlanConfig(dp_size=1, max_tokens_per_micro=8))
