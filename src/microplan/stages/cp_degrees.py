"""Dynamic CP degrees: how many GPUs each sample's CP group spans (``ContextParallel(max_size=c)``).

Design note. A sample's *need* is the fewest power-of-two GPUs that keep each GPU under the cap
with its halo rows (``cp_degrees``: ⌈row/d⌉ + 2 per row segment ≤ cap, ``footprint.gpu_tokens``);
``group_room`` is what a group of w GPUs may hold before its row is rounded up to the row
multiple. Beyond the need, ``balanced_degrees`` widens a sample whose per-GPU cost exceeds the mean
load of a GPU slot, greedily (a heap by per-GPU cost), only while the CP price
(``per_gpu_cost``: ``cost.cp.cp_micro_costs``, or cost / width without a CP term) says the wider
split is faster, and while the unit GPU-slots left still hold the short samples' tokens.
``cp_increments`` gives the packer the price's per-bin slopes (compute per unit of cost,
exposed communication per token). Cost: O(n log n) for the widening heap; the rest is numpy.
Guarantees: a degree is never below the need; a need above ``max_size`` is a PlanError naming
the sample, its halo rows and the fixes.
"""

from __future__ import annotations

import heapq

import numpy as np

from ..config import PlanConfig
from ..cost.cp import cp_micro_costs
from ..errors import PlanError
from ..footprint import HALO_ROWS

__all__ = ["group_room", "cp_degrees", "per_gpu_cost", "cp_increments", "balanced_degrees", "cdiv"]


def cdiv(x: int, d: int) -> int:
    return -(-x // d)


def group_room(width: np.ndarray | int, cfg: PlanConfig) -> np.ndarray | int:
    """Tokens (samples plus their halo room) a CP group of ``width`` GPUs may hold before its row
    is rounded up to the row multiple r: ⌊cap / r⌋ · r on one GPU; width · cap − 2·width − (r − 1)
    on a split group (the row pad's halo rows; ⌈S/r⌉·r ≤ S + r − 1), so every GPU stays within
    ``footprint.gpu_tokens``."""
    r = cfg.pad_row_to_multiple_of
    w = np.asarray(width)
    full = w * int(cfg.max_tokens_per_micro)  # type: ignore[arg-type]
    if r == 1:
        return full
    # a split row: its pad segment's halo rows, and rounding up to r must not eat the samples' halo room
    return np.where(w > 1, full - HALO_ROWS * w - (r - 1), full // r * r)


def cp_degrees(lens: np.ndarray, samples: np.ndarray, cfg: PlanConfig, segs: np.ndarray) -> np.ndarray:
    """Smallest power-of-two CP degree per sample that keeps each GPU under the cap (``lens``:
    what each sample occupies, its padding included; ``segs``: its row segments — 1 for a flat
    sample, the trie's for a tree atom — each costing a GPU of a split group 2 halo rows, the row
    pad one more segment when r > 1)."""
    cap, cmax = cfg.max_tokens_per_micro, cfg.context_parallel.max_size  # type: ignore[union-attr]
    r = cfg.pad_row_to_multiple_of
    row, room = _split_room(lens, segs, cfg)
    split = np.where(room >= 1, np.maximum(-(-row // np.maximum(room, 1)), 2), 2 * int(cmax) + 1)  # room < 1: no width fits
    need = np.where(row <= cap, 1, split)
    deg = np.left_shift(1, np.ceil(np.log2(np.maximum(need, 1))).astype(np.int64))
    deg = np.where(deg < need, deg * 2, deg)  # guard float rounding
    if lens.size and deg.max() > cmax:
        j = int(np.argmax(deg))
        halo = f" (split, each GPU also computes {2 * int(segs[j] + (r > 1))} halo rows: 2 per row segment)"
        raise PlanError(f"sample {int(samples[j])} has {int(lens[j])} tokens{halo}: it needs {int(deg[j])} GPUs at "
                        f"max_tokens_per_micro={cap}, more than ContextParallel.max_size={cmax}; raise max_size "
                        "(and dp_size), raise max_tokens_per_micro, or truncate the sample.")
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


def _split_room(lens: np.ndarray, segs: np.ndarray, cfg: PlanConfig) -> tuple[np.ndarray, np.ndarray]:
    """Each sample's row (rounded to the row multiple r) and the owned rows one GPU of a split
    group has left beside its halo rows: ⌈row/d⌉ + 2·S ≤ cap ⟺ ⌈row/d⌉ ≤ room for d > 1
    (``footprint.gpu_tokens``; S its segments, the row pad one more when r > 1)."""
    r = cfg.pad_row_to_multiple_of
    return -(-lens // r) * r, cfg.max_tokens_per_micro - HALO_ROWS * (segs + (r > 1))  # type: ignore[operator]


def balanced_degrees(lens: np.ndarray, costs: np.ndarray, deg: np.ndarray, gpu_slots: int, cap: int,
                      cmax: int, cfg: PlanConfig, segs: np.ndarray) -> np.ndarray:
    """Widen samples whose per-GPU cost exceeds the mean load of a GPU slot, within budget.

    A sample costing more than τ = Σ cost / (dp·K) leaves its slot waiting however the other
    groups are filled; doubling its CP degree cuts its per-GPU time (halves it under perfect
    scaling; the CP price of ``cost/cp.py`` otherwise). Greedy: repeatedly double the sample with
    the highest per-GPU cost above τ while doubling lowers that cost and the widened groups still
    leave enough unit GPU-slots for the short samples' tokens. Never below the token need; a
    unit sample is split only when each GPU of the pair holds its half plus its halo rows
    (``segs``: its row segments, the row pad one more when r > 1; ``footprint.gpu_tokens``) —
    a sample that fits one GPU may not fit two. Wider than 2 only shrinks the half.
    """
    tau = float(costs.sum()) / gpu_slots
    row, room = _split_room(lens, segs, cfg)
    splits = -(-row // 2) <= room  # cp_degrees' rule at d = 2
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
        if -neg <= tau or 2 * d > cmax or extra > budget or (d == 1 and not splits[i]):
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
