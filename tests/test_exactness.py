"""Exactness with real gradients: the plan's loss_scale makes the reduced gradient ∇J, any split.

One gloo spawn per world size (1, 2, 4); each rank runs every case (2 data sets — GRPO groups and
step-wise multi-turn rollouts with variable samples per prompt — × PPO clipped surrogate and
-A·logp × layouts: static, dynamic, placeholders, trailing prompts dropped, and on even worlds
static context parallel 2 with W = dp·cp, and dynamic CP up to 2 over the W-GPU plane with
slots mixing 1- and 2-GPU groups) × all 7 loss modes
× 3 engine conventions (DDP/FSDP mean, Megatron 1/K, sum) on a tiny float64 Llama with packed
varlen forwards. The reference ∇J is computed on one process from the DESIGN.md table (see
tests/_exactness.py). The naive per-micro token mean is checked to be measurably wrong on the
same data, so these assertions can fail.
"""

from __future__ import annotations

import re

import pytest
import torch

import microplan as mp
from microplan.torch import pack_micro, token_logprobs, weighted_loss

from _exactness import (COMBOS, DATASETS, KINDS, NAIVE, WORLDS, check_model_weights_agree, layouts, make_batch,
                        make_config, one_thread, packed_vs_unpacked, rank_worker, reference_grads, setup)
from _examples import GRPO_STEP, run_example
from _gloo import RankError, run_gloo
from _tiny_model import make_model, padded_logprobs

TOL = 1e-10


@pytest.fixture(scope="module")
def experiment():
    with one_thread():
        state, data = setup()
        refs = reference_grads(state, data)
    return state, data, refs


_RESULTS: dict[int, list] = {}


def _world(experiment, world: int) -> list[dict]:
    if world not in _RESULTS:
        _RESULTS[world] = run_gloo(rank_worker, world, experiment, timeout_s=240)
    res = _RESULTS[world]
    errors = [r for r in res if isinstance(r, RankError)]
    assert not errors, errors[0].traceback
    return res


@pytest.mark.parametrize("world", WORLDS)
def test_gradient_is_exact_for_every_mode_convention_and_layout(experiment, world):
    res = _world(experiment, world)
    errs = res[0]["errors"]
    exact = {k: v for k, v in errs.items() if k[3] != NAIVE[0]}
    want = {(d, k, lay, mode, conv) for d in DATASETS for k in KINDS for lay in layouts(world) for mode, conv in COMBOS}
    assert set(exact) == want  # every case ran
    worst = max(exact, key=exact.get)
    assert exact[worst] <= TOL, f"worst relative gradient error {exact[worst]:.3e} at {worst}"
    assert all(r["errors"] == errs for r in res)  # every rank holds the same reduced gradient


@pytest.mark.parametrize("world", WORLDS)
def test_cases_include_placeholders_drops_and_several_micros(experiment, world):
    res = _world(experiment, world)
    counts = [r["counts"] for r in res]
    for case in counts[0]:
        ph = sum(c[case]["placeholders"] for c in counts)
        if case[2] == "pad":
            assert ph > 0, case  # placeholder micro-batches really ran forward/backward
        assert (counts[0][case]["dropped"] > 0) == (case[2] == "trail")
        assert counts[0][case]["steps"] >= 1
        assert counts[0][case]["cp_size"] == (2 if case[2] in ("cp2", "dcp") else 1)
        if case[2] == "dcp" and world == 4:  # dynamic CP really mixed 1- and 2-GPU groups in one slot
            assert counts[0][case]["mixed_slots"] > 0, case
    assert max(sum(c[case]["micros"] for c in counts) / counts[0][case]["steps"] for case in counts[0]) >= 4


@pytest.mark.parametrize("world", WORLDS)
def test_naive_per_micro_token_mean_is_measurably_wrong(experiment, world):
    errs = _world(experiment, world)[0]["errors"]
    naive = {k: v for k, v in errs.items() if k[3] == NAIVE[0]}
    assert len(naive) == len(DATASETS) * len(KINDS) * len(layouts(world))
    assert min(naive.values()) > 1e-3, min(naive.items(), key=lambda kv: kv[1])


def test_ranks_rebuild_the_same_model(experiment):
    assert check_model_weights_agree(experiment[0]) == 0.0


def test_ppo_data_really_clips(experiment):
    _, data, _ = experiment
    with one_thread(), torch.no_grad():
        model = make_model(0)
        model.load_state_dict(experiment[0])
        ds = data["grpo"]
        lps = padded_logprobs(model, ds.tokens)
        r = torch.cat([torch.exp(lp - old)[m] for lp, old, m in zip(lps, ds.old_logp, ds.masks)])
    clipped = float(((r < 0.8) | (r > 1.2)).double().mean())
    assert 0.1 < clipped < 0.9, clipped


@pytest.mark.parametrize("dname", DATASETS)
def test_packed_forward_equals_unpacked_forward(experiment, dname):
    state, data, _ = experiment
    with one_thread():
        good = packed_vs_unpacked(state, data[dname])
        leaky = packed_vs_unpacked(state, data[dname], restart_positions=False)
    assert good["samples"] == len(data[dname].tokens)
    assert good["logits_max_abs_diff"] <= 1e-12 and good["logprob_max_abs_diff"] <= 1e-12, good
    # positions that do not restart make HF attend across samples: the comparison can fail
    assert leaky["logprob_max_abs_diff"] > 1e-3, leaky


def test_placeholder_backward_gives_zero_gradient_on_every_parameter(experiment):
    with one_thread():
        model = make_model(0)
        p = pack_micro(mp.Micro.placeholder(), [])
        logp = token_logprobs(model(**p.model_inputs(), use_cache=False).logits, p)
        weighted_loss(-logp, p).backward()
    grads = [q.grad for q in model.parameters()]
    assert all(g is not None for g in grads)  # every parameter is in the graph: DDP/FSDP hooks fire
    assert all(float(g.abs().max()) == 0.0 for g in grads)


def test_reference_uses_every_step_of_every_layout(experiment):
    _, data, refs = experiment
    for dname, ds in data.items():
        batch = make_batch(ds)
        for w in WORLDS:
            for lay in layouts(w):
                for s in mp.plan(batch, make_config(w, lay, "token-mean", "ddp-mean")).steps:
                    assert (dname, "ppo", tuple(s.samples.tolist()), "token-mean") in refs


def test_grpo_example_runs_and_is_split_invariant():
    """examples/grpo_step.py end to end on 1 and 2 gloo ranks: same J and gradient norm per step."""
    out = run_example(GRPO_STEP, "1", "2", timeout=240)  # both world sizes, one after the other
    assert out.returncode == 0, out.stderr[-3000:]
    runs = {}
    for world, block in zip((1, 2), out.stdout.split("done in")[:2]):
        steps = re.findall(r"step (\d+): J = ([-+\d.e]+)\s+\|grad\| = ([\d.e+-]+)", block)
        assert len(steps) == 2 and "plan " in block and f"on {world} rank" in block, block
        runs[world] = [(float(j), float(g)) for _, j, g in steps]
    for (j1, g1), (j2, g2) in zip(runs[1], runs[2]):
        assert j1 == pytest.approx(j2, rel=1e-4) and g1 == pytest.approx(g2, rel=1e-4)


def test_model_is_float64_end_to_end(experiment):
    """One backward of a micro-batch's loss equals two backwards of its halves to float64 precision.

    Guards the proof itself: with transformers' stock RMSNorm (which casts to float32) this
    differs by ~3e-8, and gradient agreement would only show float32 reproducibility.
    """
    state, data, _ = experiment
    ds = data["stepwise"]
    micro = mp.plan(make_batch(ds), mp.PlanConfig(dp_size=1, micro_batch_size=3)).steps[0].micros[0][0]
    p = pack_micro(micro, ds.tokens, loss_masks=ds.masks)
    half = (torch.arange(p.num_tokens) * 2 // p.num_tokens).double()
    with one_thread():
        model = make_model(0)
        model.load_state_dict(state)
        params = list(model.parameters())

        def grad(mask: torch.Tensor) -> torch.Tensor:
            logp = token_logprobs(model(**p.model_inputs(), use_cache=False).logits, p)
            return torch.cat([g.reshape(-1) for g in torch.autograd.grad(weighted_loss(-logp * mask, p), params)])

        whole, a, b = grad(torch.ones_like(half)), grad(1 - half), grad(half)
    assert float((whole - a - b).norm() / whole.norm()) < 1e-13
