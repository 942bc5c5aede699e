"""The exactness experiment shared by tests/test_exactness.py and benchmarks/bench_exactness.py.

For each world size W (one gloo spawn), every rank loops over cases = data set × per-token loss
(PPO clipped surrogate, -A·logp) × batching layout (static CP 2 included on even worlds: gloo
rank g is CP rank g % 2 of DP group g // 2 and backwards the loss of its half of the tokens; the
full forward stands in for ring attention), and within a case over all 7 loss modes × 3
engine conventions at once: the plan's layout does not depend on the loss, so one packed forward
per micro-batch serves the 21 (mode, convention) losses, each ``weighted_loss(ℓ, pack_micro(...))``
with its own plan's weights (÷K where the engine divides by the micro count), and one batched
backward (``is_grads_batched``; identical to 21 separate backwards) gives their gradients. A 22nd
row is the naive per-micro token mean frameworks shipped. Per step, the accumulated gradients
are all-reduced (SUM, then ÷W for "mean" as DDP/FSDP do) and compared with the reference ∇J
computed in the parent from the DESIGN.md table on one process.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import torch

import microplan as mp
from microplan.torch import pack_micro, pack_values, token_logprobs, weighted_loss

from _tiny_model import (Dataset, attach_old_logp, make_dataset, make_model, padded_logprobs,
                         per_token_loss, reference_objective)

NORM_H = 16.0
WORLDS = (1, 2, 4)
DATASETS = ("grpo", "stepwise")
KINDS = ("ppo", "pg")
CONVENTIONS: dict[str, dict[str, Any]] = {
    "ddp-mean": {},                                                   # DDP / FSDP: average over W ranks
    "megatron-1/K": {"engine_divides_by_micro_count": True},          # engine divides each micro loss by K
    "sum": {"grad_reduction": "sum"},                                 # gradients summed over ranks
}
COMBOS = [(mode, conv) for mode in mp.LOSS_MODES for conv in CONVENTIONS]
NAIVE = ("naive-token-mean", "ddp-mean")  # extra row: each micro's token mean, ÷K, mean over ranks


def layouts(world: int) -> dict[str, dict[str, Any]]:
    """Batching layouts: static, dynamic, placeholder-forcing, trailing prompts dropped, and (even
    worlds) static context parallel of degree 2: W/2 DP groups of 2 CP ranks, W = dp·cp."""
    out = {
        "static": dict(micro_batch_size=2, steps=mp.Steps(prompts_per_step=3)),
        "dynamic": dict(max_tokens_per_micro=32, steps=mp.Steps(prompts_per_step=3)),
        "pad": dict(max_tokens_per_micro=24, steps=mp.Steps(prompts_per_step=1), align=max(1, 4 // world)),
        "trail": dict(max_tokens_per_micro=16, steps=mp.Steps(prompts_per_step=4), align=2, sync="step"),
    }
    if world % 2 == 0:
        out["cp2"] = dict(max_tokens_per_micro=16, steps=mp.Steps(prompts_per_step=3),
                          context_parallel=mp.ContextParallel(size=2))
        # dynamic CP over the W-GPU plane: a cap of 8 tokens per GPU gives slots mixing 1- and
        # 2-GPU groups (and placeholders), one prompt per step
        out["dcp"] = dict(max_tokens_per_micro=8, steps=mp.Steps(prompts_per_step=1),
                          context_parallel=mp.ContextParallel(max_size=2))
    return out


def cp_degree(world: int, layout: str) -> int:
    """Static CP degree (1 for dynamic CP: its plan has one row per GPU of the plane)."""
    cp = layouts(world)[layout].get("context_parallel")
    return cp.size if cp is not None and cp.size is not None else 1


def make_batch(ds: Dataset) -> mp.Batch:
    return mp.Batch(ds.seq_lens, loss_tokens=ds.loss_tokens, prompt_ids=ds.prompt_ids, rollout_ids=ds.rollout_ids)


def make_config(world: int, layout: str, mode: str, conv: str) -> mp.PlanConfig:
    h = NORM_H if mode == "seq-mean-token-sum-norm" else None
    return mp.PlanConfig(dp_size=world // cp_degree(world, layout),
                         loss=mp.Loss(mode, norm_constant=h, **CONVENTIONS[conv]),
                         **layouts(world)[layout])


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Tiny float64 models are 20× slower with intra-op threads on a shared 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def setup() -> tuple[dict[str, torch.Tensor], dict[str, Dataset]]:
    """The model's weights and the data sets (with old log-probs from the same model)."""
    model = make_model(0)
    data = {name: attach_old_logp(make_dataset(name, seed=k), model) for k, name in enumerate(DATASETS)}
    return {k: v.clone() for k, v in model.state_dict().items()}, data


def reference_grads(state: dict[str, torch.Tensor], data: dict[str, Dataset]) -> dict[tuple, torch.Tensor]:
    """{(data, kind, step samples, mode): ∇J} for every step any world size / layout will run."""
    model = make_model(0)
    model.load_state_dict(state)
    params = list(model.parameters())
    refs: dict[tuple, torch.Tensor] = {}
    for dname, ds in data.items():
        sets = {tuple(s.samples.tolist()) for w in WORLDS for lay in layouts(w)
                for s in mp.plan(make_batch(ds), make_config(w, lay, "token-sum", "ddp-mean")).steps}
        for kind in KINDS:
            for samples in sorted(sets):
                lps = padded_logprobs(model, [ds.tokens[i] for i in samples])
                losses = {i: per_token_loss(lp[ds.masks[i]], ds.old_logp[i][ds.masks[i]],
                                            torch.tensor(ds.adv[i], dtype=lp.dtype), kind)
                          for i, lp in zip(samples, lps)}
                J = torch.stack([reference_objective(m, losses, ds, list(samples), NORM_H) for m in mp.LOSS_MODES])
                g = torch.autograd.grad(J, params, grad_outputs=torch.eye(len(J), dtype=J.dtype), is_grads_batched=True)
                flat = torch.cat([x.reshape(len(J), -1) for x in g], dim=1)
                for j, mode in enumerate(mp.LOSS_MODES):
                    refs[(dname, kind, samples, mode)] = flat[j]
    return refs


def _same_layout(plans: list[mp.Plan]) -> None:
    base = plans[0]
    for p in plans[1:]:
        for sa, sb in zip(base.steps, p.steps):
            if sa.micro_count != sb.micro_count or any(
                    not (ma.indices.tolist() == mb.indices.tolist())
                    for ra, rb in zip(sa.micros, sb.micros) for ma, mb in zip(ra, rb)):
                raise AssertionError(f"plan layout depends on the loss config ({p.config.loss}); "
                                     "the shared-forward experiment assumes it does not")


def _run_case(rank: int, world: int, model: torch.nn.Module, ds: Dataset, kind: str, layout: str,
              refs: dict[tuple, torch.Tensor], dname: str) -> tuple[dict[tuple, float], dict[str, int]]:
    import torch.distributed as dist
    params = list(model.parameters())
    batch = make_batch(ds)
    plans = [mp.plan(batch, make_config(world, layout, mode, conv)) for mode, conv in COMBOS]
    _same_layout(plans)
    rows = len(COMBOS) + 1
    cp = cp_degree(world, layout)
    plan_rank, cp_rank = divmod(rank, cp)  # gloo rank → (DP group = plan rank, position in its CP group)
    mean_rows = torch.tensor([CONVENTIONS[c].get("grad_reduction", "mean") == "mean" for _, c in COMBOS] + [True])
    errs: dict[tuple, float] = {}
    counts = {"micros": 0, "placeholders": 0, "steps": 0, "dropped": int(plans[0].dropped.size), "cp_size": 1,
              "mixed_slots": 0}
    for s, step in enumerate(plans[0].steps):
        K = step.micro_count
        acc = torch.zeros(rows, sum(p.numel() for p in params), dtype=torch.float64)
        for m in range(K):
            micro = step.micros[plan_rank][m]
            packs = [pack_micro(p.steps[s].micros[plan_rank][m], ds.tokens, loss_masks=ds.masks) for p in plans]
            p0 = packs[0]
            counts["micros"] += 1
            counts["placeholders"] += p0.is_placeholder
            counts["cp_size"] = max(counts["cp_size"], p0.cp_size)
            counts["mixed_slots"] += len({row[m].cp_size for row in step.micros}) > 1
            logp = token_logprobs(model(**p0.model_inputs(), attention_mask=None, use_cache=False).logits, p0)
            ell = per_token_loss(logp, pack_values(p0, ds.old_logp), pack_values(p0, ds.adv), kind)
            # static CP: the gloo rank's place in its DP group; dynamic CP: the micro says
            c, q = (cp, cp_rank) if cp > 1 else (micro.cp_size, micro.cp_rank)
            if c > 1:  # CP: this rank holds (and backwards the loss of) one contiguous chunk of the tokens;
                # the full forward stands in for ring attention, whose backward also reaches all K/V
                T = p0.num_tokens
                ell = ell * ((torch.arange(T) * c // T) == q).to(ell.dtype)
            losses = [weighted_loss(ell, pk) / (K if CONVENTIONS[conv].get("engine_divides_by_micro_count") else 1)
                      for pk, (_, conv) in zip(packs, COMBOS)]
            naive = (ell * p0.loss_mask).sum() / p0.loss_mask.sum().clamp(min=1) / K
            L = torch.stack(losses + [naive])
            g = torch.autograd.grad(L, params, grad_outputs=torch.eye(rows, dtype=L.dtype), is_grads_batched=True)
            acc += torch.cat([x.reshape(rows, -1) for x in g], dim=1)
        dist.all_reduce(acc)                       # gradient reduction over the W ranks (SUM) ...
        acc[mean_rows] /= world                    # ... then ÷W where the engine averages
        samples = tuple(step.samples.tolist())
        counts["steps"] += 1
        for (mode, conv), row in zip(COMBOS + [NAIVE], acc):
            ref = refs[(dname, kind, samples, "token-mean" if mode == NAIVE[0] else mode)]
            err = float((row - ref).norm() / ref.norm())
            key = (dname, kind, layout, mode, conv)
            errs[key] = max(errs.get(key, 0.0), err)
    return errs, counts


def rank_worker(rank: int, world: int, state: dict[str, torch.Tensor], data: dict[str, Dataset],
                refs: dict[tuple, torch.Tensor]) -> dict[str, Any]:
    """Runs on each gloo rank: every case, every step; returns worst errors and what ran."""
    t0 = time.perf_counter()
    model = make_model(0)
    model.load_state_dict(state)
    errs: dict[tuple, float] = {}
    counts: dict[tuple, dict[str, int]] = {}
    for dname, ds in data.items():
        for kind in KINDS:
            for layout in layouts(world):
                e, c = _run_case(rank, world, model, ds, kind, layout, refs, dname)
                errs.update(e)
                counts[(dname, kind, layout)] = c
    return {"errors": errs, "counts": counts, "seconds": time.perf_counter() - t0}


def check_model_weights_agree(state: dict[str, torch.Tensor]) -> float:
    """Max |Δ| between ``make_model(0)`` rebuilt here and ``state`` (0.0: ranks rebuild the same model)."""
    m = make_model(0)
    return max(float((v - state[k]).abs().max()) for k, v in m.state_dict().items())


def packed_vs_unpacked(state: dict[str, torch.Tensor], ds: Dataset, *,
                       restart_positions: bool = True) -> dict[str, float]:
    """Max |Δ| of logits and per-sample log-probs: one packed forward vs one forward per sample."""
    model = make_model(0)
    model.load_state_dict(state)
    batch = make_batch(ds)
    micro = mp.plan(batch, mp.PlanConfig(dp_size=1, micro_batch_size=len(ds.tokens))).steps[0].micros[0][0]
    pk = pack_micro(micro, ds.tokens, loss_masks=ds.masks)
    pos = pk.position_ids if restart_positions else torch.arange(pk.num_tokens)
    with torch.no_grad():
        logits = model(input_ids=pk.input_ids[None], position_ids=pos[None], attention_mask=None,
                       use_cache=False).logits[0]
        lp = token_logprobs(logits, pk)
        d_logit = d_lp = 0.0
        for i, lg_i, lp_i in zip(pk.sample_indices.tolist(), pk.split(logits), pk.split(lp)):
            ref_logits = model(input_ids=ds.tokens[i][None], use_cache=False).logits[0]
            ref_lp = padded_logprobs(model, [ds.tokens[i]])[0]
            d_logit = max(d_logit, float((lg_i - ref_logits).abs().max()))
            d_lp = max(d_lp, float((lp_i - ref_lp).abs().max()))
    return {"logits_max_abs_diff": d_logit, "logprob_max_abs_diff": d_lp, "tokens": pk.num_tokens,
            "samples": pk.num_samples}
