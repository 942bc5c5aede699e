"""Planning time, side by side in one process: microplan vs the slime and verl re-implementations.

Design note. Two steps from the grpo-longtail family (max_len 16,384, cap 32,768 tokens per GPU,
~7B dense cost model): 16,384 samples at dp=128 and 4,096 samples at dp=32, 128 samples per GPU, so K = 17–18 micro-batches per rank.
Each planner plans the same step ``--repeats`` times after one warm-up run, interleaved round by
round (so machine noise hits every planner alike); we report the median and the ratios
peer / microplan. microplan is timed on ``plan(batch, config)`` (Batch already built), the peers
on ``plan_<peer>(seq_lens, ...)`` — each from the input it naturally takes. ``verl`` plans every
rank's micro-batches in turn (the whole plan, as microplan computes it); ``verl-critical-path``
is what one verl worker waits for upstream, where workers micro-batch in parallel: the driver's
DP split plus the slowest rank's own KK.

The user's whole path (issue 20) is timed too, from the arrays a trainer holds: ``Batch(...)``
with prompt lengths, prompt and rollout ids (``batch``: int ids; ``batch-str``: verl-style string
uids), then ``plan``, then reading every ``Micro.indices`` (``path``); ratios peer / path are
reported beside peer / plan. Targets: Batch <= 3 ms, path <= 20 ms and >= 40x slime and verl.
``plan-config`` / ``path-config``: the same plan and path with the cost a user gets by default,
``FlopsCost.from_hf_config`` of Qwen2.5-7B (``metrics.config_7b_cost``: a cost not proportional
to tokens, so the packer's capacity fallback runs), ``plan-token`` with ``TokenCost`` (issue 27:
path-config <= 20 ms, plan-config <= 2x plan-token, >= 40x slime and verl).
``hedged``: the same plan with the attention term known to ±10 % (``attention_rel_sd=0.1``, what a
``CostMeter`` hands out after a few noisy steps): the price of the hedged lockstep pass.
``padded``, ``padded-2d``: the same step with ``layout="padded"`` / ``"padded-2d"`` (runs of
length-sorted samples, slot levels and their local search: ``stages/padded.py``).
``shared``: the same plan with ``share_prefixes=True`` (each group's samples share their prompt:
the trie-priced candidates of ``stages/granularity.py``; issue 30: <= 150 ms and <= 3x the plain
plan at 16k/dp=128).

Local placement at scale (issue 17): every sample on rank 0 of dp=1,024 (the other ranks run
placeholders), timed once each: ``plan`` and ``Plan.validate()`` (target: both together <= 3 s).

``--clock cpu`` times CPU time (``time.process_time``) and reports the minimum of the repeats
instead of the median of wall times: for a shared, loaded machine (other processes' work is not
counted; ratios within one run stay comparable).

Run: ``python -m benchmarks.bench_speed [--repeats N] [--no-local] [--clock wall|cpu]``; writes
``benchmarks/results/speed-<date>-<host>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import microplan as mp  # noqa: E402
from microplan.traces import generate  # noqa: E402

from benchmarks._results import save_json  # noqa: E402
from benchmarks.metrics import config_7b_cost, dense_7b_cost  # noqa: E402
from benchmarks.peers import plan_slime, plan_verl, verl  # noqa: E402

CASES = ((16384, 128), (4096, 32))   # (samples, dp)
MAX_LEN, CAP, GROUP = 16384, 32768, 8
TARGETS = {"slime": 25.0, "verl": 50.0}  # required speed-up of microplan at 16k samples, dp=128
PATH_TARGETS = {"batch_ms": 3.0, "path_ms": 20.0, "slime": 40.0, "verl": 40.0}  # issue 20 item 6, 16k/dp=128
CONFIG_TARGETS = {"path_ms": 20.0, "vs_token": 2.0, "slime": 40.0, "verl": 40.0}  # issue 27 item 3, 16k/dp=128
SHARE_TARGETS = {"share_ms": 150.0, "vs_plain": 3.0}  # issue 30 item 6, 16k/dp=128: sharing vs the same plan unshared
LOCAL = dict(samples=4096, dp=1024, target_s=3.0)  # issue 17: one loaded rank of 1,024
HEDGE_SD = 0.1  # attention known to ±10 %: a CostMeter's typical sd after 3 steps at 5 % timing noise


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCK["wall"]


def _wall(fn) -> float:
    """ms of ``fn()`` on the chosen clock (``--clock``: wall by default, or this process's CPU time)."""
    t = _clock()
    fn()
    return (_clock() - t) * 1e3


def _verl_critical_path(lens: np.ndarray, dp: int) -> float:
    """ms of verl's critical path: driver DP split + the slowest rank's own micro-batching."""
    t = _clock()
    parts, plens, work = verl.balance_batch(lens, dp)
    k = max(verl.micro_count(p, plens, CAP) for p in parts)
    driver = (_clock() - t) * 1e3
    return driver + max(_wall(lambda: verl.rearrange_micro_batches(p, work, k, len(lens))) for p in parts)


def _user_path(lens: np.ndarray, plens: np.ndarray, pids, rids, cfg: mp.PlanConfig) -> int:
    """What a trainer runs: Batch from its arrays, plan, every micro-batch's index list read."""
    plan = mp.plan(mp.Batch(lens, prompt_lens=plens, prompt_ids=pids, rollout_ids=rids), cfg)
    return sum(m.indices.size for step in plan.steps for row in step.micros for m in row)


def _timers(batch: mp.Batch, dp: int, cost) -> dict:
    """name -> callable returning its own wall time in ms."""
    cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=CAP, cost=cost, sync="micro")
    hedged = replace(cfg, cost=replace(cost, attention_rel_sd=HEDGE_SD))
    padded = replace(cfg, layout="padded")
    shared = replace(cfg, share_prefixes=True)
    by_config = replace(cfg, cost=config_7b_cost())
    by_tokens = replace(cfg, cost=mp.TokenCost())
    lens = np.asarray(batch.seq_lens)
    plens, pids, rids = np.asarray(batch.prompt_lens), np.asarray(batch.prompt_codes), np.asarray(batch.rollout_codes)
    uids = [f"{int(p) * 2654435761 % 2 ** 32:08x}-uid" for p in pids]  # verl-style string uids, one per prompt
    rid_str = [f"{u}/{int(r)}" for u, r in zip(uids, rids)]
    return {
        "microplan": lambda: _wall(lambda: mp.plan(batch, cfg)),
        "hedged": lambda: _wall(lambda: mp.plan(batch, hedged)),
        "padded": lambda: _wall(lambda: mp.plan(batch, padded)),
        "padded-2d": lambda: _wall(lambda: mp.plan(batch, replace(padded, layout="padded-2d"))),
        "shared": lambda: _wall(lambda: mp.plan(batch, shared)),
        "batch": lambda: _wall(lambda: mp.Batch(lens, prompt_lens=plens, prompt_ids=pids, rollout_ids=rids)),
        "batch-str": lambda: _wall(lambda: mp.Batch(lens, prompt_lens=plens, prompt_ids=uids, rollout_ids=rid_str)),
        "path": lambda: _wall(lambda: _user_path(lens, plens, pids, rids, cfg)),
        "plan-config": lambda: _wall(lambda: mp.plan(batch, by_config)),
        "plan-token": lambda: _wall(lambda: mp.plan(batch, by_tokens)),
        "path-config": lambda: _wall(lambda: _user_path(lens, plens, pids, rids, by_config)),
        "slime": lambda: _wall(lambda: plan_slime(lens, dp=dp, cap=CAP, cost=cost)),
        "verl": lambda: _wall(lambda: plan_verl(lens, dp=dp, cap=CAP, cost=cost)),
        "verl-critical-path": lambda: _verl_critical_path(lens, dp),
    }


def time_case(samples: int, dp: int, repeats: int, cost, summary=np.median) -> dict:
    """Median wall time (ms; ``summary``: the statistic over repeats) of each planner on one step,
    and peer/microplan ratios."""
    batch = generate("grpo-longtail", num_prompts=samples // GROUP, samples_per_prompt=GROUP,
                     max_len=MAX_LEN, seed=0)
    fns = _timers(batch, dp, cost)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(fn())
    med = {k: float(summary(v)) for k, v in times.items()}
    peers = ("slime", "verl", "verl-critical-path")
    return dict(samples=samples, dp=dp, cap=CAP, tokens=int(np.sum(batch.seq_lens)), repeats=repeats,
                median_ms=med, all_ms=times,
                ratio={k: med[k] / med["microplan"] for k in peers},
                ratio_path={k: med[k] / med["path"] for k in peers},
                ratio_path_config={k: med[k] / med["path-config"] for k in peers})


def time_local(samples: int, dp: int, cost) -> dict:
    """Local placement with every sample on rank 0 of ``dp``: plan and validate wall times (s)."""
    batch = generate("grpo-longtail", num_prompts=samples // GROUP, samples_per_prompt=GROUP,
                     max_len=MAX_LEN, seed=0).with_rank_of(np.zeros(samples, dtype=np.int64))
    cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=CAP, cost=cost, placement="local")
    t = _clock()
    plan = mp.plan(batch, cfg)
    t_plan = _clock() - t
    t = _clock()
    plan.validate()
    t_val = _clock() - t
    return dict(samples=samples, dp=dp, cap=CAP, K=plan.steps[0].micro_count,
                micro_batches=dp * plan.steps[0].micro_count, plan_s=t_plan, validate_s=t_val,
                target_s=LOCAL["target_s"])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--no-local", action="store_true", help="skip the local-placement dp=1,024 case (~5-20 s)")
    ap.add_argument("--clock", choices=tuple(CLOCK), default="wall",
                    help="wall: median wall time; cpu: minimum CPU time of the repeats (a loaded machine)")
    args = ap.parse_args(argv)
    global _clock
    _clock = CLOCK[args.clock]
    summary = np.median if args.clock == "wall" else np.min
    load = os.getloadavg()[0]
    cost = dense_7b_cost()
    cases = []
    for samples, dp in CASES:
        c = time_case(samples, dp, args.repeats, cost, summary)
        cases.append(c)
        m, rp = c["median_ms"], c["ratio_path"]
        print(f"{samples:>6} samples dp={dp:<4} microplan {m['microplan']:8.1f} ms   slime {m['slime']:8.1f} ms "
              f"({c['ratio']['slime']:5.1f}x)   verl {m['verl']:8.1f} ms ({c['ratio']['verl']:5.1f}x)   "
              f"verl critical path {m['verl-critical-path']:7.1f} ms ({c['ratio']['verl-critical-path']:5.1f}x)")
        print(f"{'':>6}   user path: Batch {m['batch']:5.2f} ms (string uids {m['batch-str']:5.2f} ms)   "
              f"Batch+plan+indices {m['path']:6.1f} ms   slime {rp['slime']:5.1f}x   verl {rp['verl']:5.1f}x   "
              f"verl critical path {rp['verl-critical-path']:5.1f}x")
        rc = c["ratio_path_config"]
        print(f"{'':>6}   config cost (from_hf_config, Qwen2.5-7B): plan {m['plan-config']:6.1f} ms "
              f"({m['plan-config'] / m['plan-token']:.2f}x TokenCost's {m['plan-token']:.1f} ms)   "
              f"Batch+plan+indices {m['path-config']:6.1f} ms   slime {rc['slime']:5.1f}x   verl {rc['verl']:5.1f}x")
        print(f"{'':>6}   hedged plan (FlopsCost.attention_rel_sd={HEDGE_SD:g}, a metered cost): {m['hedged']:6.1f} ms "
              f"({m['hedged'] / m['microplan']:.1f}x the plain plan)")
        print(f"{'':>6}   padded layout (layout='padded'): {m['padded']:6.1f} ms   'padded-2d': {m['padded-2d']:6.1f} ms")
        print(f"{'':>6}   prefix sharing (share_prefixes=True): {m['shared']:6.1f} ms "
              f"({m['shared'] / m['microplan']:.1f}x the plain plan)")
    big = cases[0]["ratio"]
    print("targets at 16k/dp=128: " + ", ".join(
        f"{k} >= {v:.0f}x: {'met' if big[k] >= v else 'MISSED'} ({big[k]:.1f}x)" for k, v in TARGETS.items()))
    m, rp = cases[0]["median_ms"], cases[0]["ratio_path"]
    path_ok = {"batch_ms": m["batch"] <= PATH_TARGETS["batch_ms"], "path_ms": m["path"] <= PATH_TARGETS["path_ms"],
               "slime": rp["slime"] >= PATH_TARGETS["slime"], "verl": rp["verl"] >= PATH_TARGETS["verl"]}
    print("user-path targets at 16k/dp=128: " + ", ".join(
        f"{k} {'<=' if k.endswith('ms') else '>='} {v:g}: {'met' if path_ok[k] else 'MISSED'}"
        for k, v in PATH_TARGETS.items()))
    rc = cases[0]["ratio_path_config"]
    config_ok = {"path_ms": m["path-config"] <= CONFIG_TARGETS["path_ms"],
                 "vs_token": m["plan-config"] <= CONFIG_TARGETS["vs_token"] * m["plan-token"],
                 "slime": rc["slime"] >= CONFIG_TARGETS["slime"], "verl": rc["verl"] >= CONFIG_TARGETS["verl"]}
    print("config-cost path targets at 16k/dp=128: " + ", ".join(
        f"{k} {'<=' if k in ('path_ms', 'vs_token') else '>='} {v:g}: {'met' if config_ok[k] else 'MISSED'}"
        for k, v in CONFIG_TARGETS.items()) + f"   ({args.clock} clock, load average {load:.1f})")
    share_ok = {"share_ms": m["shared"] <= SHARE_TARGETS["share_ms"],
                "vs_plain": m["shared"] <= SHARE_TARGETS["vs_plain"] * m["microplan"]}
    print(f"sharing targets at 16k/dp=128: share_ms <= {SHARE_TARGETS['share_ms']:g}: "
          f"{'met' if share_ok['share_ms'] else 'MISSED'} ({m['shared']:.1f} ms), shared <= "
          f"{SHARE_TARGETS['vs_plain']:g}x the plain plan: {'met' if share_ok['vs_plain'] else 'MISSED'} "
          f"({m['shared'] / m['microplan']:.1f}x)")
    local = None
    if not args.no_local:
        local = time_local(LOCAL["samples"], LOCAL["dp"], cost)
        tot = local["plan_s"] + local["validate_s"]
        print(f"local placement, {local['samples']} samples all on rank 0 of dp={local['dp']} (K={local['K']}, "
              f"{local['micro_batches']:,} micro-batches): plan {local['plan_s']:.2f} s, validate "
              f"{local['validate_s']:.2f} s, together {tot:.2f} s (target <= {LOCAL['target_s']:g} s: "
              f"{'met' if tot <= LOCAL['target_s'] else 'MISSED'})")
    result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), cost=cost.to_dict(),
                  family="grpo-longtail", max_len=MAX_LEN, targets=TARGETS, cases=cases,
                  path_targets=PATH_TARGETS, config_targets=CONFIG_TARGETS, config_cost=config_7b_cost().to_dict(),
                  share_targets=SHARE_TARGETS, share_met=share_ok,
                  clock=args.clock, statistic="median" if args.clock == "wall" else "min", load_average=load,
                  local=local)
    if not args.no_write:
        print(f"wrote {save_json('speed', result).with_suffix('.json')}")
    return result


if __name__ == "__main__":
    main()
