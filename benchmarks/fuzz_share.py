"""Fuzz "sharing never hurts": random compositions planned with and without ``share_prefixes``.

Design note. Each case draws a batch with a random prefix forest (GRPO groups, append-only and
edited chains, branching links, members spread over owner ranks, vision tokens) and a random
composition of the options that plan with sharing (placement global/local, pad_to_multiple_of,
pad_row_to_multiple_of, static CP, dynamic CP, a vision cap, pipeline_stages, align, every
short_step, steps, loss modes, sync, a dense or hedged or CP-priced cost), plans it with
``share_prefixes=False`` and ``True``, and counts, among the cases whose unshared plan plans:

- refusals: the shared plan raises;
- more dropped: it drops more samples (``short_step="drop"``);
- slower: dropping as many, its ``predicted_time`` exceeds the unshared one's (relative 1e-9; a
  plan that drops fewer trains more samples, and is better first, as the planner ranks plans).

The guarantee (docs/prefix.md) says all three are 0. Cases whose unshared plan is refused say
nothing about sharing and are only counted. Run:

    PYTHONPATH=$PWD/src python -m benchmarks.fuzz_share --cases 3000 --seed 0

Prints the counts, per composition family, and the first failures with their inputs.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import microplan as mp  # noqa: E402

COSTS = {"token": mp.TokenCost(), "flops": mp.FlopsCost(linear=1.0, quadratic=1e-2, per_micro=4.0),
         "dense": mp.FlopsCost(linear=1.0, quadratic=0.0, packed_quadratic=1e-3, per_micro=4.0),
         "hedged": mp.FlopsCost(linear=1.0, quadratic=1e-2, per_micro=4.0, attention_rel_sd=0.2),
         "cp-priced": mp.FlopsCost(linear=1.0, quadratic=1e-2, per_micro=4.0,
                                   cp=mp.CPCost(comm_per_token=0.2, efficiency=0.9, split_overhead=2.0))}


def draw_forest(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(lens, prompt ids, prefix_parent, shared_prefix_lens) of one of the planner's forest shapes."""
    shape = rng.choice(["grpo", "append", "edited", "branching", "none"])
    top = int(rng.choice([8, 24, 64, 160]))
    lens = rng.integers(1, top + 1, n).astype(np.int64)
    parent = np.full(n, -1, dtype=np.int64)
    shared = np.zeros(n, dtype=np.int64)
    group = int(rng.integers(1, 6))
    pids = np.arange(n) // group
    for i in range(1, n):
        if shape == "grpo":
            p = i - i % group
            if p != i:
                lens[i] = lens[p] + int(rng.integers(0, top // 2 + 1))
                parent[i], shared[i] = p, int(rng.integers(1, lens[p] + 1))
        elif shape in ("append", "edited") and rng.random() < 0.9:
            p = i - 1
            if shape == "append":
                lens[i] = lens[p] + int(rng.integers(1, top // 2 + 2))
                s = int(lens[p])
            else:
                s = int(rng.integers(1, min(lens[i], lens[p]) + 1))
            parent[i], shared[i] = p, s
            pids[i] = pids[p]
        elif shape == "branching" and rng.random() < 0.8:
            p = int(rng.integers(max(0, i - 6), i))
            parent[i], shared[i] = p, int(rng.integers(1, min(lens[i], lens[p]) + 1))
    return lens, pids, parent, shared


def draw_case(rng: np.random.Generator, *, dynamic_cp: bool = True) -> tuple[mp.Batch, dict[str, Any], dict[str, Any]]:
    """(batch, PlanConfig keyword arguments without share_prefixes, the option draw for reports);
    ``dynamic_cp=False`` draws fixed CP where dynamic CP would be drawn."""
    n = int(rng.integers(1, 40))
    lens, pids, parent, shared = draw_forest(rng, n)
    dp = int(rng.integers(1, 6))
    cp = rng.choice(["none", "none", "fixed", "dynamic" if dynamic_cp else "fixed"])
    local = bool(rng.random() < 0.3) and cp != "dynamic"
    kw_b: dict[str, Any] = dict(prompt_ids=pids, prefix_parent=parent, shared_prefix_lens=shared,
                                rank_of=rng.integers(0, dp, n))
    vision = bool(rng.random() < 0.2)
    if vision:
        kw_b["vision_tokens"] = rng.integers(0, 30, n)
    batch = mp.Batch(lens, **kw_b)
    width = int(rng.choice([2, 4]))
    ctx = None if cp == "none" else \
        mp.ContextParallel(size=width) if cp == "fixed" else mp.ContextParallel(max_size=width)
    cost = str(rng.choice(list(COSTS)))
    o = dict(dp=dp, cp=str(cp), local=local, mult=int(rng.choice([1, 1, 2, 4, 8])), row=int(rng.choice([1, 1, 4, 8])),
             vcap=vision and bool(rng.random() < 0.5), pipe=int(rng.choice([1, 1, 2])),
             align=int(rng.choice([1, 1, 2])),
             short=str(rng.choice(["pad", "drop", "error"])), steps=rng.choice([0, 0, 1, 2]),
             cap=int(rng.integers(8, 300)), sync=str(rng.choice(["micro", "step"])), cost=cost,
             loss=str(rng.choice(["token-mean", "seq-mean-token-mean", "prompt-mean"])))
    kw = dict(dp_size=dp * (width if cp == "dynamic" else 1), max_tokens_per_micro=o["cap"],
              placement="local" if local else "global", pad_to_multiple_of=o["mult"], pad_row_to_multiple_of=o["row"],
              max_vision_tokens_per_micro=60 if o["vcap"] else None, pipeline_stages=o["pipe"], align=o["align"],
              short_step=o["short"], context_parallel=ctx, sync=o["sync"], cost=COSTS[cost], loss=mp.Loss(o["loss"]),
              steps=None if not o["steps"] else mp.Steps(prompts_per_step=int(o["steps"])))
    return batch, kw, o


def family(o: dict[str, Any]) -> str:
    return f"cp={o['cp']} local={o['local']} mult={o['mult']>1}"


def check(batch: mp.Batch, kw: dict[str, Any]) -> tuple[str, str]:
    """("unshared-refused" | "ok" | "refused" | "slower" | "more-dropped", detail)."""
    try:
        flat = mp.plan(batch, mp.PlanConfig(share_prefixes=False, **kw))
    except mp.PlanError:
        return "unshared-refused", ""
    try:
        tree = mp.plan(batch, mp.PlanConfig(share_prefixes=True, **kw))
    except mp.PlanError as exc:
        return "refused", str(exc)
    if tree.dropped.size > flat.dropped.size:
        return "more-dropped", f"{tree.dropped.size} > {flat.dropped.size} dropped"
    if tree.dropped.size < flat.dropped.size:   # trains more samples (short_step="drop"): better first
        return "ok", ""
    a, b = flat.stats.predicted_time, tree.stats.predicted_time
    if b > a * (1 + 1e-9) + 1e-12:
        return "slower", f"{b:.6g} > {a:.6g} ({b / a:.3f}x)"
    return "ok", ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=5, help="failures to print in full")
    ap.add_argument("--case", type=int, default=None, help="re-draw one case (as numbered in the report) and stop")
    args = ap.parse_args(argv)
    counts: Counter[str] = Counter()
    bad_by_family: Counter[str] = Counter()
    shown = 0
    for k in range(args.cases) if args.case is None else [args.case]:
        batch, kw, o = draw_case(np.random.default_rng([args.seed, k]))   # case k alone re-draws it
        verdict, detail = check(batch, kw)
        counts[verdict] += 1
        if verdict not in ("ok", "unshared-refused"):
            bad_by_family[f"{verdict}: {family(o)}"] += 1
            if shown < args.show:
                shown += 1
                print(f"case {k} (--seed {args.seed} --case {k}): {verdict}: {detail}\n  options {o}\n"
                      f"  lens {batch.seq_lens.tolist()}\n  parent {batch.prefix_parent.tolist()}\n"
                      f"  shared {batch.shared_prefix_lens.tolist()}")
    if args.case is not None:
        print(f"case {args.case}: {verdict} {detail}")
        return 0 if verdict in ("ok", "unshared-refused") else 1
    planned = args.cases - counts["unshared-refused"]
    print(f"{args.cases} compositions (seed {args.seed}), {planned} plan without sharing "
          f"({counts['unshared-refused']} refused "
          f"unshared); with share_prefixes=True: {counts['refused']} refused, {counts['slower']} predicted slower, "
          f"{counts['more-dropped']} dropping more samples")
    for key, c in sorted(bad_by_family.items()):
        print(f"  {key}: {c}")
    return 0 if planned == counts["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
