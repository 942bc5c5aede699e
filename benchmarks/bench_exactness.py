"""Exactness benchmark: worst relative gradient error of microplan's loss_scale, per mode and world size.

Runs the experiment of tests/_exactness.py (tiny float64 Llama, packed varlen forwards, gloo
worlds 1/2/4, 2 data sets × PPO / -A·logp × 4-6 layouts (static CP 2 and dynamic CP ≤ 2 on even worlds) × 7 loss
modes × 3 engine conventions),
prints the worst ‖g − ∇J‖/‖∇J‖ per mode, per convention and per layout × world size, the naive per-micro
token mean for contrast, and the packed-vs-unpacked forward difference, then writes everything to
benchmarks/results/exactness-<YYYY-MM-DD>-<hostname>.json.

    python benchmarks/bench_exactness.py [--worlds 1 2 4]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import socket
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import microplan as mp  # noqa: E402
from _exactness import (CONVENTIONS, DATASETS, NAIVE, one_thread, packed_vs_unpacked, rank_worker,  # noqa: E402
                        reference_grads, setup)
from _gloo import RankError, run_gloo  # noqa: E402

TOL = 1e-10


def run(worlds: list[int]) -> dict:
    t0 = time.perf_counter()
    with one_thread():
        state, data = setup()
        refs = reference_grads(state, data)
        packed = {d: packed_vs_unpacked(state, data[d]) for d in DATASETS}
    t_ref = time.perf_counter() - t0
    per_world: dict[int, dict] = {}
    for w in worlds:
        t = time.perf_counter()
        res = run_gloo(rank_worker, w, (state, data, refs), timeout_s=600)
        bad = [r for r in res if isinstance(r, RankError)]
        if bad:
            raise SystemExit(f"world {w}: rank failed:\n{bad[0].traceback}")
        per_world[w] = {"errors": res[0]["errors"], "wall_s": time.perf_counter() - t,
                        "placeholders": sum(c["placeholders"] for r in res for c in r["counts"].values()),
                        "micros": sum(c["micros"] for r in res for c in r["counts"].values()),
                        "ranks_agree": all(r["errors"] == res[0]["errors"] for r in res)}
    return {"state_setup_s": t_ref, "packed_vs_unpacked": packed, "worlds": per_world}


def summarise(out: dict) -> dict:
    by_mode: dict[str, dict[str, float]] = defaultdict(dict)
    by_conv: dict[str, dict[str, float]] = defaultdict(dict)
    by_case: dict[str, float] = {}
    by_layout: dict[str, dict[str, float]] = defaultdict(dict)
    for w, r in out["worlds"].items():
        for (d, kind, lay, mode, conv), e in r["errors"].items():
            by_mode[mode][str(w)] = max(by_mode[mode].get(str(w), 0.0), e)
            if mode != NAIVE[0]:
                by_conv[conv][str(w)] = max(by_conv[conv].get(str(w), 0.0), e)
                ck = f"{d}/{kind}/{lay}"
                by_case[ck] = max(by_case.get(ck, 0.0), e)
                by_layout[lay][str(w)] = max(by_layout[lay].get(str(w), 0.0), e)
    exact = [e for w in out["worlds"].values() for k, e in w["errors"].items() if k[3] != NAIVE[0]]
    naive = [e for w in out["worlds"].values() for k, e in w["errors"].items() if k[3] == NAIVE[0]]
    return {"worst_by_mode_and_world": dict(by_mode), "worst_by_convention_and_world": dict(by_conv),
            "worst_by_case": by_case, "worst_by_layout_and_world": dict(by_layout), "worst": max(exact), "cases": len(exact),
            "naive_token_mean_min_error": min(naive), "naive_token_mean_max_error": max(naive),
            "passed": max(exact) <= TOL and min(naive) > 1e-3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default: benchmarks/results/...)")
    args = ap.parse_args()
    out = run(args.worlds)
    summary = summarise(out)
    worlds = [str(w) for w in args.worlds]
    print(f"worst relative gradient error ‖g − ∇J‖/‖∇J‖ (float64; tolerance {TOL:g})")
    print(f"{'mode':28s}" + "".join(f"{'W=' + w:>12s}" for w in worlds))
    for mode in [*mp.LOSS_MODES, NAIVE[0]]:
        row = summary["worst_by_mode_and_world"][mode]
        print(f"{mode:28s}" + "".join(f"{row[w]:12.2e}" for w in worlds))
    print(f"\n{'convention':28s}" + "".join(f"{'W=' + w:>12s}" for w in worlds))
    for conv in CONVENTIONS:
        row = summary["worst_by_convention_and_world"][conv]
        print(f"{conv:28s}" + "".join(f"{row[w]:12.2e}" for w in worlds))
    print(f"\n{'layout':28s}" + "".join(f"{'W=' + w:>12s}" for w in worlds))
    for lay, row in summary["worst_by_layout_and_world"].items():  # cp2/dcp: even worlds only
        print(f"{lay:28s}" + "".join(f"{row[w]:12.2e}" if w in row else f"{'-':>12s}" for w in worlds))
    for w, r in out["worlds"].items():
        print(f"W={w}: {r['micros']} micro-batch forwards over all cases ({r['placeholders']} placeholders) "
              f"in {r['wall_s']:.1f}s, ranks agree: {r['ranks_agree']}")
    for d, r in out["packed_vs_unpacked"].items():
        print(f"packed vs unpacked forward [{d}: {r['samples']} samples, {r['tokens']} tokens]: "
              f"max |Δ logits| = {r['logits_max_abs_diff']:.2e}, max |Δ logp| = {r['logprob_max_abs_diff']:.2e}")
    print(f"\nworst over {summary['cases']} (case, mode, convention, world) cells: {summary['worst']:.2e}; "
          f"naive per-micro token mean: {summary['naive_token_mean_min_error']:.2e} .. "
          f"{summary['naive_token_mean_max_error']:.2e} -> {'PASS' if summary['passed'] else 'FAIL'}")
    host = socket.gethostname()
    path = args.out or ROOT / "benchmarks" / "results" / f"exactness-{dt.date.today().isoformat()}-{host}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "exactness", "date": dt.datetime.now().isoformat(timespec="seconds"), "host": host,
        "python": platform.python_version(), "torch": torch.__version__, "microplan": mp.__version__,
        "model": "LlamaForCausalLM 2 layers, hidden 16, 2 heads / 1 KV head, vocab 32, float64, sdpa",
        "tolerance": TOL, "summary": summary,
        "packed_vs_unpacked": out["packed_vs_unpacked"],
        "worlds": {str(w): {k: v for k, v in r.items() if k != "errors"} for w, r in out["worlds"].items()},
        "errors": [{"world": w, "data": k[0], "loss": k[1], "layout": k[2], "mode": k[3], "convention": k[4],
                    "rel_error": e} for w, r in out["worlds"].items() for k, e in sorted(r["errors"].items())],
    }
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    if not summary["passed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
