"""A laid-out step as its micro-batches: members in execution order, tries, CP degree, loss scales.

Design note. The last stages of the flow on one step's :class:`~microplan.stages.place.PlacedStep`:
each (rank, slot) of the grid becomes a :class:`~microplan.types.Micro` holding its bin's
samples — ascending global index for flat rows, depth-first order with the bin's prefix trie
for tree rows (``prefix.micro_tree``) — and every sample gets its loss scale
(``weigh.loss_scales``, over the step's kept samples, with the step's K). Flat bins cost one
stable argsort and dp·K slices (no per-sample Python; ``micros.grid_micros``); tree bins one
depth-first sort of the step (``prefix.dfs_flat``) and dp·K slices. A tree row's trie is
computed on first read of ``Micro.tree`` (:class:`StepTries`: every bin's trie of the step in
one ``trie.micro_trees`` pass, kept; ``types._Tree``), so a plan whose tries nobody reads pays
for none; every reader of the field (equality, pickling, JSON, ``validate``) sees the trie the
eager path would have built. Dynamic CP builds its groups' tries at once (``tree_parts``).
"""

from __future__ import annotations

import numpy as np

from .._sort import stable_argsort
from ..batch import Batch
from ..prefix import PrefixTree, RowRules, dfs_flat
from ..trie import micro_trees
from ..types import Micro, Step, _micro_tree_grid
from .context import PlanContext
from .micros import binned_micros, grid_micros
from .place import PlacedStep
from .weigh import loss_coefficients, loss_scales

__all__ = ["StepTries", "build_step", "tree_columns", "tree_parts"]


def _empty_parts() -> tuple[np.ndarray, ...]:
    out = tuple(np.zeros(0, dtype=d) for d in (np.int64, np.int64, np.int64, np.float64))
    for a in out:
        a.setflags(write=False)
    return out


def build_step(s: int, lay: PlacedStep, ctx: PlanContext) -> Step:
    """The Step of a layout: micro-batches on the grid, loss scales exact over the kept samples."""
    cfg, b = ctx.cfg, ctx.batch
    D, K = cfg.dp_size, lay.K
    atoms = lay.atoms
    kept, sbin = lay.samples, lay.sample_bin
    if kept.size > 1 and not (kept[1:] > kept[:-1]).all():  # plain atoms come ascending already
        order = stable_argsort(kept)
        kept, sbin = kept[order], sbin[order]                    # ascending global index
    assert cfg.loss is not None
    every = kept.size == b.num_samples  # ascending distinct samples, all of them: kept is arange(n), no gather
    cols = (b.loss_tokens, b.prompt_codes, b.rollout_codes)
    coef = loss_coefficients(cfg.loss, *(cols if every else [c[kept] for c in cols]))
    scale = loss_scales(cfg.loss, coef, grad_world=cfg.grad_world, micro_count=K)
    cp, mfp = cfg.static_cp_size, ctx.mfp
    if lay.width is not None:  # dynamic CP: a group's ranks share its bin
        return Step(s, _group_micros(lay, ctx, kept, sbin, scale), kept, choice=lay.choice)
    if not atoms.trees:  # a rank's placeholders share one (immutable) Micro
        return Step(s, grid_micros(kept, sbin, lay.grid, scale, b, cp_size=cp, footprint=mfp), kept,
                    choice=lay.choice)
    cols, bounds, tries = tree_columns(ctx.parent, ctx.shared, b, kept, sbin, D * K, scale, rules=ctx.fp.row_rules())
    grid = lay.grid  # a rank's placeholders share one Micro; the others slice columns and tries on first read
    micros = _micro_tree_grid(cols, bounds[:-1][grid], bounds[1:][grid], grid, tries, cp, mfp)
    return Step(s, micros, kept, choice=lay.choice)


def _group_micros(lay: PlacedStep, ctx: PlanContext, kept: np.ndarray, sbin: np.ndarray,
                  scale: np.ndarray) -> list[list[Micro]]:
    """Rank r's Micros under dynamic CP: bin ``grid[r, m]`` of width w runs on w consecutive ranks
    of slot m (its CP group; an empty bin is a placeholder group), each member at its CP rank."""
    assert lay.width is not None
    D, K, nb = ctx.cfg.dp_size, lay.K, lay.width.size
    if lay.atoms.trees:
        empty = (_empty_parts(), None)
        parts = [empty if p is None else p
                 for p in tree_parts(ctx.parent, ctx.shared, ctx.batch, kept, sbin, nb, scale,
                                     rules=ctx.fp.row_rules())]
    else:
        parts = [(p, None) for p in binned_micros(kept, sbin, nb, scale, ctx.batch)]
    width = lay.width.tolist()
    micros: list[list[Micro]] = [[None] * K for _ in range(D)]  # type: ignore[list-item]
    for m in range(K):
        col = lay.grid[:, m].tolist()
        r = 0
        while r < D:
            b, w = col[r], width[col[r]]
            group = tuple(range(r, r + w))
            cols, tree = parts[b]
            for q in range(w):
                micros[r + q][m] = Micro._trusted(*cols, w, q, group, tree, footprint=ctx.mfp)  # type: ignore[arg-type]
            r += w
    return micros


class StepTries:
    """Every bin's prefix trie of one step, computed in one ``trie.micro_trees`` pass the first time
    any is read (``tries[g]``), then kept: the tries of ``micro_trees(parent, shared, lens, kept,
    sbin, nb, rules=rules)``, whenever they are read. Holds its own copy of the samples and their
    bins; the forest and lengths are the batch's (immutable)."""

    __slots__ = ("_args", "_rules", "_trees")

    def __init__(self, parent: np.ndarray, shared: np.ndarray, lens: np.ndarray, kept: np.ndarray,
                 sbin: np.ndarray, nb: int, rules: RowRules | None) -> None:
        self._args = (parent, shared, lens, kept.copy(), sbin.copy(), nb)
        self._rules = rules
        self._trees: list[PrefixTree] | None = None

    def __getitem__(self, g: int) -> PrefixTree:
        trees = self._trees
        if trees is None:  # two threads may both compute them: the same tries, either list kept
            trees = self._trees = micro_trees(*self._args, rules=self._rules)
        return trees[g]


def tree_columns(parent: np.ndarray, shared: np.ndarray, b: Batch, kept: np.ndarray, sbin: np.ndarray, nb: int,
                 scale: np.ndarray, *, rules: RowRules | None = None,
                 ) -> tuple[list[np.ndarray], np.ndarray, StepTries]:
    """The Micro columns of every bin of tree rows at once — indices, seq_lens, loss_tokens,
    loss_scale, read-only, bin after bin, each bin's samples depth-first — with the bounds of bin g
    (``bounds[g]:bounds[g + 1]``) and each bin's prefix trie, computed on first read
    (:class:`StepTries`; ``rules``: the plan's ``Footprint.row_rules``, which decide where a row
    is laid out flat, ``prefix.micro_tree``). ``kept`` ascending, ``sbin`` and ``scale`` aligned."""
    flat, bounds = dfs_flat(parent, shared, kept, sbin, nb)   # every bin's samples, depth-first, bin after bin
    trees = StepTries(parent, shared, b.seq_lens, kept, sbin, nb, rules)
    pos = flat if kept.size == b.num_samples else np.searchsorted(kept, flat)  # every sample kept: kept is arange(n)
    cols = [flat, b.seq_lens[flat], b.loss_tokens[flat], scale[pos].astype(np.float64, copy=False)]
    for c in cols:  # each column gathered once, then sliced
        c.setflags(write=False)  # and so every slice of it
    return cols, bounds, trees


def tree_parts(parent: np.ndarray, shared: np.ndarray, b: Batch, kept: np.ndarray, sbin: np.ndarray, nb: int,
               scale: np.ndarray, *,
               rules: RowRules | None = None) -> list[tuple[tuple[np.ndarray, ...], PrefixTree] | None]:
    """Per bin of tree rows: its Micro's four columns in depth-first order and its prefix trie
    (None for an empty bin; :func:`tree_columns` cut bin by bin)."""
    (ix, ln, lt, sc), bounds, trees = tree_columns(parent, shared, b, kept, sbin, nb, scale, rules=rules)
    out: list[tuple[tuple[np.ndarray, ...], PrefixTree] | None] = []
    for g, (lo, hi) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        out.append(None if hi == lo else ((ix[lo:hi], ln[lo:hi], lt[lo:hi], sc[lo:hi]), trees[g]))
    return out
