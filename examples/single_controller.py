"""Single-controller training step (Ray-style, in plain Python): the driver plans, workers run.

    python examples/single_controller.py

The driver holds every rollout (as a Ray/verl driver does after generation), builds the global
``Batch``, plans ONCE, and hands each worker only its slice: ``plan.rank(r)`` (its micro-batches,
step by step, with loss scales) plus the tensors of exactly those samples. Workers are separate
processes (a process pool stands in for Ray actors); they need no torch.distributed and never
plan. Each worker returns its summed micro-batch gradients per step; the driver averages them
(the 'mean' all-reduce a DP engine performs) and checks the result against a single-process
reference of the objective. Prints ``OK`` lines and a per-worker table; exits non-zero on error::

    OK step 0: mean of 4 worker gradients = reference ∇J (max diff 1.7e-18)
    OK step 1: mean of 4 worker gradients = reference ∇J (max diff 1.5e-18)
"""

from __future__ import annotations

import multiprocessing as mp_proc
from dataclasses import dataclass

import numpy as np
import torch

import microplan as mp
from microplan.torch.loss import token_logprobs, weighted_loss
from microplan.torch.packing import pack_micro, pack_values

VOCAB, HIDDEN, CAP, WORKERS = 64, 16, 512, 4


@dataclass(frozen=True)
class WorkOrder:
    """What the driver ships to worker ``rank``: its micro-batches and only the tensors they need."""

    rank: int
    steps: list[tuple[mp.Micro, ...]]  # plan.rank(rank)
    tokens: dict[int, torch.Tensor]   # global sample index -> token ids
    advantages: dict[int, float]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, VOCAB)).double()


def worker(order: WorkOrder) -> list[list[torch.Tensor]]:
    """Run every micro-batch of every step; return the accumulated gradient of each step."""
    torch.set_num_threads(1)
    net = make_model()  # in a real system: the actor's weights
    grads = []
    for micros in order.steps:
        net.zero_grad()
        for micro in micros:  # identical count K on every worker; placeholders weigh 0
            p = pack_micro(micro, order.tokens)
            logp = token_logprobs(net(p.input_ids), p)
            weighted_loss(-pack_values(p, order.advantages, dtype=torch.float64) * logp, p).backward()
        grads.append([q.grad.clone() for q in net.parameters()])
    return grads


def rollouts(n_prompts: int = 10, group: int = 4) -> tuple[mp.Batch, list[torch.Tensor], list[float]]:
    """The driver's rollouts: GRPO groups of ``group`` responses, long-tailed lengths."""
    g = torch.Generator().manual_seed(7)
    toks, plens, pids, adv = [], [], [], []
    for p in range(n_prompts):
        plen = int(torch.randint(8, 40, (1,), generator=g))
        rewards = torch.rand(group, generator=g)
        for j in range(group):
            resp = int(torch.empty(1).exponential_(1 / 120, generator=g).clamp(4, 460))
            toks.append(torch.randint(0, VOCAB, (plen + resp,), generator=g))
            plens.append(plen), pids.append(f"prompt-{p}")
            adv.append(float(rewards[j] - rewards.mean()))
    return mp.Batch([len(t) for t in toks], prompt_lens=plens, prompt_ids=pids), toks, adv


def reference(samples: np.ndarray, batch: mp.Batch, toks: list[torch.Tensor], adv: list[float]) -> list:
    """∇J of token-mean over one step's samples, computed one sample at a time."""
    net = make_model()
    n_tok = int(batch.loss_tokens[samples].sum())
    J = 0.0
    for i in samples.tolist():
        t, k = toks[i], int(batch.loss_tokens[i])
        lp = torch.log_softmax(net(t[:-1]), -1).gather(-1, t[1:, None]).squeeze(-1)
        J = J + (-adv[i] * lp[-k:]).sum() / n_tok
    J.backward()
    return [q.grad for q in net.parameters()]


def main() -> None:
    batch, toks, adv = rollouts()
    cfg = mp.PlanConfig(dp_size=WORKERS, max_tokens_per_micro=CAP, steps=mp.Steps(prompts_per_step=5),
                        loss=mp.Loss("token-mean"))
    plan = mp.plan(batch, cfg)  # once, on the driver
    plan.validate()
    orders, table = [], []
    for r in range(WORKERS):
        steps = plan.rank(r)
        need = sorted({int(i) for micros in steps for m in micros for i in m.indices})
        orders.append(WorkOrder(r, steps, {i: toks[i] for i in need}, {i: adv[i] for i in need}))
        ph = sum(m.is_placeholder for micros in steps for m in micros)
        top = max(m.num_tokens for micros in steps for m in micros)
        table.append(f"{r:>6}  {str([len(m) for m in steps]):>22}  {ph:>12}  {top:>16}  {len(need):>15}")
    with mp_proc.get_context("fork").Pool(WORKERS) as pool:
        results = pool.map(worker, orders)
    for s, step in enumerate(plan.steps):  # the result first: each step's gradient against the reference
        avg = [sum(res[s][k] for res in results) / WORKERS for k in range(len(results[0][s]))]
        want = reference(step.samples, batch, toks, adv)
        err = max(float((a - w).abs().max()) for a, w in zip(avg, want))
        assert err < 1e-12, f"step {s}: averaged worker gradient differs from the reference by {err}"
        print(f"OK step {s}: mean of {WORKERS} worker gradients = reference ∇J (max diff {err:.1e})")
    print(f"plan {plan.fingerprint()[:12]}: {batch.num_samples} samples, {len(plan.steps)} steps, "
          f"{batch.total_tokens} tokens, cap {CAP}/GPU")
    print("worker  micro-batches per step  placeholders  max tokens/micro  samples shipped")
    print("\n".join(table))

if __name__ == "__main__":
    main()
