"""What the sharing floor's slack costs: plans with ``SKIP_SLACK`` as shipped vs laying every candidate out.

Design note. ``stages/granularity.py`` skips the tree cuts and the per-sample candidate once a
candidate sits within ``SKIP_SLACK`` of the sharing floor (a lower bound of every sharing layout),
so a skipped candidate could have been at most that much faster. This script measures what the
rule changes on the trace families: for each family × prompts (32, 256) × dp (8, 64) × cap (32k,
48k tokens) × sync (micro, step) × ``pad_to_multiple_of`` (1, 8), 8 samples per prompt, the ~7B
cost of the speed benchmarks, it plans the step with ``share_prefixes=True`` twice — as shipped,
and with ``SKIP_SLACK = 0`` (a candidate is skipped only at the floor itself, where nothing can
beat it) — and reports how many plans differ, how much slower (predicted time) the shipped ones
are, and that none is slower than the same batch unshared. Planning only; no timing.

Run: ``python -m benchmarks.share_slack``.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import microplan as mp  # noqa: E402
from microplan.stages import granularity  # noqa: E402
from microplan.traces import FAMILIES, generate  # noqa: E402

from benchmarks.metrics import dense_7b_cost  # noqa: E402

GRID = dict(prompts=(32, 256), dp=(8, 64), cap=(32768, 49152), sync=("micro", "step"), multiple=(1, 8))


def _plan(batch: mp.Batch, cfg: mp.PlanConfig, slack: float) -> mp.Plan | None:
    shipped = granularity.SKIP_SLACK
    granularity.SKIP_SLACK = slack
    try:
        return mp.plan(batch, cfg)
    except mp.PlanError:
        return None
    finally:
        granularity.SKIP_SLACK = shipped


def main(argv: list[str] | None = None) -> dict:
    cost = dense_7b_cost()
    cases = planned = changed = worse_than_unshared = 0
    worst, worst_case = 1.0, ""
    for fam, n, dp, cap, sync, mult in itertools.product(FAMILIES, *GRID.values()):
        batch = generate(fam, num_prompts=n, samples_per_prompt=8, max_len=16384, seed=0)
        cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, cost=cost, sync=sync, share_prefixes=True,
                            pad_to_multiple_of=mult)
        cases += 1
        shipped, full = _plan(batch, cfg, granularity.SKIP_SLACK), _plan(batch, cfg, 0.0)
        if shipped is None or full is None:
            continue
        planned += 1
        flat = _plan(batch, replace(cfg, share_prefixes=False), granularity.SKIP_SLACK)
        t_ship, t_full = shipped.stats.predicted_time, full.stats.predicted_time
        if flat is not None and t_ship > flat.stats.predicted_time * (1 + 1e-9):
            worse_than_unshared += 1
        if shipped.fingerprint() != full.fingerprint():
            changed += 1
            if t_ship / t_full > worst:
                worst, worst_case = t_ship / t_full, f"{fam}, {n} prompts, dp {dp}, cap {cap}, sync {sync}, x{mult}"
    print(f"{cases} configurations, {planned} plan; SKIP_SLACK={granularity.SKIP_SLACK:g} vs 0: {changed} plans differ, "
          f"the worst {100 * (worst - 1):.2f} % slower (predicted; {worst_case or '-'}); slower than unshared: "
          f"{worse_than_unshared}")
    return dict(cases=cases, planned=planned, changed=changed, worst_ratio=worst, worse_than_unshared=worse_than_unshared)


if __name__ == "__main__":
    main()
