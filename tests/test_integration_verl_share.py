"""``install(share_prefixes=True)`` on verl 0.9.1's REAL FSDP engine, on CPU gloo ranks.

What runs is verl's own code end to end: ``FSDPEngineWithLMHead(model_config, engine_config,
optimizer_config, checkpoint_config).initialize()`` (verl loads the model from a local directory,
applies its monkey patches, wraps it in FSDP2 — ``fully_shard`` over a gloo device mesh — and
builds the optimizer), ``train_batch`` / ``infer_batch`` / ``forward_backward_batch`` (its
micro-batching through ``prepare_micro_batches``, the loss normaliser all-reduce, the restore),
``forward_step`` with its remove-padding ``prepare_model_inputs`` / ``prepare_model_outputs``,
``optimizer_step`` (FSDP2 grad clipping), verl's ``ppo_loss`` with an ``FSDPActorConfig`` and
verl's data layout (``left_right_2_no_padding``).

What is CUDA-only in verl 0.9.1, and how this runs without it (benchmarks/_verl_engine.py): verl
has no CPU platform (its fallback ``PlatformCUDA.current_device()`` calls
``torch.cuda.current_device()``), so a CPU platform is registered with verl's ``set_platform``;
verl's default ``flash_attention_2`` is replaced by sdpa through verl's ``override_config``.

Claims: on 2 ranks with uneven local batches of GRPO groups (siblings sharing prompts, some
sharing a response prefix), with gradient checkpointing on (the backward re-runs each layer with
the tree's attention), the log-probs and entropies of the log-prob pass and the parameter update
of one PPO step (SGD, so the update is the gradient) equal stock verl's within 1e-5 relative in
float32, while the tree rows compute fewer tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from _require import require  # noqa: E402

verl = require("verl")
require("verl.workers.engine.fsdp.transformer_impl")  # needs peft, accelerate and datasets (the 'verl' extra)

import microplan as mp  # noqa: E402
import microplan.integrations.verl as mpv  # noqa: E402
from _gloo import RankError, run_gloo  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: ``benchmarks``
from benchmarks._verl_engine import actor_engine, cpu_platform, grpo_batch, params  # noqa: E402

TEMPERATURE = 0.7


#: each rank's GRPO groups: (prompt length, response lengths); uneven counts and lengths
GROUPS = [[(20, [9, 14, 5, 11]), (11, [4, 12, 7]), (16, [13, 6])], [(23, [8, 5, 14, 10, 6]), (9, [12, 4, 9])]]
MAX_TOKEN_LEN = 80


def _batch(rank: int, *, update: bool):
    """verl's actor batch for ``rank`` (left-right padded → ``left_right_2_no_padding``)."""
    return grpo_batch(GROUPS[rank], vocab=32, seed=100 + rank, update=update, max_token_len=MAX_TOKEN_LEN,
                      temperature=TEMPERATURE, shared_response_prefix=3,
                      global_batch_size=sum(len(r) for g in GROUPS for _, r in g))


def _pass(path: str, share: bool | None) -> dict:
    """One log-prob pass and one PPO update on this rank; ``share=None``: stock verl (no install)."""
    from functools import partial

    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss
    rank = torch.distributed.get_rank()
    if share is not None:
        mpv.install(share_prefixes=share)  # the documented setup: metered, the cost from the engine's model
    try:
        eng = actor_engine(path)
        before = params(eng)
        with eng.eval_mode():
            lp = eng.infer_batch(_batch(rank, update=False))["model_output"]
        cfg = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, use_dynamic_bsz=True,
                              ppo_max_token_len_per_gpu=MAX_TOKEN_LEN, rollout_n=1, entropy_coeff=0.01)
        with eng.train_mode():
            out = eng.train_batch(_batch(rank, update=True), partial(ppo_loss, cfg))
        delta = (params(eng) - before).numpy()
        counts = mpv.token_counts()
        attention = eng.module.config._attn_implementation  # the model's own is back after each loop
        from microplan.integrations._verl_meter import STATE as METER
        records = METER["meter"].num_records if METER["meter"] is not None else -1
        tree_records = METER["tree_records"]
    finally:
        if share is not None:
            mpv.uninstall()
    return {"log_probs": [t.numpy().copy() for t in lp["log_probs"].unbind()],  # numpy: tensors would travel
            "entropy": [t.numpy().copy() for t in lp["entropy"].unbind()],        # as shared memory that dies
            "delta": delta, "loss": out["loss"], "counts": tuple(counts), "attention": attention,
            "records": records, "tree_records": tree_records}  # with the rank


def _worker(rank: int, world: int, path: str) -> dict:
    cpu_platform()
    return {name: _pass(path, share) for name, share in (("verl", None), ("unshared", False), ("shared", True))}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """The tiny float32 Llama verl loads (``from_pretrained`` of a local directory: no network)."""
    from _tiny_model import make_model
    path = str(tmp_path_factory.mktemp("tiny-llama"))
    make_model(7, dtype=torch.float32, max_positions=64).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(model_dir):
    out = run_gloo(_worker, 2, args=(model_dir,), timeout_s=600)
    assert not any(isinstance(o, RankError) for o in out), out
    return out


def test_log_probs_and_entropy_equal_verls_own_within_1e5(runs):
    """Every position verl reads (no_padding_2_padding drops each sample's last: its 'label' is the
    next row of the packed micro-batch, which depends on the split even in stock verl)."""
    for rank, run in enumerate(runs):
        ref = run["verl"]
        for name in ("unshared", "shared"):
            for key in ("log_probs", "entropy"):
                assert [t.size for t in run[name][key]] == [t.size for t in ref[key]]  # verl's layout
                last = key == "log_probs"
                got = np.concatenate([t[:-1] if last else t for t in run[name][key]])
                want = np.concatenate([t[:-1] if last else t for t in ref[key]])
                assert _rel(got, want) < 1e-5, f"rank {rank} {name} {key}: {_rel(got, want):.2e}"


def test_update_equals_verls_own_within_1e5(runs):
    for rank, run in enumerate(runs):
        ref = run["verl"]["delta"]
        assert np.linalg.norm(ref) > 0
        for name in ("unshared", "shared"):
            err = _rel(run[name]["delta"], ref)
            assert err < 1e-5, f"rank {rank} {name}: update differs by {err:.2e} relative"
    assert _rel(runs[0]["shared"]["delta"], runs[1]["shared"]["delta"]) == 0.0  # DP: one update everywhere


def test_tree_rows_compute_each_shared_prompt_once(runs):
    for rank, run in enumerate(runs):
        computed, unshared, micros = run["shared"]["counts"]
        assert micros > 0 and computed < unshared, run["shared"]["counts"]
        assert run["unshared"]["counts"] == (0, 0, 0)  # share_prefixes=False: verl's own forward
        assert {r["attention"] for r in run.values()} == {"sdpa"}
        # the meter learns from every micro-batch the update runs, tree rows (priced by their trie) included
        assert run["unshared"]["records"] > 0 and run["shared"]["records"] > 0, run
        assert run["shared"]["tree_records"] > 0, run
        print(f"rank {rank}: tokens computed {computed} shared vs {unshared} unshared over {micros} micro-batches "
              "(log-prob + update passes)")


# -- one micro-batch through verl's forward_step: the options the tree path keeps ------------------

def _micro(temperature):
    from verl.utils import tensordict_utils as tu
    td = _batch(0, update=False)
    tu.assign_non_tensor(td, calculate_sum_pi_squared=True)
    if temperature == "per-sample":  # a [bsz] tensor, as verl allows
        td["temperature"] = 0.5 + torch.rand(td.batch_size[0], generator=torch.Generator().manual_seed(3))
    else:
        tu.assign_non_tensor(td, temperature=temperature)
    return td


def _step_worker(rank: int, world: int, path: str) -> dict:
    """verl's ``forward_step`` on one micro-batch per temperature kind: verl's packed row, then the tree row."""
    from microplan.integrations import _verl_tree
    cpu_platform()
    eng = actor_engine(path)
    out = {}
    for kind in (1.0, TEMPERATURE, "per-sample"):
        with eng.eval_mode(), torch.no_grad():
            want = eng.forward_step(_micro(kind), None, forward_only=True)[1]["model_output"]
            mpv.install(share_prefixes=True, meter=False)
            try:
                got = eng.forward_step(_micro(kind), None, forward_only=True)[1]["model_output"]
                counts = mpv.token_counts()
            finally:
                mpv.uninstall()
        out[str(kind)] = {"counts": tuple(counts), "restored": _verl_tree.STATE["restore"] is None,
                          **{f"{w}/{k}": [t.numpy().copy() for t in d[k].unbind()]
                             for w, d in (("got", got), ("want", want))
                             for k in ("log_probs", "entropy", "sum_pi_squared")}}
    # one sample per group: nothing shared, so verl's own row runs (bit for bit, uncounted)
    from verl.utils import tensordict_utils as tu
    alone = lambda: tu.index_select_tensor_dict(_micro(1.0), torch.tensor([0, 4, 7]))  # noqa: E731
    firsts = {int(t[0]) for t in alone()["input_ids"].unbind()}
    with eng.eval_mode(), torch.no_grad():
        want = eng.forward_step(alone(), None, forward_only=True)[1]["model_output"]["log_probs"]
        mpv.install(share_prefixes=True, meter=False)
        try:
            got = eng.forward_step(alone(), None, forward_only=True)[1]["model_output"]["log_probs"]
            out["alone"] = {"counts": tuple(mpv.token_counts()), "firsts": len(firsts),
                            "equal": all(torch.equal(a, b) for a, b in zip(got.unbind(), want.unbind()))}
        finally:
            mpv.uninstall()
    return out


def test_forward_step_matches_verls_with_temperatures_entropy_and_sum_pi_squared(model_dir):
    """verl's ``forward_step`` on one micro-batch, tree row vs verl's packed row: log-probs (every
    position but each sample's last), entropy and Σπ² agree, for unit, scalar and per-sample
    temperatures (the tree path dedups (row, label, temperature) triples)."""
    (out,) = run_gloo(_step_worker, 1, args=(model_dir,), timeout_s=300)
    assert not isinstance(out, RankError), out
    alone = out.pop("alone")
    assert alone == {"counts": (0, 0, 0), "firsts": 3, "equal": True}, alone
    for kind, res in out.items():
        computed, unshared, micros = res["counts"]
        assert micros == 1 and computed < unshared and res["restored"], (kind, res["counts"])
        for key in ("log_probs", "entropy", "sum_pi_squared"):
            got, want = res[f"got/{key}"], res[f"want/{key}"]
            assert [t.size for t in got] == [t.size for t in want]
            cut = (lambda t: t[:-1]) if key == "log_probs" else (lambda t: t)
            x, y = np.concatenate([cut(t) for t in got]), np.concatenate([cut(t) for t in want])
            assert _rel(x, y) < 1e-5, (kind, key, _rel(x, y))


# -- what runs as a tree, and the plan behind it -------------------------------------------------------

def test_eligible_keeps_verls_forward_for_what_a_tree_row_cannot_run():
    from verl.utils import tensordict_utils as tu

    from microplan.integrations._verl_tree import eligible
    assert eligible(_batch(1, update=False))
    for key, value in (("use_fused_kernels", True), ("distillation_use_topk", True), ("sp_size", 2)):
        td = _batch(1, update=False)
        tu.assign_non_tensor(td, **{key: value})
        assert not eligible(td), key  # fused kernels score inside the model; Ulysses splits the row
    td = _batch(1, update=False)
    pos = [p + 1 for p in td["position_ids"].unbind()]  # positions not 0..L-1 (e.g. packed turns)
    td["position_ids"] = torch.nested.as_nested_tensor(pos, layout=torch.jagged)
    assert not eligible(td) and eligible(td, positions=False)


def test_install_wraps_the_lm_engine_only_and_uninstall_restores_it():
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    from microplan.integrations import _verl_tree
    names = ("forward_backward_batch", "forward_step", "prepare_model_inputs", "prepare_model_outputs")
    before = {n: FSDPEngineWithLMHead.__dict__.get(n) for n in names}
    critic = FSDPEngineWithValueHead.prepare_model_outputs
    mpv.install(share_prefixes=True, meter=False)
    try:
        assert all(FSDPEngineWithLMHead.__dict__.get(n) is not before[n] for n in names)
        assert FSDPEngineWithValueHead.prepare_model_outputs is critic  # a value head scores its own way
        assert not _verl_tree._shares(object.__new__(FSDPEngineWithValueHead), FSDPEngineWithLMHead)
        actor = object.__new__(FSDPEngineWithLMHead)
        actor.use_ulysses_sp = False
        assert _verl_tree._shares(actor, FSDPEngineWithLMHead)
        actor.use_ulysses_sp = True
        assert not _verl_tree._shares(actor, FSDPEngineWithLMHead)
        assert _verl_tree.sharing_engine() is None  # outside an engine's loop the plan does not share
    finally:
        mpv.uninstall()
    assert {n: FSDPEngineWithLMHead.__dict__.get(n) for n in names} == before


def _plan_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist
    td = _batch(rank, update=False)
    ids = td["input_ids"]
    off = ids.offsets().tolist()
    tokens = [ids.values()[a:b] for a, b in zip(off[:-1], off[1:])]
    lens = [t.numel() for t in tokens]
    flat = mpv.plan_micro_batches(lens, MAX_TOKEN_LEN, dp_group=dist.group.WORLD)
    tree = mpv.plan_micro_batches(lens, MAX_TOKEN_LEN, dp_group=dist.group.WORLD, token_ids=tokens)
    micros = tree.plan.steps[0].micros[rank]
    return {"flat": flat.index_lists, "tree": tree.index_lists, "n": len(lens),
            "unique": [int(m.num_tokens) for m in micros if not m.is_placeholder],
            "home": [bool(((m.indices - tree.offset) >= 0).all() and ((m.indices - tree.offset) < len(lens)).all())
                     for m in micros]}


def test_the_plan_caps_unique_tokens_and_keeps_samples_home_on_gloo_ranks():
    """plan_micro_batches(token_ids=...) over 2 uneven ranks: a permutation of the local samples,
    the same K everywhere, every tree under the cap in UNIQUE tokens, and fewer micro-batches than
    planning by whole samples (siblings share their prompt)."""
    out = run_gloo(_plan_worker, 2, timeout_s=240)
    assert not any(isinstance(o, RankError) for o in out), out
    assert len({len(o["tree"]) for o in out}) == 1
    for o in out:
        assert sorted(i for idx in o["tree"] for i in idx) == list(range(o["n"]))
        assert all(o["home"]) and max(o["unique"]) <= MAX_TOKEN_LEN
    assert len(out[0]["tree"]) < len(out[0]["flat"]), out


def test_token_ids_need_one_list_per_sample_and_no_groups():
    with pytest.raises(mp.PlanError, match="force_group_size=1"):
        mpv.plan_micro_batches([4, 4], 16, force_group_size=2, token_ids=[[1, 2, 3, 4], [1, 2, 3, 5]])
    with pytest.raises(mp.PlanError, match="one token list per sample"):
        mpv.plan_micro_batches([4, 4], 16, token_ids=[[1, 2, 3, 4]])


def test_a_rank_whose_rows_run_flat_plans_no_sharing():
    """A rank whose micro-batches will run verl's flat forward (e.g. position ids not 0..L-1) must
    be planned with every token counted: a tree-sized micro-batch run flat would break max_token_len."""
    toks = [[1, 2, 3, 4, 5, 6, 7, k] for k in range(8)]          # 8 samples sharing a 7-token prompt
    shared = mpv.plan_micro_batches([8] * 8, 16, token_ids=toks)
    flat = mpv.plan_micro_batches([8] * 8, 16, token_ids=toks, share_local=False)
    assert len(shared.index_lists) < len(flat.index_lists)
    assert all(len(ix) * 8 <= 16 for ix in flat.index_lists)   # each flat micro-batch within the cap
