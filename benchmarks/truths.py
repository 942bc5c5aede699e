"""Simulated machines for the cost benchmarks: truths the planner is not given, and scoring under them.

Design note. A plan is only as good as the cost model it balances, so these benchmarks never
score a plan with the model it was planned with. A *truth* is a cost model standing in for the
machine (attention slower per FLOP than the weight GEMMs, a per-micro-batch overhead, or a
dense kernel whose attention is T² of the packed row); *measured* times are the truth's
micro-batch cost times (1 + noise·N(0, 1)); a prefix-tree micro-batch (``share_prefixes``) costs
what its trie holds: linear per unique token, attention per token over its whole path (depth²).
Plans are scored by their lockstep time under the noise-free truth over the truth's own lower bound (``microplan.stats.step_lower_bound``).

Model: a Llama-2-7B-shaped dense decoder (``LLAMA2_7B``), FLOPs from ``from_hf_config``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

import microplan as mp
from microplan.stats import k_lower_bound, step_cost_grid, step_lower_bound
from microplan.traces import generate

__all__ = ["LLAMA2_7B", "flops", "truth", "measured_seconds", "score", "steps_of"]

LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000, "hidden_act": "silu"}


def flops() -> mp.FlopsCost:
    """Pure forward+backward FLOPs of the model (no kernel slowdown, no per-micro term)."""
    return mp.FlopsCost.from_hf_config(LLAMA2_7B, attention="flops", per_micro=0.0)


def truth(attention_slowdown: float, overhead: float, cap: int, *, packed: bool = False) -> mp.FlopsCost:
    """A simulated machine: attention ``attention_slowdown``x slower per FLOP than the GEMMs, a
    per-micro overhead of ``overhead`` x a cap-full micro-batch's linear compute; ``packed``: a
    dense masked kernel (all T² pairs of the packed row) instead of a varlen one."""
    f = flops()
    attn = attention_slowdown * f.quadratic
    return mp.FlopsCost(linear=f.linear, quadratic=0.0 if packed else attn,
                        packed_quadratic=2.0 * attn if packed else 0.0,
                        per_micro=overhead * f.linear * cap)


def measured_seconds(plan: mp.Plan, machine: mp.FlopsCost, noise: float, rng: np.random.Generator):
    """(micro, seconds) of every micro-batch of every rank: truth x (1 + noise·N(0,1))."""
    for step in plan.steps:
        for row in step.micros:
            for micro in row:  # a prefix-tree Micro is priced by its trie (unique tokens, depth²)
                t = machine.micro_cost(micro if micro.num_samples else [1])
                yield micro, t * max(1.0 + noise * rng.standard_normal(), 0.05)


def score(plan: mp.Plan, machine: mp.FlopsCost) -> float:
    """Σ over steps of lockstep time under ``machine`` / Σ of its lower bound (1.0 = optimal)."""
    cfg = replace(plan.config, cost=machine)
    lock = lb = 0.0
    for step in plan.steps:
        grid = step_cost_grid(plan.batch, cfg, step)
        lock += float(grid.max(axis=0).sum())
        idx = step.samples
        k_lb = k_lower_bound(cfg, int(idx.size), int(plan.batch.seq_lens[idx].sum()))
        lb += step_lower_bound(plan.batch, cfg, idx, k_lb)
    return lock / lb


def steps_of(family: str, *, max_len: int, group: int, dp: int, spg: int, count: int, seed: int,
             shared: bool = False, prompt_len: tuple[int, int] | None = None) -> list[mp.Batch]:
    """``count`` consecutive optimizer steps of whole prompts, each holding >= dp·spg samples;
    ``shared``: with the generator's prefix forest (a sample's parent is in its own prompt, so in its step)."""
    per_prompt = group * (2 if family == "stepwise-multiturn" else 1)
    prompts = (-(-dp * spg // per_prompt) + 2) * count * 2
    b = generate(family, num_prompts=prompts, samples_per_prompt=group, max_len=max_len, seed=seed,
                 prompt_len=prompt_len)
    pid = np.asarray(b.prompt_ids)
    out, start = [], 0
    for _ in range(count):
        want = min(start + dp * spg, pid.size) - 1
        cut = int(np.searchsorted(pid, pid[want], side="right"))
        sl = slice(start, cut)
        extra = {}
        if shared:
            parent = np.asarray(b.prefix_parent)[sl]
            extra = dict(prefix_parent=np.where(parent >= 0, parent - start, -1),
                         shared_prefix_lens=np.asarray(b.shared_prefix_lens)[sl])
        out.append(mp.Batch(b.seq_lens[sl], loss_tokens=b.loss_tokens[sl], prompt_ids=pid[sl],
                            rollout_ids=np.asarray(b.rollout_ids)[sl], **extra))
        start = cut
    return out
