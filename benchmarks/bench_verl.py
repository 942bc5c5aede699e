"""microplan's verl drop-in vs verl's REAL ``rearrange_micro_batches`` (verl 0.9.1), same inputs, same run.

Design note. Needs the verl package (``pip install --no-deps verl==0.9.1`` + tensordict, ray,
omegaconf, hydra-core, codetiming; see tests/test_integration_verl.py). For every trace family ×
dp × seed: one step from ``bench_planners.make_step``, cut to a multiple of dp; the driver split is
verl's own ``get_seqlen_balanced_partitions(calculate_workload(lens), dp, equal_size=True)`` with
``_balance_batch``'s order, exactly as the PPO trainer dispatches. Then, per rank:

- verl: its real ``rearrange_micro_batches`` on a TensorDict of the rank's samples (nested
  ``input_ids``). The DP all-reduces are emulated in one process: the MAX of the ranks' local counts
  is passed as ``min_num_micro_batch`` (verl takes ``max(min_num_micro_batch, local)``, the same
  code path), and when a rank's partition breaks the cap and verl grows its count, every rank is
  re-run at the grown count (what the MIN all-reduce of ``within_limit`` does). A ValueError from
  verl is a crash.
- microplan: the drop-in's plan — local placement over the dp ranks, ``short_step="error"`` —
  built from the ranks' samples in rank order, as ``plan_distributed`` gathers them (so it is the
  plan every rank computes); once with the drop-in's default cost (verl's workload model,
  24576·L + L²) and once with ``install(cost=...)`` given the benchmark's 7B cost, as a user who
  passes ``FlopsCost.from_hf_config(model_config)`` would.

A last row replaces verl's driver split by the drop-in's (``install()`` patches both sides), so
its inputs to the worker side differ: it shows the end-to-end effect.

Under a truth (second table): the same steps scored under a simulated machine the planner never
sees (``benchmarks.truths.truth``: a Llama-2-7B's FLOPs with attention 2.5x slower per FLOP than
the GEMMs and a per-micro overhead of 2 % of a cap-full micro-batch), for verl, the drop-in with
verl's 7B workload constant (the old default), ``install(hf_config=LLAMA2_7B)`` with no cost and
no timings (the new default's first step), and the same after 3 metered warm-up steps (a
``CostMeter`` with that FLOPs prior fed each warm-up step's micro-batch times, truth × (1 + 3 %
noise), from plans made with its own current fit — what the engine loop does); for that row the
meter's predicted lockstep time of the scored step is compared with the truth's. All rows are scored by
benchmarks/metrics.py with the benchmark's 7B cost: over-cap and empty
micro-batches, equal counts, lockstep / LB (global lower bound) and lockstep / rank LB (the best
any micro-batching can do on the given split). Run:
``python -m benchmarks.bench_verl [--quick]`` where verl is installed; writes
``benchmarks/results/verl-<date>-<host>.json``.
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
from microplan.integrations.verl import VERL_WORKLOAD  # noqa: E402
from microplan.planner import build_plan  # noqa: E402

from benchmarks._results import save_json  # noqa: E402
from benchmarks.bench_planners import FAMILIES, SPG, format_table, make_step, summarise  # noqa: E402
from benchmarks.metrics import dense_7b_cost, from_microplan, step_metrics  # noqa: E402
from benchmarks.truths import LLAMA2_7B, truth  # noqa: E402


def driver_split(lens: np.ndarray, dp: int) -> list[list[int]]:
    """verl's _balance_batch: KK equal_size on calculate_workload, each part ordered light/heavy/light."""
    import torch
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions
    work = calculate_workload(torch.from_numpy(lens))
    parts = get_seqlen_balanced_partitions(work, k_partitions=dp, equal_size=True)
    out = []
    for part in parts:
        part = sorted(part, key=lambda x: (int(work[x]), x))
        out.append(part[::2] + part[1::2][::-1])
    return out


def microplan_split(lens: np.ndarray, dp: int) -> list[list[int]]:
    """The drop-in's driver split on verl's workloads (what _balance_batch gets once install()ed)."""
    import torch
    from verl.utils.seqlen_balancing import calculate_workload

    from microplan.integrations.verl import get_seqlen_balanced_partitions
    return get_seqlen_balanced_partitions(calculate_workload(torch.from_numpy(lens)), dp, True)


def _tensordict(lens: np.ndarray):
    import torch
    from verl.utils import tensordict_utils as tu
    rows = [torch.zeros(int(L), dtype=torch.int8) for L in lens]
    return tu.get_tensordict({"input_ids": torch.nested.as_nested_tensor(rows, layout=torch.jagged)})


def run_verl(parts: list[list[int]], lens: np.ndarray, cap: int) -> list[list[np.ndarray]]:
    """verl's real per-rank function with the DP all-reduces emulated (module note)."""
    from verl.utils.seqlen_balancing import ceildiv, rearrange_micro_batches
    tds = [_tensordict(lens[p]) for p in parts]
    K = max(min(len(p), ceildiv(int(lens[p].sum()), cap)) for p in parts)  # all_reduce(MAX)
    while True:
        got = [rearrange_micro_batches(td, max_token_len=cap, min_num_micro_batch=K)[1] for td in tds]
        grown = max(len(g) for g in got)
        if grown == K:
            break
        K = grown  # a rank broke the cap at K: every rank retries at the grown count (MIN all-reduce)
    return [[np.asarray([p[i] for i in idx], dtype=np.int64) for idx in g] for p, g in zip(parts, got)]


def run_microplan(parts: list[list[int]], lens: np.ndarray, cap: int, cost=VERL_WORKLOAD) -> list[list[np.ndarray]]:
    """The drop-in's plan over all ranks (samples in rank order, as plan_distributed gathers them)."""
    order = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    owners = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
    cfg = mp.PlanConfig(dp_size=len(parts), max_tokens_per_micro=cap, cost=cost, placement="local",
                        short_step="error")
    plan = build_plan(mp.Batch(lens[order], rank_of=owners), cfg)
    return [[order[m] for m in row] for row in from_microplan(plan)]


def run_case(family: str, dp: int, seed: int, cost) -> list[dict]:
    _, cap, _ = FAMILIES[family]
    spg = SPG[seed % len(SPG)]
    batch = make_step(family, dp, spg, seed)
    lens = np.asarray(batch.seq_lens)[: batch.num_samples // dp * dp]
    verl_parts, mp_parts = driver_split(lens, dp), microplan_split(lens, dp)
    rows = []
    planners = (("microplan drop-in, verl workload", verl_parts, run_microplan),
                ("microplan drop-in, cost=7B", verl_parts, lambda p, ln, c: run_microplan(p, ln, c, cost)),
                ("verl 0.9.1 (real)", verl_parts, run_verl),
                ("microplan both sides, cost=7B", mp_parts, lambda p, ln, c: run_microplan(p, ln, c, cost)))
    for name, parts, fn in planners:
        row = dict(family=family, dp=dp, seed=seed, spg=spg, planner=name, samples=int(lens.size), cap=cap)
        t = time.perf_counter()
        try:
            plan = fn(parts, lens, cap)
        except ValueError as exc:  # verl refuses (a rank holds fewer samples than the agreed count)
            rows.append({**row, "crash": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        m = step_metrics(plan, lens, dp=dp, cap=cap, cost=cost)
        rows.append({**row, "crash": None, "ms": (time.perf_counter() - t) * 1e3, **m.to_dict()})
    return rows


def _lockstep(plan: list[list[np.ndarray]], lens: np.ndarray, cost) -> float:
    K = max(len(row) for row in plan)
    return float(sum(max((cost.micro_cost(lens[row[m]]) if m < len(row) and len(row[m]) else 0.0) for row in plan)
                     for m in range(K)))


def run_truth_case(family: str, dp: int, seed: int, warmup: int = 3) -> list[dict]:
    """The second table's rows for one step (module note)."""
    _, cap, _ = FAMILIES[family]
    spg = SPG[seed % len(SPG)]
    machine = truth(2.5, 0.02, cap)
    prior = mp.FlopsCost.from_hf_config(LLAMA2_7B)
    meter = mp.CostMeter(prior=prior)
    rng = np.random.default_rng(seed)
    for j in range(warmup):  # the engine loop: plan with the current fit, time every micro-batch, record
        b = make_step(family, dp, spg, 1000 + 7 * seed + j)
        wl = np.asarray(b.seq_lens)[: b.num_samples // dp * dp]
        for row in run_microplan(driver_split(wl, dp), wl, cap, meter.cost()):
            for idx in row:
                meter.record(wl[idx], machine.micro_cost(wl[idx]) * max(1 + 0.03 * rng.standard_normal(), 0.05))
    batch = make_step(family, dp, spg, seed)
    lens = np.asarray(batch.seq_lens)[: batch.num_samples // dp * dp]
    parts = driver_split(lens, dp)
    learned = meter.cost()
    planners = (("verl 0.9.1 (real)", lambda: run_verl(parts, lens, cap)),
                ("drop-in, verl's 7B constant (old default)", lambda: run_microplan(parts, lens, cap)),
                ("drop-in, install(hf_config=...)", lambda: run_microplan(parts, lens, cap, prior)),
                (f"drop-in, after {warmup} metered steps", lambda: run_microplan(parts, lens, cap, learned)))
    rows = []
    for name, fn in planners:
        row = dict(family=family, dp=dp, seed=seed, spg=spg, planner=name, samples=int(lens.size), cap=cap)
        t = time.perf_counter()
        try:
            plan = fn()
        except ValueError as exc:
            rows.append({**row, "crash": f"{type(exc).__name__}: {exc}"[:200]})
            continue
        m = step_metrics(plan, lens, dp=dp, cap=cap, cost=machine)
        extra = {}
        if name.endswith("metered steps"):
            extra["predicted_over_truth"] = _lockstep(plan, lens, learned) / _lockstep(plan, lens, machine)
        rows.append({**row, "crash": None, "ms": (time.perf_counter() - t) * 1e3, **m.to_dict(), **extra})
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="dp 8 and 32, 3 seeds")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    import verl  # noqa: F401 - fail early with the real import error
    dps, seeds = ((8, 32), range(3)) if args.quick else ((8, 32, 128), range(6))
    cost = dense_7b_cost()
    rows = [r for fam in FAMILIES for dp in dps for seed in seeds for r in run_case(fam, dp, seed, cost)]
    summary = summarise(rows)
    print("microplan's verl drop-in vs verl's real rearrange_micro_batches; cells: median/worst over dp x seed")
    print(format_table(summary))
    for name in dict.fromkeys(r["planner"] for r in rows):
        ok = [r for r in rows if r["crash"] is None and r["planner"] == name]
        if not ok:
            continue
        crashed = sum(r["planner"] == name for r in rows) - len(ok)
        print(f"  {name} over {len(ok)} cases (+{crashed} crashed): over-cap {sum(r['over_cap'] for r in ok)}, "
              f"empty {sum(r['empties'] for r in ok)}, unequal counts {sum(not r['equal_counts'] for r in ok)}, "
              f"lockstep/rankLB median {np.median([r['lockstep_rank_ratio'] for r in ok]):.4f} worst "
              f"{max(r['lockstep_rank_ratio'] for r in ok):.4f}")
    truth_rows = [r for fam in FAMILIES for dp in (8, 32) for seed in seeds for r in run_truth_case(fam, dp, seed)]
    truth_summary = summarise(truth_rows)
    print("\nUnder a truth the planner does not see (attention 2.5x slower per FLOP, 2 % per-micro overhead; "
          "dp 8 and 32); cells: median/worst")
    print(format_table(truth_summary))
    for name in dict.fromkeys(r["planner"] for r in truth_rows):
        ok = [r for r in truth_rows if r["crash"] is None and r["planner"] == name]
        line = (f"  {name}: lockstep/rankLB median {np.median([r['lockstep_rank_ratio'] for r in ok]):.4f} worst "
                f"{max(r['lockstep_rank_ratio'] for r in ok):.4f} over {len(ok)} cases")
        if ok and "predicted_over_truth" in ok[0]:
            err = [abs(r["predicted_over_truth"] - 1) for r in ok]
            line += f"; meter's predicted step time vs truth: median {np.median(err):.2%}, worst {max(err):.2%}"
        print(line)
    result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), quick=args.quick,
                  verl=__import__("verl").__version__, cost=cost.to_dict(), dp=list(dps), seeds=list(seeds),
                  summary=summary, rows=rows, truth_summary=truth_summary, truth_rows=truth_rows)
    if not args.no_write:
        stem = save_json("verl", result)
        print(f"\nwrote {stem}.json")
    return result


if __name__ == "__main__":
    main()
