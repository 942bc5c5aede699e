"""Pipeline parallelism: predicted 1F1B step time of microplan's micro-batch order vs the usual orders.

Design note. For every trace family × dp × seed (one step, benchmarks/bench_planners.make_step)
at the bench_planners step size and 4× it, and p ∈ {4, 8} pipeline stages, microplan plans the step with ``pipeline_stages=p`` (K >= p
micro-batches per rank, then its order: skewed pyramids + local search, stages/pipeline.py).
The SAME micro-batches (the slot grid of the plan) are then run in other orders — verl's
(sort descending, even positions reversed then odd: smallest at both ends), ascending and
descending — by permuting the grid's columns, and each order's step time is predicted by the
same schedule model (Megatron's 1F1B op order; lockstep ranks: the pipeline sees slot maxima;
per stage f = c/(3p), b = 2f; sends free). Interleaved rows: ``virtual_stages=2``, ``align=p``
(Megatron's default microbatch_group_size_per_vp_stage). "verl plan": verl's own layout (its
micro-batches with ``min_num_micro_batch=p``, its order, no cap check) under the same model, for
reference. Cells are the other
order's time / microplan's time (> 1: microplan is faster), median/worst over cases; "bubble" is
microplan's idle share of a stage. Cost model: metrics.dense_7b_cost.

Run: ``python -m benchmarks.bench_pipeline [--quick]``. Prints the table and writes
``benchmarks/results/pipeline-<date>-<host>.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import microplan as mp  # noqa: E402
from microplan.stages.pipeline import step_pipeline_time, verl_order  # noqa: E402
from microplan.stats import step_cost_grid  # noqa: E402

from benchmarks._results import record  # noqa: E402
from benchmarks.bench_planners import FAMILIES, SPG, make_step  # noqa: E402
from benchmarks.metrics import cost_grid, dense_7b_cost  # noqa: E402
from benchmarks.peers import plan_verl  # noqa: E402

ORDERS = ("verl", "ascending", "descending")
SCALES = (1, 4)  # step size: bench_planners' samples per GPU (16/32/64 by seed) × this; ×4 gives K ≈ 4× more
TARGET = 1.0  # every other order's time / microplan's: >= 1 in every case


def _orders(slot_cost: np.ndarray) -> dict[str, np.ndarray]:
    desc = np.argsort(-slot_cost, kind="stable")
    return {"verl": verl_order(slot_cost), "ascending": desc[::-1], "descending": desc}


def run_case(family: str, dp: int, seed: int, p: int, v: int, cost, scale: int = 1) -> dict:
    """One step at p stages (v chunks): microplan's pipeline time and every other order's ratio."""
    _, cap, _ = FAMILIES[family]
    batch = make_step(family, dp, SPG[seed % len(SPG)] * scale, seed)
    cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, cost=cost, pipeline_stages=p, virtual_stages=v,
                        align=p if v > 1 else 1)
    plan = mp.plan(batch, cfg)
    step = plan.steps[0]
    grid = step_cost_grid(batch, cfg, step)
    ours = plan.stats.steps[0].pipeline_time
    row = dict(family=family, dp=dp, seed=seed, p=p, v=v, scale=scale, K=step.micro_count,
               K_lb=plan.stats.steps[0].micro_count_lower_bound, time=ours,
               bubble=plan.stats.steps[0].pipeline_bubble)
    # K by pipeline time: the first K tried is the K of least lockstep time (today's K before issue 20)
    times = dict(step.choice.candidates) if step.choice is not None else {step.micro_count: ours}
    k_flat = step.choice.candidates[0][0] if step.choice is not None else step.micro_count
    row["K lockstep"] = k_flat
    row["lockstep K"] = times[k_flat] / ours
    for name, order in _orders(grid.max(axis=0)).items():
        row[name] = step_pipeline_time(grid[:, order], cfg) / ours
    verl = plan_verl(np.asarray(batch.seq_lens), dp=dp, cap=cap, align=p if v > 1 else 1, min_num_micro_batch=p)
    vgrid = cost_grid(verl, np.asarray(batch.seq_lens), cost)
    row["verl plan"] = step_pipeline_time(vgrid, cfg) / ours
    row["verl K"] = int(vgrid.shape[1])
    return row


def summarise(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["family"], r["scale"], r["p"], r["v"]), []).append(r)
    out = []
    for (fam, scale, p, v), rs in groups.items():
        s = dict(family=fam, scale=scale, p=p, v=v, cases=len(rs), K=float(np.median([r["K"] for r in rs])),
                 bubble=(float(np.median([r["bubble"] for r in rs])), max(r["bubble"] for r in rs)))
        s["K lockstep"] = float(np.median([r["K lockstep"] for r in rs]))
        for name in (*ORDERS, "verl plan", "lockstep K"):
            vals = [r[name] for r in rs if np.isfinite(r[name])]
            s[name] = (float(np.median(vals)), min(vals), max(vals)) if vals else (float("nan"),) * 3
            s[name + " n/a"] = len(rs) - len(vals)
        out.append(s)
    return out


def format_table(summary: list[dict]) -> str:
    head = (f"{'family':19s} {'step':>4s} {'p':>2s} {'v':>2s} {'K med':>6s} {'K lock':>6s} {'bubble med/worst':>17s}   "
            + "   ".join(f"{n + ' med/min':>17s}" for n in (*ORDERS, "verl plan", "lockstep K")))
    lines = [head, "-" * len(head)]
    for s in summary:
        cells = "   ".join(f"{s[n][0]:8.4f}/{s[n][1]:.4f}" if np.isfinite(s[n][0]) else f"{'n/a':>17s}"
                           for n in (*ORDERS, "verl plan", "lockstep K"))
        lines.append(f"{s['family']:19s} {'×' + str(s['scale']):>4s} {s['p']:2d} {s['v']:2d} {s['K']:6.1f} "
                     f"{s['K lockstep']:6.1f} "
                     f"{s['bubble'][0]:8.3f}/{s['bubble'][1]:.3f}   {cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="dp 8, 3 seeds")
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    dps, seeds = ((8,), range(3)) if args.quick else ((8, 32), range(6))
    cost = dense_7b_cost()
    rows = [run_case(fam, dp, seed, p, v, cost, scale) for fam in args.families for scale in SCALES for dp in dps
            for seed in seeds for p in (4, 8) for v in (1, 2)]
    summary = summarise(rows)
    print("cells: other order's predicted pipeline step time / microplan's (>= 1: microplan faster), "
          "median/min over dp x seed cases; step ×4: 4× the samples per GPU; v=2: interleaved, align=p")
    print(format_table(summary))
    worst = min(min(r[n] for n in ORDERS) for r in rows)
    print(f"\nmicroplan's order is never slower than {', '.join(ORDERS)}: min ratio {worst:.6f} "
          f"(target >= {TARGET}) over {len(rows)} cases")
    flat = [r["lockstep K"] for r in rows]
    best_p8 = max((s["lockstep K"][0], s["family"], s["scale"], s["v"]) for s in summary if s["p"] == 8)
    print(f"K by pipeline time vs the K of least lockstep time (both in microplan's order): never slower "
          f"(min ratio {min(flat):.6f}, target >= 1); best p=8 family median {best_p8[0]:.4f} ({best_p8[1]} "
          f"×{best_p8[2]}, v={best_p8[3]}; target >= 1.05)")
    return record("pipeline", write=not args.no_write, quick=args.quick, cost=cost.to_dict(), dp=list(dps),
                  seeds=list(seeds), scales=SCALES, target=TARGET, summary=summary, rows=rows)


if __name__ == "__main__":
    main()
