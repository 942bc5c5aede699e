"""Forward-only passes of an RL step: ``plan_forward(batch, config, *, like=None) -> Plan``.

Design note. Before training, an RL step runs forward-only passes over the same samples: the
actor's old log-probs, the reference model's log-probs, the critic's values. They hang on
unequal micro-batch counts exactly like a backward pass, so a forward plan keeps every core
guarantee (every sample once, equal counts with explicit placeholders, a hard cap, K >=
``pipeline_stages``) and differs in three ways: its loss scales are all 0 (``Plan.kind ==
"forward"``; ``validate`` checks it), it is one step holding every sample, and it has its own
geometry or exactly the training one.

- ``like=None``: its own geometry. ``config.steps`` and ``config.short_step`` are ignored (the
  pass covers every sample, nothing is dropped: the plan's config records ``steps=None,
  short_step="pad"``); ``config.max_tokens_per_micro`` is the *forward* cap — no activations
  are kept for backward, so it is usually 2–4× the training cap, bounded by the logits memory
  (:func:`microplan.logits_token_cap`) — and ``config.cost`` balances it (use a forward-only
  cost, e.g. ``FlopsCost.from_hf_config(cfg, backward_factor=0)``). With a memory budget
  (``PlanConfig(memory=M, max_bytes_per_micro=B)``) the pass plans against B with ``M.forward``
  (no saved activations: more tokens per micro-batch than training), M itself when it has none.
- ``like=train_plan``: the training plan's geometry, step by step — every micro-batch holds the
  same samples in the same order on the same rank and slot — so the forward computes each
  token's log-prob from the very same packed row as the training forward: bit-identical
  old log-probs (tests/test_forward_torch.py), and every sample's value is already on the rank
  that trains it. ``config`` supplies only the cost model (for predicted times); its parallel
  layout (dp_size, context_parallel, pipeline stages) must match the training plan's. Samples
  the training plan dropped are dropped here too (they train in no step, so need no log-prob).
  A ``like`` plan made from another batch is refused (the batches' fingerprints differ).
Trade-off: the own geometry at a larger cap runs fewer micro-batches per rank than training
(benchmarks/bench_planners.py, forward rows, measures how many); ``like`` buys bit-identity at
the training K.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .batch import Batch
from .config import PlanConfig
from .errors import PlanError
from .plan import Plan
from .planner import plan
from .stages.fit import effective_cap
from .stages.pipeline import order_step
from .stats import step_cost_grid
from .types import Micro, Step

__all__ = ["plan_forward"]


def plan_forward(batch: Batch, config: PlanConfig, *, like: Plan | None = None) -> Plan:
    """Plan a forward-only pass over ``batch`` (binding API; see the module note).

    Args:
        batch: the step's samples (the same Batch the training plan was made from).
        config: the forward pass's config: its ``max_tokens_per_micro`` is the forward cap and
            its ``cost`` the forward cost; ``steps`` and ``short_step`` are ignored. With
            ``like``, only ``cost`` is used and the parallel layout must match.
        like: a plan (training or forward) whose geometry to reproduce exactly.

    Returns a :class:`Plan` with ``kind == "forward"`` and every ``loss_scale`` 0.

    Raises:
        PlanError: a sample longer than the forward cap (without context parallel to hold it),
            a ``like`` plan made from another batch or for another parallel layout.
    """
    if not isinstance(batch, Batch):
        raise PlanError(f"plan_forward() takes a microplan.Batch, got {type(batch).__name__}; wrap lengths as "
                        "Batch(seq_lens).")
    if not isinstance(config, PlanConfig):
        raise PlanError(f"plan_forward() takes a microplan.PlanConfig, got {type(config).__name__}.")
    if like is not None:
        return _like(batch, config, like)
    cfg = replace(config, steps=None, short_step="pad")
    if cfg.memory is not None:  # the no-grad pass's model against the same byte budget (memory/model.py)
        cfg = replace(cfg, memory=cfg.memory.forward_model())
    _check_forward_cap(batch, cfg)
    own = plan(batch, cfg)
    cfg = own.config  # with a byte budget: the token cap the planner chose
    steps = []
    for step in own.steps:  # a forward-only pipeline has its own best order (none for 1F1B without VPP)
        step = order_step(step, step_cost_grid(batch, cfg, step), cfg, backward_ratio=0.0)
        steps.append(_zero_scales(step))
    return Plan(batch=batch, config=cfg, steps=steps, dropped=own.dropped, drop_reasons=own.drop_reasons,
                kind="forward")


def _zero_scales(step: Step) -> Step:
    """The step with every loss scale 0 (same micro-batches, same order, same CP groups)."""
    zeros: dict[int, np.ndarray] = {}

    def zero(n: int) -> np.ndarray:
        if n not in zeros:
            z = np.zeros(n, dtype=np.float64)
            z.setflags(write=False)
            zeros[n] = z
        return zeros[n]

    micros = tuple(tuple(Micro._trusted(m.indices, m.seq_lens, m.loss_tokens, zero(m.indices.size), m.cp_size,
                                        m.cp_rank, m.cp_group, m.tree, footprint=m.footprint)
                         for m in row) for row in step.micros)
    return Step(step.index, micros, step.samples, choice=step.choice)


def _check_forward_cap(batch: Batch, cfg: PlanConfig) -> None:
    cap = effective_cap(cfg)
    cp = cfg.context_parallel
    if cap is None or batch.num_samples == 0 or (cp is not None and cp.dynamic):
        return  # static batching has no token cap; dynamic CP sizes its groups (cp.py refuses what cannot fit)
    j = int(np.argmax(batch.seq_lens))
    L = int(batch.seq_lens[j])
    if L <= cap:
        return
    where = f"max_tokens_per_micro={cfg.max_tokens_per_micro}" + (f" × cp size {cfg.static_cp_size} = {cap}"
                                                                  if cfg.static_cp_size > 1 else "")
    raise PlanError(f"plan_forward: sample {j} has {L} tokens, more than the forward cap ({where}). Raise the "
                    f"forward cap to at least {L} (a forward pass keeps no activations for backward, so 2-4x the "
                    "training cap usually fits; microplan.logits_token_cap bounds it by logits memory), enable "
                    "context_parallel, or reuse the training layout: plan_forward(batch, config, like=train_plan).")


_LAYOUT = ("dp_size", "context_parallel", "pipeline_stages", "virtual_stages")


def _like(batch: Batch, config: PlanConfig, like: Plan) -> Plan:
    if not isinstance(like, Plan):
        raise PlanError(f"plan_forward(like=...) takes a microplan.Plan (the training plan), got "
                        f"{type(like).__name__}.")
    if like.batch != batch:
        raise PlanError(_other_batch(batch, like.batch))
    for name in _LAYOUT:
        mine, theirs = getattr(config, name), getattr(like.config, name)
        if mine != theirs:
            raise PlanError(f"plan_forward(like=...): the like plan has {name}={theirs!r} but config has "
                            f"{name}={mine!r}; the forward pass reproduces the like plan on the same ranks, so "
                            f"pass a config with {name}={theirs!r} (or plan the forward pass without like=).")
    cfg = replace(like.config, cost=config.cost)
    steps = [_zero_scales(step) for step in like.steps]
    return Plan(batch=batch, config=cfg, steps=steps, dropped=like.dropped, drop_reasons=like.drop_reasons,
                kind="forward")


def _other_batch(batch: Batch, other: Batch) -> str:
    """Why two batches differ: sizes, fingerprints and the first differing field."""
    head = (f"plan_forward(like=...): the like plan was made from another batch ({other.num_samples} samples, "
            f"fingerprint {other.fingerprint()[:12]}) than the one given ({batch.num_samples} samples, fingerprint "
            f"{batch.fingerprint()[:12]})")
    mine, theirs = batch.to_dict(), other.to_dict()
    for key in mine:
        a, b = mine[key], theirs.get(key)
        if a != b:
            if isinstance(a, list) and isinstance(b, list):
                i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                head += f"; first difference: {key}[{i}]"
            else:
                head += f"; {key} differ"
            break
    return (head + ". Pass the Batch the training plan was made from (the same lengths, loss tokens and ids, "
            "in the same order), or plan the forward pass without like=.")
