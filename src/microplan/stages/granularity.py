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

Under dynamic context parallel the candidates are whole trees cut only where a tree fits no
group of ``max_size`` GPUs, one atom per sample fitted on flat rows (the unshared plan's groups
and widths, each bin priced as its tree row: the fitter's choices are not monotone in the bin
costs, so this is what keeps sharing from being slower), and one atom per sample; each is laid
out by the same ``lay_out`` (which chooses the CP widths inside the fit) and the same
``short_step`` rule picks among them.

Guarantee: a sharing plan is never predicted slower than the per-sample candidate, which packs
exactly what the plain planner packs into rows that never cost more (``prefix.flat_wins``), nor
drops more samples — so sharing never hurts (docs/prefix.md). Cost: up to four layouts per
sharing step (three under dynamic CP; one without).
"""

from __future__ import annotations

import numpy as np

from ..cost.models import is_additive
from ..errors import PlanError
from ..stats import unshared_step_bound
from ..trie import StepTrees
from .atoms import Atoms, StepForest, sample_atoms, tree_atoms
from .cp_degrees import group_room
from .context import PlanContext
from .fit import effective_cap
from .place import Layout, lay_out

__all__ = ["best_layout", "CUT_FRACTIONS", "PER_SAMPLE_SLACK"]

CUT_FRACTIONS = (1.0, 0.5)  # tree-cut limits tried, as fractions of the mean micro-batch load
_MARGIN = 1e-9  # relative: a candidate beats the unshared bound only by more than rounding
PER_SAMPLE_SLACK = 0.02  # the most a skipped per-sample candidate could have been faster (relative)


def best_layout(s: int, samples: np.ndarray, ctx: PlanContext) -> Layout:
    """The step's layout (module note)."""
    if not ctx.cfg.share_prefixes:
        return lay_out(s, sample_atoms(samples, ctx), ctx)
    errors: list[PlanError] = []

    def attempt(a: Atoms) -> Layout | None:
        """A candidate, or None when its atoms cannot be packed."""
        try:
            return lay_out(s, a, ctx, short_step="pad")
        except PlanError as exc:
            errors.append(exc)
            return None

    cp = ctx.cfg.context_parallel
    atoms, cands = (_dynamic_cp_candidates if cp is not None and cp.dynamic else _candidates)(samples, ctx, attempt)
    if not cands:
        raise errors[-1]
    return _short_step(s, atoms, cands, ctx)


def _candidates(samples: np.ndarray, ctx: PlanContext, attempt) -> tuple[list[Atoms], list[Layout]]:
    """Whole trees (cut only where a tree exceeds the cap), trees cut to fractions of the mean
    micro-batch load, and one atom per sample (last), each laid out under ``short_step="pad"``."""
    cap = effective_cap(ctx.cfg)
    assert cap is not None  # share_prefixes needs dynamic batching (config.py)
    forest = StepForest()  # the step's trees, found once for every limit
    atoms = [tree_atoms(samples, ctx, cap, forest)]
    per_sample = sample_atoms(samples, ctx)
    first = attempt(atoms[0]) or attempt(per_sample)
    if first is None:
        return [per_sample], []
    cands = [first]
    mean = float(first.bin_tokens.sum()) / max(first.bin_tokens.size, 1)
    largest, tried = int(first.bin_tokens.max(initial=0)), {cap}
    for frac in CUT_FRACTIONS:
        limit = max(1, int(mean * frac))
        if limit < largest and limit not in tried:
            tried.add(limit)
            cut = tree_atoms(samples, ctx, limit, forest)
            if any(_same_atoms(cut, a) for a in atoms):
                continue  # the same atoms lay out the same: nothing new to try
            atoms.append(cut)
            cands.append(attempt(cut))  # type: ignore[arg-type]
    atoms.append(per_sample)
    cands = [c for c in cands if c is not None]
    if first.atoms is not per_sample and not _skip_per_sample(cands, samples, ctx, forest.trees):
        cands.append(attempt(per_sample))  # type: ignore[arg-type]
    return atoms, [c for c in cands if c is not None]


def _same_atoms(a: Atoms, b: Atoms) -> bool:
    """Whether two tree cuts of one step are the same atoms (same members, order and sizes)."""
    return a.size == b.size and np.array_equal(a.ptr, b.ptr) and np.array_equal(a.members, b.members) \
        and np.array_equal(a.tokens, b.tokens)


def _skip_per_sample(cands: list[Layout], samples: np.ndarray, ctx: PlanContext, trees: list[StepTrees]) -> bool:
    """Whether the per-sample candidate cannot matter (module note): a candidate ``short_step`` may
    keep is predicted faster than the unshared plan's lower bound (``stats.unshared_step_bound``), so
    the guarantee holds without it, and within ``PER_SAMPLE_SLACK`` of the least time any sharing
    layout of the step could have (:func:`_sharing_floor`), so it could have won by no more. Not
    under a byte budget (the shared and unshared plans choose their own token caps)."""
    if ctx.cfg.memory is not None:
        return False
    keep = cands if ctx.cfg.short_step == "pad" else [c for c in cands if c.placeholders == 0]
    if not keep:
        return False
    best = min(c.run_time for c in keep)
    unshared, k_lb = unshared_step_bound(ctx.batch, ctx.cfg, samples, ctx.fp, with_k=True)
    if not best < unshared * (1 - _MARGIN):
        return False
    floor = _sharing_floor(trees, samples, ctx, k_lb)
    return floor is not None and best <= floor * (1 + PER_SAMPLE_SLACK)


def _sharing_floor(trees: list[StepTrees], samples: np.ndarray, ctx: PlanContext, k_lb: int) -> float | None:
    """A lower bound of the per-sample candidate's predicted step time, or None where not derived
    (a cost with a packed-row term, padding multiples, context parallel). Its K is the unshared
    plan's (it packs what that plan packs), at least ``k_lb``; every GPU-slot costs at least
    ``per_micro``; every token of each tree's trie runs in some micro-batch at least once (a
    bin's row holds at least the trie of its samples; under local placement a bin holds one
    owner's samples), priced by the cost's additive ``tree_costs``; so Σ_m max_r and max_r Σ_m
    are both at least (Σ tries' cost + vision) / dp_size + k_lb · per_micro."""
    cfg = ctx.cfg
    cost = cfg.cost
    if not is_additive(cost) or ctx.fp.padding.sample_multiple != 1 or cfg.context_parallel is not None:  # type: ignore[arg-type]
        return None
    work = sum(float(cost.tree_costs(t.exact.tokens, t.exact.depth_sq).sum()) for t in trees)  # type: ignore[union-attr]
    if ctx.fp.vision_costs is not None:
        work += float(ctx.fp.vision_costs[samples].sum())
    return work / cfg.dp_size + k_lb * float(cost.per_micro)  # type: ignore[union-attr]


def _dynamic_cp_candidates(samples: np.ndarray, ctx: PlanContext, attempt) -> tuple[list[Atoms], list[Layout]]:
    """``share_prefixes`` × ``ContextParallel(max_size=c)``: whole trees (cut only where a tree fits
    no group of c GPUs), one atom per sample fitted as the unshared plan fits them (its groups and
    widths, each bin priced as its tree row: never slower than the unshared plan, whose bin choices
    the fitter makes from flat rows), and one atom per sample (last)."""
    cmax = int(ctx.cfg.context_parallel.max_size)  # type: ignore[union-attr]
    per_sample = sample_atoms(samples, ctx)
    atoms = [tree_atoms(samples, ctx, int(group_room(cmax, ctx.cfg))), per_sample._replace(flat_fit=True),
             per_sample]
    return atoms, [c for c in map(attempt, atoms) if c is not None]


def _short_step(s: int, atoms: list[Atoms], cands: list[Layout], ctx: PlanContext) -> Layout:
    """``short_step`` across candidates (module note); ``atoms[-1]`` holds one atom per sample."""
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
