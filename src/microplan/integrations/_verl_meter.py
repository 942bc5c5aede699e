"""verl's balancing cost, learned from the run: the trained model's FLOPs, then the machine's seconds.

Design note. The drop-in balances each step with :func:`current_cost`:

1. ``install(cost=...)``: that model, as given;
2. else a :class:`~microplan.CostMeter` with records: its fit (seconds of this machine);
3. else the trained model's FLOPs, ``FlopsCost.from_hf_config``: from ``install(hf_config=...)``
   (a dict or a transformers config, for drivers, tests and benchmarks) or, in a worker, from the
   ``model_config.hf_config`` verl's engine holds (read at the engine's first step);
4. else tokens (+ 256 tokens' worth per micro-batch): no constant of another model.

Metering (``install(meter=True)``, the default): :func:`wrap_engine` wraps verl's engine
``forward_backward_batch`` (training passes, not the forward-only log-prob passes): each
micro-batch's time is the span between consecutive ``forward_step`` calls (its forward and the
backward verl runs right after), stamped with CUDA events on GPU (no sync in the loop) or the
host clock on CPU; a micro-batch that ran as a prefix-tree row (``_verl_tree``,
``install(share_prefixes=True)``) is recorded as its tree ``Micro``, priced by its trie (unique
tokens, each token's attention over its path), so the meter learns from shared and flat
micro-batches alike; after the loop, ONE synchronisation and ONE ``all_gather_object`` over the
data-parallel group give every rank all ranks' records, which every rank records in the same
order — so every rank holds the same fit and plans the same plan (the plan fingerprints keep
agreeing). The step's predicted lockstep time (Σ over slots of the slowest rank, by the model the
step was planned with, in seconds once calibrated) and the measured one go into the metrics dict
verl logs: ``microplan/predicted_s``, ``microplan/measured_s``, ``microplan/predicted_error``.
Exploration: a training pass's balancing plans with the meter's ``explore_config``
(:func:`planning_config`): in the meter's warm-up steps (its ``explore_steps``, counted in
training passes) it may plan at a lower token cap, within the meter's cost budget, until the
records tell a dense (packed-T²) kernel from a varlen one; forward-only passes plan with the plain
cost and never count as steps. Every rank calls it with the same gathered batch and the same
records, so every rank gets the same config.
Trade-off: the first metered step is planned with FLOPs (right shape, unknown scale); from the
second on, seconds (benchmarks/bench_verl.py: lockstep / bound after 3 metered steps).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..cost.meter import CostMeter
from ..cost.models import CostModel, FlopsCost, TokenCost
from ..errors import PlanError
from ..types import Micro

if TYPE_CHECKING:
    from ..batch import Batch
    from ..config import PlanConfig

__all__ = ["STATE", "current_cost", "planning_config", "set_model", "wrap_engine", "unwrap_engines", "effective_lengths", "FALLBACK"]

#: with no cost, no records and no model config: tokens plus 256 tokens' worth per micro-batch.
FALLBACK = TokenCost(per_micro=256.0)
STATE: dict[str, Any] = {"cost": None, "prior": None, "meter": None, "metering": True, "forward_only": False,
                         "training": False, "tree_records": 0}  # records of tree micro-batches since reset
_WRAPPED: list[tuple[Any, str, Any]] = []


def reset(*, cost: CostModel | None = None, hf_config: Any = None, metering: bool = True) -> None:
    prior = FlopsCost.from_hf_config(hf_config) if hf_config is not None else None
    STATE.update(cost=cost, prior=prior, metering=metering, meter=CostMeter(prior=prior) if prior is not None else None,
                 tree_records=0)


def set_model(hf_config: Any) -> None:
    """The worker's model config (verl's ``model_config.hf_config``), when install() got none."""
    if STATE["prior"] is None and hf_config is not None:
        STATE["prior"] = FlopsCost.from_hf_config(hf_config)
        STATE["meter"] = CostMeter(prior=STATE["prior"])


def current_cost() -> CostModel:
    """The cost to plan the next micro-batching with (module note, 1-4)."""
    if STATE["cost"] is not None:
        return STATE["cost"]
    if STATE["meter"] is not None:
        return STATE["meter"].cost()
    return FALLBACK


def planning_config(config: PlanConfig, batch: Batch) -> PlanConfig:
    """``config`` with the cost to plan this balancing with (:func:`current_cost`); inside a metered
    training pass, the meter's :meth:`~microplan.CostMeter.explore_config` instead — in its warm-up
    steps possibly a lower ``max_tokens_per_micro`` (a probe), so the records tell a dense kernel
    from a varlen one. ``batch`` is the batch the plan is made of (every rank's, identical on every
    rank, as the meter is: every rank gets the same config). A batch the unexplored config cannot
    plan gets the plain config (the planner then raises its own error, on every rank alike)."""
    meter = STATE["meter"]
    if STATE["cost"] is not None or meter is None or not STATE["training"]:
        return replace(config, cost=current_cost())
    try:
        return meter.explore_config(config, batch)
    except PlanError:
        return replace(config, cost=meter.cost())


def wrap_engine(cls: Any) -> None:
    """Meter ``cls.forward_backward_batch`` (a verl engine class) in this process; idempotent."""
    if any(c is cls for c, _, _ in _WRAPPED):
        return
    original = cls.forward_backward_batch

    def forward_backward_batch(self: Any, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        set_model(getattr(getattr(self, "model_config", None), "hf_config", None))
        STATE["forward_only"] = bool(forward_only)  # a byte budget plans this pass with the forward model
        try:
            if forward_only or not STATE["metering"] or STATE["meter"] is None:
                return original(self, data, loss_function, forward_only=forward_only)
            STATE["training"] = True  # this pass's balancing may explore (planning_config)
            return _metered(self, original, data, loss_function)
        finally:
            STATE["forward_only"] = STATE["training"] = False
    _WRAPPED.append((cls, "forward_backward_batch", original))
    cls.forward_backward_batch = forward_backward_batch


def unwrap_engines() -> None:
    while _WRAPPED:
        cls, name, original = _WRAPPED.pop()
        setattr(cls, name, original)


def effective_lengths(batch: Any) -> np.ndarray:
    """Tokens of each row, as verl counts them: nested ``input_ids`` lengths, else the attention mask sum."""
    ids = batch["input_ids"]
    if getattr(ids, "is_nested", False):
        return ids.offsets().diff().cpu().numpy().astype(np.int64)
    return batch["attention_mask"].sum(dim=1).cpu().numpy().astype(np.int64)


def _metered(engine: Any, original: Any, data: Any, loss_function: Any) -> Any:
    import torch
    cuda = torch.cuda.is_available()
    marks: list[Any] = []
    lens: list[np.ndarray] = []
    planned = current_cost()
    step = engine.forward_step

    def mark() -> None:
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append(ev)
        else:
            marks.append(time.perf_counter())

    def timed_step(micro_batch: Any, *args: Any, **kwargs: Any) -> Any:
        from ._verl_tree import STATE as TREE
        mark()
        n = TREE["micro_batches"]
        out = step(micro_batch, *args, **kwargs)
        # a prefix-tree micro-batch ran its trie: its Micro (unique tokens, each token's path) prices it
        lens.append(effective_lengths(micro_batch) if TREE["micro_batches"] == n else TREE["last_tree"])
        return out
    engine.forward_step = timed_step
    try:
        out = original(engine, data, loss_function, forward_only=False)
        mark()
    finally:
        del engine.forward_step
    if cuda:
        marks[-1].synchronize()  # the one host sync of the step
        seconds = [marks[i].elapsed_time(marks[i + 1]) / 1e3 for i in range(len(marks) - 1)]
    else:
        seconds = [marks[i + 1] - marks[i] for i in range(len(marks) - 1)]
    ranks = _gather(engine, [(ln.tolist() if isinstance(ln, np.ndarray) else ln, s) for ln, s in zip(lens, seconds)])
    _record(ranks, planned, out)
    return out


def _gather(engine: Any, mine: list) -> list[list]:
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    group = engine.get_data_parallel_group() if hasattr(engine, "get_data_parallel_group") else None
    world = dist.get_world_size(group)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)  # the one collective of the step
    return everyone


def _record(ranks: list[list], planned: CostModel, out: Any) -> None:
    """Record every rank's micro-batches (same order on every rank); report predicted vs measured."""
    meter: CostMeter = STATE["meter"]
    calibrated = bool(meter.num_records)
    # each entry: a flat micro-batch's lengths, or a tree micro-batch's Micro (priced by its trie)
    ranks = [[(e if isinstance(e, Micro) else np.asarray(e, dtype=np.int64), s) for e, s in r] for r in ranks]
    K = max(len(r) for r in ranks)
    pred = sum(max((planned.micro_cost(r[m][0]) if m < len(r) else 0.0) for r in ranks)
               for m in range(K)) if calibrated else 0.0
    meas = sum(max((r[m][1] if m < len(r) else 0.0) for r in ranks) for m in range(K))
    for r in ranks:
        for what, seconds in r:
            if len(what.seq_lens if isinstance(what, Micro) else what) and seconds > 0:
                meter.record(what, float(seconds))
                STATE["tree_records"] += isinstance(what, Micro)
    if isinstance(out, dict):
        metrics = out.setdefault("metrics", {})
        metrics["microplan/measured_s"] = [meas]
        if calibrated:  # the plan's model was already in seconds
            metrics["microplan/predicted_s"] = [pred]
            metrics["microplan/predicted_error"] = [pred / meas - 1.0 if meas > 0 else 0.0]
