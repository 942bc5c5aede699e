"""Dynamic CP degrees: how many GPUs each sample's CP group spans (``ContextParallel(max_size=c)``).

Design note. A sample's *need* is the fewest power-of-two GPUs that keep each GPU under the cap
(``cp_degrees``: ⌈row/d⌉ ≤ cap, ``footprint.gpu_tokens``); ``group_room`` is what a group of w
GPUs may hold before its row is rounded up to the row multiple. Beyond the need,
``balanced_degrees`` widens a sample whose per-GPU cost exceeds the mean load of a GPU slot, greedily (a heap by per-GPU cost), only while the CP price
(``per_gpu_cost``: ``cost.cp.cp_micro_costs``, or cost / width without a CP term) says the wider
split is faster, and while the unit GPU-slots left still hold the short samples' tokens.
``cp_increments`` gives the packer the price's per-bin slopes (compute per unit of cost,
exposed communication per token). Cost: O(n log n) for the widening heap; the rest is numpy.
Guarantees: a degree is never below the need; a need above ``max_size`` is a PlanError naming
the sample and the fixes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from .._intmath import cdiv, round_up
from ..config import PlanConfig
from ..cost.cp import cp_micro_costs
from ..errors import PlanError
from ..fixes import too_long_fixes

__all__ = ["group_room", "cp_degrees", "per_gpu_cost", "cp_increments", "balanced_degrees"]


def group_room(width: np.ndarray | int, cfg: PlanConfig) -> np.ndarray | int:
    """Tokens a CP group of ``width`` GPUs may hold before its row is rounded up to the row
    multiple r: ⌊width · cap / r⌋ · r, so the padded row U ≤ width · cap and every GPU computes
    ⌈U/width⌉ ≤ cap rows (``footprint.gpu_tokens``)."""
    r = cfg.pad_row_to_multiple_of
    full = np.asarray(width) * int(cfg.max_tokens_per_micro)  # type: ignore[arg-type]
    return full if r == 1 else full // r * r


def cp_degrees(lens: np.ndarray, samples: np.ndarray, cfg: PlanConfig, *,
               name: Callable[[int], str] | None = None) -> np.ndarray:
    """Smallest power-of-two CP degree per sample that keeps each GPU under the cap (``lens``:
    what each sample occupies, its padding included; its row is rounded up to the row multiple):
    ⌈row/d⌉ ≤ cap. ``name(j)``: how a refusal names unit j (default: "sample i has L tokens")."""
    cap, cmax = cfg.max_tokens_per_micro, cfg.context_parallel.max_size  # type: ignore[union-attr]
    row = _row(lens, cfg)
    need = cdiv(row, cap)  # type: ignore[operator]
    deg = np.left_shift(1, np.ceil(np.log2(np.maximum(need, 1))).astype(np.int64))
    deg = np.where(deg < need, deg * 2, deg)  # guard float rounding
    if lens.size and deg.max() > cmax:
        j = int(np.argmax(deg))
        who = name(j) if name is not None else f"sample {int(samples[j])} has {int(lens[j])} tokens"
        raise PlanError(f"{who}: it needs {int(deg[j])} GPUs at max_tokens_per_micro={cap}, more than "
                        f"ContextParallel.max_size={cmax}; "
                        f"{too_long_fixes(cfg, padded=cfg.pad_row_to_multiple_of > 1 or cfg.pad_to_multiple_of > 1)}.")
    return deg


def per_gpu_cost(cfg: PlanConfig, costs: np.ndarray, lens: np.ndarray, width: np.ndarray | int) -> np.ndarray:
    """Per-GPU cost (per_micro excluded) of work ``costs`` of ``lens`` tokens over groups of ``width``:
    the CP price (``cost/cp.py``); ``costs / width`` when the cost has no CP term."""
    cost = cfg.cost
    if getattr(cost, "cp", None) is None:
        return costs / width
    pm = float(cost.per_micro)  # type: ignore[union-attr]
    return cp_micro_costs(cost, costs + pm, lens, width) - pm


def cp_increments(cfg: PlanConfig, width: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Per bin: per-GPU load per unit of sample cost and per token a sample adds to a group of
    ``width`` (the CP price's compute and exposed communication; None without a CP term)."""
    cp = getattr(cfg.cost, "cp", None)
    if cp is None:
        return None
    w = width.astype(np.float64)
    split = w > 1
    return (np.where(split, 1.0 / (w * cp.efficiency), 1.0),
            np.where(split, (1.0 - cp.overlap) * cp.comm_rates(w) * (w - 1.0) / w, 0.0))


def _row(lens: np.ndarray, cfg: PlanConfig) -> np.ndarray:
    """Each sample's row alone: its tokens rounded up to the row multiple."""
    r = cfg.pad_row_to_multiple_of
    return round_up(lens, r)


def balanced_degrees(lens: np.ndarray, costs: np.ndarray, deg: np.ndarray, gpu_slots: int, cap: int,
                      cmax: int, cfg: PlanConfig) -> np.ndarray:
    """Widen samples whose per-GPU cost exceeds the mean load of a GPU slot, within budget.

    A sample costing more than τ = Σ cost / (dp·K) leaves its slot waiting however the other
    groups are filled; doubling its CP degree cuts its per-GPU time (halves it under perfect
    scaling; the CP price of ``cost/cp.py`` otherwise). Greedy: repeatedly double the sample with
    the highest per-GPU cost above τ while doubling lowers that cost and the widened groups still
    leave enough unit GPU-slots for the short samples' tokens. Never below the token need (a
    wider group of a sample that fits its group fits too: ⌈row/2d⌉ ≤ ⌈row/d⌉).
    """
    tau = float(costs.sum()) / gpu_slots
    out = deg.copy()
    short_tokens = int(lens[deg == 1].sum())
    budget = gpu_slots - cdiv(short_tokens, cap) - int(deg[deg > 1].sum())
    per = per_gpu_cost(cfg, costs, lens, out)
    heap = [(-float(per[i]), int(i)) for i in np.flatnonzero(costs > tau)]
    heapq.heapify(heap)
    while heap:
        neg, i = heapq.heappop(heap)
        d = int(out[i])
        extra = d if d > 1 else 2  # a unit sample becomes a 2-wide group: it leaves the short pool
        if -neg <= tau or 2 * d > cmax or extra > budget:
            continue
        wider = float(per_gpu_cost(cfg, costs[i:i + 1], lens[i:i + 1], 2 * d)[0])
        if wider >= -neg:  # splitting wider is predicted no faster: keep the sample at d
            continue
        budget -= extra
        if d == 1:
            budget += cdiv(short_tokens, cap) - cdiv(short_tokens - int(lens[i]), cap)
            short_tokens -= int(lens[i])
        out[i] = 2 * d
        heapq.heappush(heap, (-wider, i))
    return out
