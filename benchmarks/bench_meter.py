"""CostMeter on simulated machines: does planning with the metered model approach planning with the truth?

Design note. For each trace family × dp × seed × truth (``benchmarks/truths.py``: attention 1.5x
or 2.5x slower per FLOP with a 2 % per-micro overhead, or a dense kernel whose attention is T² of
the packed row), a run of optimizer steps is planned one at a time. Each step is planned with
``meter.cost()`` (the prior — ``FlopsCost.from_hf_config`` of a 7B model, the hedged default —
before any record), "run" on the simulated machine (truth cost x (1 + 3 % noise) per
micro-batch and rank), and every micro-batch's time is recorded. After 3 warm-up steps the next
3 steps are scored by lockstep time under the noise-free truth / the truth's lower bound, side by
side with the same step planned with the truth itself (oracle) and with the prior alone
(uncalibrated). Under the packed-T² truth the uncalibrated planner is also run with the cap
divided by 1..8 and the best of those is the reference ("told a smaller cap").

Targets (issue 9): metered lockstep/LB <= 1.003 median, <= 1.01 worst, within 0.002 of the oracle,
on every family at dp 8 and 32; packed-T²: metered within 0.5 % of the best smaller-cap plan.

Issue 20 adds, under the packed-T² truths, a cap sweep (12 caps from the longest sample to the cap,
token- and prior-balanced plans; the best under the truth) and an all-K sweep (the planner's
packing at every K, planned with the truth), and ``--grid``: the meter against the oracle on a grid
of varlen truths (attention 1.2/2/3x, per-micro overhead 0/5/10 % of a cap-full micro-batch, 1/5 %
noise). The grid also plans with an *informed estimator* (least squares on the same records, told
the truth's form and its per-micro overhead): what the warm-up records can tell at all, the
yardstick for the meter's misses. ``--warmup N`` scores after N warm-up steps instead of 3.

Issue 27: every step is planned with ``meter.explore_config(config, batch)``, so the meter may probe
a lower cap in the warm-up steps (``microplan.cost.explore``); each run reports what the probes cost
under the truth (of the warm-up steps' time). ``--dense-grid``: dense kernels (attention 1x and
2.5x slower per FLOP, a lone sample paying its causal L²) on every family and dp 8/32, in the
family's own shape and "at-cap" (short samples, 128 per GPU: every warm-up micro-batch holds
~cap tokens, so T² looks constant), from the default prior, against the best cap-swept plan
(``--no-explore``: a meter that never probes, the baseline). ``--trees``: ``share_prefixes=True``
under a grid of hidden varlen truths that price each prefix tree by its trie; the meter records
the tree micro-batches and is scored against the plan made with the truth.

Run: ``python -m benchmarks.bench_meter [--quick] [--grid [--warmup N] [--noise ...] | --dense-grid
[--no-explore] | --trees]``; writes ``benchmarks/results/meter[-grid[-warmupN]|-dense-grid|-trees]-<date>-<host>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import microplan as mp  # noqa: E402
from microplan.cost.explore import lockstep_seconds  # noqa: E402

from benchmarks._results import save_json  # noqa: E402
from benchmarks.bench_planners import FAMILIES, SPG, verl_split_owners  # noqa: E402
from benchmarks.truths import LLAMA2_7B, measured_seconds, score, steps_of, truth  # noqa: E402

WARMUP, SCORED, NOISE = 3, 3, 0.03
CAP_POINTS = 12  # caps of the dense truth's cap sweep
TRUTHS = {"attn1.5": (1.5, 0.02, False), "attn2.5": (2.5, 0.02, False), "dense-T2": (2.5, 0.02, True),
          "dense-T2c": (2.5, 0.02, "causal")}  # dense-T2c: a lone sample pays its causal attention (L²)
#: the dense grid (issue 27): dense kernels of attention 1x and 2.5x slower per FLOP (a lone sample
#: pays its causal L²), each on the family's own shape and "at-cap": short samples (max_len = cap/4)
#: and 128 per GPU, so every warm-up micro-batch holds ~cap tokens and T² looks constant
DENSE_GRID = {"dense-1x": (1.0, 0.02, "causal"), "dense-2.5x": (2.5, 0.02, "causal")}
SHAPES = ("family", "at-cap")


class Swept(NamedTuple):
    score: float  # lockstep/LB under the truth of the best plan of the sweep
    K: int        # its micro-batches per rank
    cap: int      # the cap it was planned with


def cap_sweep(batch: mp.Batch, dp: int, cap: int, costs: tuple, machine: mp.FlopsCost, points: int = CAP_POINTS) -> Swept:
    """The best plan (under the truth) of plans balanced by ``costs`` at caps from the batch's longest
    sample up to ``cap`` (a geometric grid of ``points``): a user who knows the kernel is dense and
    lowers the cap until the step is fastest."""
    longest = int(batch.seq_lens.max())
    best = Swept(float("inf"), 0, cap)
    for c in np.unique(np.geomspace(longest, cap, points).round().astype(np.int64)).tolist():
        for cm in costs:
            plan = mp.plan(batch, mp.PlanConfig(dp_size=dp, max_tokens_per_micro=int(c), cost=cm))
            got = score(plan, machine)
            if got < best.score:
                best = Swept(got, plan.steps[0].micro_count, int(c))
    return best


def best_k(batch: mp.Batch, dp: int, cap: int, machine: mp.FlopsCost) -> float:
    """The planner's own packing at EVERY K from the cap's lower bound to one sample per micro-batch,
    planned and scored under the truth: the best K there is for the planner's packer (lockstep/LB)."""
    from microplan.stages import fit
    from microplan.stages.kchoice import step_time
    from microplan.stages.pack import bins_lower_bound
    cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, cost=machine)
    plan = mp.plan(batch, cfg)
    lens = np.asarray(batch.seq_lens)
    costs = machine.sample_costs(lens)
    n = lens.size
    K0 = int(fit.min_micro_count(fit.cdiv(bins_lower_bound(lens, cap, None), dp), cfg))
    times = [step_time(b, min(n, dp * K), dp, K, lens, costs, machine, "micro")
             for K in range(K0, max(n // dp, K0) + 1)
             if (b := fit._pack_at(lens, costs, min(n, dp * K), dp, K, cfg)) is not None]
    chosen = plan.stats.steps[0].lockstep_time
    return score(plan, machine) * min(min(times), chosen) / chosen


def informed_fit(records: list[tuple[float, float, float]], per_micro: float) -> mp.FlopsCost:
    """The reference estimator of the grid: told the truth's form (varlen, Σ L and Σ L²) AND its
    per-micro overhead, it fits the two remaining coefficients by least squares weighted for
    relative noise. What it misses is what the records of the warm-up steps cannot tell."""
    T, Q, y = np.array(records).T
    w = 1.0 / y
    th, *_ = np.linalg.lstsq(np.stack([T, Q], axis=1) * w[:, None], (y - per_micro) * w, rcond=None)
    return mp.FlopsCost(linear=max(float(th[0]), 1e-30), quadratic=max(float(th[1]), 0.0), per_micro=per_micro)


def run_case(family: str, dp: int, seed: int, truth_name: str, all_k: bool = False, *,
             spec: tuple | None = None, noise: float = NOISE, warmup: int = WARMUP, informed: bool = False,
             hedge: bool = True, placement: str = "global", shape: str = "family", sweep: bool | None = None,
             explore: bool = True) -> dict:
    """One run of ``warmup`` + SCORED steps under a truth (``spec``: (slowdown, overhead, packed), else
    ``TRUTHS[truth_name]``) with timing noise ``noise``; ``informed``: also plan the scored steps
    with :func:`informed_fit` of the same records. The meter hedges (``CostMeter(hedge=...)``); each
    scored step is also planned on its point estimate alone (``attention_rel_sd=0``: "point"), from
    the same records. ``placement="local"``: every step's samples pinned by verl's driver split
    (``bench_planners.verl_split_owners``) and every plan made with ``placement="local"``.

    Every step is planned with ``meter.explore_config(config, batch)``: in the warm-up steps the
    meter may probe a lower cap (``microplan.cost.explore``); each probe step is also planned at
    the cap (what the meter would have run without exploring) and both are timed under the truth:
    ``explore_cost`` = Σ (probe − unexplored) / Σ the unexplored warm-up steps' time. ``shape``:
    "family" (the family's max_len, SPG by seed) or "at-cap" (max_len = cap/4, 128 samples per
    GPU: every warm-up micro-batch at the cap). ``sweep``: run the cap sweep (default: dense truths).
    ``explore=False``: a meter that never probes (``explore_steps=0``), the baseline."""
    max_len, cap, group = FAMILIES[family]
    spg = SPG[seed % len(SPG)]
    if shape == "at-cap":
        max_len, spg = cap // 4, 128

    def config(cost) -> mp.PlanConfig:
        return mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, cost=cost, placement=placement)
    slow, over, packed = {**TRUTHS, **DENSE_GRID}[truth_name] if spec is None else spec
    sweep = bool(packed) if sweep is None else sweep
    machine = truth(slow, over, cap, packed=bool(packed))
    if packed == "causal":  # the dense kernel's unmasked path for a lone sample: attention·L²
        machine = replace(machine, quadratic=machine.packed_quadratic / 2)
    prior = mp.FlopsCost.from_hf_config(LLAMA2_7B)
    meter = mp.CostMeter(prior=prior, hedge=hedge, explore_steps=warmup if explore else 0)
    rng = np.random.default_rng(seed)
    steps = steps_of(family, max_len=max_len, group=group, dp=dp, spg=spg, count=warmup + SCORED, seed=seed)
    if placement == "local":
        steps = [b.with_rank_of(verl_split_owners(b.seq_lens, dp)) for b in steps]
    out: dict = dict(family=family, dp=dp, seed=seed, truth=truth_name, shape=shape, metered=[], oracle=[], uncal=[],
                     smaller_cap=[], K_metered=[], K_oracle=[], K_sweep=[], all_k=[], informed=[], point=[])
    records: list[tuple[float, float, float]] = []
    warm_time = warm_extra = 0.0
    for s, batch in enumerate(steps):
        cfg = meter.explore_config(config(None), batch)
        cost = cfg.cost
        plan = mp.plan(batch, cfg)
        if s < warmup:
            unexplored = plan if cfg.max_tokens_per_micro == cap else mp.plan(batch, config(cost))
            warm_time += lockstep_seconds(unexplored, machine)
            warm_extra += lockstep_seconds(plan, machine) - lockstep_seconds(unexplored, machine)
        if s >= warmup:
            sd = getattr(cost, "attention_rel_sd", 0.0)
            out["point"].append(score(mp.plan(batch, replace(cfg, cost=replace(cost, attention_rel_sd=0.0))), machine)
                                if sd else score(plan, machine))
            if informed:
                ref = mp.plan(batch, config(informed_fit(records, machine.per_micro)))
                out["informed"].append(score(ref, machine))
            oracle = mp.plan(batch, config(machine))
            uncal = mp.plan(batch, config(prior))
            out["metered"].append(score(plan, machine))
            out["oracle"].append(score(oracle, machine))
            out["uncal"].append(score(uncal, machine))
            out["K_metered"].append(plan.steps[0].micro_count)
            out["K_oracle"].append(oracle.steps[0].micro_count)
            if sweep:
                sweep_best = cap_sweep(batch, dp, cap, (mp.TokenCost(), prior), machine)
                out["smaller_cap"].append(sweep_best.score)
                out["K_sweep"].append(sweep_best.K)
                if all_k:
                    out["all_k"].append(best_k(batch, dp, cap, machine))
        for micro, t in measured_seconds(plan, machine, noise, rng):
            meter.record(micro, t)
            lens = np.asarray(micro.seq_lens if micro.num_samples else [1], dtype=np.float64)
            records.append((float(lens.sum()), float((lens * lens).sum()), t))
    rep = meter.report()
    out["explore_cost"] = warm_extra / warm_time if warm_time > 0 else 0.0
    out["probes"] = [dict(step=p.step, cap=p.cap, fraction=p.fraction, predicted_share=p.extra_share)
                     for p in rep.probes]
    out["regime"], out["evidence"] = rep.regime, rep.regime_evidence
    out["prior_terms"] = list(rep.prior_terms)
    out["meter_error"] = rep.recent_median_error
    out["fit"] = rep.cost.to_dict()
    return out


def summarise(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["family"], r["dp"], r["truth"], r.get("shape", "family")), []).append(r)
    out = []
    for (fam, dp, tr, shape), rs in groups.items():
        cell = lambda key: [v for r in rs for v in r[key]]  # noqa: E731
        met, ora, unc = np.array(cell("metered")), np.array(cell("oracle")), np.array(cell("uncal"))
        ec = [r["explore_cost"] for r in rs]
        s = dict(family=fam, dp=dp, truth=tr if shape == "family" else f"{tr}@{shape}", shape=shape,
                 steps=int(met.size), explore_cost=(float(np.median(ec)), float(max(ec))),
                 probes=float(np.mean([len(r["probes"]) for r in rs])),
                 regimes=sorted({str(r["regime"]) for r in rs}),
                 metered=(float(np.median(met)), float(met.max())), oracle=(float(np.median(ora)), float(ora.max())),
                 uncal=(float(np.median(unc)), float(unc.max())),
                 gap=(float(np.median(met - ora)), float((met - ora).max())),
                 meter_error=float(np.median([r["meter_error"] for r in rs if r["meter_error"] is not None])),
                 K_metered=float(np.median(cell("K_metered"))), K_oracle=float(np.median(cell("K_oracle"))))
        if cell("smaller_cap"):
            sc = np.array(cell("smaller_cap"))
            s["smaller_cap"] = (float(np.median(sc)), float(sc.max()))
            s["vs_smaller_cap"] = (float(np.median(met / sc)), float((met / sc).max()))
            s["K_sweep"] = float(np.median(cell("K_sweep")))
        if cell("all_k"):
            ak = np.array(cell("all_k"))
            s["oracle_vs_all_k"] = (float(np.median(ora / ak)), float((ora / ak).max()))
        out.append(s)
    return out


def format_table(summary: list[dict]) -> str:
    head = (f"{'family':<19}{'dp':>4}  {'truth':<17}{'metered':>16}{'oracle':>16}{'uncalibrated':>16}"
            f"{'met-oracle':>18}{'K met/orc':>11}{'meter err':>10}{'best smaller cap':>18}{'met/best':>16}"
            f"{'K sweep':>8}{'oracle/all-K':>16}{'explore cost med/max':>22}{'probes':>7}  regime")
    lines = [head, "-" * len(head)]
    f2 = lambda x: f"{x[0]:.4f}/{x[1]:.4f}"  # noqa: E731
    for s in summary:
        sc = f2(s["smaller_cap"]) if "smaller_cap" in s else "-"
        vs = f2(s["vs_smaller_cap"]) if "vs_smaller_cap" in s else "-"
        lines.append(f"{s['family']:<19}{s['dp']:>4}  {s['truth']:<17}{f2(s['metered']):>16}{f2(s['oracle']):>16}"
                     f"{f2(s['uncal']):>16}{s['gap'][0]:>+9.4f}/{s['gap'][1]:+.4f}"
                     f"{s['K_metered']:>6.0f}/{s['K_oracle']:<4.0f}{s['meter_error']:>10.1%}{sc:>18}{vs:>16}"
                     f"{s.get('K_sweep', float('nan')):>8.0f}"
                     f"{f2(s['oracle_vs_all_k']) if 'oracle_vs_all_k' in s else '-':>16}"
                     f"{s['explore_cost'][0]:>+11.2%}/{s['explore_cost'][1]:+.2%}{s['probes']:>7.1f}  "
                     f"{','.join(s['regimes'])}")
    return "\n".join(lines)


def check_targets(summary: list[dict]) -> dict[str, bool]:
    plain = [s for s in summary if not s["truth"].startswith("dense")]
    dense = [s for s in summary if s["truth"].startswith("dense")]
    return {
        "exploration <= 2% of the warm-up steps' time (every run)": all(s["explore_cost"][1] <= 0.02 for s in summary),
        "metered lockstep/LB <= 1.003 median": all(s["metered"][0] <= 1.003 for s in plain),
        "metered lockstep/LB <= 1.01 worst": all(s["metered"][1] <= 1.01 for s in plain),
        "metered within 0.002 of oracle (median)": all(s["gap"][0] <= 0.002 for s in plain),
        "dense-T2: metered within 0.5% of best smaller cap (median)":
            all(s["vs_smaller_cap"][0] <= 1.005 for s in dense),
    }


#: the tree grid: hidden varlen truths (attention slowdown, per-micro overhead), as the varlen grid's
TREE_TRUTHS = {f"attn{a}/over{o}": (a, o) for a in (1.2, 2.0, 3.0) for o in (0.0, 0.05, 0.10)}
TREE_PROMPTS = (512, 4096)  # prompt tokens (log-uniform): long shared prompts, so trees differ from flat rows


def run_tree_case(family: str, dp: int, seed: int, truth_name: str, noise: float = NOISE,
                  warmup: int = WARMUP) -> dict:
    """Issue 27 item 2: ``share_prefixes=True`` — every micro-batch a prefix tree — under a hidden varlen
    truth (``TREE_TRUTHS``) that prices each tree by its trie (linear per unique token, attention per
    token over its path). The meter records the plan's tree ``Micro``s (their trie features); its
    plans are scored against the plan made with the truth (oracle) and with the prior alone."""
    max_len, cap, group = FAMILIES[family]
    slow, over = TREE_TRUTHS[truth_name]
    machine = truth(slow, over, cap)
    prior = mp.FlopsCost.from_hf_config(LLAMA2_7B)
    meter = mp.CostMeter(prior=prior, explore_steps=warmup)
    rng = np.random.default_rng(seed)
    steps = steps_of(family, max_len=max_len, group=group, dp=dp, spg=SPG[seed % len(SPG)], count=warmup + SCORED,
                     seed=seed, shared=True, prompt_len=TREE_PROMPTS)
    base = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, share_prefixes=True)
    out: dict = dict(family=family, dp=dp, seed=seed, truth=truth_name, metered=[], oracle=[], uncal=[], shared=[])
    for s, batch in enumerate(steps):
        plan = mp.plan(batch, meter.explore_config(base, batch))
        if s >= warmup:
            out["metered"].append(score(plan, machine))
            out["oracle"].append(score(mp.plan(batch, replace(base, cost=machine)), machine))
            out["uncal"].append(score(mp.plan(batch, replace(base, cost=prior)), machine))
        trees = [m for st in plan.steps for row in st.micros for m in row if m.tree is not None]
        out["shared"].append(sum(m.num_tokens for m in trees) / max(1, sum(int(m.seq_lens.sum()) for m in trees)))
        for micro, t in measured_seconds(plan, machine, noise, rng):
            meter.record(micro, t)
    out["fit"] = meter.report().cost.to_dict()
    return out


def summarise_trees(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["family"], r["dp"], r["truth"]), []).append(r)
    out = []
    for (fam, dp, tr), rs in groups.items():
        met, ora, unc = (np.array([v for r in rs for v in r[k]]) for k in ("metered", "oracle", "uncal"))
        out.append(dict(family=fam, dp=dp, truth=tr, steps=int(met.size), gap=(float(np.median(met - ora)),
                        float((met - ora).max())), uncal_gap=(float(np.median(unc - ora)), float((unc - ora).max())),
                        metered=float(np.median(met)),
                        unique_share=float(np.median([v for r in rs for v in r["shared"]]))))
    return out


def format_trees(summary: list[dict]) -> str:
    lines = [f"{'family':<19}{'dp':>4}  {'truth':<12}{'met-oracle med/worst':>24}{'prior-oracle med/worst':>26}"
             f"{'metered':>9}{'unique/flat tokens':>20}", "-" * 114]
    for c in summary:
        lines.append(f"{c['family']:<19}{c['dp']:>4}  {c['truth']:<12}{c['gap'][0]:>+12.4f}/{c['gap'][1]:+.4f}"
                     f"{c['uncal_gap'][0]:>+14.4f}/{c['uncal_gap'][1]:+.4f}{c['metered']:>9.4f}"
                     f"{c['unique_share']:>20.3f}")
    return "\n".join(lines)


def run_dense_grid(seeds: range, families: list[str], explore: bool = True) -> list[dict]:
    """Issue 27 item 1: every family x dp 8/32 x ``DENSE_GRID`` truth x ``SHAPES``, from the default
    prior (``FlopsCost.from_hf_config``, attention not told), scored against the best cap-swept plan."""
    return [run_case(fam, dp, seed, tr, shape=shape, explore=explore) for fam in families for dp in (8, 32)
            for tr in DENSE_GRID for shape in SHAPES for seed in seeds]


def dense_targets(summary: list[dict]) -> dict[str, bool]:
    return {
        "dense grid: metered within 0.5% of the best cap-swept plan (median, every cell)":
            all(s["vs_smaller_cap"][0] <= 1.005 for s in summary),
        "dense grid: exploration <= 2% of the warm-up steps' time (every run)":
            all(s["explore_cost"][1] <= 0.02 for s in summary),
    }


GRID_ATTENTION, GRID_OVERHEAD, GRID_NOISE = (1.2, 2.0, 3.0), (0.0, 0.05, 0.10), (0.01, 0.05)


def run_grid(seeds: range, families: list[str], warmup: int = WARMUP, noises: tuple = GRID_NOISE,
             hedge: bool = True, placement: str = "global") -> list[dict]:
    """Issue 20 item 2: metered − oracle lockstep/LB per cell of a grid of varlen truths (attention
    1.2-3x slower per FLOP, per-micro overhead 0-10 % of a cap-full micro-batch, 1-5 % noise), and
    the same gap for the informed estimator (the truth's form and per-micro overhead given)."""
    cells = []
    for fam in families:
        for dp in (8, 32):
            for a in GRID_ATTENTION:
                for o in GRID_OVERHEAD:
                    for nz in noises:
                        rows = [run_case(fam, dp, seed, f"attn{a}/over{o}", spec=(a, o, False), noise=nz,
                                         warmup=warmup, informed=True, hedge=hedge, placement=placement)
                                for seed in seeds]
                        per_seed = [np.subtract(r["metered"], r["oracle"]) for r in rows]
                        gap = np.concatenate(per_seed)
                        ref = np.array([m - q for r in rows for m, q in zip(r["informed"], r["oracle"])])
                        pt = np.array([m - q for r in rows for m, q in zip(r["point"], r["oracle"])])
                        held = sorted({t for r in rows for t in r["prior_terms"]})
                        cells.append(dict(family=fam, dp=dp, attention=a, overhead=o, noise=nz,
                                          gap_median=float(np.median(gap)), gap_worst=float(gap.max()),
                                          gap_ci90=median_ci90(per_seed),
                                          informed_median=float(np.median(ref)), point_median=float(np.median(pt)),
                                          metered=float(np.median([m for r in rows for m in r["metered"]])),
                                          prior_terms=held))
    return cells


def median_ci90(per_seed: list[np.ndarray], reps: int = 2000) -> list[float]:
    """90 % interval of a cell's median gap, bootstrapping over seeds (a seed's scored steps share
    its warm-up records, so they are resampled together); deterministic."""
    rng = np.random.default_rng(0)
    meds = [np.median(np.concatenate([per_seed[i] for i in rng.integers(0, len(per_seed), len(per_seed))]))
            for _ in range(reps)]
    return [float(np.percentile(meds, 5)), float(np.percentile(meds, 95))]


def format_grid(cells: list[dict]) -> str:
    lines = [f"{'family':<19}{'dp':>4}{'attn':>6}{'over':>6}{'noise':>7}{'met-oracle med/worst':>24}"
             f"{'median 90% CI':>18}{'informed':>10}{'point':>9}{'metered':>9}  from the prior", "-" * 133]
    for c in cells:
        ci = c.get("gap_ci90", [float("nan")] * 2)
        lines.append(f"{c['family']:<19}{c['dp']:>4}{c['attention']:>6.1f}{c['overhead']:>6.2f}{c['noise']:>7.2f}"
                     f"{c['gap_median']:>+12.4f}/{c['gap_worst']:+.4f}{ci[0]:>+9.4f}..{ci[1]:+.4f}"
                     f"{c['informed_median']:>+10.4f}"
                     f"{c['point_median']:>+9.4f}{c['metered']:>9.4f}  "
                     f"{', '.join(c['prior_terms']) or '-'}")
    for nz in sorted({c["noise"] for c in cells}):
        sub = [c for c in cells if c["noise"] == nz]
        lines.append(f"noise {nz:.0%}: {sum(c['gap_median'] <= 0.002 for c in sub)}/{len(sub)} cells within 0.002 "
                     f"(median; {sum(c.get('gap_ci90', [0.0])[0] > 0.002 for c in sub)} whose 90% interval lies "
                     f"above it); worst cell median {max(c['gap_median'] for c in sub):+.4f}, worst step "
                     f"{max(c['gap_worst'] for c in sub):+.4f}; informed estimator: "
                     f"{sum(c['informed_median'] <= 0.002 for c in sub)}/{len(sub)} cells, worst cell median "
                     f"{max(c['informed_median'] for c in sub):+.4f}; point estimate (no hedge, same records): "
                     f"{sum(c['point_median'] <= 0.002 for c in sub)}/{len(sub)} cells, worst cell median "
                     f"{max(c['point_median'] for c in sub):+.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 seeds instead of 6")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--grid", action="store_true", help="the grid of varlen truths of issue 20 (item 2) instead")
    ap.add_argument("--dense-grid", action="store_true", help="the dense grid of issue 27 (item 1) instead")
    ap.add_argument("--trees", action="store_true",
                    help="share_prefixes=True under a trie-priced truth (issue 27 item 2)")
    ap.add_argument("--no-explore", action="store_true", help="--dense-grid: a meter that never probes (baseline)")
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--warmup", type=int, default=WARMUP, help="warm-up steps before scoring (default %(default)s)")
    ap.add_argument("--noise", type=float, nargs="*", default=list(GRID_NOISE), help="--grid: timing noises")
    ap.add_argument("--seeds", type=int, default=6, help="seeds per cell (default %(default)s; --quick: 2)")
    ap.add_argument("--no-hedge", action="store_true", help="--grid: CostMeter(hedge=False) in the loop")
    ap.add_argument("--placement", choices=("global", "local"), default="global",
                    help="--grid: plan with placement='local', samples pinned by verl's driver split")
    args = ap.parse_args(argv)
    seeds = range(2) if args.quick else range(args.seeds)
    if args.grid:
        cells = run_grid(seeds, args.families, args.warmup, tuple(args.noise), hedge=not args.no_hedge,
                         placement=args.placement)
        print(f"CostMeter vs oracle on a grid of varlen truths ({len(seeds)} seeds x {SCORED} scored steps after "
              f"{args.warmup} warm-up steps; cells: lockstep/LB metered − oracle, median/worst step; informed: "
              "the same gap for least squares told the truth's form and per-micro overhead; point: the meter's "
              "point estimate without the hedge, same records)")
        print(format_grid(cells))
        result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), quick=args.quick,
                      warmup=args.warmup, scored=SCORED, seeds=len(seeds), hedge=not args.no_hedge,
                      placement=args.placement, cells=cells)
        if not args.no_write:
            name = "meter-grid" if args.warmup == WARMUP else f"meter-grid-warmup{args.warmup}"
            name += "" if len(seeds) == 6 else f"-seeds{len(seeds)}"
            name += "-nohedge" if args.no_hedge else ""
            name += "-local" if args.placement == "local" else ""
            print(f"wrote {save_json(name, result)}.json")
        return result
    if args.trees:
        rows = [run_tree_case(fam, dp, seed, tr) for fam in args.families for dp in (8, 32) for tr in TREE_TRUTHS
                for seed in seeds]
        summary = summarise_trees(rows)
        print(f"share_prefixes=True, a hidden trie-priced truth: lockstep / LB metered − oracle (median/worst over "
              f"{len(seeds)} seeds x {SCORED} scored steps after {WARMUP} warm-up steps, {NOISE:.0%} noise); prior − "
              "oracle: the plan a meter that learns nothing from trees keeps (the prior)")
        print(format_trees(summary))
        targets = {"trees: metered within 0.002 of the oracle (median, every cell)":
                   all(c["gap"][0] <= 0.002 for c in summary)}
        for k, ok in targets.items():
            print(f"  {'met' if ok else 'MISSED'}: {k}")
        result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), quick=args.quick,
                      truths=TREE_TRUTHS, warmup=WARMUP, scored=SCORED, noise=NOISE, targets=targets,
                      summary=summary, rows=rows)
        if not args.no_write:
            print(f"wrote {save_json('meter-trees' + ('' if len(seeds) == 6 else f'-seeds{len(seeds)}'), result)}.json")
        return result
    if args.dense_grid:
        rows = run_dense_grid(seeds, args.families, explore=not args.no_explore)
        summary = summarise(rows)
        print(f"Dense grid from the default prior (FlopsCost.from_hf_config(7B), attention not told): lockstep / LB "
              f"under the truth, median/worst over {len(seeds)} seeds x {SCORED} scored steps after {WARMUP} warm-up "
              "steps; met/best = metered / the best cap-swept plan; explore cost = what the probes cost under the "
              "truth, of the warm-up steps' time")
        print(format_table(summary))
        targets = dense_targets(summary)
        for k, ok in targets.items():
            print(f"  {'met' if ok else 'MISSED'}: {k}")
        result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), quick=args.quick,
                      truths={k: dict(zip(("attention_slowdown", "overhead", "packed"), v))
                              for k, v in DENSE_GRID.items()},
                      shapes=list(SHAPES), explore=not args.no_explore, warmup=WARMUP, scored=SCORED, noise=NOISE,
                      targets=targets,
                      summary=summary, rows=rows)
        if not args.no_write:
            name = "meter-dense-grid" + ("" if len(seeds) == 6 else f"-seeds{len(seeds)}")
            name += "-noexplore" if args.no_explore else ""
            print(f"wrote {save_json(name, result)}.json")
        return result
    rows = [run_case(fam, dp, seed, tr, all_k=tr.startswith("dense")) for fam in FAMILIES for dp in (8, 32) for seed in seeds for tr in TRUTHS]
    summary = summarise(rows)
    print(f"lockstep / LB under the simulated truth (median/worst over {len(seeds)} seeds x {SCORED} scored steps, "
          f"after {WARMUP} warm-up steps; {NOISE:.0%} timing noise); prior: FlopsCost.from_hf_config(7B) default")
    print(format_table(summary))
    targets = check_targets(summary)
    for k, ok in targets.items():
        print(f"  {'met' if ok else 'MISSED'}: {k}")
    result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), quick=args.quick,
                  truths={k: dict(zip(("attention_slowdown", "overhead", "packed"), v)) for k, v in TRUTHS.items()},
                  warmup=WARMUP, scored=SCORED, noise=NOISE, targets=targets, summary=summary, rows=rows)
    if not args.no_write:
        stem = save_json("meter", result)
        print(f"wrote {stem}.json")
    return result


if __name__ == "__main__":
    main()
