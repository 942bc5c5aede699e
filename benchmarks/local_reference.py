"""An expensive reference search for local placement: how far is microplan's plan from the best?

Design note. ``placement="local"`` keeps every sample on its rank; the step's lockstep time is
Σ_m max_r s_r(m), s_r rank r's micro-batch costs heaviest first. ``stats.split_lower_bound``
bounds it from below; this script bounds the *optimum* from above by searching hard, off the plan
path, on bench_planners' cases (same generator, split and seeds):

1. start from microplan's own packing at each K in [K_split, K_plan + 1] (``local._pack`` and
   ``_polish`` at that K);
2. anneal every rank's packing jointly (moves of one sample to another of its rank's bins, swaps
   of two samples; the token cap kept, no bin emptied) on a smooth surrogate of the lockstep time,
   Σ_m LSE_β over ranks of s_r(m), β raised over the run, the true lockstep time of every state
   visited tracked, proposals drawn from the ranks that weigh in the surrogate;
3. finish with ``local_refine.polish_local`` (unbounded change budget) on the best state.

Prints, per case, lockstep / split bound of the plan and of the best state found per K, and the
plan's lockstep over the best found; writes ``results/local-reference-<date>-<host>.json``.
Measured (2026-11-26, bimodal dp 128, verl's split): from the packing of the planner before its
repair step (``--no-repair --seeds 0 --seconds 20``), 1.0002 at K = 3 and 1.0041 at K = 4 (the
plan: 1.0159 at K = 4); from the current packing (``--seconds 30``), seeds 0/1/3/4, the plan (1.0007/1.0005/1.0008/1.0005) is within
0.04% of the best found — see benchmarks/README.md, "Local placement".

Run: ``python -m benchmarks.local_reference [--family bimodal] [--dp 128] [--seeds 0 1 3 4]
[--seconds 30]`` (~1 CPU minute per K and seed).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import microplan as mp  # noqa: E402
from microplan.stages.fit import effective_cap  # noqa: E402
from microplan.stages import local  # noqa: E402
from microplan.stages.local import _pack, _polish, _Ranks  # noqa: E402
from microplan.stages.local_refine import RankBins, polish_local  # noqa: E402

from benchmarks._results import record  # noqa: E402
from benchmarks.bench_planners import FAMILIES, SPG, make_step, verl_split_owners  # noqa: E402
from benchmarks.metrics import dense_7b_cost  # noqa: E402


class Case:
    """One bench_planners case under local placement (verl's split) and its per-rank items."""

    def __init__(self, family: str, dp: int, seed: int) -> None:
        self.family, self.dp, self.seed = family, dp, seed
        self.cost = dense_7b_cost()
        self.cap = FAMILIES[family][1]
        self.batch = make_step(family, dp, SPG[seed % len(SPG)], seed)
        self.owner = verl_split_owners(self.batch.seq_lens, dp)
        self.cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=self.cap, cost=self.cost, placement="local")
        self.lens = np.asarray(self.batch.seq_lens, dtype=np.int64)
        self.costs = self.cost.sample_costs(self.lens.astype(np.float64))
        t = time.process_time()
        self.plan = mp.plan(self.batch.with_rank_of(self.owner), self.cfg)
        self.plan_cpu = time.process_time() - t
        st = self.plan.stats.steps[0]
        self.K_plan, self.plan_lock, self.split = st.micro_count, st.lockstep_time, st.split_lower_bound

    def packing(self, K: int) -> list[np.ndarray]:
        """microplan's own per-rank bins at K (steps 2-5 of local.py's note)."""
        ranks = _Ranks(self.owner, self.lens, self.costs, self.dp, None)
        ranks.additive_bins = True
        cost = self.cost

        def bin_cost(p, b, nb):
            return np.bincount(b, weights=self.costs[p], minlength=nb) + cost.per_micro
        bins = _pack(ranks, K, self.cfg)
        assert bins is not None, f"no packing at K={K}"
        return _polish(ranks, bins, K, self.cfg, bin_cost), ranks


def lockstep(grid: np.ndarray) -> float:
    return float((-np.sort(-grid, axis=1)).max(axis=0).sum())


def anneal(items: list[tuple[list[float], list[int]]], bins: list[list[int]], K: int, cap: int, pm: float,
           seconds: float, rng: random.Random) -> tuple[float, list[list[int]]]:
    """The best (lockstep, bins) found by the joint annealing of the module note (costs in any unit)."""
    D = len(items)
    C = [[pm] * K for _ in range(D)]
    T = [[0] * K for _ in range(D)]
    N = [[0] * K for _ in range(D)]
    for r, (a, ln) in enumerate(items):
        for i, b in enumerate(bins[r]):
            C[r][b] += a[i]
            T[r][b] += ln[i]
            N[r][b] += 1
    P = np.array([sorted(c, reverse=True) for c in C])
    unit = float(P.max(axis=0).sum()) / K
    best = float(P.max(axis=0).sum())
    best_bins = [list(b) for b in bins]
    t_end = time.process_time() + seconds
    beta_lo, beta_hi = 30.0 / unit, 3000.0 / unit
    t0 = time.process_time()
    steps = 0
    while True:
        now = time.process_time()
        if now >= t_end:
            break
        frac = (now - t0) / seconds
        beta = beta_lo * (beta_hi / beta_lo) ** frac
        tau = 2e-4 * unit * (1 - frac)  # Metropolis temperature on the surrogate
        M = P.max(axis=0)
        E = np.exp(beta * (P - M))
        Z = E.sum(axis=0)
        w = E.sum(axis=1)
        picks = rng.choices(range(D), weights=w.tolist(), k=400)
        Zl, Ml = Z.tolist(), M.tolist()
        for r in picks:
            steps += 1
            a, ln = items[r]
            n = len(a)
            if n < 2:
                continue
            br, Cr, Tr, Nr = bins[r], C[r], T[r], N[r]
            i = rng.randrange(n)
            src = br[i]
            if rng.random() < 0.4:  # move i to another bin
                dst = rng.randrange(K - 1)
                dst += dst >= src
                if Nr[src] < 2 or Tr[dst] + ln[i] > cap:
                    continue
                j = -1
                d_c, d_t = a[i], ln[i]
            else:  # swap i with j of another bin
                j = rng.randrange(n)
                dst = br[j]
                if dst == src:
                    continue
                d_c, d_t = a[i] - a[j], ln[i] - ln[j]
                if Tr[dst] + d_t > cap or Tr[src] - d_t > cap:
                    continue
            newC = list(Cr)
            newC[src] -= d_c
            newC[dst] += d_c
            old_p = sorted(Cr, reverse=True)
            new_p = sorted(newC, reverse=True)
            dS = 0.0
            newZ = []
            for k in range(K):
                z = Zl[k] - math.exp(min(beta * (old_p[k] - Ml[k]), 600.0)) \
                    + math.exp(min(beta * (new_p[k] - Ml[k]), 600.0))
                z = max(z, 1e-300)
                newZ.append(z)
                dS += math.log(z) - math.log(Zl[k])
            dS /= beta
            if dS > 0 and (tau <= 0 or rng.random() >= math.exp(-dS / tau)):
                continue
            Cr[:] = newC
            Tr[src] -= d_t
            Tr[dst] += d_t
            if j < 0:
                Nr[src] -= 1
                Nr[dst] += 1
                br[i] = dst
            else:
                br[i], br[j] = dst, src
            Zl = newZ
            P[r] = new_p
            val = float(P.max(axis=0).sum())
            if val < best * (1 - 1e-12):
                best, best_bins = val, [list(b) for b in bins]
    return best, best_bins


def run(case: Case, K: int, seconds: float, seed: int) -> dict:
    bins, ranks = case.packing(K)
    pm = float(case.cost.per_micro)
    busy = ranks.busy.tolist()
    items = [(ranks.costs[r].tolist(), ranks.lens[r].astype(int).tolist()) for r in busy]
    start = [bins[r].astype(int).tolist() for r in busy]
    grid0 = np.array([np.bincount(bins[r], weights=ranks.costs[r], minlength=K) + pm for r in busy])
    got, best_bins = anneal(items, start, K, effective_cap(case.cfg), pm, seconds, random.Random(seed))
    rb = {q: RankBins(np.asarray(best_bins[q]), ranks.costs[r], ranks.lens[r], None) for q, r in enumerate(busy)}
    grid = np.array([np.bincount(rb[q].bins, weights=rb[q].costs, minlength=K) + pm for q in range(len(busy))])
    new = polish_local(rb, grid, case.cost, effective_cap(case.cfg), max_changes=10_000)
    for q, b in new.items():
        grid[q] = np.bincount(b, weights=rb[q].costs, minlength=K) + pm
    return dict(K=K, start=lockstep(grid0), annealed=got, polished=lockstep(grid))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", default="bimodal", choices=list(FAMILIES))
    ap.add_argument("--dp", type=int, default=128)
    ap.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 3, 4])
    ap.add_argument("--seconds", type=float, default=30.0, help="CPU seconds of annealing per K")
    ap.add_argument("--no-repair", action="store_true",
                    help="plan and start without local.py's step 4 (the planner before it): local.REPAIR = False")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    local.REPAIR = not args.no_repair
    rows = []
    print(f"{'case':<22} {'K':>3} {'plan/split':>10} {'start/split':>11} {'best/split':>10} {'plan/best':>9}")
    for seed in args.seeds:
        case = Case(args.family, args.dp, seed)
        k_split = max(1, int(np.ceil(np.bincount(case.owner, weights=case.lens).max() / effective_cap(case.cfg))))
        for K in range(k_split, case.K_plan + 2):
            res = run(case, K, args.seconds, seed)
            best = min(res["annealed"], res["polished"])
            row = dict(family=args.family, dp=args.dp, seed=seed, K_plan=case.K_plan, plan=case.plan_lock,
                       split=case.split, plan_cpu_s=case.plan_cpu, best=best, **res)
            rows.append(row)
            print(f"{args.family + ' dp' + str(args.dp) + ' s' + str(seed):<22} {K:>3} "
                  f"{case.plan_lock / case.split:>10.4f} {res['start'] / case.split:>11.4f} "
                  f"{best / case.split:>10.4f} {case.plan_lock / best:>9.4f}", flush=True)
    return record("local-reference" + ("-norepair" if args.no_repair else ""), write=not args.no_write,
                  seconds=args.seconds, repair=not args.no_repair, rows=rows)


if __name__ == "__main__":
    main()
