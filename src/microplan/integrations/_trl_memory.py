"""TRL's accumulation chunks under a memory budget: every chunk's predicted peak bytes fit.

Design note. TRL fixes the chunk count (``steps_per_generation``: one chunk per training step,
the optimizer's accumulation windows counted in them) and runs each chunk as ONE padded batch:
``n`` rows of ``W`` = the generation batch's (left-padded) prompt width + the chunk's completion
width (trimmed to its longest completion by the drop-in). So the budget cannot choose the
number of micro-batches, as ``PlanConfig(max_bytes_per_micro=...)`` does; it can only choose
which rows share a chunk. :func:`fit_budget`, per optimizer-step window:

1. the token-balanced partition (``_trl_split.partition``), if every chunk fits — so a budget
   that the default split already meets changes nothing;
2. else, where the loss rule lets rows move (``free``, ``count``), rows sorted by completion
   length (longest first) cut into consecutive chunks — long completions share a chunk, so the
   padded width is paid by as few rows as possible: ``free`` (any non-empty chunks) fills each
   chunk with as many rows as fit under a limit, leaving one for each later chunk, at the least
   limit (bisected, at most the budget) for which the last chunk still fits. ``count`` and ``keep`` keep
   TRL's row count ``n`` per chunk, and the chunk holding the longest row then costs ``n`` rows
   at its width under any cut: if the token-balanced partition does not fit, no partition does;
3. else a :class:`~microplan.PlanError` naming the fullest chunk's bytes, the budget and the fixes.

Pricing (:func:`padded_bytes`): each row of a padded ``[n, W]`` batch is one sample of ``W``
tokens: ``per_token·n·W + max(per_sample_sq, per_row_sq)·n·W² + per_micro`` per phase (a dense
kernel's mask is ``[W, W]`` per row), the largest phase, never below ``floor``, checked with the
model's margin (``with_margin(bytes) <= budget``), as the planner checks its micro-batches.
Guarantee: every chunk returned satisfies that check; chunks are non-empty, rows stay in their
window, ``count``/``keep`` keep TRL's row counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..errors import PlanError
from ..memory.model import MemoryModel

__all__ = ["padded_bytes", "fit_budget"]


def padded_bytes(model: MemoryModel, rows: int, width: int) -> int:
    """Predicted peak bytes (no margin) of one padded ``[rows, width]`` micro-batch (module note)."""
    n, w = float(rows), float(width)
    raw = max(p.per_token * n * w + max(p.per_sample_sq, p.per_row_sq) * n * w * w + p.per_micro
              for p in model.phases())
    return int(math.ceil(max(model.floor, raw)))


def fit_budget(parts: list[np.ndarray], widths: np.ndarray, prompt_width: int, rule: str, model: MemoryModel,
               budget: int) -> list[np.ndarray]:
    """Chunks of one window whose predicted bytes fit ``budget`` (module note, 1-3).

    ``parts``: the token-balanced chunks (window-local row indices); ``widths``: each row's
    completion width as its chunk will run it (the full width when chunks are not trimmed);
    ``rule``: the loss type's re-cut rule (``_trl_split.RULES``).
    """
    def fits(p: np.ndarray) -> bool:
        return model.with_margin(padded_bytes(model, p.size, prompt_width + int(widths[p].max()))) <= budget
    if all(fits(p) for p in parts):
        return parts
    if rule == "free":
        order = np.array(sorted(range(widths.size), key=lambda i: (-int(widths[i]), i)), dtype=np.int64)
        row_w = prompt_width + widths[order]

        def cost(a: int, b: int) -> int:  # order[a:b] as one chunk (its first row is its widest), margin included
            return int(model.with_margin(padded_bytes(model, b - a, int(row_w[a]))))
        sizes = _least_max(cost, order.size, len(parts), budget)
        if sizes is not None:
            edges = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
            return [np.sort(order[edges[j]:edges[j + 1]]) for j in range(len(sizes))]
    worst = max(parts, key=lambda p: padded_bytes(model, p.size, prompt_width + int(widths[p].max())))
    w = prompt_width + int(widths[worst].max())
    need = model.with_margin(padded_bytes(model, worst.size, w))
    how = "no re-cut of this optimizer step's rows fits either" if rule == "free" else \
        (f"the loss type keeps TRL's {worst.size} rows per chunk, so the chunk holding the longest row is that "
         "large under any cut")
    raise PlanError(f"split_tensor_dict: a chunk of {worst.size} rows x {w} tokens (padded) is predicted at {need:,} "
                    f"bytes with the memory model's {model.margin:.0%} margin, over max_bytes_per_micro={budget:,}; "
                    f"{how}. Raise steps_per_generation (more, smaller chunks per generation), lower "
                    "per_device_train_batch_size or max_completion_length, turn on gradient checkpointing, or raise "
                    "max_bytes_per_micro.")


def _greedy(cost: Callable[[int, int], int], n: int, k: int, limit: int) -> list[int] | None:
    """Chunk sizes over rows ``0..n-1`` (widest first), each as full as ``limit`` allows with one row
    left for each later chunk; None when the last chunk is over ``limit``."""
    sizes, start = [], 0
    for j in range(k - 1):
        size = 1
        while start + size < n - (k - 1 - j) and cost(start, start + size + 1) <= limit:
            size += 1
        if cost(start, start + size) > limit:
            return None
        sizes.append(size)
        start += size
    return sizes + [n - start] if cost(start, n) <= limit else None


def _least_max(cost: Callable[[int, int], int], n: int, k: int, budget: int) -> list[int] | None:
    """The greedy sizes at the least limit <= ``budget`` that still fits (bisection: a feasible
    limit stays feasible when raised), so the fullest chunk is as light as this cut allows."""
    best = _greedy(cost, n, k, budget)
    lo, hi = 0, budget
    while best is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        got = _greedy(cost, n, k, mid)
        lo, hi, best = (lo, mid, got) if got is not None else (mid, hi, best)
    return best
