"""Fault table: how every rank of a gloo group ends when one rank misbehaves, and how fast.

Design note. Runs the fault cases of ``tests/test_faults.py`` (different configs, a NaN length,
an empty rank, a loader that raises, planning that fails on one rank, disagreeing plans, bad
exchange inputs...) on spawned gloo groups of 2, 4 and 8 CPU ranks — all guarded cases in one
spawn per world size — plus the two unguarded cases (a rank raising outside microplan, its
process exiting or lingering). For each case it records how each rank ended (grouped by
outcome) and the wall time (max over ranks; unguarded: the whole spawn). A guarded case passes
when every rank ends with the same PlanError, or all with the same valid plan, in well under a
second; unguarded peers must end with an error within the process-group timeout.

Run: ``python -m benchmarks.bench_faults [--worlds 2 4 8] [--no-write]``; prints the table and
writes ``benchmarks/results/faults-<date>-<host>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the gloo harness and the fault cases live with the tests
if str(ROOT) not in sys.path:  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(ROOT))

from test_faults import format_table, run_fault_suite, run_unguarded  # noqa: E402

from benchmarks._results import save_json  # noqa: E402



def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    rows = [row for w in args.worlds for row in run_fault_suite(w)]
    rows += [run_unguarded(4, stay_alive_s=0, pg_timeout_s=5), run_unguarded(4, stay_alive_s=4, pg_timeout_s=2)]
    print(format_table(rows))
    guarded = [r for r in rows if "same_on_all_ranks" in r]
    ok = all(r["same_on_all_ranks"] for r in guarded)
    result = {"date": datetime.date.today().isoformat(), "host": socket.gethostname(), "backend": "gloo (CPU)",
              "all_guarded_cases_agree": ok, "max_guarded_seconds": max(r["seconds"] for r in guarded),
              "cases": [{**r, "ranks": [{"ended": e, "ranks": rs} for e, rs in r["ranks"].items()]} for r in rows]}
    if not args.no_write:
        print(f"wrote {save_json('faults', result).with_suffix('.json').relative_to(ROOT)}")
    return result


if __name__ == "__main__":
    main()
