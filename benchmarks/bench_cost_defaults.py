"""Which uncalibrated default loses least? Candidate defaults scored under a range of simulated truths.

Design note. ``FlopsCost.from_hf_config`` must pick an attention slowdown and a per-micro
overhead before anything is measured. For each candidate default (slowdown d, per-micro
overhead of p tokens of linear compute) every benchmark step (trace families x dp 8/32 x 3 seeds,
the bench_planners settings, 7B model) is planned with that candidate and scored under every
truth (attention slowdown t in 1..3, per-micro overhead 0..5 % of a cap-full micro-batch) by its
lockstep time relative to the plan made with the truth itself ("regret" = ratio − 1). A
candidate's score is its worst regret over the truths (median over steps per truth, and the
worst step). The chosen default is the one with the smallest worst-case median regret; ties go
to the smaller worst-step regret.

Run: ``python -m benchmarks.bench_cost_defaults``; writes ``benchmarks/results/cost-defaults-<date>-<host>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import microplan as mp  # noqa: E402

from benchmarks._results import save_json  # noqa: E402
from benchmarks.bench_planners import FAMILIES, SPG  # noqa: E402
from benchmarks.truths import flops, score, steps_of, truth  # noqa: E402

SLOWDOWNS = (1.0, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0)
PER_MICRO_TOKENS = (0, 128, 256, 512, 1024)
TRUTH_SLOW = (1.0, 1.5, 2.0, 2.5, 3.0)
TRUTH_OVER = (0.0, 0.01, 0.02, 0.035, 0.05)


def candidate(slow: float, tokens: int) -> mp.FlopsCost:
    f = flops()
    return mp.FlopsCost(linear=f.linear, quadratic=slow * f.quadratic, per_micro=tokens * f.linear)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    cands = [(s, p) for s in SLOWDOWNS for p in PER_MICRO_TOKENS]
    truths = [(t, o) for t in TRUTH_SLOW for o in TRUTH_OVER]
    regret = {c: {t: [] for t in truths} for c in cands}
    for fam, (max_len, cap, group) in FAMILIES.items():
        for dp in (8, 32):
            for seed in range(args.seeds):
                batch = steps_of(fam, max_len=max_len, group=group, dp=dp, spg=SPG[seed % 3], count=1, seed=seed)[0]
                machines = {t: truth(t[0], t[1], cap) for t in truths}
                best = {t: score(mp.plan(batch, mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, cost=m)), m)
                        for t, m in machines.items()}
                for c in cands:
                    plan = mp.plan(batch, mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, cost=candidate(*c)))
                    for t, m in machines.items():
                        regret[c][t].append(score(plan, m) / best[t] - 1.0)
    rows = []
    for c in cands:
        med = {t: float(np.median(v)) for t, v in regret[c].items()}
        worst = {t: float(np.max(v)) for t, v in regret[c].items()}
        rows.append(dict(slowdown=c[0], per_micro_tokens=c[1], worst_median=max(med.values()),
                         worst_step=max(worst.values()), mean_median=float(np.mean(list(med.values()))),
                         median_by_truth={f"{t[0]}x/{t[1]:.3f}": v for t, v in med.items()}))
    rows.sort(key=lambda r: (round(r["worst_median"], 5), r["worst_step"]))
    print("regret = lockstep(plan with the default, scored under a truth) / lockstep(plan with that truth) - 1")
    print(f"truths: attention {TRUTH_SLOW}x slower per FLOP x per-micro overhead {TRUTH_OVER} of a cap-full micro")
    print(f"{'slowdown':>9}{'pm tokens':>10}{'worst median':>14}{'worst step':>12}{'mean median':>13}")
    for r in rows:
        print(f"{r['slowdown']:>9.2f}{r['per_micro_tokens']:>10}{r['worst_median']:>14.4%}{r['worst_step']:>12.4%}"
              f"{r['mean_median']:>13.4%}")
    best_row = rows[0]
    print(f"least worst-case median regret: slowdown {best_row['slowdown']}, per-micro {best_row['per_micro_tokens']} tokens")
    pure = next(r for r in rows if r["slowdown"] == 1.0 and r["per_micro_tokens"] == 0)
    print(f"pure FLOPs (slowdown 1, no per-micro): worst median {pure['worst_median']:.4%}, worst step "
          f"{pure['worst_step']:.4%}")
    result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), seeds=args.seeds,
                  slowdowns=SLOWDOWNS, per_micro_tokens=PER_MICRO_TOKENS, truth_slowdowns=TRUTH_SLOW,
                  truth_overheads=TRUTH_OVER, best=best_row, rows=rows)
    if not args.no_write:
        stem = save_json("cost-defaults", result)
        print(f"wrote {stem}.json")
    return result


if __name__ == "__main__":
    main()
