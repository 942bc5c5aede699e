"""Dynamic context parallel on an SPMD trainer: a real transformers model, microplan's CP attention.

    python examples/dynamic_cp.py                    # spawns 4 gloo CPU ranks itself
    torchrun --nproc-per-node 4 examples/dynamic_cp.py

``ContextParallel(max_size=4)``: ``dp_size`` counts every GPU of the DP×CP plane, and the plan
cuts each micro slot into power-of-two CP groups (never empty) so that no GPU holds more than
``max_tokens_per_micro``, choosing the widths by predicted time. For these rollouts (24 samples
of 12-115 tokens, a cap of 160 per GPU: a group of c GPUs holds c × 160 tokens) the fastest
choice is one slot of two 2-GPU groups in step 0 and two slots of one 4-GPU group in step 1, so
three CP process groups are created, once, for the plan (another batch mixes widths within a
slot; the recipe below does not change). It prints, the errors varying
in their last digit::

    OK step 0: K=1 micro slots, CP sizes [2], 3 CP process groups, 4 sharded micro-batch runs, gradient relative error vs per-sample reference 3.4e-16
    OK step 1: K=2 micro slots, CP sizes [4], 3 CP process groups, 8 sharded micro-batch runs, gradient relative error vs per-sample reference 3.8e-16

Each rank: ``plan_distributed`` over the plane → ``exchange_samples`` (every member of a CP group
receives its micro-batch's samples) → one process group per distinct CP group, created by every
rank in the same sorted order and cached across steps (the docs/integration.md recipe) → per
micro-batch: ``pack_micro(...).cp_shard(micro.cp_rank)`` (this GPU's zigzag share of the row),
the model — a tiny Llama built from a config with ``register_attention()`` — runs inside
``context_parallel(cp_group)``, where every layer all-gathers the group's keys and values, and
the member backwards its shard's loss (the gathers' backward reduce-scatters the K/V gradients)
→ gradients averaged over the plane (W = every GPU of it) → compared with a single-process,
per-sample reference of the objective (no packing, no CP). Prints ``OK`` lines; exits non-zero
on any mismatch. float64 throughout (the norms too: transformers' RMSNorm rounds through
float32), so the check is to 1e-10; in bf16 training nothing changes but the dtype.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist

import microplan as mp
from microplan.torch import context_parallel, pack_micro, pack_values, register_attention, token_logprobs, weighted_loss
from microplan.torch.distributed import exchange_samples, local_view, plan_distributed
from spmd_fsdp_style import launch  # the same launcher
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

VOCAB, CAP, WORLD, MAX_CP = 64, 160, 4, 4


def rollouts(rank: int) -> tuple[dict, list[torch.Tensor], list[torch.Tensor]]:
    """This rank's rollouts: 2 prompts × 3 responses of 8-100 tokens; local advantages per sample."""
    g = torch.Generator().manual_seed(10 + rank)
    lens, plens, pids, toks, adv = [], [], [], [], []
    for p in range(2):
        plen = int(torch.randint(4, 16, (1,), generator=g))
        rewards = torch.rand(3, generator=g)
        for j in range(3):
            n = plen + int(torch.randint(8, 100, (1,), generator=g))
            lens.append(n), plens.append(plen), pids.append(f"r{rank}-p{p}")
            toks.append(torch.randint(0, VOCAB, (n,), generator=g))
            adv.append((rewards[j] - rewards.mean()).reshape(1).double())
    return {"seq_lens": lens, "prompt_lens": plens, "prompt_ids": pids}, toks, adv


def model() -> torch.nn.Module:
    """A 2-layer Llama with random weights, identical on every rank, float64 end to end."""
    class Float64Norm(LlamaRMSNorm):  # same math and parameters, computed in the input's dtype
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      attn_implementation=register_attention())
    torch.manual_seed(0)  # FSDP/DDP broadcast the initial weights; a seed does it here
    net = LlamaForCausalLM(cfg).double()
    for m in net.modules():
        if type(m) is LlamaRMSNorm:
            m.__class__ = Float64Norm
    return net


def cp_process_groups(plan: mp.Plan, plane: dist.ProcessGroup, cp_pgs: dict) -> dict:
    """One process group per distinct CP group of the plan (plan ranks → global ranks), cached."""
    wide = sorted({m.cp_group for st in plan.steps for row in st.micros for m in row if m.cp_size > 1})
    for g in wide:  # every rank walks the same sorted list: new_group is collective
        if g not in cp_pgs:
            cp_pgs[g] = dist.new_group([dist.get_global_rank(plane, q) for q in g])
    return cp_pgs


def train_step(net: torch.nn.Module, micros: tuple, tokens: dict, adv: dict, cp_pgs: dict,
               plane: dist.ProcessGroup) -> int:
    """One optimizer step on this GPU: its shard of each micro-batch, then the mean over the plane."""
    net.zero_grad()
    sharded = 0
    for micro in micros:
        p = pack_micro(micro, tokens).cp_shard(micro.cp_rank)  # the whole row when cp_size is 1
        if micro.cp_size > 1:  # the attention gathers keys/values over the micro-batch's CP group
            with context_parallel(cp_pgs[micro.cp_group]):
                logits = net(**p.model_inputs(), use_cache=False).logits
            sharded += 1
        else:
            logits = net(**p.model_inputs(), use_cache=False).logits
        logp = p.expand(token_logprobs(logits, p))           # this GPU's tokens, per-sample layout
        weighted_loss(-pack_values(p, adv, dtype=logp.dtype) * logp, p).backward()
    world = dist.get_world_size(plane)
    for q in net.parameters():  # FSDP/DDP: average over every GPU of the plane (W = the plane)
        if q.grad is None:
            q.grad = torch.zeros_like(q)
        dist.all_reduce(q.grad, group=plane)
        q.grad /= world
    return sharded


def reference_grad(net: torch.nn.Module, samples: np.ndarray, batch: mp.Batch, tokens: dict, adv: dict) -> list:
    """∇J for token-mean over the step's samples, one sample at a time, no packing, no CP."""
    net.zero_grad()
    n_tok = int(batch.loss_tokens[samples].sum())
    J = 0.0
    for i in samples.tolist():
        t, k = tokens[i], int(batch.loss_tokens[i])
        logits = net(input_ids=t[None, :-1], use_cache=False).logits[0]
        lp = torch.log_softmax(logits, -1).gather(-1, t[1:, None]).squeeze(-1)
        J = J + (-adv[i] * lp[-k:]).sum() / n_tok
    J.backward()
    return [q.grad.clone() if q.grad is not None else torch.zeros_like(q) for q in net.parameters()]


def run(rank: int, world: int) -> None:
    plane = dist.new_group(list(range(world)))  # the DP×CP plane: here every process
    spec, toks, adv = rollouts(rank)
    view = local_view(spec, group=plane)
    cfg = mp.PlanConfig(dp_size=world, max_tokens_per_micro=CAP, steps=mp.Steps(num_steps=2),
                        context_parallel=mp.ContextParallel(max_size=MAX_CP), loss=mp.Loss("token-mean"))
    plan = plan_distributed(view, cfg, group=plane)
    tokens = exchange_samples(plan, view, toks, group=plane)  # to every member of each CP group
    advs = {i: a[0] for i, a in exchange_samples(plan, view, adv, group=plane).items()}
    cp_pgs = cp_process_groups(plan, plane, {})
    net = model()
    all_t = {int(view.offsets[r]) + j: t for r in range(world) for j, t in enumerate(rollouts(r)[1])}
    all_a = {int(view.offsets[r]) + j: a[0] for r in range(world) for j, a in enumerate(rollouts(r)[2])}
    for s, micros in enumerate(plan.rank(dist.get_rank(plane))):
        sharded = torch.tensor([train_step(net, micros, tokens, advs, cp_pgs, plane)])
        got = [q.grad.clone() for q in net.parameters()]
        want = reference_grad(net, plan.steps[s].samples, view.batch, all_t, all_a)
        err = float(torch.cat([(g - w).reshape(-1) for g, w in zip(got, want)]).norm()
                    / torch.cat([w.reshape(-1) for w in want]).norm())
        assert err < 1e-10, f"rank {rank} step {s}: gradient differs from the reference by {err:.2e} relative"
        dist.all_reduce(sharded, group=plane)
        sizes = sorted({m.cp_size for row in plan.steps[s].micros for m in row})
        assert int(sharded) > 0, f"step {s} has no CP group wider than 1: the example would not exercise CP"
        if rank == 0:
            print(f"OK step {s}: K={plan.steps[s].micro_count} micro slots, CP sizes {sizes}, "
                  f"{len(cp_pgs)} CP process group{'s' if len(cp_pgs) != 1 else ''}, "
                  f"{int(sharded)} sharded micro-batch runs, "
                  f"gradient relative error vs per-sample reference {err:.1e}")


if __name__ == "__main__":
    launch(run, WORLD)
    sys.exit(0)
