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

Run: ``python -m benchmarks.bench_speed [--repeats N]``; writes
``benchmarks/results/speed-<date>-<host>.json``.
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
from microplan.traces import generate  # noqa: E402

from benchmarks._results import save_json  # noqa: E402
from benchmarks.metrics import dense_7b_cost  # noqa: E402
from benchmarks.peers import plan_slime, plan_verl, verl  # noqa: E402

CASES = ((16384, 128), (4096, 32))   # (samples, dp)
MAX_LEN, CAP, GROUP = 16384, 32768, 8
TARGETS = {"slime": 25.0, "verl": 50.0}  # required speed-up of microplan at 16k samples, dp=128


def _wall(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def _verl_critical_path(lens: np.ndarray, dp: int) -> float:
    """ms of verl's critical path: driver DP split + the slowest rank's own micro-batching."""
    t = time.perf_counter()
    parts, plens, work = verl.balance_batch(lens, dp)
    k = max(verl.micro_count(p, plens, CAP) for p in parts)
    driver = (time.perf_counter() - t) * 1e3
    return driver + max(_wall(lambda: verl.rearrange_micro_batches(p, work, k, len(lens))) for p in parts)


def _timers(batch: mp.Batch, dp: int, cost) -> dict:
    """name -> callable returning its own wall time in ms."""
    cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=CAP, cost=cost, sync="micro")
    lens = np.asarray(batch.seq_lens)
    return {
        "microplan": lambda: _wall(lambda: mp.plan(batch, cfg)),
        "slime": lambda: _wall(lambda: plan_slime(lens, dp=dp, cap=CAP, cost=cost)),
        "verl": lambda: _wall(lambda: plan_verl(lens, dp=dp, cap=CAP, cost=cost)),
        "verl-critical-path": lambda: _verl_critical_path(lens, dp),
    }


def time_case(samples: int, dp: int, repeats: int, cost) -> dict:
    """Median wall time (ms) of each planner on one step, and peer/microplan ratios."""
    batch = generate("grpo-longtail", num_prompts=samples // GROUP, samples_per_prompt=GROUP,
                     max_len=MAX_LEN, seed=0)
    fns = _timers(batch, dp, cost)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(fn())
    med = {k: float(np.median(v)) for k, v in times.items()}
    return dict(samples=samples, dp=dp, cap=CAP, tokens=int(np.sum(batch.seq_lens)), repeats=repeats,
                median_ms=med, all_ms=times,
                ratio={k: med[k] / med["microplan"] for k in med if k != "microplan"})


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    cost = dense_7b_cost()
    cases = []
    for samples, dp in CASES:
        c = time_case(samples, dp, args.repeats, cost)
        cases.append(c)
        m = c["median_ms"]
        print(f"{samples:>6} samples dp={dp:<4} microplan {m['microplan']:8.1f} ms   slime {m['slime']:8.1f} ms "
              f"({c['ratio']['slime']:5.1f}x)   verl {m['verl']:8.1f} ms ({c['ratio']['verl']:5.1f}x)   "
              f"verl critical path {m['verl-critical-path']:7.1f} ms ({c['ratio']['verl-critical-path']:5.1f}x)")
    big = cases[0]["ratio"]
    print("targets at 16k/dp=128: " + ", ".join(
        f"{k} >= {v:.0f}x: {'met' if big[k] >= v else 'MISSED'} ({big[k]:.1f}x)" for k, v in TARGETS.items()))
    result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), cost=cost.to_dict(),
                  family="grpo-longtail", max_len=MAX_LEN, targets=TARGETS, cases=cases)
    if not args.no_write:
        print(f"wrote {save_json('speed', result).with_suffix('.json')}")
    return result


if __name__ == "__main__":
    main()
