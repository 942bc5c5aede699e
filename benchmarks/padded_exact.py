"""Exact optimum of padded lockstep time for mid-size steps: a MILP over contiguous runs (a reference).

Design note. ``benchmarks/padded_optimum.py`` enumerates the 2^(n-1) cuts of the sorted samples
(n ≤ ~14). This module solves the same problem exactly for n ~ 20–80 with a mixed-integer
program (``scipy.optimize.milp``, HiGHS). By the contiguity lemma (``stages/padded_bound.py``)
some optimal plan cuts the samples, sorted by length (descending), into contiguous runs; a run
[a, e) costs c = per_micro + k·r(W_a, k) (k = e − a rows of the width at a) and keeps the cap
when k·W_a ≤ cap.

1. *Runs as a path.* x_r ∈ {0, 1} for every candidate run r (O(n·k_max) of them); the chosen
   runs form a path 0 → n (flow conservation at every cut point 1..n−1, one run leaves 0).
2. *Lockstep as levels.* Let v_1 > v_2 > ... > v_L be the distinct run costs, v_{L+1} = 0, and
   N_l the number of chosen runs costing ≥ v_l. ``assign.arrange`` cuts the sorted costs into
   slots of dp, so slot s's head exceeds t iff more than s·dp runs cost more than t: the number
   of slot heads above t is ⌈N(t)/dp⌉, and lockstep time = ∫ ⌈N(t)/dp⌉ dt
   = Σ_l (v_l − v_{l+1})·⌈N_l/dp⌉ — per_micro of the placeholders included (below the cheapest
   run every one of the K = ⌈m/dp⌉ slots counts; more slots than that only add per_micro).
   Integer z_l ≥ N_l/dp with a positive weight is ⌈N_l/dp⌉ at the optimum; N_l is a chain
   N_l = N_{l−1} + Σ_{r at level l} x_r (sparse). Valid cuts: z non-decreasing in l, z at a
   run's level ≥ x_r (a chosen run makes a slot head at least its cost).
3. *No placeholders* (``placeholders=False``, the planner's contract under ``short_step``):
   exactly dp·K runs, Σ x_r = dp·z_L, or every sample alone (m = n).

Guarantees: the optimum over every padded plan (set partitions included, by the lemma) when the
solver proves it (``proved``); otherwise ``time`` is the best plan found and ``bound`` HiGHS's
dual bound, itself a valid lower bound on every plan. Checked against the exhaustive optimum in
tests/test_padded_exact.py. The LP relaxation alone is the padding volume (Σ costs / dp, no
granularity), so the ceilings are left to branch and bound: that is the trade-off against a
planner-side bound. Measured (``python -m benchmarks.bench_layouts --quick``, mid table, 2
shared cores, 20 s per solve): proved in 0.8–14 s on 24–32 samples (5 of 12 steps); on 40–50
samples and at dp 8 with 48 it stops at the limit, its dual bound 1.0005–1.098× the best plan
(the slack is largest at dp 8, where ⌈N/dp⌉ rounds most). The lower bound ``fewest runs above
each level, rounded up`` (a shortest path per level) as variable bounds proved no more steps.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from microplan.cost.models import row_costs

__all__ = ["ExactOptimum", "padded_exact", "runs_lockstep"]


class ExactOptimum(NamedTuple):
    time: float                 # lockstep time of the best plan found (inf: none found)
    bound: float                # a lower bound on every plan's lockstep time (= time when proved)
    K: int                      # micro-batches per rank of that plan
    runs: tuple[int, ...]       # its run boundaries [0, b1, ..., n] (samples sorted by length, descending)
    proved: bool                # whether the solver proved it optimal (relative gap <= ``gap``)
    seconds: float              # solver wall time


class _Runs(NamedTuple):
    start: np.ndarray   # int64 first sorted position of each candidate run
    end: np.ndarray     # int64 one past its last
    cost: np.ndarray    # float64 per_micro + k·r(W, k)


def _candidates(lens, dp: int, cap: int | None, cost, width_multiple: int) -> _Runs:
    """Every run [a, a+k) of the sorted samples that keeps the cap, with its cost."""
    L = -np.sort(-np.asarray(lens, dtype=np.int64))
    W = -(-L // width_multiple) * width_multiple
    n = int(L.size)
    a = np.repeat(np.arange(n), n - np.arange(n))
    k = np.concatenate([np.arange(1, n - i + 1) for i in range(n)])
    ok = np.ones(a.size, dtype=bool) if cap is None else k * W[a] <= cap
    a, k = a[ok], k[ok]
    c = float(cost.per_micro) + k * row_costs(cost, W[a].astype(np.float64), k)
    return _Runs(a, a + k, c)


def runs_lockstep(lens, runs, *, dp: int, cost, width_multiple: int = 1) -> float:
    """Lockstep time of run boundaries of the sorted samples (K = ⌈runs/dp⌉, placeholders cost per_micro)."""
    L = -np.sort(-np.asarray(lens, dtype=np.int64))
    W = (-(-L // width_multiple) * width_multiple).astype(np.float64)
    b = np.asarray(runs, dtype=np.int64)
    k = np.diff(b)
    c = float(cost.per_micro) + k * row_costs(cost, W[b[:-1]], k)
    K = -(-k.size // dp)
    c = np.concatenate([c, np.full(dp * K - k.size, float(cost.per_micro))])
    return float(np.sort(c)[::-1][::dp].sum())


def padded_exact(lens, *, dp: int, cap: int | None, cost, width_multiple: int = 1, placeholders: bool = True,
                 time_limit: float = 60.0, gap: float = 1e-6, upper: float | None = None) -> ExactOptimum:
    """The least padded lockstep time of these samples on dp ranks (module note): a MILP solved by
    HiGHS within ``time_limit`` seconds; ``placeholders=False``: exactly min(n, dp·K) runs; ``upper``:
    the lockstep time of a known plan: runs costing more are in no better plan and are left out."""
    import time as _time
    lens = np.asarray(lens, dtype=np.int64)
    n = int(lens.size)
    r = _candidates(lens, dp, cap, cost, width_multiple)
    if upper is not None:  # a run costing more than a known plan's time is in no better plan
        keep = r.cost <= upper * (1 + 1e-9)
        r = _Runs(r.start[keep], r.end[keep], r.cost[keep])
    if n == 0 or not (r.start == 0).any():
        return ExactOptimum(float("inf"), float("inf"), 0, (), False, 0.0)
    singles = runs_lockstep(lens, np.arange(n + 1), dp=dp, cost=cost, width_multiple=width_multiple)
    if not placeholders and n <= dp:  # every K leaves a whole slot: every sample alone
        return ExactOptimum(singles, singles, 1, tuple(range(n + 1)), True, 0.0)
    R = r.cost.size
    levels, lev = np.unique(-r.cost, return_inverse=True)  # level 0: the costliest
    v = -levels
    L = v.size
    scale = float(v[0])
    weight = (v - np.append(v[1:], 0.0)) / scale            # v_l − v_{l+1}
    ix, iz, iN = 0, R, R + L                                # variable blocks: x, z, N
    rows, cols, vals, lo, hi = [], [], [], [], []
    row = 0

    def add(cs, vs, lb, ub):
        nonlocal row
        rows.extend([row] * len(cs))
        cols.extend(cs)
        vals.extend(vs)
        lo.append(lb)
        hi.append(ub)
        row += 1

    out_of = [[] for _ in range(n + 1)]
    into = [[] for _ in range(n + 1)]
    for j in range(R):
        out_of[int(r.start[j])].append(j)
        into[int(r.end[j])].append(j)
    add([ix + j for j in out_of[0]], [1.0] * len(out_of[0]), 1, 1)
    for p in range(1, n):  # flow conservation at every cut point
        add([ix + j for j in into[p]] + [ix + j for j in out_of[p]], [1.0] * len(into[p]) + [-1.0] * len(out_of[p]),
            0, 0)
    at = [[] for _ in range(L)]
    for j in range(R):
        at[int(lev[j])].append(j)
    for l_ in range(L):  # N_l = N_{l-1} + Σ x at level l; dp·z_l >= N_l; z_l >= z_{l-1}
        prev = [iN + l_ - 1] if l_ else []
        add([iN + l_] + prev + [ix + j for j in at[l_]], [1.0] + [-1.0] * len(prev) + [-1.0] * len(at[l_]), 0, 0)
        add([iz + l_, iN + l_], [float(dp), -1.0], 0, np.inf)
        if l_:
            add([iz + l_, iz + l_ - 1], [1.0, -1.0], 0, np.inf)
    for j in range(R):  # a chosen run heads a slot at least as costly as itself
        add([iz + int(lev[j]), ix + j], [1.0, -1.0], 0, np.inf)
    if not placeholders:  # exactly dp·K runs (K = z_L)
        add([ix + j for j in range(R)] + [iz + L - 1], [1.0] * R + [-float(dp)], 0, 0)
    A = coo_matrix((vals, (rows, cols)), shape=(row, R + 2 * L)).tocsr()
    c = np.concatenate([np.zeros(R), weight, np.zeros(L)])
    integrality = np.concatenate([np.ones(R), np.ones(L), np.zeros(L)])
    ub = np.concatenate([np.ones(R), np.full(L, float(n)), np.full(L, float(n))])
    t0 = _time.perf_counter()
    res = milp(c, constraints=LinearConstraint(A, lo, hi), integrality=integrality, bounds=Bounds(0, ub),
               options=dict(time_limit=float(time_limit), mip_rel_gap=gap, presolve=True))
    dt = _time.perf_counter() - t0
    dual = getattr(res, "mip_dual_bound", None)
    bound = float(dual) * scale if dual is not None and np.isfinite(dual) else 0.0
    if res.status == 2:  # proved infeasible: no plan of exactly dp·K runs (every sample alone is left)
        best = ExactOptimum(float("inf"), float("inf"), 0, (), True, dt)
    elif res.x is None:
        best = ExactOptimum(float("inf"), bound, 0, (), False, dt)
    else:
        chosen = np.flatnonzero(res.x[:R] > 0.5)
        b = tuple(sorted({0, *(int(e) for e in r.end[chosen])}))
        t = runs_lockstep(lens, b, dp=dp, cost=cost, width_multiple=width_multiple)
        best = ExactOptimum(t, min(bound, t), -(-(len(b) - 1) // dp), b, res.status == 0, dt)
    if not placeholders and singles < best.time:  # m = n: every sample alone (dp·K >= n)
        best = best._replace(time=singles, K=-(-n // dp), runs=tuple(range(n + 1)))
    if not placeholders:
        best = best._replace(bound=min(best.bound, singles))
    return best
