"""Is the padded plan's gap to LB_gran on large steps the plan's or the bound's? An annealing search.

Design note. ``benchmarks/padded_exact.py`` proves optima on steps of ~24–32 samples; past ~50 the
MILP stops at its time limit with a dual bound barely above LB_gran
(``stages/padded_bound.py``), so on the benchmark's large steps (128–2,065 samples) neither side
is known. This script searches the plan's neighbourhood instead: by the contiguity lemma a padded
plan is a cut of the length-sorted samples into runs, so it anneals the cut (shift one boundary
by up to 3 samples, or move one boundary anywhere; Metropolis acceptance on the lockstep time
``padded_exact.runs_lockstep``, a linearly cooling temperature from 1 % of the plan's time), at
M = dp·K runs for the plan's K and for K ± 1 (started from the plan's cut, its dp longest runs
halved, or its dp cheapest feasible neighbour merges). The cap holds throughout (k·W ≤ cap).
A search, not a proof: "nothing better found" is evidence that the gap is the bound's slack.

Run: ``python -m benchmarks.padded_anneal [--quick] [--seconds S]``; writes
``benchmarks/results/padded-anneal-<date>-<host>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import microplan as mp  # noqa: E402
from microplan.cost.models import row_costs  # noqa: E402
from microplan.stages.padded_bound import padded_lower_bound  # noqa: E402

from benchmarks._results import save_json  # noqa: E402
from benchmarks.bench_layouts import _plan_microplan  # noqa: E402
from benchmarks.bench_planners import FAMILIES, SPG, make_step  # noqa: E402
from benchmarks.metrics import dense_7b_cost, padded_step_metrics  # noqa: E402


class Cuts:
    """Lockstep time of run boundaries of the length-sorted samples (inf when a run breaks the cap)."""

    def __init__(self, lens: np.ndarray, dp: int, cap: int, cost) -> None:
        self.L = -np.sort(-np.asarray(lens, dtype=np.int64))
        self.W = self.L.astype(np.float64)
        self.dp, self.cap, self.cost = dp, cap, cost

    def time(self, b: np.ndarray) -> float:
        k = np.diff(b)
        if (k <= 0).any() or (k * self.L[b[:-1]] > self.cap).any():
            return float("inf")
        c = float(self.cost.per_micro) + k * row_costs(self.cost, self.W[b[:-1]], k)
        K = -(-k.size // self.dp)
        c = np.concatenate([c, np.full(self.dp * K - k.size, float(self.cost.per_micro))])
        return float(np.sort(c)[::-1][::self.dp].sum())


def plan_cut(plan, lens: np.ndarray) -> np.ndarray:
    """The plan's micro-batches as a cut of the sorted samples (same counts, widest first: the
    contiguity lemma's refill, never slower)."""
    mbs = sorted(((int(lens[list(m)].max()), len(m)) for row in plan for m in row if len(m)), reverse=True)
    return np.r_[0, np.cumsum([k for _, k in mbs])].astype(np.int64)


def start_at(cut: np.ndarray, M: int, cuts: Cuts) -> np.ndarray | None:
    """A cut into M runs near ``cut``: its longest runs halved, or its cheapest feasible merges."""
    m = cut.size - 1
    if M == m:
        return cut.copy()
    k = np.diff(cut)
    if M > m:
        big = np.argsort(-k, kind="stable")[:M - m]
        big = big[k[big] >= 2]
        out = np.unique(np.r_[cut, cut[big] + k[big] // 2])
        return out if out.size - 1 == M else None
    out = cut.copy()
    for _ in range(m - M):  # drop the interior boundary whose merge costs least
        best, arg = float("inf"), -1
        for i in range(1, out.size - 1):
            t = cuts.time(np.delete(out, i))
            if t < best:
                best, arg = t, i
        if arg < 0:
            return None
        out = np.delete(out, arg)
    return out


def anneal(cut: np.ndarray, cuts: Cuts, seconds: float, rng: np.random.Generator) -> float:
    n, M = int(cut[-1]), cut.size - 1
    cur, f = cut.copy(), cuts.time(cut)
    best, T0, t0 = f, 0.01 * f, time.perf_counter()
    while (el := time.perf_counter() - t0) < seconds and M > 1:
        T = T0 * (1 - el / seconds) + 1e-300
        i = int(rng.integers(1, M))
        if rng.random() < 0.7:
            c = cur.copy()
            c[i] += int(rng.integers(-3, 4))
            if not c[i - 1] < c[i] < c[i + 1]:
                continue
        else:
            j = int(rng.integers(1, n))
            if j in cur:
                continue
            c = np.sort(np.r_[np.delete(cur, i), j])
        g = cuts.time(c)
        if g < f or rng.random() < np.exp(-(g - f) / T):
            cur, f = c, g
            best = min(best, f)
    return best


def run_case(family: str, dp: int, seed: int, seconds: float) -> dict:
    _, cap, _ = FAMILIES[family]
    lens = np.asarray(make_step(family, dp, SPG[seed % len(SPG)], seed).seq_lens)
    cost = dense_7b_cost()
    plan, _ = _plan_microplan(mp.Batch(lens.tolist()), dp, cap, cost, "padded")
    got = padded_step_metrics(plan, lens, dp=dp, cap=cap, cost=cost).lockstep
    cuts = Cuts(lens, dp, cap, cost)
    cut = plan_cut(plan, lens)
    K = len(plan[0])
    rng = np.random.default_rng(seed)
    found = {}
    for k in (K - 1, K, K + 1):
        s = None if k < 1 else start_at(cut, min(dp * k, lens.size), cuts)
        if s is not None and np.isfinite(cuts.time(s)):
            found[k] = anneal(s, cuts, seconds, rng) / got
    bound = padded_lower_bound(lens, dp=dp, cap=cap, cost=cost).time
    return dict(family=family, dp=dp, seed=seed, samples=int(lens.size), K=K, plan_lb=got / bound,
                refill=cuts.time(cut) / got, best_found=min(found.values(), default=float("nan")),
                by_K={str(k): v for k, v in found.items()})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="dp 8 and 32, seeds 0-1 (else 0-2)")
    ap.add_argument("--seconds", type=float, default=8.0, help="annealing seconds per K (default %(default)s)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    seeds = range(2) if args.quick else range(3)
    rows = [run_case(f, dp, s, args.seconds) for f in FAMILIES for dp in (8, 32) for s in seeds]
    print(f"padded plans vs an annealing search over run cuts (K-1, K, K+1; {args.seconds:g} s each)")
    print(f"{'family':<20}{'dp':>4}{'seed':>5}{'n':>6}{'K':>4}{'plan/LB_gran':>14}{'best found/plan':>17}  by K")
    for r in rows:
        byk = ", ".join(f"K={k}: {v:.4f}" for k, v in r["by_K"].items())
        print(f"{r['family']:<20}{r['dp']:>4}{r['seed']:>5}{r['samples']:>6}{r['K']:>4}{r['plan_lb']:>14.4f}"
              f"{r['best_found']:>17.4f}  {byk}")
    b = np.array([r["best_found"] for r in rows])
    print(f"best found / plan: min {b.min():.4f}, median {np.median(b):.4f} over {b.size} steps "
          f"({int((b < 1 - 1e-9).sum())} steps where the search beat the plan)")
    result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), seconds=args.seconds,
                  quick=args.quick, rows=rows)
    if not args.no_write:
        print(f"wrote {save_json('padded-anneal', result)}.json")
    return result


if __name__ == "__main__":
    main()
