"""Planners scored on MEASURED time: a real transformers Llama on CPU, every micro-batch run and timed.

Design note. A 4-layer Llama (hidden 256, float32, random weights; benchmarks/_timed_model.py)
runs forward + backward of every micro-batch of every rank of every scored step, under two
attention backends: transformers' sdpa over the packed row (T²) and microplan's per-sample
varlen attention (Σ L², ``register_attention``). Steps come from the trace families
(``microplan.traces.generate``) at CPU scale (samples up to ``max_len`` tokens), consecutive
chunks of whole prompts with ``dp·spg`` samples or more; dp ranks are simulated in one process.

Planners, all with the same per-GPU cap:

- ``microplan-flops``: ``FlopsCost.from_hf_config(config)``, the uncalibrated default.
- ``microplan-profiled``: ``microplan.torch.profile_cost`` on this model and backend, once.
- ``microplan-metered``: ``CostMeter(prior=from_hf_config)``, fed every micro-batch timing of the
  steps it ran itself: ``warmup`` steps before scoring, then it keeps learning while scored.
- ``verl``, ``slime``, ``nemo-rl``: benchmarks/peers (slime balances on the FLOPs model).

Scored per step: measured lockstep time Σ_m max_r t(r, m) (FSDP-style sync per micro-batch) and
step-sync time max_r Σ_m t(r, m) (DDP no_sync) of the same plan (microplan plans with
``sync="micro"``); K; over-cap micro-batches; for microplan's models the predicted-vs-measured
relative error per micro-batch and per step (lockstep). ``microplan-flops`` predicts FLOPs: its
errors are after the one best seconds-per-FLOP scale (median ratio), i.e. the model's shape only.
A composition (multiset of lengths) is timed once per backend and reused (fair across planners).
Empty micro-batches (a peer's MAX all-reduce leftovers) run as 1-token placeholders.

Run: ``python -m benchmarks.bench_measured [--quick]``. The full run is sized for ~30 minutes on
a quiet 2-core machine; ``--quick`` (one family, dp 4, tiny steps) takes ~2 minutes. Writes
``benchmarks/results/measured-<date>-<host>.{json,png}``.
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
from microplan.torch import profile_cost  # noqa: E402
from microplan.traces import generate  # noqa: E402

from benchmarks._results import save_json  # noqa: E402
from benchmarks._timed_model import BACKENDS, SimulatedModel, TimedModel  # noqa: E402
from benchmarks.peers import plan_nemo_rl, plan_slime, plan_verl  # noqa: E402

MICROPLAN = ("microplan-flops", "microplan-profiled", "microplan-metered")
PEERS = {"verl": plan_verl, "slime": plan_slime, "nemo-rl": plan_nemo_rl}
FAMILIES = ("grpo-longtail", "bimodal", "stepwise-multiturn", "long-context")
FULL = dict(families=FAMILIES, dps=(4, 8), max_len=2048, cap=2048, spg=6, warmup=3, scored=2,
            profile_repeats=3, repeats=1)
QUICK = dict(families=("grpo-longtail",), dps=(4,), max_len=1024, cap=1024, spg=4, warmup=1, scored=2,
             profile_repeats=1, repeats=1)
TARGETS = {"best_microplan_lowest": True, "longtail_margin_vs_best_peer": 0.03, "step_pred_error_median": 0.05}

LensPlan = list[list[np.ndarray]]


# -- steps ----------------------------------------------------------------------------------------

def make_steps(family: str, *, dp: int, spg: int, count: int, max_len: int, seed: int = 0) -> list[mp.Batch]:
    """``count`` consecutive steps of whole prompts, each with at least ``dp·spg`` samples."""
    group = 4 if family == "stepwise-multiturn" else 8
    target = dp * spg
    b = generate(family, num_prompts=max(8, 2 * count * target // group + 8), samples_per_prompt=group,
                 max_len=max_len, seed=seed)
    pid = np.asarray(b.prompt_ids)
    starts = np.flatnonzero(np.r_[True, pid[1:] != pid[:-1]])
    ends = np.r_[starts[1:], pid.size]
    steps, a = [], 0
    for e in ends:
        if e - a >= target:
            sl = slice(a, int(e))
            steps.append(mp.Batch(b.seq_lens[sl], loss_tokens=b.loss_tokens[sl], prompt_ids=pid[sl],
                                  rollout_ids=np.asarray(b.rollout_ids)[sl]))
            a = int(e)
            if len(steps) == count:
                return steps
    raise RuntimeError(f"{family}: not enough prompts for {count} steps of {target} samples")


# -- plans as lengths ------------------------------------------------------------------------------

def microplan_lens(batch: mp.Batch, dp: int, cap: int, cost) -> LensPlan:
    p = mp.plan(batch, mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, cost=cost, sync="micro"))
    return [[np.asarray(m.seq_lens) for m in row] for row in p.steps[0].micros]


def peer_lens(fn: Callable, batch: mp.Batch, dp: int, cap: int, cost) -> LensPlan:
    lens = np.asarray(batch.seq_lens)
    plan = fn(lens, dp=dp, cap=cap, cost=cost)
    return [[lens[np.where(idx < 0, ~idx, idx)] for idx in row] for row in plan]


# -- scoring ---------------------------------------------------------------------------------------

def lockstep(t: list[list[float]]) -> float:
    """Σ_m max_r t(r, m) (a rank without slot m contributes 0, as benchmarks/metrics.py)."""
    K = max((len(row) for row in t), default=0)
    return float(sum(max(row[m] for row in t if m < len(row)) for m in range(K)))


def step_sync(t: list[list[float]]) -> float:
    return float(max(sum(row) for row in t))


def _pred(cost, lens_plan: LensPlan) -> list[list[float]]:
    return [[float(cost.micro_cost(m if len(m) else [1])) for m in row] for row in lens_plan]


def score(model: TimedModel, lens_plan: LensPlan, cap: int, cost=None) -> dict:
    """Measured (and, with ``cost``, predicted) times of one plan of one step."""
    t = model.time_plan(lens_plan)
    row = dict(lockstep=lockstep(t), step_sync=step_sync(t), K=max(len(r) for r in lens_plan),
               micros=sum(len(r) for r in lens_plan),
               over_cap=int(sum(1 for r in lens_plan for m in r if len(m) > 1 and int(np.sum(m)) > cap)),
               measured=[x for r in t for x in r])
    if cost is not None:
        p = _pred(cost, lens_plan)
        row.update(predicted=[x for r in p for x in r], predicted_lockstep=lockstep(p))
    return row


def record(meter: mp.CostMeter, lens_plan: LensPlan, t: list[float]) -> None:
    flat = [m if len(m) else np.ones(1, dtype=np.int64) for r in lens_plan for m in r]
    for m, s in zip(flat, t):
        meter.record(m, s)


def errors(rows: list[dict], scaled: bool) -> dict:
    """Median/max |pred/meas - 1| per micro-batch and per step (lockstep); ``scaled``: after the best scale."""
    meas = np.concatenate([r["measured"] for r in rows])
    pred = np.concatenate([r["predicted"] for r in rows])
    s = float(np.median(meas / pred)) if scaled else 1.0
    step_m = np.array([r["lockstep"] for r in rows])
    step_p = np.array([r["predicted_lockstep"] for r in rows]) * s
    em, es = np.abs(pred * s / meas - 1), np.abs(step_p / step_m - 1)
    return dict(scale=s, micro_median=float(np.median(em)), micro_max=float(em.max()),
                step_median=float(np.median(es)), step_max=float(es.max()))


# -- one (backend, family, dp) case ------------------------------------------------------------------

def run_case(model: TimedModel, family: str, dp: int, opts: dict, prior, profiled, log) -> list[dict]:
    """Metered warm-up, then every planner on the scored steps; one row per (planner, step)."""
    cap = opts["cap"]
    steps = make_steps(family, dp=dp, spg=opts["spg"], count=opts["warmup"] + opts["scored"],
                       max_len=opts["max_len"], seed=opts["seed"])
    meter = mp.CostMeter(prior=prior)
    for batch in steps[:opts["warmup"]]:
        lp = microplan_lens(batch, dp, cap, meter.cost())
        record(meter, lp, [x for r in model.time_plan(lp) for x in r])
    rows = []
    for s, batch in enumerate(steps[opts["warmup"]:]):
        base = dict(backend=model.backend, family=family, dp=dp, step=s, samples=batch.num_samples,
                    tokens=int(np.sum(batch.seq_lens)))
        mcost = meter.cost()
        for name, cost in (("microplan-flops", prior), ("microplan-profiled", profiled), ("microplan-metered", mcost)):
            lp = microplan_lens(batch, dp, cap, cost)
            r = score(model, lp, cap, cost)
            if name == "microplan-metered":
                record(meter, lp, r["measured"])
            rows.append({**base, "planner": name, **r})
        for name, fn in PEERS.items():
            rows.append({**base, "planner": name, **score(model, peer_lens(fn, batch, dp, cap, prior), cap)})
        log(f"  {model.backend} {family} dp={dp} step {s}: " + "  ".join(
            f"{r['planner']}={r['lockstep']:.2f}s" for r in rows[-len(MICROPLAN) - len(PEERS):]))
    return rows


# -- summary ----------------------------------------------------------------------------------------

def summarise(rows: list[dict]) -> list[dict]:
    """Per (backend, family, dp, planner): Σ over scored steps of each time, vs best, prediction errors."""
    keys = ("backend", "family", "dp")
    cases: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        cases.setdefault(tuple(r[k] for k in keys), {}).setdefault(r["planner"], []).append(r)
    out = []
    for key, by in cases.items():
        tot = {p: sum(r["lockstep"] for r in rs) for p, rs in by.items()}
        fair_peers = [p for p in PEERS if p in by and all(r["over_cap"] == 0 for r in by[p])]
        best_peer = min((tot[p] for p in fair_peers), default=float("nan"))
        best_mp = min(tot[p] for p in ("microplan-profiled", "microplan-metered") if p in tot)
        for p, rs in by.items():
            s = dict(zip(keys, key), planner=p, steps=len(rs), lockstep=tot[p],
                     step_sync=sum(r["step_sync"] for r in rs), K=float(np.mean([r["K"] for r in rs])),
                     over_cap=sum(r["over_cap"] for r in rs), vs_best_peer=tot[p] / best_peer - 1,
                     vs_best=tot[p] / min(tot.values()) - 1, best_microplan_margin=1 - best_mp / best_peer)
            if "predicted" in rs[0]:
                s["errors"] = errors(rs, scaled=(p == "microplan-flops"))
            out.append(s)
    return out


def check_targets(summary: list[dict]) -> dict:
    """The issue's targets, per (backend, family, dp) case."""
    cases: dict[tuple, list[dict]] = {}
    for s in summary:
        cases.setdefault((s["backend"], s["family"], s["dp"]), []).append(s)
    out = {}
    for key, ss in cases.items():
        by = {s["planner"]: s for s in ss}
        best_mp = min(by[p]["lockstep"] for p in ("microplan-profiled", "microplan-metered"))
        errs = [by[p]["errors"]["step_median"] for p in ("microplan-profiled", "microplan-metered")]
        out["/".join(map(str, key))] = dict(
            lowest=bool(best_mp <= min(s["lockstep"] for s in ss)),
            margin_vs_best_peer=ss[0]["best_microplan_margin"],
            step_pred_error_median=min(errs))
    return out


def format_table(summary: list[dict]) -> str:
    head = (f"{'backend':<12}{'family':<20}{'dp':>3}  {'planner':<19}{'lockstep s':>11}{'vs best peer':>13}"
            f"{'step-sync s':>12}{'K':>5}{'over':>5}{'err micro':>10}{'err step':>9}")
    lines = [head, "-" * len(head)]
    last = None
    for s in summary:
        key = (s["backend"], s["family"], s["dp"])
        if last is not None and key != last:
            lines.append("")
        last = key
        e = s.get("errors")
        err = f"{e['micro_median']:>9.1%}{e['step_median']:>9.1%}" if e else f"{'':>9}{'':>9}"
        lines.append(f"{s['backend']:<12}{s['family']:<20}{s['dp']:>3}  {s['planner']:<19}{s['lockstep']:>11.2f}"
                     f"{s['vs_best_peer']:>+13.1%}{s['step_sync']:>12.2f}{s['K']:>5.1f}{s['over_cap']:>5} {err}")
    return "\n".join(lines)


def plot(summary: list[dict], path: Path, title: str) -> None:
    """One panel per backend: lockstep time of each planner relative to the best cap-respecting peer."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    backends = list(dict.fromkeys(s["backend"] for s in summary))
    planners = list(dict.fromkeys(s["planner"] for s in summary))
    fig, axes = plt.subplots(len(backends), 1, figsize=(12, 4 * len(backends)), squeeze=False)
    for ax, b in zip(axes[:, 0], backends):
        cases = list(dict.fromkeys((s["family"], s["dp"]) for s in summary if s["backend"] == b))
        by = {(s["family"], s["dp"], s["planner"]): s for s in summary if s["backend"] == b}
        w = 0.8 / len(planners)
        x = np.arange(len(cases))
        for i, p in enumerate(planners):
            ax.bar(x + i * w, [100 * by[f, d, p]["vs_best_peer"] for f, d in cases], w, label=p)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(x + 0.4 - w / 2, [f"{f}\ndp={d}" for f, d in cases], fontsize=8)
        ax.set_ylabel("measured lockstep vs best\ncap-respecting peer (%)")
        ax.set_title(f"{b}: {BACKENDS[b]}", fontsize=9)
        ax.legend(ncol=6, fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main ---------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one family, dp 4, tiny steps (~2 minutes)")
    ap.add_argument("--families", nargs="*")
    ap.add_argument("--dp", nargs="*", type=int)
    ap.add_argument("--backends", nargs="*", default=list(BACKENDS))
    ap.add_argument("--repeats", type=int, help="timed runs per composition (median)")
    ap.add_argument("--spg", type=int, help="samples per GPU per step")
    ap.add_argument("--scored", type=int, help="scored steps per case")
    ap.add_argument("--warmup", type=int, help="metered warm-up steps per case")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--simulate", action="store_true",
                    help="no model: a noise-free machine shaped like the measured one (_timed_model.SimulatedModel)")
    ap.add_argument("--no-lone-discount", action="store_true",
                    help="with --simulate: a lone sample on the packed row costs like a pack (no causal discount)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    opts = dict(QUICK if args.quick else FULL, seed=args.seed)
    for k, v in (("families", args.families), ("dps", args.dp), ("repeats", args.repeats), ("spg", args.spg),
                 ("scored", args.scored), ("warmup", args.warmup)):
        if v:
            opts[k] = tuple(v) if isinstance(v, list) else v
    t0 = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)  # noqa: E731
    model = SimulatedModel(lone_discount=not args.no_lone_discount) if args.simulate else TimedModel(seed=args.seed, repeats=opts["repeats"])
    clock = model.clock if args.simulate else None
    prior = mp.FlopsCost.from_hf_config(model.config_dict)
    rows, profiles = [], {}
    for backend in args.backends:
        model.use(backend)
        model.warm(opts["cap"])
        prof = profile_cost(model.run, max_tokens_per_micro=opts["cap"], repeats=opts["profile_repeats"],
                            vocab_size=model.vocab, device="cpu", seed=args.seed, time_budget_s=None, clock=clock)
        profiles[backend] = dict(cost=prof.cost.to_dict(), r2=prof.r2, heldout_median=prof.heldout_median_error,
                                 heldout_max=prof.heldout_max_error, regime=prof.regime,
                                 rows=[{k: r[k] for k in ("seq_lens", "seconds", "times", "heldout")} for r in prof.rows])
        log(f"{backend}: profiled ({prof.regime}): {prof.cost.describe()}; R²={prof.r2:.4f}, held-out "
            f"median {prof.heldout_median_error:.1%} / max {prof.heldout_max_error:.1%}")
        for fam in opts["families"]:
            for dp in opts["dps"]:
                rows.extend(run_case(model, fam, dp, opts, prior, prof.cost, log))
    summary = summarise(rows)
    targets = check_targets(summary)
    print(format_table(summary))
    print("\ntargets (lowest: best of profiled/metered is the lowest lockstep; margin vs the best cap-respecting "
          "peer; step prediction error, median over steps):")
    for k, v in targets.items():
        print(f"  {k:<40} lowest={v['lowest']!s:<5}  margin={v['margin_vs_best_peer']:+.1%}  "
              f"step err={v['step_pred_error_median']:.1%}")
    log(f"done: {model.runs} timed forward+backward runs, {model.cached} distinct compositions")
    if args.simulate:
        print(f"a real run would compute ~{model.compute_seconds / 60:.0f} minutes of forward+backward "
              f"(1-thread speed of the measured machine, repeats=1)")
    result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), quick=args.quick,
                  simulated=args.simulate, lone_discount=None if not args.simulate else not args.no_lone_discount,
                  threads=torch.get_num_threads(), model=model.config_dict, backends=BACKENDS,
                  options={k: list(v) if isinstance(v, tuple) else v for k, v in opts.items()},
                  prior=prior.to_dict(), profiles=profiles, targets_set=TARGETS, targets=targets,
                  summary=summary, rows=rows, seconds=time.perf_counter() - t0)
    if not args.no_write:
        kind = "measured" if not args.simulate else "measured-simulated" + ("-uniform" if args.no_lone_discount else "")
        stem = save_json(kind, result)
        plot(summary, stem.with_suffix(".png"), "Simulated machine of the measured shape (no compute, no noise)"
             if args.simulate else "Measured step time (lower is better): 4-layer Llama on CPU, every micro-batch "
             "run fwd+bwd")
        print(f"wrote {stem}.json and {stem}.png")
    return result


if __name__ == "__main__":
    main()
