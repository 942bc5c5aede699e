"""Padded layouts: padding waste and lockstep balance of microplan vs the peers' padded batching.

Design note. Trainers without varlen kernels run a micro-batch of n samples as an ``[n, W]``
tensor, so the cap counts n·W and every row costs like a row of W. For every trace family × dp ×
seed we build ONE optimizer step (``bench_planners.make_step``: ~16/32/64 samples per GPU, the
family's cap and context window), lay it out with each planner and score it with
``metrics.padded_step_metrics`` (same definitions for everyone): padded tokens / real tokens,
micro-batches over the cap counting padding, equal counts, lockstep / LB_pad (the padded cost
of the plan's own micro-batches, perfectly balanced: balance only), lockstep / LB_gran (the
granularity-aware bound of ``stages/padded_bound.py``, valid for every padded plan: padding and
balance, no plan beats it) and lockstep / LB_real (the varlen lower bound of the real tokens:
padding and balance together). A second table draws small steps (12 samples of each family,
12 seeds, dp 2–3) and compares microplan's padded plan with the exhaustive optimum
(``benchmarks/padded_optimum.py``; ``opt`` may use placeholders anywhere, ``opt_full`` none where
the samples suffice — the planner's contract under ``short_step``) and that optimum with
LB_gran: how far the plan is from the best plan, and how far the bound is from physics; every
step is listed with its K and the optima's. A third table takes mid steps (~24–50 samples of each
family, dp 2–8, ``MID``) beyond the exhaustive search and compares the plan with the exact optimum
of ``benchmarks/padded_exact.py`` (a MILP, ``--mid-limit`` seconds per solve, default 20):
plan/opt (the best plan known), plan/dual (the solver's lower bound: an upper bound on how far
the plan can be from the optimum), opt/LB_gran (the bound's slack), K vs K_opt and how many
solves proved optimality. Planners (1D rows):
microplan ``layout="padded"``, NeMo-RL's sorted buckets, fixed micro_batch_size (verl/OpenRLHF
static); 2D rows ([n, max prompt + max response]): microplan ``layout="padded-2d"`` vs UniRL's 2D
FFD. ``microplan-varlen`` (the varlen plan, scored in varlen cost) is the reference a padded
layout gives up. Cost: the ~7B dense model of bench_planners (metrics.dense_7b_cost).

Run: ``python -m benchmarks.bench_layouts [--quick] [--mid-seeds 3] [--mid-limit 20] [--volume-max-work W]``
(~4 minutes with ``--quick`` on 2 shared cores, most of it the mid table's solves). Prints the tables
and writes ``benchmarks/results/layouts-<date>-<host>.json`` (``layouts-volume<W>-...`` with
``--volume-max-work``, which overrides ``stages/padded.py``'s budget for the deep search's volume-cut
starts: 0 turns them off, for a before/after in one machine state).
"""

from __future__ import annotations

import datetime
import socket
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import microplan as mp  # noqa: E402

from benchmarks._results import save_json  # noqa: E402
from benchmarks.bench_planners import (FAMILIES, SPG, _agg, _mw, bench_args, group_rows, make_step,  # noqa: E402
                                       run_grid)
from benchmarks.bench_planners import COLUMNS as _PLANNER_COLUMNS  # noqa: E402
from benchmarks.bench_planners import format_table as _format_table  # noqa: E402
from benchmarks.metrics import dense_7b_cost, from_microplan, padded_step_metrics, step_metrics  # noqa: E402
from benchmarks.padded_exact import padded_exact  # noqa: E402
from benchmarks.padded_optimum import padded_optimum  # noqa: E402
from microplan.stages.padded_bound import padded_lower_bound  # noqa: E402
from microplan.traces import generate  # noqa: E402
from benchmarks.peers.padded import plan_fixed_mbs, plan_sorted_buckets, plan_unirl_2d  # noqa: E402

TARGETS = {"families": ["grpo-longtail", "stepwise-multiturn"], "waste_median": 1.05, "lockstep_median": 1.01,
           "over_cap": 0, "small_median": 1.01, "small_worst": 1.03}
PLANNERS = {
    "microplan": "microplan layout='padded' (runs of similar length, K by predicted time)",
    "sorted-buckets": "NeMo-RL (NVIDIA-NeMo/RL, 2026-08) dynamic batching: sorted, strided deal, shared boundaries",
    "fixed-mbs": "verl/OpenRLHF static micro_batch_size = cap // max_len on contiguous shares",
    "microplan-2d": "microplan layout='padded-2d' ([n, max prompt + max response])",
    "unirl-2d": "UniRL (Tencent-Hunyuan/UniRL, 2026-06) per-rank FFD under the dense 2D budget, count MAX",
    "microplan-varlen": "microplan layout='varlen' (reference: no padding, scored in varlen cost)",
}
TWO_D = ("microplan-2d", "unirl-2d")


def _plan_microplan(batch: mp.Batch, dp: int, cap: int, cost, layout: str):
    cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, cost=cost, layout=layout)
    t = time.perf_counter()
    p = mp.plan(batch, cfg)
    dt = time.perf_counter() - t
    p.validate()
    return from_microplan(p), dt


def run_case(family: str, dp: int, seed: int, cost, planners: list[str]) -> list[dict]:
    max_len, cap, _ = FAMILIES[family]
    spg = SPG[seed % len(SPG)]
    b = make_step(family, dp, spg, seed)
    lens, plens = np.asarray(b.seq_lens), np.asarray(b.prompt_lens)
    rows = []
    gran = padded_lower_bound(lens, dp=dp, cap=cap, cost=cost).time  # valid for 2D rows too (wider)
    for name in planners:
        row = dict(family=family, dp=dp, seed=seed, spg=spg, planner=name, samples=b.num_samples,
                   tokens=int(lens.sum()), cap=cap)
        t = time.perf_counter()
        if name == "microplan-varlen":
            plan, dt = _plan_microplan(b, dp, cap, cost, "varlen")
            m = step_metrics(plan, lens, dp=dp, cap=cap, cost=cost)
            rows.append({**row, "ms": dt * 1e3, "over_cap": m.over_cap, "max_tokens_ratio": m.max_tokens_ratio,
                         "waste": 1.0, "equal_counts": m.equal_counts, "empties": m.empties, "lost": m.lost,
                         "duplicated": m.duplicated, "K": m.K, "lockstep_ratio": m.lockstep_ratio,
                         "real_ratio": m.lockstep_ratio, "gran_ratio": float("nan")})
            continue
        if name in ("microplan", "microplan-2d"):
            plan, dt = _plan_microplan(b, dp, cap, cost, "padded" if name == "microplan" else "padded-2d")
        elif name == "sorted-buckets":
            plan, dt = plan_sorted_buckets(lens, dp=dp, cap=cap), time.perf_counter() - t
        elif name == "fixed-mbs":
            plan, dt = plan_fixed_mbs(lens, dp=dp, cap=cap, max_len=max_len), time.perf_counter() - t
        else:
            plan, dt = plan_unirl_2d(lens, plens, dp=dp, cap=cap), time.perf_counter() - t
        m = padded_step_metrics(plan, lens, dp=dp, cap=cap, cost=cost, prompt_lens=plens if name in TWO_D else None)
        rows.append({**row, "ms": dt * 1e3, **m.to_dict(), "gran_ratio": m.lockstep / gran})
    return rows


def summarise(rows: list[dict], keys: tuple[str, ...] = ("family", "planner")) -> list[dict]:
    """Median and worst of every column per group of ``keys``."""
    out = []
    for key, rs in group_rows(rows, keys).items():
        s = dict(zip(keys, key), cases=len(rs))
        for col in ("over_cap", "max_tokens_ratio", "waste", "lockstep_ratio", "gran_ratio", "real_ratio", "ms", "K"):
            s[col] = _agg([r[col] for r in rs])
        s["equal"] = float(np.mean([r["equal_counts"] for r in rs]))
        s["empties"] = _agg([r["empties"] for r in rs])
        s["lost"] = max(r["lost"] for r in rs)
        s["dup"] = max(r["duplicated"] for r in rs)
        out.append(s)
    return out


_SHARED = {name: col for col in _PLANNER_COLUMNS for name in (col[0],)}  # bench_planners' cells
COLUMNS = [_SHARED["over-cap"], _SHARED["tok/cap"],
           ("padded/real", 13, lambda s: _mw(s["waste"], ".3f")),
           _SHARED["equal"], _SHARED["empty"], _SHARED["lost/dup"],
           ("K", 7, lambda s: _mw(s["K"], ".0f")),
           ("lockstep/LB_pad", 15, lambda s: _mw(s["lockstep_ratio"], ".4f")),
           ("lockstep/LB_gran", 16, lambda s: _mw(s["gran_ratio"], ".4f")),
           ("lockstep/LB_real", 16, lambda s: _mw(s["real_ratio"], ".4f")),
           _SHARED["plan ms"]]


def format_table(summary: list[dict], keys: tuple[str, ...] = ("family", "planner")) -> str:
    """Fixed-width table of this benchmark's columns (bench_planners.format_table)."""
    return _format_table(summary, keys, COLUMNS)


def check_targets(summary: list[dict]) -> list[str]:
    """The issue's targets for microplan's padded layout, as lines 'ok'/'MISS'."""
    out = []
    for s in summary:
        if s["planner"] != "microplan" or s["family"] not in TARGETS["families"]:
            continue
        ok = (s["waste"][0] <= TARGETS["waste_median"], s["lockstep_ratio"][0] <= TARGETS["lockstep_median"],
              s["over_cap"][1] == TARGETS["over_cap"])
        out.append(f"{s['family']}: padded/real median {s['waste'][0]:.3f} (<= 1.05: {'ok' if ok[0] else 'MISS'}), "
                   f"lockstep/LB_pad median {s['lockstep_ratio'][0]:.4f} (<= 1.01: {'ok' if ok[1] else 'MISS'}), "
                   f"lockstep/LB_gran median {s['gran_ratio'][0]:.4f}, "
                   f"over-cap worst {s['over_cap'][1]:.0f} (0: {'ok' if ok[2] else 'MISS'})")
    return out


def small_cases(families: list[str], cost, seeds: int = 12, n: int = 12) -> list[dict]:
    """Small steps (n samples of a family, dp 2 or 3): microplan's padded plan vs the exhaustive
    optimum (with placeholders anywhere, and without where the samples suffice: the planner's
    contract under ``short_step``) vs LB_gran."""
    rows = []
    for fam in families:
        max_len, cap, group = FAMILIES[fam]
        for seed in range(seeds):
            pool = np.asarray(generate(fam, num_prompts=8, samples_per_prompt=group, max_len=max_len, seed=seed).seq_lens)
            lens = np.random.default_rng(seed).choice(pool, size=min(n, pool.size), replace=False)
            dp = 2 + seed % 2
            opt = padded_optimum(lens, dp=dp, cap=cap, cost=cost)
            full = padded_optimum(lens, dp=dp, cap=cap, cost=cost, placeholders=False)
            plan, _ = _plan_microplan(mp.Batch(lens.tolist()), dp, cap, cost, "padded")
            m = padded_step_metrics(plan, lens, dp=dp, cap=cap, cost=cost)
            bound = padded_lower_bound(lens, dp=dp, cap=cap, cost=cost).time
            rows.append(dict(family=fam, seed=seed, dp=dp, n=int(lens.size), K=len(plan[0]), K_opt=opt.K,
                             K_full=full.K, plan_opt=m.lockstep / opt.time, plan_full=m.lockstep / full.time,
                             opt_bound=opt.time / bound, plan_bound=m.lockstep / bound))
    return rows


def check_small(rows: list[dict]) -> list[str]:
    """Issue 20's small-step targets (plan/optimum median <= 1.01, worst <= 1.03), both optima."""
    out = []
    for col, name in (("plan_full", "opt_full (no placeholders)"), ("plan_opt", "opt (placeholders anywhere)")):
        med, worst = _agg([r[col] for r in rows])
        ok = med <= TARGETS["small_median"], worst <= TARGETS["small_worst"]
        out.append(f"small steps plan/{name}: median {med:.4f} (<= 1.01: {'ok' if ok[0] else 'MISS'}), "
                   f"worst {worst:.4f} (<= 1.03: {'ok' if ok[1] else 'MISS'})")
    return out


def format_small(rows: list[dict]) -> str:
    """Per family (median/worst), then every step."""
    out = [f"{'family':<20}{'cases':>6}{'plan/opt':>16}{'plan/opt_full':>16}{'opt/LB_gran':>16}{'plan/LB_gran':>16}"
           f"{'K=K_opt':>9}", "-" * 99]
    for (fam,), rs in group_rows(rows, ("family",)).items():
        cell = lambda col: _mw(_agg([r[col] for r in rs]), ".4f")  # noqa: E731
        out.append(f"{fam:<20}{len(rs):>6}{cell('plan_opt'):>16}{cell('plan_full'):>16}{cell('opt_bound'):>16}"
                   f"{cell('plan_bound'):>16}{np.mean([r['K'] == r['K_opt'] for r in rs]):>9.0%}")
    every = lambda col: _mw(_agg([r[col] for r in rows]), ".4f")  # noqa: E731
    out.append(f"{'all':<20}{len(rows):>6}{every('plan_opt'):>16}{every('plan_full'):>16}{every('opt_bound'):>16}"
               f"{every('plan_bound'):>16}{np.mean([r['K'] == r['K_opt'] for r in rows]):>9.0%}")
    out += ["", f"{'family':<20}{'seed':>5}{'dp':>4}{'K':>4}{'K_opt':>6}{'K_full':>7}{'plan/opt':>10}{'plan/full':>10}"
            f"{'opt/LB':>8}"]
    out += [f"{r['family']:<20}{r['seed']:>5}{r['dp']:>4}{r['K']:>4}{r['K_opt']:>6}{r['K_full']:>7}"
            f"{r['plan_opt']:>10.4f}{r['plan_full']:>10.4f}{r['opt_bound']:>8.4f}" for r in rows]
    return "\n".join(out)


MID = ((24, 2), (40, 4), (32, 8), (48, 2), (32, 4), (48, 8))  # (samples, dp) of the mid steps, cycled by seed


def mid_cases(families: list[str], cost, seeds: int = 3, time_limit: float = 20.0) -> list[dict]:
    """Mid-size steps (a family's step of ~24–64 samples, dp 2–8, ``MID`` cycled by family and seed):
    microplan's padded plan vs the exact optimum of ``benchmarks/padded_exact.py`` (no
    placeholders where the samples suffice: the planner's contract), solved within ``time_limit``
    seconds. ``opt`` is the best plan known (the solver's, or the planner's when the solver stops
    short); ``dual`` the solver's lower bound (valid for every plan): plan/dual bounds plan/optimum."""
    rows = []
    for f, fam in enumerate(families):
        _, cap, _ = FAMILIES[fam]
        for seed in range(seeds):
            n, dp = MID[(f + seed) % len(MID)]
            b = make_step(fam, dp, -(-n // dp), seed)
            lens = np.asarray(b.seq_lens)
            plan, dt = _plan_microplan(mp.Batch(lens.tolist()), dp, cap, cost, "padded")
            got = padded_step_metrics(plan, lens, dp=dp, cap=cap, cost=cost).lockstep
            ex = padded_exact(lens, dp=dp, cap=cap, cost=cost, placeholders=False, time_limit=time_limit, upper=got)
            opt, K_opt = (ex.time, ex.K) if ex.time <= got else (got, len(plan[0]))
            bound = padded_lower_bound(lens, dp=dp, cap=cap, cost=cost).time
            rows.append(dict(family=fam, seed=seed, dp=dp, n=int(lens.size), K=len(plan[0]), K_opt=K_opt,
                             proved=bool(ex.proved), plan_opt=got / opt, opt_bound=opt / bound,
                             plan_dual=got / max(ex.bound, bound), dual_bound=max(ex.bound, bound) / bound,
                             solve_s=ex.seconds, ms=dt * 1e3))
    return rows


def format_mid(rows: list[dict]) -> str:
    """Per family (median/worst), then every step."""
    cols = (("plan/opt", "plan_opt"), ("plan/dual", "plan_dual"), ("opt/LB_gran", "opt_bound"))
    out = [f"{'family':<20}{'cases':>6}" + "".join(f"{c:>16}" for c, _ in cols) + f"{'K=K_opt':>9}{'proved':>8}",
           "-" * 91]
    groups = list(group_rows(rows, ("family",)).items()) + [(("all",), rows)]
    for (fam,), rs in groups:
        out.append(f"{fam:<20}{len(rs):>6}" + "".join(f"{_mw(_agg([r[k] for r in rs]), '.4f'):>16}" for _, k in cols)
                   + f"{np.mean([r['K'] == r['K_opt'] for r in rs]):>9.0%}{sum(r['proved'] for r in rs):>5}/{len(rs)}")
    out += ["", f"{'family':<20}{'seed':>5}{'dp':>4}{'n':>4}{'K':>4}{'K_opt':>6}{'plan/opt':>10}{'plan/dual':>10}"
            f"{'opt/LB':>8}{'proved':>7}{'solve s':>8}{'plan ms':>8}"]
    out += [f"{r['family']:<20}{r['seed']:>5}{r['dp']:>4}{r['n']:>4}{r['K']:>4}{r['K_opt']:>6}{r['plan_opt']:>10.4f}"
            f"{r['plan_dual']:>10.4f}{r['opt_bound']:>8.4f}{'yes' if r['proved'] else 'no':>7}{r['solve_s']:>8.1f}"
            f"{r['ms']:>8.0f}" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict:
    import argparse
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--mid-seeds", type=int, default=3, help="mid-size steps per family (0: no mid table)")
    ap.add_argument("--mid-limit", type=float, default=20.0, help="seconds per exact solve of a mid step")
    ap.add_argument("--volume-max-work", type=float, default=None,
                    help="override stages/padded.py's VOLUME_MAX_WORK (0: no volume-cut starts), for a before/after")
    mid_args, rest = ap.parse_known_args(argv)
    from microplan.stages import padded
    if mid_args.volume_max_work is not None:
        padded.VOLUME_MAX_WORK = mid_args.volume_max_work
    args, dps, seeds = bench_args(rest, __doc__, list(PLANNERS), (8, 16, 32))
    cost = dense_7b_cost()
    rows = run_grid(run_case, args.families, dps, seeds, cost, args.planners)
    summary = summarise(rows)
    print(f"padded layouts, one step per case, dp {list(dps)} x seeds {list(seeds)}; cells: median/worst")
    print(format_table(summary))
    print("\nmicroplan by family x dp:")
    mp_rows = [r for r in rows if r["planner"] in ("microplan", "microplan-2d")]
    print(format_table(summarise(mp_rows, ("family", "dp", "planner")), ("family", "dp", "planner")))
    small = small_cases([f for f in args.families if f in FAMILIES], cost, seeds=12)
    print("\nsmall steps (12 samples, dp 2-3): microplan layout='padded' vs the exhaustive optimum (opt: placeholders "
          "anywhere; opt_full: none where the samples suffice, the planner's contract); median/worst")
    print(format_small(small))
    fams = [f for f in args.families if f in FAMILIES]
    mid = mid_cases(fams, cost, seeds=mid_args.mid_seeds, time_limit=mid_args.mid_limit) if mid_args.mid_seeds else []
    if mid:
        print(f"\nmid steps (~24-64 samples, dp 2-8): microplan layout='padded' vs the exact optimum (MILP, "
              f"benchmarks/padded_exact.py, {mid_args.mid_limit:g} s per solve; opt: the best plan known, proved or "
              "not; dual: the solver's lower bound); median/worst")
        print(format_mid(mid))
    print("\ntargets (microplan, layout='padded'):")
    for line in check_targets(summary) + check_small(small):
        print("  " + line)
    result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), quick=args.quick,
                  cost=cost.to_dict(), families={f: dict(zip(("max_len", "cap", "group"), v)) for f, v in FAMILIES.items()},
                  dp=list(dps), seeds=list(seeds), targets=TARGETS, labels=PLANNERS, summary=summary, rows=rows,
                  small=small, mid=mid, mid_limit_s=mid_args.mid_limit, volume_max_work=padded.VOLUME_MAX_WORK)
    if not args.no_write:
        vmw = mid_args.volume_max_work
        stem = save_json("layouts" if vmw is None else f"layouts-volume{vmw:g}", result)
        print(f"\nwrote {stem}.json")
    return result


if __name__ == "__main__":
    main()
