"""Which atoms a step is packed as: one candidate per granularity, the best by predicted time.

Design note. Without sharing a step's atoms are its samples: one layout. With
``share_prefixes`` whole trees save the most tokens but balance coarsely when a step holds few
large trees per rank, and cutting them duplicates root paths. So the step is laid out with
whole trees (cut only where a tree exceeds the cap), with trees cut into parts of about the
mean micro-batch load and half of it, and with one atom per sample (each micro-batch's samples
still share their trie); the layout with the least predicted step time (then the fewest
tokens) is kept. ``short_step`` is applied across candidates, not inside each one: ``pad``
keeps the fastest candidate; ``drop`` and ``error`` keep the fastest that needs no placeholder —
so whenever the ``pad`` plan needs none, all three give the same plan — and only when no
candidate fills the ranks does ``error`` raise (counting samples, not tree parts) or ``drop``
drop whole trailing rollouts from the candidate that keeps the most samples.

Guarantee: a sharing plan is never predicted slower than the per-sample candidate, which packs
exactly what the plain planner packs. Cost: up to four layouts per sharing step (one without).
"""

from __future__ import annotations

import numpy as np

from ..errors import PlanError
from .atoms import Atoms, sample_atoms, tree_atoms
from .cp import DynamicCPStep, plan_dynamic_cp_step
from .cp_degrees import group_room
from .cp_units import atom_units
from .context import PlanContext
from .fit import effective_cap
from .place import Layout, lay_out

__all__ = ["best_layout", "best_dynamic_cp", "CUT_FRACTIONS"]

CUT_FRACTIONS = (1.0, 0.5)  # tree-cut limits tried, as fractions of the mean micro-batch load


def best_layout(s: int, samples: np.ndarray, ctx: PlanContext) -> Layout:
    """The step's layout (module note)."""
    if not ctx.cfg.share_prefixes:
        return lay_out(s, sample_atoms(samples, ctx), ctx)
    cap = effective_cap(ctx.cfg)
    assert cap is not None  # share_prefixes needs dynamic batching (config.py)
    errors: list[PlanError] = []

    def attempt(a: Atoms) -> Layout | None:
        """A candidate, or None when its atoms cannot be packed."""
        try:
            return lay_out(s, a, ctx, short_step="pad")
        except PlanError as exc:
            errors.append(exc)
            return None

    atoms = [tree_atoms(samples, ctx, cap)]
    per_sample = sample_atoms(samples, ctx)
    first = attempt(atoms[0]) or attempt(per_sample)
    if first is None:
        raise errors[-1]
    cands = [first]
    mean = float(first.bin_tokens.sum()) / max(first.bin_tokens.size, 1)
    largest, tried = int(first.bin_tokens.max(initial=0)), {cap}
    for frac in CUT_FRACTIONS:
        limit = max(1, int(mean * frac))
        if limit < largest and limit not in tried:
            tried.add(limit)
            atoms.append(tree_atoms(samples, ctx, limit))
            cands.append(attempt(atoms[-1]))  # type: ignore[arg-type]
    atoms.append(per_sample)
    if first.atoms is not per_sample:
        cands.append(attempt(per_sample))  # type: ignore[arg-type]
    cands = [c for c in cands if c is not None]
    policy = ctx.cfg.short_step
    full = [c for c in cands if c.placeholders == 0]
    if policy == "pad":
        return min(cands, key=Layout.key)
    if full:
        return min(full, key=Layout.key)
    if policy == "error":
        return lay_out(s, atoms[-1], ctx)  # raises, counting samples (one atom per sample)
    best, err = None, None
    for a in atoms:  # drop: every granularity, the fewest samples dropped, then time
        try:
            c = lay_out(s, a, ctx)
        except PlanError as exc:
            err = exc
            continue
        if best is None or c.key() < best.key():
            best = c
    if best is None:
        raise err  # type: ignore[misc]
    return best


def best_dynamic_cp(s: int, samples: np.ndarray, ctx: PlanContext) -> DynamicCPStep:
    """``share_prefixes`` × ``ContextParallel(max_size=c)``: the step packed by ``stages/cp.py`` as
    whole trees (cut only where a tree fits no group of c GPUs) and as one
    atom per sample (each micro-batch's samples still share their trie); the candidate dropping
    the fewest samples, then with the least predicted time, is kept."""
    cfg, b = ctx.cfg, ctx.batch
    forest = (ctx.parent, ctx.shared)
    cmax = int(cfg.context_parallel.max_size)  # type: ignore[union-attr]
    cands, errors = [], []
    whole = tree_atoms(samples, ctx, int(group_room(cmax, cfg)))  # each part fits a group of cmax GPUs
    for u in (atom_units(whole), atom_units(sample_atoms(samples, ctx))):
        try:
            cands.append(plan_dynamic_cp_step(s, samples, b, ctx.costs, cfg, ctx.fp, units=u, forest=forest))
        except PlanError as exc:
            errors.append(exc)
    if not cands:
        raise errors[-1]
    return min(cands, key=lambda c: (c.dropped.size, c.time))
