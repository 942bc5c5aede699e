"""The CP exactness experiment of tests/test_cp_attention.py: real all-gather-KV CP on gloo ranks.

Four gloo CPU processes run a float64 transformers Llama (``register_attention()``, float64
norms: tests/_tiny_model.py). Each *case* is a plan whose micro-batches are executed by CP groups
of the processes — every member packs the micro-batch, keeps ``cp_shard(its cp_rank)``, runs
the model inside ``context_parallel(its CP group)`` and backwards its shard's loss:

- ``fixed``: flat rows, ``ContextParallel(size=c)``, dp = 4 / c (process g is CP rank g % c of
  DP group g // c);
- ``dynamic``: flat rows, ``ContextParallel(max_size=c)`` over the 4-process plane (the plan
  says each micro-batch's group and cp_rank; slots mix widths);
- ``tree``: a ``share_prefixes=True`` plan with ``ContextParallel(size=c)`` at dp = 4 / c: tree
  rows sharded over c processes by ``PackedMicro.cp_shard(q)``, each GPU's ⌈U/c⌉ rows counted by the planner;
- ``dynamic-tree``: ``share_prefixes=True`` with ``ContextParallel(max_size=c)`` over the plane
  (tree atoms in groups of mixed widths).

Per micro-batch: one forward, then one backward per loss mode (the 7 plans share the layout,
differ in weights); every backward's gathers reduce-scatter over the group. Per step the summed
gradients are all-reduced and divided as the engine does, J likewise, and compared with the
single-process per-sample reference (sdpa attention, padded batch, J from the DESIGN.md table).
"""

from __future__ import annotations

from typing import Any

import torch

import microplan as mp
from microplan.torch import context_parallel, pack_micro, pack_values, register_attention, token_logprobs, weighted_loss

from _tiny_model import Dataset, attach_old_logp, make_dataset, make_model, padded_logprobs, per_token_loss, \
    reference_objective

NORM_H = 16.0
WORLD = 4


def datasets() -> dict[str, Dataset]:
    """Flat-row data (GRPO, step-wise) and tree data (prefixes that really repeat), old log-probs attached."""
    from test_prefix_torch import _dataset
    model = make_model(3, max_positions=128)
    out = {name: make_dataset(name, seed=k) for k, name in enumerate(("grpo", "stepwise"))}
    out.update({f"tree-{k}": _dataset(k, seed=5) for k in ("grpo", "stepwise")})
    return {name: attach_old_logp(ds, model) for name, ds in out.items()}


def cases() -> list[tuple[str, int, str, str]]:
    """(row kind, c, data set, per-token loss) of every run: c = 2 and 4; flat rows under fixed and
    dynamic CP (dynamic slots mixing widths 1 and 2, and 2 and 4), tree rows sharded by hand.
    The PPO surrogate throughout (per-sample advantages and old log-probs), -A·logp on trees too."""
    out = []
    for c in (2, 4):
        out += [("fixed", c, "grpo", "ppo"), ("dynamic", c, "stepwise" if c == 2 else "grpo", "ppo")]
        out += [("tree", c, f"tree-{d}", lk) for d in ("grpo", "stepwise") for lk in ("ppo", "pg")]
        out += [("dynamic-tree", c, "tree-grpo", "ppo")]
    return out


def config(kind: str, c: int, ds: Dataset, mode: str) -> mp.PlanConfig:
    loss = mp.Loss(mode, norm_constant=NORM_H if mode == "seq-mean-token-sum-norm" else None)
    if kind == "fixed":
        return mp.PlanConfig(dp_size=WORLD // c, max_tokens_per_micro=12, loss=loss, steps=mp.Steps(prompts_per_step=3),
                             context_parallel=mp.ContextParallel(size=c))
    if kind == "dynamic":  # caps that give slots of mixed widths on this data (checked by the test)
        return mp.PlanConfig(dp_size=WORLD, max_tokens_per_micro=8 if c == 2 else 4, loss=loss,
                             steps=mp.Steps(prompts_per_step=3), context_parallel=mp.ContextParallel(max_size=c))
    if kind == "dynamic-tree":  # caps that give slots of mixed widths on the GRPO trees (checked by the test);
        # at c = 4 a K/V price, without which a split scales perfectly and every tree goes 4 wide
        cost = mp.TokenCost(cp=mp.CPCost(comm_per_token=1.0)) if c == 4 else None
        return mp.PlanConfig(dp_size=WORLD, max_tokens_per_micro=12 if c == 2 else 10, loss=loss, cost=cost,
                             share_prefixes=True, steps=mp.Steps(prompts_per_step=2),
                             context_parallel=mp.ContextParallel(max_size=c))
    return mp.PlanConfig(dp_size=WORLD // c, max_tokens_per_micro=max(ds.seq_lens) // c + 8, loss=loss,
                         share_prefixes=True, steps=mp.Steps(prompts_per_step=2),
                         context_parallel=mp.ContextParallel(size=c))


def batch(ds: Dataset, kind: str) -> mp.Batch:
    parent = shared = None
    if kind.endswith("tree"):
        parent, shared = mp.find_shared_prefixes(ds.tokens)
    return mp.Batch(ds.seq_lens, loss_tokens=ds.loss_tokens, prompt_ids=ds.prompt_ids, rollout_ids=ds.rollout_ids,
                    prefix_parent=parent, shared_prefix_lens=shared)


def plans(kind: str, c: int, ds: Dataset) -> list[mp.Plan]:
    return [mp.plan(batch(ds, kind), config(kind, c, ds, mode)) for mode in mp.LOSS_MODES]


def reference(state: dict[str, torch.Tensor], data: dict[str, Dataset]) -> dict[tuple, tuple[torch.Tensor, float]]:
    """{(data, loss kind, step samples, mode): (∇J, J)} on one process, per sample (sdpa, padded)."""
    model = make_model(3, max_positions=128)
    model.load_state_dict(state)
    params = list(model.parameters())
    refs: dict[tuple, tuple[torch.Tensor, float]] = {}
    for kind, c, name, lk in cases():
        ds = data[name]
        for samples in {tuple(s.samples.tolist()) for s in plans(kind, c, ds)[0].steps}:
            if (name, lk, samples, mp.LOSS_MODES[0]) not in refs:
                lps = padded_logprobs(model, [ds.tokens[i] for i in samples])
                losses = {i: per_token_loss(lp[ds.masks[i]], ds.old_logp[i][ds.masks[i]],
                                            torch.tensor(ds.adv[i], dtype=lp.dtype), lk) for i, lp in zip(samples, lps)}
                J = torch.stack([reference_objective(m, losses, ds, list(samples), NORM_H) for m in mp.LOSS_MODES])
                g = torch.autograd.grad(J, params, grad_outputs=torch.eye(len(J), dtype=J.dtype), is_grads_batched=True)
                flat = torch.cat([x.reshape(len(J), -1) for x in g], dim=1)
                for j, mode in enumerate(mp.LOSS_MODES):
                    refs[(name, lk, samples, mode)] = (flat[j], float(J[j].detach()))
    return refs


class Groups:
    """CP process groups by global ranks, created by every rank in the same order (new_group is collective)."""

    def __init__(self) -> None:
        import torch.distributed as dist
        self.dist, self.pgs = dist, {}
        for c in (2, 4):  # every contiguous, width-aligned group of the 4 processes
            for g in range(0, WORLD, c):
                ranks = tuple(range(g, g + c))
                self.pgs[ranks] = dist.new_group(list(ranks))

    def __getitem__(self, ranks: tuple[int, ...]) -> Any:
        return self.pgs[tuple(ranks)]


def _member(kind: str, c: int, rank: int, micro: mp.Micro) -> tuple[int, int, tuple[int, ...]]:
    """(cp size, cp rank, CP group's global ranks) of this process for ``micro``."""
    if kind.startswith("dynamic"):
        return micro.cp_size, micro.cp_rank, tuple(micro.cp_group)
    g = rank // c
    return c, rank % c, tuple(range(g * c, g * c + c))


def run_case(rank: int, model: torch.nn.Module, groups: Groups, kind: str, c: int, name: str, ds: Dataset, lk: str,
             refs: dict) -> dict[str, Any]:
    """Every step of one case on this process; returns worst relative errors per mode and what ran."""
    dist = groups.dist
    params = list(model.parameters())
    ps = plans(kind, c, ds)
    plan_rank = rank if kind.startswith("dynamic") else rank // c
    W = WORLD
    old = dict(enumerate(ds.old_logp))
    adv = {i: a for i, a in enumerate(ds.adv)}
    errs = {m: [0.0, 0.0] for m in mp.LOSS_MODES}
    ran = {"micros": 0, "sharded": 0, "widths": set(), "crossed": 0, "max_rows_over_share": 0}
    for s, step in enumerate(ps[0].steps):
        acc = torch.zeros(len(ps), sum(p.numel() for p in params), dtype=torch.float64)
        Js = torch.zeros(len(ps), dtype=torch.float64)
        for m in range(step.micro_count):
            size, q, members = _member(kind, c, rank, step.micros[plan_rank][m])
            rows = [pack_micro(p.steps[s].micros[plan_rank][m], ds.tokens, loss_masks=ds.masks) for p in ps]
            shards = [r.cp_shard(q, cp_size=size) for r in rows]
            sh = shards[0]
            sh.validate()
            ran["micros"] += 1
            ran["widths"].add(size)
            if size > 1:
                ran["sharded"] += 1
                ran["crossed"] += _crossed(rows[0], sh)
                ran["max_rows_over_share"] = max(ran["max_rows_over_share"],
                                                 sh.num_tokens - -(-rows[0].num_tokens // size))
                with context_parallel(groups[members]):
                    logits = model(**sh.model_inputs(), use_cache=False).logits
            else:
                logits = model(**sh.model_inputs(), use_cache=False).logits
            lp = sh.expand(token_logprobs(logits, sh))
            ell = per_token_loss(lp, pack_values(sh, old).to(lp.dtype), pack_values(sh, adv, dtype=lp.dtype), lk)
            for j, shard in enumerate(shards):
                L = weighted_loss(ell, shard, per_sample=True)
                g = torch.autograd.grad(L, params, retain_graph=j + 1 < len(shards), allow_unused=True)
                acc[j] += torch.cat([(x if x is not None else torch.zeros_like(p)).reshape(-1)
                                     for x, p in zip(g, params)])
                Js[j] += L.detach()
        dist.all_reduce(acc)
        dist.all_reduce(Js)
        acc /= W  # "mean" over the plan's W = every GPU of the DP x CP plane
        Js /= W
        samples = tuple(step.samples.tolist())
        for j, mode in enumerate(mp.LOSS_MODES):
            g_ref, J_ref = refs[(name, lk, samples, mode)]
            e_g = float((acc[j] - g_ref).norm() / g_ref.norm())
            e_J = abs(float(Js[j]) - J_ref) / max(abs(J_ref), 1e-300)
            errs[mode] = [max(errs[mode][0], e_g), max(errs[mode][1], e_J)]
    ran["widths"] = sorted(ran["widths"])
    return {"errors": errs, "ran": ran}


def _crossed(row: Any, shard: Any) -> int:
    """Entries the shard scores whose target token another member holds (the successor of an
    owned row across a chunk boundary, or a child segment's first token)."""
    full = dict(zip(row.sample_indices.tolist(), row.split(torch.arange(row.num_tokens))))
    held = set(shard.cp.rows.tolist())
    return sum(int(t) not in held for i, pos in zip(shard.sample_indices.tolist(), shard.cp.sample_positions)
               for t in full[i][pos[pos > 0]].tolist())


def rank_worker(rank: int, world: int, state: dict[str, torch.Tensor], data: dict[str, Dataset],
                refs: dict) -> dict[tuple, dict[str, Any]]:
    torch.set_num_threads(1)
    model = make_model(3, attn=register_attention(), max_positions=128)
    model.load_state_dict(state)
    groups = Groups()
    out = {}
    for kind, c, name, lk in cases():
        out[(kind, c, name, lk)] = run_case(rank, model, groups, kind, c, name, data[name], lk, refs)
    out["extras"] = extras(rank, model, groups)
    return out


def extras(rank: int, model: torch.nn.Module, groups: Groups) -> dict[str, Any]:
    """A placeholder over the 4 processes (members 1-3 own nothing and run one dummy row), and a
    shard of a 4-wide group run under its 2-process group (refused)."""
    plan = mp.plan(mp.Batch([3]), mp.PlanConfig(dp_size=2, max_tokens_per_micro=8))
    ph = next(m for row in plan.steps[0].micros for m in row if m.is_placeholder)
    s = pack_micro(ph, {}).cp_shard(rank, cp_size=4)
    model.zero_grad(set_to_none=True)
    with context_parallel(groups[(0, 1, 2, 3)]):
        logits = model(**s.model_inputs(), use_cache=False).logits
    loss = weighted_loss(s.expand(token_logprobs(logits, s)), s, per_sample=True)
    loss.backward()
    grad = sum(float(p.grad.norm()) for p in model.parameters() if p.grad is not None)
    try:
        with context_parallel(groups[(0, 1) if rank < 2 else (2, 3)]):
            model(**s.model_inputs(), use_cache=False)
        wrong = "no error"
    except mp.PlanError as exc:
        wrong = str(exc)
    return {"placeholder_loss": float(loss.detach()), "placeholder_grad_norm": grad, "wrong_group": wrong}
