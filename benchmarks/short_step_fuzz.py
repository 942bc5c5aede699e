"""The short_step rule over random small dynamic-CP steps: run on two trees and compare the counts.

Design note. Draws ``--cases`` random steps (2-8 GPUs, ``ContextParallel(max_size=2|4)``, a few
1-40-token samples, with or without a prefix forest, four cost models of which two price CP
with a split overhead, caps 5-100) and plans each under ``short_step`` = pad, drop and error.
It counts what the rule forbids — a placeholder under drop/error, a rank running a placeholder
before a real micro-batch, drop/error planning other micro-batches than a pad plan that needs no
placeholder, a step without a KChoice — and prints, over the pad plans, the sum of predicted
step times and a SHA-256 of every plan's micro-batches (indices, CP size and rank, loss scales,
drops; the KChoice left out), so two trees can be diffed:

    PYTHONPATH=/path/to/main/src python -m benchmarks.short_step_fuzz > main.txt
    PYTHONPATH=$PWD/src python -m benchmarks.short_step_fuzz > branch.txt && diff main.txt branch.txt

~30 s at the default 2,000 cases. Nothing is written; the output is the record.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import microplan as mp  # noqa: E402

COSTS = (mp.TokenCost(), mp.FlopsCost(linear=1.0, quadratic=0.05, per_micro=8.0),
         mp.TokenCost(cp=mp.CPCost(comm_per_token=0.1, split_overhead=2)),
         mp.TokenCost(cp=mp.CPCost(comm_per_token=0, split_overhead=2)))


def _case(rng: np.random.Generator) -> tuple[mp.Batch, dict]:
    dp = int(rng.choice([2, 4, 8]))
    cmax = int(rng.choice([c for c in (2, 4) if c <= dp]))
    n = int(rng.integers(1, 2 * dp + 1))
    lens = rng.integers(1, 6 if rng.random() < 0.5 else 40, n)
    share = bool(rng.random() < 0.5)
    kw = {}
    if share:
        parent, shared = np.full(n, -1), np.zeros(n, dtype=np.int64)
        for i in range(1, n):
            if rng.random() < 0.6:
                p = int(rng.integers(0, i))
                parent[i], shared[i] = p, int(rng.integers(1, min(lens[i], lens[p]) + 1))
                if shared[i] >= lens[i]:
                    lens[i] = shared[i] + int(rng.integers(1, 10))
        kw = dict(prefix_parent=parent.tolist(), shared_prefix_lens=shared.tolist())
    cfg = dict(dp_size=dp, max_tokens_per_micro=int(rng.integers(5, 100)), share_prefixes=share,
               context_parallel=mp.ContextParallel(max_size=cmax), cost=COSTS[int(rng.integers(0, len(COSTS)))])
    return mp.Batch(lens.tolist(), **kw), cfg


def _layout(plan: mp.Plan) -> list:
    return [plan.dropped.tolist()] + [[[(m.indices.tolist(), m.cp_size, m.cp_rank, m.loss_scale.tolist()) for m in row]
                                       for row in s.micros] for s in plan.steps]


def run(cases: int, seed: int) -> tuple[Counter, str, float]:
    rng = np.random.default_rng(seed)
    counts: Counter = Counter()
    digest = hashlib.sha256()
    total = 0.0
    for _ in range(cases):
        batch, cfg = _case(rng)
        got: dict[str, mp.Plan | str] = {}
        for ss in ("pad", "drop", "error"):
            try:
                got[ss] = mp.plan(batch, mp.PlanConfig(short_step=ss, **cfg))
            except mp.PlanError as exc:
                got[ss] = str(exc)
        for ss, p in got.items():
            if isinstance(p, str):
                continue
            for step in p.steps:
                counts["steps without a KChoice"] += step.choice is None
                counts[f"placeholders under {ss!r}"] += step.num_placeholders if ss != "pad" else 0
                counts["ranks running a placeholder before a real micro-batch"] += sum(
                    any(a.is_placeholder and not b.is_placeholder for a, b in zip(row, row[1:])) for row in step.micros)
        pad = got["pad"]
        if isinstance(pad, str):
            counts["pad refuses"] += 1
            continue
        digest.update(json.dumps(_layout(pad)).encode())
        total += pad.stats.predicted_time
        if all(s.num_placeholders == 0 for s in pad.steps):
            for ss in ("drop", "error"):
                q = got[ss]
                same = not isinstance(q, str) and _layout(q) == _layout(pad)
                counts[f"{ss!r} plans other micro-batches than a pad plan without placeholders"] += not same
    return counts, digest.hexdigest()[:16], total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    counts, digest, total = run(args.cases, args.seed)
    keys = ["placeholders under 'drop'", "placeholders under 'error'",
            "ranks running a placeholder before a real micro-batch",
            "'drop' plans other micro-batches than a pad plan without placeholders",
            "'error' plans other micro-batches than a pad plan without placeholders",
            "steps without a KChoice", "pad refuses"]
    for k in keys:
        print(f"{k:72s} {counts[k]}")
    print(f"{'pad plans: sum of predicted step times':72s} {total:.6f}")
    print(f"{'pad plans: SHA-256 of their micro-batches':72s} {digest}")


if __name__ == "__main__":
    main()
