"""Split a batch into optimizer steps in prompt or rollout units.

Design note. Steps are formed from whole groups in order of first appearance: a prompt group
(GRPO) or a rollout (the turns of a step-wise trajectory) is atomic, so a multi-turn batch with
a variable number of samples per prompt still yields exactly the configured number of steps
(the SkyRL seed). Groups that cannot fill a last step are returned as dropped, with a reason,
never silently lost; a setting under which NO step forms (more prompts or rollouts per step than
the batch holds) is a PlanError naming the setting and the largest value that forms a step, never
a plan of zero steps. Guarantees: every sample is in exactly one step or in ``dropped``; no
rollout and no prompt group spans two steps. Cost: O(n) numpy.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..batch import Batch
from ..config import Steps
from ..errors import PlanError

__all__ = ["StepSplit", "split_steps"]


class StepSplit(NamedTuple):
    """``steps[s]``: sorted global sample indices of step s; ``dropped``/``reason``: the rest."""

    steps: list[np.ndarray]
    dropped: np.ndarray
    reason: str


def split_steps(batch: Batch, steps: Steps | None) -> StepSplit:
    """Assign every sample to a step, or to ``dropped`` when its group fills no step."""
    n = batch.num_samples
    none = np.zeros(0, dtype=np.int64)
    if n == 0:
        return StepSplit([], none, "")
    if steps is None:
        return StepSplit([np.arange(n, dtype=np.int64)], none, "")
    if steps.num_steps is not None:
        P, k = batch.num_prompts, steps.num_steps
        if k > P:
            raise PlanError(f"Steps(num_steps={k}) but the batch has only {P} prompt groups; a group is never "
                            f"split, so ask for at most {P} steps.")
        sizes = np.full(k, P // k, dtype=np.int64)
        sizes[: P % k] += 1
        step_of_prompt = np.repeat(np.arange(k, dtype=np.int64), sizes)
        step_of = step_of_prompt[batch.prompt_codes]
        return StepSplit(_group(step_of, k), none, "")
    if steps.prompts_per_step is not None:
        p = steps.prompts_per_step
        full = batch.num_prompts // p
        _check_forms_a_step(batch, full, "prompts_per_step", p, batch.num_prompts, "prompt groups")
        step_of = batch.prompt_codes // p
        reason = (f"trailing prompt group: the last {batch.num_prompts - full * p} prompt(s) do not fill a step "
                  f"of prompts_per_step={p}")
        return _finish(step_of, full, reason)
    r = steps.rollouts_per_step
    assert r is not None  # Steps.__post_init__ guarantees exactly one field
    full = batch.num_rollouts // r
    _check_forms_a_step(batch, full, "rollouts_per_step", r, batch.num_rollouts, "rollouts")
    step_of = batch.rollout_codes // r
    step_of = np.where(step_of >= full, full, step_of)  # `full` marks the dropped tail
    _check_prompts_not_cut(batch, step_of, r)
    reason = (f"trailing rollout: the last {batch.num_rollouts - full * r} rollout(s) do not fill a step "
              f"of rollouts_per_step={r}")
    return _finish(step_of, full, reason)


def _check_forms_a_step(batch: Batch, full: int, name: str, value: int, have: int, what: str) -> None:
    """Refuse a step size under which no step forms: every sample would be dropped."""
    if full == 0:
        flag = "--" + name.replace("_", "-")
        raise PlanError(f"Steps({name}={value}) forms no optimizer step: the batch has only {have:,} {what}, so all "
                        f"{batch.num_samples:,} samples would be dropped; set {name} (CLI {flag}) to at most "
                        f"{have:,}, or use Steps(num_steps=k).")


def _finish(step_of: np.ndarray, full: int, reason: str) -> StepSplit:
    dropped = np.flatnonzero(step_of >= full).astype(np.int64)
    return StepSplit(_group(step_of, full), dropped, reason if dropped.size else "")


def _group(step_of: np.ndarray, k: int) -> list[np.ndarray]:
    """Sorted sample indices per step, for steps 0..k-1 (samples with step_of >= k are left out)."""
    order = np.argsort(step_of, kind="stable").astype(np.int64)
    bounds = np.searchsorted(step_of[order], np.arange(k + 1))
    return [order[bounds[s]:bounds[s + 1]] for s in range(k)]


def _check_prompts_not_cut(batch: Batch, step_of: np.ndarray, r: int) -> None:
    P = batch.num_prompts
    lo = np.full(P, np.iinfo(np.int64).max, dtype=np.int64)
    hi = np.full(P, -1, dtype=np.int64)
    np.minimum.at(lo, batch.prompt_codes, step_of)
    np.maximum.at(hi, batch.prompt_codes, step_of)
    cut = np.flatnonzero(lo != hi)
    if cut.size:
        p = int(cut[0])
        i = int(np.flatnonzero(batch.prompt_codes == p)[0])
        raise PlanError(f"Steps(rollouts_per_step={r}) cuts the prompt group of sample {i} across two steps; a "
                        "group stays in its step. Use Steps(prompts_per_step=...) or a rollouts_per_step that is "
                        "a multiple of the group size.")
