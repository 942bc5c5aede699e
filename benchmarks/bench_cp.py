"""Context parallel on the long-context family: dynamic CP vs fixed CP vs no CP, one step per case.

Design note. A plane of G GPUs with a per-GPU token cap (activation memory) trains one step of
the long-context family (benchmarks/bench_planners.make_step: whole prompts, ~8/16/32 samples per
GPU cycled by seed). Samples reach ``max_len`` = 2× or 4× the cap, so without CP they do not fit:

- no CP at the cap: refused (PlanError naming the sample), shown as such;
- no CP with the cap raised to ``max_len`` (2–4× the activation memory per GPU): a reference;
- fixed CP c (``ContextParallel(size=c)``, G / c DP groups) for c = the degree the longest sample
  needs and twice that;
- dynamic CP (``ContextParallel(max_size=c)``, every GPU of the plane one pool) for the same c.

Score: predicted lockstep time (Σ_m max_r per-GPU cost, the plan's own stats under the ~7B dense
cost model of benchmarks/metrics.py, in which attention and linear work both divide by the CP
degree) over one common lower bound per case, LB = max(Σ cost / G + K_lb · per_micro,
max sample cost / c_big + per_micro), K_lb = ⌈tokens / (G · cap)⌉, c_big = the largest CP degree
tried; and the ratio to fixed CP of the same degree, side by side in one run. "mixed": share of
steps where the dynamic plan runs CP groups of different widths in one micro slot.

Run: ``python -m benchmarks.bench_cp [--quick]``. Prints the table and writes
``benchmarks/results/cp-<date>-<host>.{json,png}``.
"""

from __future__ import annotations

import argparse
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
from benchmarks.bench_planners import make_step  # noqa: E402
from benchmarks.metrics import dense_7b_cost  # noqa: E402

SETTINGS = ((32768, 16384), (131072, 32768))  # (max_len, per-GPU cap): the longest sample needs CP 2 / 4
SPG = (8, 16, 32)


def configs(G: int, cap: int, max_len: int, cost) -> dict[str, mp.PlanConfig | None]:
    need = 1 << int(np.ceil(np.log2(max_len / cap)))
    out: dict[str, mp.PlanConfig | None] = {
        "no CP, cap": mp.PlanConfig(dp_size=G, max_tokens_per_micro=cap, cost=cost),
        "no CP, cap=max_len": mp.PlanConfig(dp_size=G, max_tokens_per_micro=max_len, cost=cost),
    }
    for c in (need, 2 * need):
        out[f"fixed CP {c}"] = mp.PlanConfig(dp_size=G // c, max_tokens_per_micro=cap, cost=cost,
                                             context_parallel=mp.ContextParallel(size=c))
        out[f"dynamic CP <={c}"] = mp.PlanConfig(dp_size=G, max_tokens_per_micro=cap, cost=cost,
                                                 context_parallel=mp.ContextParallel(max_size=c))
    return out


def _mixed(plan: mp.Plan) -> float:
    return float(np.mean([any(len({row[m].cp_size for row in s.micros}) > 1 for m in range(s.micro_count))
                          for s in plan.steps]))


def run_case(max_len: int, cap: int, G: int, seed: int, cost) -> list[dict]:
    batch = make_step("long-context", G, SPG[seed % len(SPG)], seed, max_len=max_len)
    c = cost.sample_costs(batch.seq_lens)
    tokens = int(np.sum(batch.seq_lens))
    cfgs = configs(G, cap, max_len, cost)
    c_big = max(cfg.context_parallel.size or cfg.context_parallel.max_size
                for cfg in cfgs.values() if cfg.context_parallel is not None)
    lb = max(c.sum() / G + -(-tokens // (G * cap)) * cost.per_micro, c.max() / c_big + cost.per_micro)
    rows = []
    for name, cfg in cfgs.items():
        row = dict(max_len=max_len, cap=cap, G=G, seed=seed, samples=batch.num_samples, tokens=tokens,
                   config=name, error=None)
        t = time.perf_counter()
        try:
            plan = mp.plan(batch, cfg)
        except mp.PlanError as e:
            rows.append({**row, "error": str(e)})
            continue
        ms = (time.perf_counter() - t) * 1e3
        plan.validate()
        s = plan.stats
        rows.append({**row, "ms": ms, "K": s.micro_count, "lockstep_ratio": s.lockstep_time / lb,
                     "max_gpu_tokens": s.max_micro_tokens, "placeholders": s.num_placeholders,
                     "mixed": _mixed(plan) if cfg.context_parallel and cfg.context_parallel.dynamic else 0.0,
                     "lockstep": s.lockstep_time})
    by = {r["config"]: r for r in rows}
    for r in rows:
        ref = by.get(r["config"].replace("dynamic CP <=", "fixed CP "))
        if r["config"].startswith("dynamic") and r["error"] is None and ref and ref["error"] is None:
            r["vs_fixed"] = r["lockstep"] / ref["lockstep"]
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["max_len"], r["cap"], r["config"]), []).append(r)
    out = []
    for (max_len, cap, name), rs in groups.items():
        ok = [r for r in rs if r["error"] is None]

        def mw(k, rs=ok):
            v = [r[k] for r in rs if k in r]
            return (float(np.median(v)), float(np.max(v))) if v else None
        out.append(dict(max_len=max_len, cap=cap, config=name, cases=len(rs), refused=len(rs) - len(ok),
                        lockstep_ratio=mw("lockstep_ratio"), vs_fixed=mw("vs_fixed"), ms=mw("ms"),
                        max_gpu_tokens=max((r["max_gpu_tokens"] for r in ok), default=None),
                        mixed=float(np.mean([r["mixed"] for r in ok])) if ok else None,
                        placeholders=max((r["placeholders"] for r in ok), default=None)))
    return out


def format_table(summary: list[dict]) -> str:
    def mw(x, f):
        return "-" if x is None else f"{x[0]:{f}}/{x[1]:{f}}"

    def pct(x):
        return "-" if x is None else f"{100 * x:.0f}%"
    head = (f"{'max_len/cap':>13}  {'config':<20} {'refused':>7}  {'lockstep/LB':>15}  {'vs fixed CP':>15}  "
            f"{'GPU tok max':>11}  {'mixed':>5}  {'plan ms':>13}")
    lines = [head, "-" * len(head)]
    last = None
    for s in summary:
        key = f"{s['max_len']}/{s['cap']}"
        if last is not None and key != last:
            lines.append("")
        last = key
        lines.append(f"{key:>13}  {s['config']:<20} {s['refused']:>3}/{s['cases']:<3}  {mw(s['lockstep_ratio'], '.4f'):>15}  "
                     f"{mw(s['vs_fixed'], '.4f'):>15}  {s['max_gpu_tokens'] if s['max_gpu_tokens'] is not None else '-':>11}  "
                     f"{pct(s['mixed']):>5}  {mw(s['ms'], '.1f'):>13}")
    return "\n".join(lines)


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((s["max_len"], s["cap"]) for s in summary))
    fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        rows = [s for s in summary if (s["max_len"], s["cap"]) == key and s["lockstep_ratio"] is not None]
        x = np.arange(len(rows))
        ax.bar(x, [s["lockstep_ratio"][0] for s in rows], color=["#888" if "no CP" in s["config"] else
                                                                  "#4a7" if "dynamic" in s["config"] else "#47a"
                                                                  for s in rows])
        ax.scatter(x, [s["lockstep_ratio"][1] for s in rows], marker="_", color="k", s=80)
        ax.set_xticks(x, [s["config"] for s in rows], rotation=30, ha="right", fontsize=8)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylim(0.95, None)
        ax.set_title(f"max_len {key[0]}, cap {key[1]} tokens/GPU")
        ax.set_ylabel("lockstep / LB (bar median, tick worst)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="planes of 8 and 32 GPUs, 3 seeds")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    Gs, seeds = ((8, 32), range(3)) if args.quick else ((8, 32, 128), range(6))
    cost = dense_7b_cost()
    rows = [r for ml, cap in SETTINGS for G in Gs for seed in seeds for r in run_case(ml, cap, G, seed, cost)]
    summary = summarise(rows)
    print("long-context family, one step per case; cells: median/worst over planes of "
          f"{'/'.join(map(str, Gs))} GPUs x seeds {seeds.start}-{seeds.stop - 1}")
    print(format_table(summary))
    refusal = next((r["error"] for r in rows if r["error"]), None)
    if refusal:
        print(f"\nno CP at the cap is refused, e.g.: {refusal}")
    result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), quick=args.quick,
                  cost=cost.to_dict(), settings=SETTINGS, planes=list(Gs), seeds=list(seeds), spg=SPG,
                  microplan=mp.__version__, summary=summary, rows=rows)
    if not args.no_write:
        stem = save_json("cp", result)
        plot(summary, stem.with_suffix(".png"))
        print(f"\nwrote {stem}.json and {stem}.png")
    return result


if __name__ == "__main__":
    main()
