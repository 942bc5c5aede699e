"""``install(share_prefixes=True)`` on verl 0.9.1's REAL engine loop, on CPU gloo ranks.

What runs is verl's own code: ``FSDPEngine.forward_backward_batch`` (its micro-batching through
``prepare_micro_batches``, the loss normaliser all-reduce, the restore), ``train_batch`` /
``infer_batch`` / ``optimizer_step``, ``FSDPEngineWithLMHead.forward_step`` with its
remove-padding ``prepare_model_inputs`` / ``prepare_model_outputs`` (which run on CPU: with
``attention_mask=None`` transformers 5 derives the packed row's block-causal mask from the
position ids, so flash-attn is not needed), verl's ``ppo_loss`` with an ``FSDPActorConfig``, and
verl's data layout (``left_right_2_no_padding``). The engine object is built without
``FSDPEngine.__init__`` / ``initialize`` (they build FSDP on CUDA: ``get_device_id()`` calls
``torch.cuda.current_device()``); its module is the tiny model in torch's DDP over gloo (the
gradient average FSDP's reduce-scatter does), and verl's device helpers are pointed at "cpu" in
the test processes (verl's platform reports "cuda" on a CPU-only torch).

Claims: on 2 ranks with uneven local batches of GRPO groups (siblings sharing prompts, some
sharing a response prefix), the log-probs and entropies of the log-prob pass and the parameter
update of one PPO step equal stock verl's within 1e-5 relative in float32, while the tree rows
compute fewer tokens.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from _require import require  # noqa: E402

verl = require("verl")
require("verl.workers.engine.fsdp.transformer_impl")  # needs peft, accelerate and datasets (the 'verl' extra)

import microplan as mp  # noqa: E402
import microplan.integrations.verl as mpv  # noqa: E402
from _gloo import RankError, run_gloo  # noqa: E402

P, R = 24, 14  # prompt / response widths of verl's left-right padded batch
TEMPERATURE = 0.7


def _groups(rank: int) -> list[tuple[int, int]]:
    """(prompt length, responses) of each GRPO group on ``rank``: uneven counts and lengths."""
    return [(20, 4), (11, 3), (16, 2)] if rank == 0 else [(23, 5), (9, 3)]


def _batch(rank: int, *, update: bool):
    """verl's actor batch for ``rank`` (left-right padded → ``left_right_2_no_padding``)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding
    g = torch.Generator().manual_seed(100 + rank)
    ids, am, resp, rmask = [], [], [], []
    for plen, n in _groups(rank):
        prompt = torch.randint(0, 32, (plen,), generator=g)
        first = None
        for j in range(n):
            rl = int(torch.randint(4, R + 1, (1,), generator=g))
            r = torch.randint(0, 32, (rl,), generator=g)
            if j == 1 and first is not None:  # a response prefix shared with its sibling
                k = min(3, rl, first.numel())
                r[:k] = first[:k]
            first = r if j == 0 else first
            row, mask = torch.zeros(P + R, dtype=torch.long), torch.zeros(P + R, dtype=torch.long)
            row[P - plen:P], row[P:P + rl], mask[P - plen:P + rl] = prompt, r, 1
            ids.append(row), am.append(mask)
            resp.append(row[P:].clone()), rmask.append((torch.arange(R) < rl).float())
    ids, am = torch.stack(ids), torch.stack(am)
    B = ids.shape[0]
    data = {"input_ids": ids, "attention_mask": am, "position_ids": (am.cumsum(1) - 1).clamp(min=0),
            "prompts": ids[:, :P].clone(), "responses": torch.stack(resp), "response_mask": torch.stack(rmask)}
    if update:
        data["old_log_probs"] = -2.0 + 0.5 * torch.randn(B, R, generator=g)
        data["advantages"] = torch.randn(B, 1, generator=g).expand(B, R).clone()
    td = left_right_2_no_padding(TensorDict(data, batch_size=[B]))
    tu.assign_non_tensor(td, use_remove_padding=True, use_dynamic_bsz=True, max_token_len_per_gpu=80,
                         temperature=TEMPERATURE, calculate_entropy=True, use_fused_kernels=False,
                         global_batch_size=10 + 8)
    return td


def _engine(model):
    """verl's FSDPEngineWithLMHead without its CUDA-only construction (module note)."""
    import verl.utils.torch_functional as verl_F
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    eng = object.__new__(FSDPEngineWithLMHead)
    eng.module = torch.nn.parallel.DistributedDataParallel(model)
    eng.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    eng.optimizer_config = types.SimpleNamespace(clip_grad=1e9)
    eng.engine_config = types.SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False,
                                              use_no_sync_for_gradient_accumulation=True)
    eng.ulysses_sequence_parallel_size, eng.use_ulysses_sp, eng.ulysses_device_mesh = 1, False, None
    eng.pad_to_length, eng.scaler, eng._autocast_dtype, eng._qat_enabled = False, None, torch.float32, False
    eng.compute_entropy_from_logits = verl_F.entropy_from_logits
    return eng


def _cpu_devices() -> None:
    """verl's device helpers report "cuda" on a CPU-only torch; point the modules the loop uses at the CPU."""
    import verl.utils.seqlen_balancing as vsb
    import verl.workers.engine.fsdp.transformer_impl as ti
    ti.get_device_id = ti.get_device_name = vsb.get_device_name = lambda: "cpu"


def _pass(share: bool | None) -> dict:
    """One log-prob pass and one PPO update on this rank; ``share=None``: stock verl (no install)."""
    from functools import partial

    from _tiny_model import make_model
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss
    if share is not None:
        mpv.install(share_prefixes=share, meter=False)
    try:
        model = make_model(7, dtype=torch.float32, max_positions=64)
        eng = _engine(model)
        before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        lp = eng.infer_batch(_batch(torch.distributed.get_rank(), update=False))["model_output"]
        cfg = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, use_dynamic_bsz=True,
                              ppo_max_token_len_per_gpu=80, rollout_n=1, entropy_coeff=0.01)
        model.train()
        out = eng.train_batch(_batch(torch.distributed.get_rank(), update=True), partial(ppo_loss, cfg))
        after = torch.cat([p.detach().flatten() for p in model.parameters()])
        counts = mpv.token_counts()
    finally:
        if share is not None:
            mpv.uninstall()
    return {"log_probs": [t.numpy().copy() for t in lp["log_probs"].unbind()],  # numpy: tensors would travel
            "entropy": [t.numpy().copy() for t in lp["entropy"].unbind()],        # as shared memory that dies
            "delta": (after - before).numpy(), "loss": out["loss"], "counts": tuple(counts)}  # with the rank


def _worker(rank: int, world: int) -> dict:
    _cpu_devices()
    return {name: _pass(share) for name, share in (("verl", None), ("unshared", False), ("shared", True))}


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def runs():
    out = run_gloo(_worker, 2, timeout_s=600)
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
        print(f"rank {rank}: tokens computed {computed} shared vs {unshared} unshared over {micros} micro-batches "
              "(log-prob + update passes)")
