"""Context parallel on the long-context family, priced: dynamic CP vs fixed CP vs no CP, one step per case.

Design note. A plane of G GPUs with a per-GPU token cap (activation memory) trains one step of
the long-context family (benchmarks/bench_planners.make_step: whole prompts, ~8/16/32 samples per
GPU cycled by seed). Samples reach ``max_len`` = 2× or 4× the cap, so without CP they do not fit.

The cost is the ~7B dense model of benchmarks/metrics.py plus a CP term (``microplan.CPCost``)
derived from the same model's config (Llama-2-7B shape: 32 layers × 32 kv heads × 128, bf16,
forward all-gather + backward reduce-scatter of K/V: 1 MiB per token) and an interconnect, in two
scenarios, each with a hidden truth the planner is NOT given (its CP term differs):

- ``nvlink``: planner 300 GB/s, overlap 0, efficiency 0.95; truth 150 GB/s, overlap 0.5,
  efficiency 0.9, split overhead 0.5 × per_micro;
- ``ib``: planner 40 GB/s, overlap 0, efficiency 0.85; truth 25 GB/s, overlap 0.25, efficiency
  0.8, split overhead 1 × per_micro.

Plans per case (all planned with the scenario's priced cost unless named otherwise):
- no CP at the cap: refused (PlanError naming the sample); no CP with the cap raised to
  ``max_len`` (2–4× the activation memory per GPU): a reference only, it breaks the memory budget;
- fixed CP c (``ContextParallel(size=c)``) for c = the degree the longest sample needs and twice that;
- dynamic CP (``ContextParallel(max_size=c)``) for the same c; and dynamic CP ≤ 2·need planned
  WITHOUT the CP term (perfect scaling: microplan before the CP term), scored with it.

Scores: ``pred`` = predicted lockstep time under the planner's priced cost, over the best fixed-CP
plan of the case (target: dynamic <= 1, i.e. never slower than the best fixed CP, and no CP-free
plan fits the cap); ``truth`` = the same plans' lockstep time under the hidden truth, over the best
fixed-CP plan under that truth; ``split`` = share of the samples that fit one GPU which the plan
runs split over a CP group (fixed CP splits all of them; dynamic CP splits one only where its
layout is predicted faster: the layout that splits none is always one of its candidates).

``--nodes``: CP groups up to 16 wide on nodes of 8 GPUs, the truth NVLink inside a node and
InfiniBand across (``CPCost.node_size``), on the long-context family (samples up to 8 GPUs long)
and on straggler steps (one 100k–131k sample among short ones); dynamic CP planned with a
one-rate cost (the node's rate, or the network's) and with both tiers, each scored under the
truth against the best plan of the case, with the share of its CP groups that cross a node.

Run: ``python -m benchmarks.bench_cp [--quick] [--nodes]``. Prints the table and writes
``benchmarks/results/cp-<date>-<host>.{json,png}`` (``cp-nodes-<date>-<host>.json``).
"""

from __future__ import annotations

import argparse
import datetime
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import microplan as mp  # noqa: E402
from microplan.cost.cp import DEFAULT_GPU_FLOPS  # noqa: E402
from microplan.stages.assign import grid_time  # noqa: E402
from microplan.stats import step_cost_grid  # noqa: E402

from benchmarks._results import save_json  # noqa: E402
from benchmarks.bench_planners import make_step  # noqa: E402
from benchmarks.metrics import dense_7b_cost  # noqa: E402

SETTINGS = ((32768, 16384), (131072, 32768))  # (max_len, per-GPU cap): the longest sample needs CP 2 / 4
SPG = (8, 16, 32)
#: The benchmark model's shape (benchmarks/metrics.py: ~7B dense, Llama-2-7B: multi-head attention).
LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000}


def _cp(bandwidth: float, **kw) -> mp.CPCost:
    return mp.CPCost.from_hf_config(LLAMA2_7B, bandwidth=bandwidth, units_per_second=DEFAULT_GPU_FLOPS, **kw)


def scenarios(base: mp.FlopsCost) -> dict[str, tuple[mp.FlopsCost, mp.FlopsCost]]:
    """name -> (the planner's priced cost, the hidden truth)."""
    pm = base.per_micro
    return {
        "nvlink": (replace(base, cp=_cp(3e11, overlap=0.0, efficiency=0.95)),
                   replace(base, cp=_cp(1.5e11, overlap=0.5, efficiency=0.9, split_overhead=0.5 * pm))),
        "ib": (replace(base, cp=_cp(4e10, overlap=0.0, efficiency=0.85)),
               replace(base, cp=_cp(2.5e10, overlap=0.25, efficiency=0.8, split_overhead=pm))),
    }


def configs(G: int, cap: int, max_len: int, cost, base) -> dict[str, mp.PlanConfig | None]:
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
    out[f"dyn <={2 * need} no CP term"] = mp.PlanConfig(dp_size=G, max_tokens_per_micro=cap, cost=base,
                                                          context_parallel=mp.ContextParallel(max_size=2 * need))
    return out


def time_under(plan: mp.Plan, cost) -> float:
    """The plan's lockstep time under ``cost`` (the plan's own pricing, stats.step_cost_grid)."""
    cfg = replace(plan.config, cost=cost)
    return float(sum(grid_time(step_cost_grid(plan.batch, cfg, s), "micro") for s in plan.steps))


def split_share(plan: mp.Plan, cap: int) -> float:
    """Share of the samples that fit one GPU (<= cap tokens) that run split over a CP group."""
    fits = plan.batch.seq_lens <= cap
    split = sum(int(fits[m.indices].sum()) for s in plan.steps for row in s.micros for m in row
                if m.cp_rank == 0 and m.cp_size > 1)
    return split / max(int(fits.sum()), 1)


def run_case(max_len: int, cap: int, G: int, seed: int, scenario: str, cost, truth, base) -> list[dict]:
    batch = make_step("long-context", G, SPG[seed % len(SPG)], seed, max_len=max_len)
    tokens = int(np.sum(batch.seq_lens))
    rows = []
    for name, cfg in configs(G, cap, max_len, cost, base).items():
        row = dict(scenario=scenario, max_len=max_len, cap=cap, G=G, seed=seed, samples=batch.num_samples,
                   tokens=tokens, config=name, error=None)
        t = time.perf_counter()
        try:
            plan = mp.plan(batch, cfg)
        except mp.PlanError as e:
            rows.append({**row, "error": str(e)})
            continue
        ms = (time.perf_counter() - t) * 1e3
        plan.validate()
        rows.append({**row, "ms": ms, "K": plan.stats.micro_count, "pred": time_under(plan, cost),
                     "truth": time_under(plan, truth), "split": split_share(plan, cap),
                     "mixed": _mixed(plan) if cfg.context_parallel and cfg.context_parallel.dynamic else 0.0})
    fixed = [r for r in rows if r["config"].startswith("fixed") and r["error"] is None]
    best_p, best_t = min(r["pred"] for r in fixed), min(r["truth"] for r in fixed)
    for r in rows:
        if r["error"] is None:
            r["pred_vs_fixed"], r["truth_vs_fixed"] = r["pred"] / best_p, r["truth"] / best_t
            same = next((f for f in fixed if f["config"] == r["config"].replace("dynamic CP <=", "fixed CP ")), None)
            if same is not None and r["config"].startswith("dynamic"):
                r["pred_vs_same_fixed"] = r["pred"] / same["pred"]
    return rows


NODE = 8  # GPUs per node in the ``--nodes`` scenario
NODE_CAP = 16384
NODE_SPG = (1, 2, 4, 8, 16, 32)  # long-context samples per GPU, cycled by seed
STRAGGLER_SPG = (1, 2, 4)        # straggler steps: samples per GPU, cycled by seed


def node_costs(base: mp.FlopsCost) -> tuple[dict[str, mp.FlopsCost], mp.FlopsCost]:
    """``--nodes``: planners' costs (one rate, the node's or the network's, or both tiers) and the hidden truth
    (NVLink inside a node of 8, InfiniBand across, the ``nvlink`` scenario's truth otherwise)."""
    pm = base.per_micro
    truth = replace(base, cp=_cp(1.5e11, overlap=0.5, efficiency=0.9, split_overhead=0.5 * pm, node_size=NODE,
                                 cross_node_bandwidth=2.5e10))
    return {"one rate, NVLink": replace(base, cp=_cp(3e11, overlap=0.0, efficiency=0.95)),
            "one rate, IB": replace(base, cp=_cp(4e10, overlap=0.0, efficiency=0.95)),
            "two tiers": replace(base, cp=_cp(3e11, overlap=0.0, efficiency=0.95, node_size=NODE,
                                              cross_node_bandwidth=4e10))}, truth


def node_steps(G: int, seed: int) -> dict[str, mp.Batch]:
    """``--nodes`` steps: the long-context family with samples up to 8 GPUs long, and a straggler step (one
    sample of 100k–131k tokens among short ones of 0.5k–8k: the long trajectory of an agentic step)."""
    rng = np.random.default_rng(seed)
    n = G * STRAGGLER_SPG[seed % len(STRAGGLER_SPG)]
    straggler = np.r_[rng.integers(100_000, 131_000, 1), rng.integers(500, 8_000, n - 1)]
    return {"long-context": make_step("long-context", G, NODE_SPG[seed % len(NODE_SPG)], seed,
                                      max_len=8 * NODE_CAP),
            "straggler": mp.Batch(straggler.tolist())}


def run_nodes_case(family: str, batch: mp.Batch, G: int, seed: int, costs: dict, truth) -> list[dict]:
    """Dynamic CP <= 2·NODE on a plane of G GPUs in nodes of NODE, planned with each cost and scored under the
    truth; fixed CP NODE and 2·NODE planned with the two-tier cost as references."""
    cfgs = {f"dynamic <= {2 * NODE}, {name}": mp.PlanConfig(
        dp_size=G, max_tokens_per_micro=NODE_CAP, cost=cost, context_parallel=mp.ContextParallel(max_size=2 * NODE))
        for name, cost in costs.items()}
    for c in (NODE, 2 * NODE):
        cfgs[f"fixed CP {c}, two tiers"] = mp.PlanConfig(dp_size=G // c, max_tokens_per_micro=NODE_CAP,
                                                         cost=costs["two tiers"], context_parallel=mp.ContextParallel(size=c))
    rows = []
    for name, cfg in cfgs.items():
        plan = mp.plan(batch, cfg)
        plan.validate()
        wide = [m.cp_size > NODE for s in plan.steps for row in s.micros for m in row if m.cp_rank == 0]
        rows.append(dict(family=family, G=G, seed=seed, samples=batch.num_samples, config=name,
                         truth=time_under(plan, truth), pred=time_under(plan, cfg.cost),
                         cross_node=float(np.mean(wide)), K=plan.stats.micro_count))
    best = min(r["truth"] for r in rows)
    for r in rows:
        r["truth_vs_best"] = r["truth"] / best
    return rows


def nodes_main(quick: bool, write: bool) -> dict:
    base = dense_7b_cost()
    costs, truth = node_costs(base)
    Gs, seeds = ((32,), range(6)) if quick else ((32, 64, 128), range(12))
    rows = [r for G in Gs for seed in seeds for fam, batch in node_steps(G, seed).items()
            for r in run_nodes_case(fam, batch, G, seed, costs, truth)]
    print(f"CP groups across nodes of {NODE} GPUs (truth: NVLink 150 GB/s inside, InfiniBand 25 GB/s across); "
          f"planes of {'/'.join(map(str, Gs))} GPUs x seeds {seeds.start}-{seeds.stop - 1}; time under the truth / "
          "the best plan of the case, median/worst; cross-node: share of CP groups wider than a node, median/worst")
    print(f"{'family':<14}{'plan':<34}{'truth/best':>18}{'cross-node':>14}")
    for fam in ("long-context", "straggler"):
        for name in dict.fromkeys(r["config"] for r in rows):
            rs = [r for r in rows if r["config"] == name and r["family"] == fam]
            t = [r["truth_vs_best"] for r in rs]
            x = [r["cross_node"] for r in rs]
            print(f"{fam:<14}{name:<34}{np.median(t):>9.4f}/{max(t):.4f}{np.median(x):>8.0%}/{max(x):.0%}")
    result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), quick=quick, node=NODE,
                  cap=NODE_CAP, costs={k: c.to_dict() for k, c in costs.items()}, truth=truth.to_dict(),
                  planes=list(Gs), seeds=list(seeds), rows=rows)
    if write:
        print(f"wrote {save_json('cp-nodes', result)}.json")
    return result


def _mixed(plan: mp.Plan) -> float:
    return float(np.mean([any(len({row[m].cp_size for row in s.micros}) > 1 for m in range(s.micro_count))
                          for s in plan.steps]))


def summarise(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["scenario"], r["max_len"], r["cap"], r["config"]), []).append(r)
    out = []
    for (scenario, max_len, cap, name), rs in groups.items():
        ok = [r for r in rs if r["error"] is None]

        def mw(k, rs=ok):
            v = [r[k] for r in rs if k in r]
            return (float(np.median(v)), float(np.max(v))) if v else None
        out.append(dict(scenario=scenario, max_len=max_len, cap=cap, config=name, cases=len(rs),
                        refused=len(rs) - len(ok), pred_vs_fixed=mw("pred_vs_fixed"),
                        truth_vs_fixed=mw("truth_vs_fixed"), pred_vs_same_fixed=mw("pred_vs_same_fixed"),
                        split=mw("split"), ms=mw("ms"),
                        mixed=float(np.mean([r["mixed"] for r in ok])) if ok else None))
    return out


def format_table(summary: list[dict]) -> str:
    def mw(x, f):
        return "-" if x is None else f"{x[0]:{f}}/{x[1]:{f}}"

    def pct(x):
        return "-" if x is None else f"{100 * x[0]:.0f}%/{100 * x[1]:.0f}%"
    head = (f"{'scenario':<8} {'max_len/cap':>12}  {'config':<22} {'refused':>7}  {'pred/best fixed':>15}  "
            f"{'truth/best fixed':>16}  {'split fits-1':>12}  {'plan ms':>11}")
    lines = [head, "-" * len(head)]
    last = None
    for s in summary:
        key = (s["scenario"], f"{s['max_len']}/{s['cap']}")
        if last is not None and key != last:
            lines.append("")
        last = key
        lines.append(f"{key[0]:<8} {key[1]:>12}  {s['config']:<22} {s['refused']:>3}/{s['cases']:<3}  "
                     f"{mw(s['pred_vs_fixed'], '.4f'):>15}  {mw(s['truth_vs_fixed'], '.4f'):>16}  "
                     f"{pct(s['split']):>12}  {mw(s['ms'], '.0f'):>11}")
    return "\n".join(lines)


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((s["scenario"], s["max_len"], s["cap"]) for s in summary))
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        rows = [s for s in summary if (s["scenario"], s["max_len"], s["cap"]) == key and s["pred_vs_fixed"] is not None]
        x = np.arange(len(rows))
        colors = ["#888" if "no CP" in s["config"] and "term" not in s["config"] else
                  "#c84" if "term" in s["config"] else "#4a7" if "dynamic" in s["config"] else "#47a" for s in rows]
        ax.bar(x - 0.2, [s["pred_vs_fixed"][0] for s in rows], width=0.4, color=colors, label="predicted")
        ax.bar(x + 0.2, [s["truth_vs_fixed"][0] for s in rows], width=0.4, color=colors, alpha=0.5, label="hidden truth")
        ax.set_xticks(x, [s["config"] for s in rows], rotation=30, ha="right", fontsize=8)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_ylim(min(0.8, min(min(s["pred_vs_fixed"][0], s["truth_vs_fixed"][0]) for s in rows) - 0.05), None)
        ax.set_title(f"{key[0]}: max_len {key[1]}, cap {key[2]}", fontsize=9)
        ax.set_ylabel("lockstep / best fixed CP (median)")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="planes of 8 and 32 GPUs, 3 seeds")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--nodes", action="store_true",
                    help=f"CP groups up to {2 * NODE} wide on nodes of {NODE}: one-rate vs two-tier CP cost")
    args = ap.parse_args(argv)
    if args.nodes:
        return nodes_main(args.quick, not args.no_write)
    Gs, seeds = ((8, 32), range(3)) if args.quick else ((8, 32, 128), range(6))
    base = dense_7b_cost()
    scen = scenarios(base)
    rows = [r for name, (cost, truth) in scen.items() for ml, cap in SETTINGS for G in Gs for seed in seeds
            for r in run_case(ml, cap, G, seed, name, cost, truth, base)]
    summary = summarise(rows)
    print("long-context family, one step per case; cells: median/worst over planes of "
          f"{'/'.join(map(str, Gs))} GPUs x seeds {seeds.start}-{seeds.stop - 1}")
    print(format_table(summary))
    dyn = [r for r in rows if r["config"].startswith("dynamic") and r["error"] is None]
    worst = max(r["pred_vs_same_fixed"] for r in dyn)
    print(f"\ndynamic CP (priced) / fixed CP of the same max degree, predicted: worst {worst:.4f} over {len(dyn)} plans "
          f"(target <= 1); no CP-free plan fits the cap")
    refusal = next((r["error"] for r in rows if r["error"]), None)
    if refusal:
        print(f"no CP at the cap is refused, e.g.: {refusal}")
    result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), quick=args.quick,
                  scenarios={k: dict(planner=c.to_dict(), truth=t.to_dict()) for k, (c, t) in scen.items()},
                  settings=SETTINGS, planes=list(Gs), seeds=list(seeds), spg=SPG,
                  microplan=mp.__version__, summary=summary, rows=rows)
    if not args.no_write:
        stem = save_json("cp", result)
        plot(summary, stem.with_suffix(".png"))
        print(f"\nwrote {stem}.json and {stem}.png")
    return result


if __name__ == "__main__":
    main()
