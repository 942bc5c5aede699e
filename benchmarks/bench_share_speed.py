"""Planning time with shared prefixes, side by side with the same plan without sharing (issue 17, item 4).

Design note. Two workloads: the step of ``bench_speed`` (16,384 ``grpo-longtail`` samples, n = 8,
dp 128, cap 32,768 tokens, ~7B cost model) with its prefix forest (a group's samples share the
prompt), and one append-only chain of n = 250 / 500 / 1,000 / 1,500 samples (sample i continues
sample i-1 whole and adds 20 tokens, 200 + 20 i tokens, dp 1). Each row plans the same batch
with ``PlanConfig(share_prefixes=True)`` and without it, interleaved round by round, and reports
the medians and their ratio. The ``primitives`` columns time what ``microplan.trie`` /
``microplan.prefix`` compute inside the sharing plan: ``cut_trees`` at the cap, ``set_tries`` of
the plan's micro-batches (and with multiple 8), every micro-batch's ``PrefixTree`` one
``micro_tree`` at a time and with ``micro_trees`` at once (absent on a tree without trie.py, so
the script also runs on an older checkout for a before/after comparison).

Measurements: benchmarks/README.md (its Speed section) and the JSON files.

Targets (issue 17): sharing within 3x of no sharing; <= 150 ms for the GRPO step; chain of
1,500 <= 0.2 s (linear in n).

``--clock cpu``: CPU time, minimum of the repeats (``median_ms`` then holds minima), for a loaded
machine.

Run: ``python -m benchmarks.bench_share_speed [--repeats N] [--quick] [--no-write] [--clock wall|cpu]``; writes
``benchmarks/results/share-speed-<date>-<host>.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import microplan as mp  # noqa: E402
from microplan.prefix import forest_of, micro_tree  # noqa: E402
from microplan.traces import generate  # noqa: E402

from benchmarks._results import record  # noqa: E402
from benchmarks.metrics import dense_7b_cost  # noqa: E402

CAP = 32768
CHAINS = (250, 500, 1000, 1500)
TARGETS = {"ratio": 3.0, "grpo_ms": 150.0, "chain1500_ms": 200.0}


def chain(n: int) -> mp.Batch:
    """One append-only chain: sample i continues sample i-1 whole and adds 20 tokens."""
    lens = 200 + 20 * np.arange(n)
    return mp.Batch(lens, prefix_parent=np.arange(-1, n - 1),
                    shared_prefix_lens=np.concatenate([[0], lens[:-1]]))


def cases(quick: bool) -> list[tuple[str, mp.Batch, int]]:
    out = [("grpo 16,384 dp128", generate("grpo-longtail", num_prompts=2048, samples_per_prompt=8,
                                          max_len=16384, seed=0), 128)]
    out += [(f"chain {n:,} dp1", chain(n), 1) for n in (CHAINS[:3] if quick else CHAINS)]
    return out


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCK["wall"]


def _ms(fn) -> float:
    """ms of ``fn()`` on the chosen clock (``--clock``: wall by default, or this process's CPU time)."""
    t = _clock()
    fn()
    return (_clock() - t) * 1e3


def primitives(batch: mp.Batch, plan: mp.Plan) -> dict[str, float]:
    """ms of the trie primitives on this batch and its sharing plan (empty without trie.py)."""
    try:
        from microplan.trie import cut_trees, micro_trees, set_tries
    except ImportError:
        return {}
    parent, shared = forest_of(batch)
    lens = batch.seq_lens
    micros = [m.indices for step in plan.steps for row in step.micros for m in row if m.indices.size]
    members = np.concatenate(micros)
    set_of = np.repeat(np.arange(len(micros)), [m.size for m in micros])
    samples = np.arange(batch.num_samples)
    return {"cut_trees": _ms(lambda: cut_trees(parent, shared, lens, samples, CAP)),
            "set_tries": _ms(lambda: set_tries(parent, shared, lens, members, set_of, len(micros))),
            "set_tries_x8": _ms(lambda: set_tries(parent, shared, lens, members, set_of, len(micros), multiple=8)),
            "micro_tree_all": _ms(lambda: [micro_tree(parent, shared, lens, m) for m in micros]),
            "micro_trees": _ms(lambda: micro_trees(parent, shared, lens, members, set_of, len(micros)))}


def time_case(name: str, batch: mp.Batch, dp: int, repeats: int, cost, summary=np.median) -> dict:
    cfgs = {k: mp.PlanConfig(dp_size=dp, max_tokens_per_micro=CAP, cost=cost, sync="micro", share_prefixes=share)
            for k, share in (("no-share", False), ("share", True))}
    plans = {k: mp.plan(batch, c) for k, c in cfgs.items()}  # warm-up
    times: dict[str, list[float]] = {k: [] for k in cfgs}
    for _ in range(repeats):
        for k, c in cfgs.items():
            times[k].append(_ms(lambda: mp.plan(batch, c)))
    med = {k: float(summary(v)) for k, v in times.items()}
    prim = primitives(batch, plans["share"])
    return dict(case=name, samples=batch.num_samples, dp=dp, median_ms=med, all_ms=times,
                ratio=med["share"] / med["no-share"], primitives_ms=prim,
                tokens={k: p.stats.tokens_with_sharing for k, p in plans.items()})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="chains up to 1,000 and 3 repeats")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--clock", choices=tuple(CLOCK), default="wall",
                    help="wall: median wall time; cpu: minimum CPU time of the repeats (a loaded machine)")
    args = ap.parse_args(argv)
    global _clock
    _clock = CLOCK[args.clock]
    summary = np.median if args.clock == "wall" else np.min
    cost = dense_7b_cost()
    repeats = 3 if args.quick else args.repeats
    rows = []
    print(f"{'case':<20}{'no-share ms':>12}{'share ms':>10}{'ratio':>7}   primitives ms (cut_trees, set_tries, "
          f"set_tries x8, micro_tree one by one, micro_trees)")
    for name, batch, dp in cases(args.quick):
        r = time_case(name, batch, dp, repeats, cost, summary)
        rows.append(r)
        m, p = r["median_ms"], r["primitives_ms"]
        prim = ", ".join(f"{v:.1f}" for v in p.values()) if p else "-"
        print(f"{name:<20}{m['no-share']:>12.1f}{m['share']:>10.1f}{r['ratio']:>7.1f}   {prim}")
    grpo = rows[0]["median_ms"]["share"]
    c1500 = next((r["median_ms"]["share"] for r in rows if r["case"].startswith("chain 1,500")), None)
    worst = max(r["ratio"] for r in rows)
    met = {"ratio": worst <= TARGETS["ratio"], "grpo_ms": grpo <= TARGETS["grpo_ms"],
           "chain1500_ms": c1500 is not None and c1500 <= TARGETS["chain1500_ms"]}
    print(f"targets: share/no-share <= {TARGETS['ratio']:.0f}x: {'met' if met['ratio'] else 'MISSED'} "
          f"(worst {worst:.1f}x); grpo <= {TARGETS['grpo_ms']:.0f} ms: {'met' if met['grpo_ms'] else 'MISSED'} "
          f"({grpo:.0f} ms); chain 1,500 <= {TARGETS['chain1500_ms']:.0f} ms: "
          f"{'met' if met['chain1500_ms'] else 'MISSED'} ({c1500 if c1500 is None else round(c1500)} ms)")
    return record("share-speed", write=not args.no_write, cap=CAP, cost=cost.to_dict(), targets=TARGETS,
                  met=met, rows=rows, clock=args.clock, statistic="median" if args.clock == "wall" else "min",
                  load_average=os.getloadavg()[0])


if __name__ == "__main__":
    main()
