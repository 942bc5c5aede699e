"""Fingerprints of plans over a fixed set of inputs: the check that speed work leaves plans bit-identical.

Design note. Each case plans one synthetic step (``microplan.traces.generate``) under one config
and prints a SHA-256 of the plan's JSON (``Plan.to_json``: every index list, loss scale, CP field
and the K choice with its predicted times) and of the index lists read through ``Step.micros``
(what a trainer reads). The cases are bench_speed's two inputs plus configs that reach the other
stages: step sync, a dense packed-row cost (the K search), align, pipeline order, static and
dynamic CP, shared prefixes, padded layouts, row/sample multiples, local placement, several
steps with ``short_step="drop"``, static batching; and last the user's default path (16k
samples, dp 128, ``FlopsCost.from_hf_config`` of Qwen2.5-7B) and bench_share_speed's GRPO step.
Run it on two trees and diff the output:

    PYTHONPATH=/path/to/main/src python -m benchmarks.plan_hashes > main.txt
    PYTHONPATH=$PWD/src python -m benchmarks.plan_hashes > branch.txt && diff main.txt branch.txt

~20 s. Nothing is written; the output is the record.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import microplan as mp  # noqa: E402
from microplan.traces import generate  # noqa: E402

from benchmarks.metrics import config_7b_cost, dense_7b_cost  # noqa: E402

CAP = 32768


def _batch(family: str, prompts: int, group: int = 8, seed: int = 0, max_len: int = 16384) -> mp.Batch:
    return generate(family, num_prompts=prompts, samples_per_prompt=group, max_len=max_len, seed=seed)


def cases() -> list[tuple[str, mp.Batch, mp.PlanConfig]]:
    """(name, batch, config) of every case, in a fixed order."""
    cost = dense_7b_cost()
    dense = mp.FlopsCost(linear=cost.linear, per_micro=cost.per_micro, packed_quadratic=cost.quadratic)
    big, small = _batch("grpo-longtail", 2048), _batch("grpo-longtail", 512)
    g = dict(max_tokens_per_micro=CAP, cost=cost)
    out = [("speed-16k-dp128", big, mp.PlanConfig(dp_size=128, **g)),
           ("speed-4k-dp32", small, mp.PlanConfig(dp_size=32, **g)),
           ("step-sync", small, mp.PlanConfig(dp_size=32, sync="step", **g)),
           ("token-cost", small, mp.PlanConfig(dp_size=16, max_tokens_per_micro=CAP)),
           ("dense-k-search", _batch("grpo-longtail", 64), mp.PlanConfig(dp_size=8, max_tokens_per_micro=CAP,
                                                                         cost=dense)),
           ("align-2", _batch("bimodal", 256), mp.PlanConfig(dp_size=16, align=2, max_tokens_per_micro=49152,
                                                             cost=cost)),
           ("pipeline-4", _batch("bimodal", 128), mp.PlanConfig(dp_size=8, pipeline_stages=4,
                                                                max_tokens_per_micro=49152, cost=cost)),
           ("static-cp-2", _batch("long-context", 128, max_len=32768),
            mp.PlanConfig(dp_size=8, context_parallel=mp.ContextParallel(size=2), max_tokens_per_micro=24576,
                          cost=cost)),
           ("dynamic-cp-4", _batch("long-context", 128, max_len=32768),
            mp.PlanConfig(dp_size=16, context_parallel=mp.ContextParallel(max_size=4), max_tokens_per_micro=16384,
                          cost=cost)),
           ("share-prefixes", _batch("stepwise-multiturn", 64, group=4),
            mp.PlanConfig(dp_size=8, share_prefixes=True, max_tokens_per_micro=24576, cost=cost)),
           ("padded", _batch("grpo-longtail", 128), mp.PlanConfig(dp_size=8, layout="padded", **g)),
           ("multiples", small, mp.PlanConfig(dp_size=32, pad_to_multiple_of=16, pad_row_to_multiple_of=8, **g)),
           ("steps-drop", _batch("grpo-longtail", 300, seed=1),
            mp.PlanConfig(dp_size=16, steps=mp.Steps(prompts_per_step=64), short_step="drop", **g)),
           ("static-batching", small, mp.PlanConfig(dp_size=32, micro_batch_size=4, cost=cost)),
           ("prompt-mean", small, mp.PlanConfig(dp_size=32, loss=mp.Loss("prompt-mean"), **g))]
    owners = np.random.default_rng(0).integers(0, 16, small.num_samples)
    out.append(("local", small.with_rank_of(owners), mp.PlanConfig(dp_size=16, placement="local", **g)))
    out.append(("speed-16k-config", big, mp.PlanConfig(dp_size=128, max_tokens_per_micro=CAP, sync="micro",
                                                        cost=config_7b_cost())))
    out.append(("share-16k-dp128", big, mp.PlanConfig(dp_size=128, share_prefixes=True, sync="micro", **g)))
    return out


def fingerprint(plan: mp.Plan) -> tuple[str, str]:
    """(SHA-256 of the plan JSON, SHA-256 of every Micro's indices read through Step.micros), 16 hex each."""
    js = hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]
    h = hashlib.sha256()
    for step in plan.steps:
        for row in step.micros:
            for m in row:
                h.update(np.ascontiguousarray(m.indices, dtype=np.int64).tobytes() + b"|")
            h.update(b"/")
    return js, h.hexdigest()[:16]


def main() -> None:
    for name, batch, cfg in cases():
        js, ix = fingerprint(mp.plan(batch, cfg))
        print(f"{name:18s} json {js}  indices {ix}")


if __name__ == "__main__":
    main()
