"""Prefix trees across a context-parallel group (issue 18): planning figures and measured CPU time.

Design note. Two parts, side by side in one run.

*Planning* (``share_prefixes=True`` with fixed ``ContextParallel(size=4)`` and dynamic
``ContextParallel(max_size=4)``, under the ~7B cost alone and with bench_cp's InfiniBand CP
price, which makes splitting cost K/V traffic, so dynamic widths differ). A
step-wise family with 16k–64k-token histories (``stepwise-multiturn``, ``max_len`` 65,536,
prompts 16k–32k) at dp × cp = 8 × 4, planned under the ~7B cost model with fixed
``ContextParallel(size=4)`` and dynamic ``ContextParallel(max_size=4)``. Reported per plan:
the CP widths used,
tokens without / with sharing, K, GPUs over the cap (each GPU's owned tokens under the
``cp_shard`` cut, :func:`microplan.cp_cut.cp_loads`: all it computes), and the per-GPU attention-cost balance
inside every CP group (max / mean of Σ (position+1) over each member's tokens; worst group).

*Measured* (CPU, gloo, c = 2): one step-wise trajectory — a history of ``--history`` tokens,
then ``--turns`` turns each adding an observation and a response — packed two ways: a tree row
(``share_prefixes=True``: every shared token once) and the same samples unshared (one flat row);
each row is sharded over 2 gloo processes with ``PackedMicro.cp_shard`` and run forward +
backward (PPO-style loss) through a float32 transformers Llama with ``register_attention()`` inside
``context_parallel``. The two rows are timed interleaved, ``--repeats`` times, minimum kept;
the time of a run is the slower member's. Reported: tokens (row, per member computed (owned)),
fwd+bwd seconds, and the ratio (target ≥ 2×).

*Cut balance* (no planner change needed): the tree micro-batches of a sharing plan without CP,
cut as ``cp_shard`` cuts them for c = 2 and 4: per-member attention cost max / mean.

Run: ``python -m benchmarks.bench_tree_cp [--quick]``; writes
``benchmarks/results/tree-cp-<date>-<host>.json``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import microplan as mp  # noqa: E402
from microplan.cp_cut import cp_loads  # noqa: E402
from microplan.traces import generate  # noqa: E402

from benchmarks._results import record  # noqa: E402
from benchmarks.bench_cp import _cp  # noqa: E402
from benchmarks.metrics import dense_7b_cost  # noqa: E402

VOCAB = 512
UNAVAILABLE = "planner: share_prefixes x CP not available"
MAX_LEN = 65536  # histories up to 64k: 4 GPUs x 16,384


# -- planning -------------------------------------------------------------------------------------

def plan_rows(seeds: range, cap: int) -> list[dict]:
    """Fixed and dynamic CP plans of the long step-wise family, with and without sharing."""
    rows = []
    for seed in seeds:
        batch = generate("stepwise-multiturn", num_prompts=8, samples_per_prompt=4, max_len=MAX_LEN,
                         prompt_len=(16384, 32768), seed=seed)
        priced = replace(dense_7b_cost(), cp=_cp(4e10, overlap=0.0, efficiency=0.85))  # bench_cp's InfiniBand
        for name, cp, dp, cost in (("fixed cp 4", mp.ContextParallel(size=4), 8, dense_7b_cost()),
                                   ("dynamic cp <= 4", mp.ContextParallel(max_size=4), 32, dense_7b_cost()),
                                   ("fixed cp 4, IB", mp.ContextParallel(size=4), 8, priced),
                                   ("dynamic <= 4, IB", mp.ContextParallel(max_size=4), 32, priced)):
            cfg = dict(dp_size=dp, max_tokens_per_micro=cap, cost=cost, context_parallel=cp)
            t0 = time.perf_counter()
            try:
                shared = mp.plan(batch, mp.PlanConfig(share_prefixes=True, **cfg))
            except mp.PlanError as exc:
                if "share_prefixes" not in str(exc):
                    raise
                print(f"{UNAVAILABLE} ({name})")
                continue
            plan_s = time.perf_counter() - t0
            plain = mp.plan(batch, mp.PlanConfig(**cfg))
            rows.append(dict(seed=seed, cp=name, **_plan_figures(shared, cap), plan_s=plan_s,
                             unshared_predicted=plain.stats.predicted_time))
    return rows


def _plan_figures(plan: mp.Plan, cap: int) -> dict:
    """Tokens, K, GPUs over the cap (owned rows under the ``cp_shard`` cut, all a GPU computes:
    ``footprint.gpu_tokens``) and the worst per-GPU attention max/mean inside a CP group."""
    over, worst, groups, fullest = 0, 1.0, 0, 0
    for step in plan.steps:
        for row in step.micros:
            for m in row:
                if m.cp_rank != 0 or m.is_placeholder:
                    continue
                if m.tree is not None:
                    lens, starts = m.tree.end - m.tree.start, m.tree.start
                else:
                    lens, starts = m.seq_lens, np.zeros_like(m.seq_lens)
                loads = cp_loads(lens, starts, m.cp_size)
                held = loads.tokens
                fullest = max(fullest, int(held.max()))
                over += int((held > cap).sum())
                if m.cp_size > 1:
                    groups += 1
                    worst = max(worst, float(loads.attention.max() / loads.attention.mean()))
    widths = sorted({m.cp_size for st in plan.steps for row in st.micros for m in row})
    return dict(tokens_unshared=int(plan.stats.tokens_without_sharing), tokens=int(plan.stats.tokens_with_sharing),
                K=[s.micro_count for s in plan.steps], over_cap=over, fullest_gpu=fullest, cp_groups=groups,
                widths=widths, attn_max_over_mean=worst, predicted=plan.stats.predicted_time)


def cut_rows(seeds: range) -> list[dict]:
    """The ``cp_shard`` cut of the family's tree micro-batches (a sharing plan without CP, dp 32,
    cap 65,536: whole trees) at c = 2 and 4: per-member attention max / mean and token spread."""
    rows = []
    for seed in seeds:
        batch = generate("stepwise-multiturn", num_prompts=8, samples_per_prompt=4, max_len=65536,
                         prompt_len=(16384, 32768), seed=seed)
        plan = mp.plan(batch, mp.PlanConfig(dp_size=32, max_tokens_per_micro=65536, cost=dense_7b_cost(),
                                            share_prefixes=True))
        trees = [m.tree for st in plan.steps for row in st.micros for m in row if m.tree is not None]
        for c in (2, 4):
            loads = [cp_loads(t.end - t.start, t.start, c) for t in trees]
            rows.append(dict(seed=seed, c=c, micros=len(trees), segments_max=max(t.start.size for t in trees),
                             attn_max_over_mean=max(float(x.attention.max() / x.attention.mean()) for x in loads),
                             token_spread=max(int(x.tokens.max() - x.tokens.min()) for x in loads)))
    return rows


# -- measured on gloo -----------------------------------------------------------------------------

def trajectory(history: int, turns: int, obs: int, resp: int,
               seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Append-only turns: sample t = history + t·(obs + resp) tokens; loss on the turn's response."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, VOCAB, (history,), generator=g)
    toks, masks = [], []
    for _ in range(turns):
        seq = torch.cat([seq, torch.randint(0, VOCAB, (obs + resp,), generator=g)])
        toks.append(seq.clone())
        m = torch.zeros(seq.numel(), dtype=torch.bool)
        m[-resp:] = True
        masks.append(m)
    return toks, masks


def rows_for(toks: list[torch.Tensor], masks: list[torch.Tensor]) -> dict:
    """The tree row and the unshared flat row of the same samples (one micro-batch each)."""
    from microplan.torch import pack_micro
    parent, shared = mp.find_shared_prefixes(toks)
    lens, k = [t.numel() for t in toks], [int(m.sum()) for m in masks]
    out = {}
    for name, share in (("tree", True), ("unshared", False)):
        b = mp.Batch(lens, loss_tokens=k, prompt_ids=[0] * len(lens), rollout_ids=[0] * len(lens),
                     prefix_parent=parent if share else None, shared_prefix_lens=shared if share else None)
        plan = mp.plan(b, mp.PlanConfig(dp_size=1, max_tokens_per_micro=sum(lens), share_prefixes=share))
        micros = plan.steps[0].micros[0]
        assert len(micros) == 1
        out[name] = pack_micro(micros[0], toks, loss_masks=masks)
    return out


def _worker(rank: int, world: int, toks: list, masks: list, layers: int, hidden: int, repeats: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    import torch.distributed as dist
    from microplan.torch import context_parallel, pack_values, register_attention, token_logprobs, weighted_loss
    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                      attn_implementation=register_attention())
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().train()
    rows = rows_for(toks, masks)
    shards = {k: p.cp_shard(rank, cp_size=world) for k, p in rows.items()}
    old = {i: torch.full((t.numel(),), -6.0) for i, t in enumerate(toks)}
    adv = {i: 0.1 * (i % 3 - 1) for i in range(len(toks))}
    group = dist.group.WORLD

    def step(s) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        with context_parallel(group):
            logits = model(**s.model_inputs(), use_cache=False).logits
        lp = s.expand(token_logprobs(logits, s))
        ratio = torch.exp(lp - pack_values(s, old, dtype=lp.dtype))
        a = pack_values(s, adv, dtype=lp.dtype)
        weighted_loss(-torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a), s, per_sample=True).backward()
        model.zero_grad(set_to_none=True)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a run lasts as long as its slower member
        return float(t)

    times: dict[str, list[float]] = {k: [] for k in shards}
    step(shards["tree"])  # warm-up
    for _ in range(repeats):  # interleaved
        for k, s in shards.items():
            times[k].append(step(s))
    return {k: dict(seconds=min(v), all=v, row_tokens=rows[k].num_tokens, member_tokens=shards[k].num_tokens,
                    owned=int(shards[k].cp.own_index.numel())) for k, v in times.items()}


def measured(args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from _gloo import RankError, run_gloo
    toks, masks = trajectory(args.history, args.turns, args.obs, args.resp)
    res = run_gloo(_worker, 2, args=(toks, masks, args.layers, args.hidden, args.repeats), timeout_s=1800,
                   pg_timeout_s=600)
    for r, out in enumerate(res):
        if isinstance(out, RankError):
            raise RuntimeError(f"rank {r}: {out.type}: {out.message}\n{out.traceback}")
    rows = rows_for(toks, masks)
    owner_balance = {}
    for k, p in rows.items():
        starts = p.position_ids[p.cu_seqlens[:-1].long()].numpy()
        loads = cp_loads(np.asarray(p.seq_lens), starts, 2)
        owner_balance[k] = float(loads.attention.max() / loads.attention.mean())
    out = {k: dict(res[0][k], members=[r[k]["member_tokens"] for r in res], owned=[r[k]["owned"] for r in res],
                   attn_max_over_mean=owner_balance[k]) for k in res[0]}
    out["speedup"] = out["unshared"]["seconds"] / out["tree"]["seconds"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a shorter trajectory, 2 repeats, 1 planning seed")
    ap.add_argument("--history", type=int, default=1024)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--obs", type=int, default=64)
    ap.add_argument("--resp", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cap", type=int, default=16384)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--plan-only", action="store_true", help="planning and cut rows only (no gloo run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.history, args.turns, args.repeats = 512, 6, 2
    planning = plan_rows(range(1 if args.quick else 3), args.cap)
    if planning:
        print(f"\nplanning: stepwise-multiturn, histories 16k-64k, cap {args.cap}/GPU, 7B cost")
        print(f"{'seed':>4}  {'cp':<16} {'unshared':>10} {'shared':>9} {'ratio':>6} {'K':>10} {'widths':>9} "
              f"{'over':>5} {'fullest GPU':>11} {'attn max/mean':>13} {'predicted':>10} {'vs unshared':>11} {'plan s':>7}")
        for r in planning:
            print(f"{r['seed']:>4}  {r['cp']:<16} {r['tokens_unshared']:>10,} {r['tokens']:>9,} "
                  f"{r['tokens_unshared'] / r['tokens']:>6.2f} {str(r['K']):>10} {str(r['widths']):>9} {r['over_cap']:>5} "
                  f"{r['fullest_gpu']:>11,} {r['attn_max_over_mean']:>13.3f} "
                  f"{r['predicted']:>10.4g} {r['unshared_predicted'] / r['predicted']:>10.2f}x {r['plan_s']:>7.3f}")
    cut = cut_rows(range(1 if args.quick else 3))
    print("\ncut (cp_shard's zigzag per segment) of the family's tree micro-batches, worst over micro-batches:")
    for r in cut:
        print(f"  seed {r['seed']} c={r['c']}: {r['micros']} trees (<= {r['segments_max']} segments), attention "
              f"max/mean {r['attn_max_over_mean']:.4f}, owned tokens differ by <= {r['token_spread']}")
    if args.plan_only:
        return record("tree-cp-plan", write=not args.no_write, args=vars(args), planning=planning or UNAVAILABLE,
                      cut=cut)
    m = measured(args)
    print(f"\nmeasured: CPU gloo, c = 2, Llama {args.layers} layers hidden {args.hidden} float32, history "
          f"{args.history} + {args.turns} turns × ({args.obs} + {args.resp}), min of {args.repeats}")
    print(f"{'row':<9} {'row tokens':>10} {'per member (owned)':>22} {'attn max/mean':>13} {'fwd+bwd s':>10}")
    for k in ("unshared", "tree"):
        r = m[k]
        members = ", ".join(f"{t} ({o})" for t, o in zip(r["members"], r["owned"]))
        print(f"{k:<9} {r['row_tokens']:>10,} {members:>22} {r['attn_max_over_mean']:>13.3f} {r['seconds']:>10.3f}")
    print(f"tree row over c=2 is {m['speedup']:.2f}x faster fwd+bwd than the unshared samples over c=2 (target >= 2)")
    return record("tree-cp", write=not args.no_write, args=vars(args), planning=planning or UNAVAILABLE, cut=cut,
                  measured=m)


if __name__ == "__main__":
    main()
