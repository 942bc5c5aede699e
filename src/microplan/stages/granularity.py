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

Candidates that cannot matter are not laid out (the trees of the step are found once for every
cut limit, ``atoms.StepForest``): a cut whose atoms equal an earlier candidate's; the cuts and
the per-sample candidate once a candidate ``short_step`` may keep is within ``SKIP_SLACK`` of the
sharing floor (:class:`_SharingFloor`: a lower bound of every sharing candidate's predicted time,
so none skipped could have been faster by more; derived for additive costs without padding
multiples, CP or a byte budget, elsewhere nothing is skipped); the per-sample candidate only
when, besides, that candidate is predicted faster than the unshared plan's lower bound
(``stats.unshared_step_bound``), which is what the guarantee below needs it for.

Under dynamic context parallel the candidates are whole trees cut only where a tree fits no
group of ``max_size`` GPUs, one atom per sample fitted on flat rows (the unshared plan's groups
and widths, each bin priced as its tree row: the fitter's choices are not monotone in the bin
costs, so this is what keeps sharing from being slower), and one atom per sample; each is laid
out by the same ``lay_out`` (which chooses the CP widths inside the fit) and the same
``short_step`` rule picks among them.

Guarantee: a sharing plan is never predicted slower than the per-sample candidate, which packs
exactly what the plain planner packs into rows that never cost more (``prefix.flat_wins``), nor
drops more samples — or, when that candidate is skipped, than the unshared plan's lower bound —
so sharing never hurts (docs/prefix.md); and never more than ``SKIP_SLACK`` slower than laying
every candidate out. Cost: up to four layouts per sharing step (three under dynamic CP; one
without), one when whole trees sit near the floor.
"""

from __future__ import annotations

import numpy as np

from ..cost.models import is_additive
from ..errors import PlanError
from ..stats import k_lower_bound, unshared_step_bound
from ..treecut import StepTrees
from ..trie_sets import set_tries
from .atoms import Atoms, StepForest, sample_atoms, tree_atoms
from .cp_degrees import group_room
from .context import PlanContext
from .fit import effective_cap
from .place import PlacedStep, lay_out

__all__ = ["best_layout", "CUT_FRACTIONS", "SKIP_SLACK"]

CUT_FRACTIONS = (1.0, 0.5)  # tree-cut limits tried, as fractions of the mean micro-batch load
_MARGIN = 1e-9  # relative: a candidate beats the unshared bound only by more than rounding
SKIP_SLACK = 0.02  # the most a candidate skipped by the sharing floor could have been faster (relative)


def best_layout(s: int, samples: np.ndarray, ctx: PlanContext) -> PlacedStep:
    """The step's layout (module note)."""
    if not ctx.cfg.share_prefixes:
        return lay_out(s, sample_atoms(samples, ctx), ctx)
    errors: list[PlanError] = []

    def attempt(a: Atoms) -> PlacedStep | None:
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


def _candidates(samples: np.ndarray, ctx: PlanContext, attempt) -> tuple[list[Atoms], list[PlacedStep]]:
    """Whole trees (cut only where a tree exceeds the cap), trees cut to fractions of the mean
    micro-batch load, and one atom per sample (last), each laid out under ``short_step="pad"``
    unless it cannot matter (module note)."""
    cap = effective_cap(ctx.cfg)
    assert cap is not None  # share_prefixes needs dynamic batching (config.py)
    forest = StepForest()  # the step's trees, found once for every limit
    atoms = [tree_atoms(samples, ctx, cap, forest)]
    per_sample = sample_atoms(samples, ctx)
    first = attempt(atoms[0]) or attempt(per_sample)
    if first is None:
        return [per_sample], []
    cands = [first]
    floor = _SharingFloor(forest, samples, ctx)
    mean = float(first.bin_tokens.sum()) / max(first.bin_tokens.size, 1)
    largest, tried = int(first.bin_tokens.max(initial=0)), {cap}
    for frac in CUT_FRACTIONS:
        limit = max(1, int(mean * frac))
        if limit < largest and limit not in tried:
            if floor.reached(cands):
                break  # no cut could be faster by more than SKIP_SLACK
            tried.add(limit)
            cut = tree_atoms(samples, ctx, limit, forest)
            if any(_same_atoms(cut, a) for a in atoms):
                continue  # the same atoms lay out the same: nothing new to try
            atoms.append(cut)
            cands.append(attempt(cut))  # type: ignore[arg-type]
            cands = [c for c in cands if c is not None]
    atoms.append(per_sample)
    if first.atoms is not per_sample and not _skip_per_sample(cands, samples, ctx, floor):
        cands.append(attempt(per_sample))  # type: ignore[arg-type]
    return atoms, [c for c in cands if c is not None]


def _same_atoms(a: Atoms, b: Atoms) -> bool:
    """Whether two tree cuts of one step are the same atoms (same members, order and sizes)."""
    return a.size == b.size and np.array_equal(a.ptr, b.ptr) and np.array_equal(a.members, b.members) \
        and np.array_equal(a.tokens, b.tokens)


def _kept_best(cands: list[PlacedStep], ctx: PlanContext) -> float | None:
    """The least predicted time among the candidates ``short_step`` may keep (under ``drop`` and
    ``error`` those without placeholders), None when there is none."""
    keep = cands if ctx.cfg.short_step == "pad" else [c for c in cands if c.placeholders == 0]
    return min((c.run_time for c in keep), default=None)


def _skip_per_sample(cands: list[PlacedStep], samples: np.ndarray, ctx: PlanContext, floor: _SharingFloor) -> bool:
    """Whether the per-sample candidate cannot matter (module note): a candidate ``short_step`` may
    keep is predicted faster than the unshared plan's lower bound (``stats.unshared_step_bound``), so
    the guarantee holds without it, and within ``SKIP_SLACK`` of the sharing floor with the unshared
    plan's K (the per-sample candidate packs what that plan packs), so it could have won by no
    more. Not under a byte budget (the shared and unshared plans choose their own token caps)."""
    best = _kept_best(cands, ctx)
    if best is None or ctx.cfg.memory is not None:
        return False
    quick, k_lb = unshared_step_bound(ctx.batch, ctx.cfg, samples, ctx.fp, slot=False, costs=ctx.costs)  # <= the bound
    if not best < quick * (1 - _MARGIN):  # the full bound (slot term, O(n log n)) only where it decides
        unshared, k_lb = unshared_step_bound(ctx.batch, ctx.cfg, samples, ctx.fp, costs=ctx.costs)
        if not best < unshared * (1 - _MARGIN):
            return False
    return floor.reached(cands, k_lb)


class _SharingFloor:
    """A lower bound of the predicted step time of every sharing candidate, where derived: an
    additive cost, no padding multiple, no context parallel, no byte budget (else never
    reached). Every token of the trie of the step's samples (of each owner's, under local
    placement: a bin holds one owner's samples) runs in some micro-batch at least once (a bin's
    row holds at least the trie of its samples; :func:`_union_trie`), priced by the cost's
    additive ``tree_costs``, and every GPU-slot costs at least ``per_micro``; so Σ_m max_r and
    max_r Σ_m are both at least (Σ tries' cost + vision) /
    dp_size + K · per_micro, K at least the step's ``k_lower_bound`` over its unique tokens (or a
    larger one the caller knows). O(trees), computed on first use."""

    def __init__(self, forest: StepForest, samples: np.ndarray, ctx: PlanContext) -> None:
        self.forest, self.samples, self.ctx = forest, samples, ctx
        self.terms: tuple[float, int] | None = None  # (work / dp_size, k lower bound)

    def reached(self, cands: list[PlacedStep], k_lb: int | None = None) -> bool:
        """Whether a candidate ``short_step`` may keep is within ``SKIP_SLACK`` of the floor."""
        best = _kept_best(cands, self.ctx)
        if best is None:
            return False
        cfg, cost, fp = self.ctx.cfg, self.ctx.cfg.cost, self.ctx.fp
        assert cost is not None
        if not is_additive(cost) or fp.padding.sample_multiple != 1 or cfg.context_parallel is not None \
                or cfg.memory is not None:  # a byte budget may run samples over the cap alone (memory/plan.py)
            return False
        if self.terms is None:
            n = int(self.samples.size)
            tries = [_union_trie(t) for t in self.forest.trees]
            work = sum(float(cost.tree_costs(tk, dsq).sum()) for tk, dsq in tries)  # type: ignore[attr-defined]
            unique = sum(int(tk.sum()) for tk, _ in tries)
            if fp.vision_costs is not None:
                work += float(fp.vision_costs[self.samples].sum())
            self.terms = (work / cfg.dp_size, k_lower_bound(cfg, n, unique, fp.vision(self.samples)))
        share, k = self.terms
        floor = share + max(k, k_lb or 0) * float(cost.per_micro)
        return best <= floor * (1 + SKIP_SLACK)


def _union_trie(t: StepTrees) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, depth_sq) of the trie of the group's samples (a group: the step, or one owner's
    samples under local placement), as arrays to price: each tree's own trie where no two trees can
    share a token, else the one trie of all the group's samples. Two trees share tokens only through
    a common ancestor outside the group (a sample of another step or rank), which a micro-batch
    holding samples of both then stores once; so the sum of the trees' tries is no lower bound
    there. Multiple 1 (the floor is derived for no padding multiple)."""
    if t.roots.size < 2 or int(np.count_nonzero(t.ep[t.roots] >= 0)) < 2:
        return t.exact.tokens, t.exact.depth_sq
    one = set_tries(t.parent, t.shared, t.lens, t.uniq, np.zeros(t.uniq.size, dtype=np.int64), 1)
    return one.tokens, one.depth_sq


def _dynamic_cp_candidates(samples: np.ndarray, ctx: PlanContext, attempt) -> tuple[list[Atoms], list[PlacedStep]]:
    """``share_prefixes`` × ``ContextParallel(max_size=c)``: whole trees (cut only where a tree fits
    no group of c GPUs), one atom per sample fitted as the unshared plan fits them (its groups and
    widths, each bin priced as its tree row: never slower than the unshared plan, whose bin choices
    the fitter makes from flat rows), and one atom per sample (last)."""
    cmax = int(ctx.cfg.context_parallel.max_size)  # type: ignore[union-attr]
    per_sample = sample_atoms(samples, ctx)
    atoms = [tree_atoms(samples, ctx, int(group_room(cmax, ctx.cfg))), per_sample._replace(flat_fit=True),
             per_sample]
    return atoms, [c for c in map(attempt, atoms) if c is not None]


def _short_step(s: int, atoms: list[Atoms], cands: list[PlacedStep], ctx: PlanContext) -> PlacedStep:
    """``short_step`` across candidates (module note); ``atoms[-1]`` holds one atom per sample."""
    policy = ctx.cfg.short_step
    full = [c for c in cands if c.placeholders == 0]
    if policy == "pad":
        return min(cands, key=PlacedStep.key)
    if full:
        return min(full, key=PlacedStep.key)
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
