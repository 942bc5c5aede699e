"""Layout quality of microplan vs the peers' planners, one step at a time, on synthetic RL traces.

Design note. For every trace family × dp × seed we build ONE optimizer step (a prefix of whole
prompts holding ~``spg`` samples per GPU, spg cycling 16/32/64 with the seed), plan it with every
planner, convert the result to ``plan[r][m]`` and score it with benchmarks/metrics.py (the
PEERS.md definitions, same for everyone). Caps are per family so that K ≈ 2–8 micro-batches per
rank; every cap is ≥ the family's ``max_len`` (no sample is over the cap). Cost model: a ~7B
dense decoder (metrics.dense_7b_cost). Planning time is one wall-clock run per case (see
bench_speed.py for medians of repeats). A peer that would crash upstream counts as a crash and
is left out of the other columns.

Forward rows (``*-forward``): the forward-only log-prob pass of the same step, planned at a
forward cap of 2, 3 or 4× the family's cap (cycled by seed) and scored with the forward-only cost
(metrics.dense_7b_forward_cost): ``microplan-forward`` is ``plan_forward`` and ``verl-forward``
verl's log-prob split (the same ``rearrange_micro_batches`` at ``log_prob_max_token_len_per_gpu``).

Run: ``python -m benchmarks.bench_planners [--quick]``. Prints the table and writes
``benchmarks/results/planners-<date>-<host>.{json,png}`` (``planners-local-…`` when only the
local rows run: ``--planners microplan-local microplan-local-rr``).
"""

from __future__ import annotations

import argparse
import datetime
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import microplan as mp  # noqa: E402
from microplan.traces import generate  # noqa: E402
from microplan.stages import local as local_stage  # noqa: E402

from benchmarks._results import save_json  # noqa: E402
from benchmarks.metrics import dense_7b_cost, dense_7b_forward_cost, from_microplan, step_metrics  # noqa: E402
from benchmarks.peers import PEERS, PeerCrash, plan_verl  # noqa: E402
from benchmarks.peers.verl import balance_batch  # noqa: E402


#: family -> (max_len, per-GPU token cap, samples per prompt / rollouts per prompt)
FAMILIES: dict[str, tuple[int, int, int]] = {
    "grpo-longtail": (16384, 32768, 8),
    "bimodal": (16384, 49152, 8),
    "stepwise-multiturn": (16384, 24576, 4),
    "long-context": (32768, 49152, 8),
}
SPG = (16, 32, 64)  # samples per GPU per step, cycled by seed
FORWARD_CAP_MULT = (2, 3, 4)  # forward cap = this × the family's (training) cap, cycled by seed
TARGETS = {"over_cap": 0, "lockstep_med": 1.005, "lockstep_worst": 1.01, "step_sync": 1.002,
           "forward_lockstep_med": 1.005, "forward_k_at_lb": 1.0, "local_lock_split_worst": 1.01}

Runner = Callable[[mp.Batch, int, int, object], tuple]  # (plan[r][m], seconds[, extra row columns])


# -- planners -----------------------------------------------------------------------------------

def _microplan(sync: str) -> Runner:
    def run(batch, dp, cap, cost):
        cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, cost=cost, sync=sync)
        t = time.perf_counter()
        p = mp.plan(batch, cfg)
        return from_microplan(p), time.perf_counter() - t
    return run


def verl_split_owners(seq_lens: np.ndarray, dp: int) -> np.ndarray:
    """Owner rank of each sample after verl's driver split (KK equal_size on its workload, pads dropped)."""
    parts, _, _ = balance_batch(np.asarray(seq_lens), dp)
    own = np.empty(len(seq_lens), dtype=np.int64)
    for r, part in enumerate(parts):
        real = [i for i in part if i < len(seq_lens)]
        own[real] = r
    return own


def _microplan_local(pin: str, repair: bool = True) -> Runner:
    """Local placement: samples pinned to ranks by verl's driver split or by round robin (arrival
    order); the row also gets ``lock_split``, lockstep over the bound the split allows
    (``microplan.stats.split_lower_bound``, from the plan's own stats). ``repair=False``: the local
    planner without its per-rank repair (``stages.local.REPAIR``), for its time and balance side by side."""
    def run(batch, dp, cap, cost):
        n = batch.num_samples
        own = verl_split_owners(batch.seq_lens, dp) if pin == "verl-split" else np.arange(n) % dp
        cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, cost=cost, placement="local")
        saved, local_stage.REPAIR = local_stage.REPAIR, repair
        try:
            t = time.perf_counter()
            p = mp.plan(batch.with_rank_of(own), cfg)
            dt = time.perf_counter() - t
        finally:
            local_stage.REPAIR = saved
        st = p.stats.steps[0]
        return from_microplan(p), dt, {"lock_split": st.lockstep_time / st.split_lower_bound}
    return run


def _peer(fn) -> Runner:
    def run(batch, dp, cap, cost):
        lens = np.asarray(batch.seq_lens)
        t = time.perf_counter()
        p = fn(lens, dp=dp, cap=cap, cost=cost)
        return p, time.perf_counter() - t
    return run


def _microplan_forward(batch, dp, cap, cost):
    cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, cost=cost)
    t = time.perf_counter()
    p = mp.plan_forward(batch, cfg)
    return from_microplan(p), time.perf_counter() - t


PLANNERS: dict[str, tuple[Runner, str]] = {
    "microplan": (_microplan("micro"), f"microplan {mp.__version__} sync='micro'"),
    "microplan-step": (_microplan("step"), f"microplan {mp.__version__} sync='step'"),
    "microplan-local": (_microplan_local("verl-split"),
                        f"microplan {mp.__version__} placement='local', samples pinned by verl's driver split"),
    "microplan-local-rr": (_microplan_local("round-robin"),
                           f"microplan {mp.__version__} placement='local', samples pinned round robin"),
    "microplan-local-norepair": (_microplan_local("verl-split", repair=False),
                                 f"microplan {mp.__version__} placement='local', verl's split, without the per-rank repair"),
    **{name: (_peer(fn), label) for name, (fn, label) in PEERS.items()},
    "microplan-forward": (_microplan_forward, f"microplan {mp.__version__} plan_forward (forward cap)"),
    "verl-forward": (_peer(plan_verl), "verl (2026-08) log-prob pass: rearrange_micro_batches at the forward cap"),
}
FORWARD = {"microplan-forward", "verl-forward"}  # planned at the forward cap, scored with the forward cost


# -- cases --------------------------------------------------------------------------------------

def make_step(family: str, dp: int, spg: int, seed: int, max_len: int | None = None) -> mp.Batch:
    """One step: the shortest prefix of whole prompts with at least dp·spg samples.

    ``max_len`` overrides the family's context window (benchmarks/bench_cp.py)."""
    fam_len, _, group = FAMILIES[family]
    max_len = fam_len if max_len is None else max_len
    target = dp * spg
    per_prompt = group * (2 if family == "stepwise-multiturn" else 1)  # multiturn: >= ~2 turns/rollout
    prompts = -(-target // per_prompt) * 2
    b = generate(family, num_prompts=prompts, samples_per_prompt=group, max_len=max_len, seed=seed)
    pid = np.asarray(b.prompt_ids)
    cut = whole_prompts(pid, target)
    return mp.Batch(b.seq_lens[:cut], loss_tokens=b.loss_tokens[:cut], prompt_lens=b.prompt_lens[:cut],
                    prompt_ids=pid[:cut], rollout_ids=b.rollout_ids[:cut])


def whole_prompts(prompt_ids: np.ndarray, target: int) -> int:
    """Samples in the shortest prefix of whole prompts holding at least ``target`` samples (all of
    them if fewer); ``prompt_ids`` non-decreasing, a prompt's samples contiguous."""
    pid = np.asarray(prompt_ids)
    return int(np.searchsorted(pid, pid[min(target, pid.size) - 1], side="right"))


def run_case(family: str, dp: int, seed: int, cost, planners: list[str], forward_cost=None) -> list[dict]:
    """Plan and score one step with every planner; one row per planner (forward planners at the
    forward cap, scored with ``forward_cost``)."""
    _, train_cap, _ = FAMILIES[family]
    spg = SPG[seed % len(SPG)]
    batch = make_step(family, dp, spg, seed)
    rows = []
    for name in planners:
        fwd = name in FORWARD
        cap = train_cap * FORWARD_CAP_MULT[seed % len(FORWARD_CAP_MULT)] if fwd else train_cap
        cost_ = (forward_cost or dense_7b_forward_cost()) if fwd else cost
        row = dict(family=family, dp=dp, seed=seed, spg=spg, planner=name, samples=batch.num_samples,
                   tokens=int(np.sum(batch.seq_lens)), cap=cap, passes="forward" if fwd else "train")
        try:
            plan, dt, *more = PLANNERS[name][0](batch, dp, cap, cost_)  # more: the row's extra columns
        except PeerCrash as e:
            rows.append({**row, "crash": str(e)})
            continue
        m = step_metrics(plan, np.asarray(batch.seq_lens), dp=dp, cap=cap, cost=cost_)
        rows.append({**row, "crash": None, "ms": dt * 1e3, **m.to_dict(), **(more[0] if more else {})})
    return rows


# -- summary ------------------------------------------------------------------------------------

def _agg(vals: list[float], worst=max) -> tuple[float, float]:
    return (float(np.median(vals)), float(worst(vals))) if vals else (float("nan"), float("nan"))


def group_rows(rows: list[dict], keys: tuple[str, ...]) -> dict[tuple, list[dict]]:
    """Rows grouped by their values of ``keys``, in first-appearance order."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups


def summarise(rows: list[dict], keys: tuple[str, ...] = ("family", "planner")) -> list[dict]:
    """Median and worst of every metric per group of ``keys`` (crashed cases counted apart)."""
    out = []
    for key, rs in group_rows(rows, keys).items():
        ok = [r for r in rs if r["crash"] is None]
        s = dict(zip(keys, key), cases=len(rs), crashes=len(rs) - len(ok))
        for col in ("over_cap", "max_tokens_ratio", "empties", "lockstep_ratio", "step_sync_ratio",
                    "lockstep_rank_ratio", "ms"):
            s[col] = _agg([r[col] for r in ok])
        s["k_excess"] = _agg([r["K"] - r["K_lb"] for r in ok])
        s["lock_split"] = _agg([r["lock_split"] for r in ok if "lock_split" in r])
        s["k_at_lb"] = float(np.mean([r["K"] == r["K_lb"] for r in ok])) if ok else float("nan")
        s["equal"] = float(np.mean([r["equal_counts"] for r in ok])) if ok else float("nan")
        s["lost"] = max((r["lost"] for r in ok), default=0)
        s["dup"] = max((r["duplicated"] for r in ok), default=0)
        out.append(s)
    return out


def _mw(x: tuple[float, float], fmt: str) -> str:
    return f"{x[0]:{fmt}}/{x[1]:{fmt}}"


COLUMNS = [("over-cap", 9, lambda s: _mw(s["over_cap"], ".0f")),
           ("tok/cap", 9, lambda s: _mw(s["max_tokens_ratio"], ".2f")),
           ("equal", 5, lambda s: f"{100 * s['equal']:.0f}%"),
           ("empty", 7, lambda s: _mw(s["empties"], ".0f")),
           ("lost/dup", 8, lambda s: f"{s['lost']}/{s['dup']}"),
           ("K-Klb", 5, lambda s: _mw(s["k_excess"], ".0f")),
           ("K=Klb", 5, lambda s: f"{100 * s['k_at_lb']:.0f}%"),
           ("lockstep/LB", 13, lambda s: _mw(s["lockstep_ratio"], ".4f")),
           ("stepsync/LB", 13, lambda s: _mw(s["step_sync_ratio"], ".4f")),
           ("lock/rankLB", 13, lambda s: _mw(s["lockstep_rank_ratio"], ".4f")),
           ("plan ms", 13, lambda s: _mw(s["ms"], ".1f")),
           ("crash", 5, lambda s: f"{s['crashes']}")]


def format_table(summary: list[dict], keys: tuple[str, ...] = ("family", "planner"), columns: list | None = None) -> str:
    """Fixed-width table; cells are median/worst over the cases of a row. ``columns``: (name, width,
    cell function) triples (default: this benchmark's COLUMNS)."""
    columns = COLUMNS if columns is None else columns
    widths = [max(len(k), *(len(str(s[k])) for s in summary)) for k in keys]
    head = "  ".join(k.ljust(w) for k, w in zip(keys, widths)) + "  " + "  ".join(n.rjust(w) for n, w, _ in columns)
    lines = [head, "-" * len(head)]
    last = None
    for s in summary:
        if last is not None and s[keys[0]] != last:
            lines.append("")
        last = s[keys[0]]
        cells = [str(s[k]).ljust(w) for k, w in zip(keys, widths)]
        lines.append("  ".join(cells) + "  " + "  ".join(f(s).rjust(w) for _, w, f in columns))
    return "\n".join(lines)


# -- chart ----------------------------------------------------------------------------------------

def plot(summary: list[dict], planners: list[str], path: Path) -> None:
    """Two panels per family: lockstep/LB and over-cap count (median bar, worst tick)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = list(dict.fromkeys(s["family"] for s in summary))
    by = {(s["family"], s["planner"]): s for s in summary}
    fig, axes = plt.subplots(2, 1, figsize=(12, 8))
    w = 0.8 / len(planners)
    x = np.arange(len(fams))
    for i, p in enumerate(planners):
        med = [by[f, p]["lockstep_ratio"][0] for f in fams]
        worst = [by[f, p]["lockstep_ratio"][1] for f in fams]
        over = [by[f, p]["over_cap"] for f in fams]
        axes[0].bar(x + i * w, med, w, label=p)
        axes[0].scatter(x + i * w, worst, marker="_", color="k", s=60)
        axes[1].bar(x + i * w, [o[0] for o in over], w, label=p)
        axes[1].scatter(x + i * w, [o[1] for o in over], marker="_", color="k", s=60)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_ylim(0.95, None)
    axes[0].set_ylabel("lockstep / LB (bar: median, tick: worst)")
    axes[1].set_ylabel("over-cap micro-batches (bar: median, tick: worst)")
    for ax in axes:
        ax.set_xticks(x + 0.4 - w / 2, fams)
    axes[0].legend(ncol=4, fontsize=8)
    fig.suptitle("microplan vs peers, one step per case; cost: ~7B dense FLOPs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------------

def bench_args(argv: list[str] | None, doc: str, planners: list[str], full_dps: tuple[int, ...],
               families: list[str] | None = None) -> tuple[argparse.Namespace, tuple[int, ...], range]:
    """The options every family × dp × seed benchmark takes; (args, dps, seeds). ``families``: the
    benchmark's own family names (default: this module's)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="dp 8 and 32, 3 seeds (under ~2 minutes)")
    ap.add_argument("--families", nargs="*", default=list(FAMILIES) if families is None else families)
    ap.add_argument("--planners", nargs="*", default=planners)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    dps, seeds = ((8, 32), range(3)) if args.quick else (full_dps, range(6))
    return args, dps, seeds


def run_grid(run_case: Callable[..., list[dict]], families: list[str], dps: tuple[int, ...], seeds: range,
             *extra) -> list[dict]:
    """The rows of ``run_case(family, dp, seed, *extra)`` over the family × dp × seed grid, in that order."""
    return [row for fam in families for dp in dps for seed in seeds for row in run_case(fam, dp, seed, *extra)]


def main(argv: list[str] | None = None) -> dict:
    args, dps, seeds = bench_args(argv, __doc__, list(PLANNERS), (8, 32, 128))
    cost, fcost = dense_7b_cost(), dense_7b_forward_cost()
    print(f"cost model: FlopsCost(linear={cost.linear:.3g}, quadratic={cost.quadratic:.6g}, "
          f"per_micro={cost.per_micro:.3g})  [~7B dense: 6·7e9 FLOPs/token, 6·32·4096 per L², 256 tokens/micro]")
    print(f"forward rows: cap × {'/'.join(map(str, FORWARD_CAP_MULT))} (by seed), forward-only cost "
          f"FlopsCost(linear={fcost.linear:.3g}, quadratic={fcost.quadratic:.6g}, per_micro={fcost.per_micro:.3g})")
    rows = run_grid(run_case, args.families, dps, seeds, cost, args.planners, fcost)
    summary = summarise(rows)
    print("cells: median/worst over dp x seed cases; equal, K=Klb: share of cases")
    print(format_table(summary))
    local = summarise([r for r in rows if "lock_split" in r], ("family", "dp", "planner"))
    if local:
        print("\nlocal placement: lockstep / the bound the split allows (stats.split_lower_bound), median/worst:")
        print(format_table(local, ("family", "dp", "planner"),
                           [("lock/split", 13, lambda s: _mw(s["lock_split"], ".4f")),
                            ("lockstep/LB", 13, lambda s: _mw(s["lockstep_ratio"], ".4f")),
                            ("plan ms", 13, lambda s: _mw(s["ms"], ".1f"))]))
    mp_rows = [r for r in rows if r["planner"].startswith("microplan")]
    print("\nmicroplan by family x dp:")
    print(format_table(summarise(mp_rows, ("family", "dp", "planner")), ("family", "dp", "planner")))
    result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), quick=args.quick,
                  cost=cost.to_dict(), forward_cost=fcost.to_dict(), forward_cap_mult=FORWARD_CAP_MULT,
                  families={f: dict(zip(("max_len", "cap", "group"), v)) for f, v in FAMILIES.items()},
                  spg=SPG, dp=list(dps), seeds=list(seeds), targets=TARGETS,
                  labels={k: v[1] for k, v in PLANNERS.items()}, summary=summary, rows=rows)
    if not args.no_write:
        # a run of the local rows alone (--planners microplan-local microplan-local-rr) is its own file
        local_only = all(p.startswith("microplan-local") for p in args.planners)
        stem = save_json("planners-local" if local_only else "planners", result)
        plot(summary, args.planners, stem.with_suffix(".png"))
        print(f"\nwrote {stem}.json and {stem}.png")
    return result


if __name__ == "__main__":
    main()
