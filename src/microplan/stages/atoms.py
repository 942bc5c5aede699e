"""Atoms: what the packer places whole — a sample, a prefix tree, or a part of a tree cut at a branch.

Design note. Every later stage (fit, arrange, CP, order, weigh) sees a step as atoms with
arrays aligned by atom: the tokens the atom occupies alone (padding included, before the row
multiple), its additive cost, its vision tokens, the rollout component it belongs to (the unit
``short_step="drop"`` removes), its owner rank (``placement="local"``), and its member samples.
Options are properties of this stage, so they compose:

- plain plans: one atom per sample (vectorised, no Python per sample);
- ``share_prefixes``: prefix trees whose trie fits a limit stay whole, larger ones are cut at
  their branches (``trie.cut_trees``); tokens are unique trie tokens, each owner segment padded
  to ``pad_to_multiple_of`` (a bound of the row that adds up over atoms: a bin's row, its runs
  or its samples flat, never holds more than its atoms' sum); attention is priced by each
  token's depth (``tree_costs``); vision tokens add up over the members (an image is never
  assumed shared); one-sample atoms are exactly the unshared plan's (a lone sample's row is its
  own padded sequence), which makes sharing never hurt (docs/prefix.md);
- ``placement="local"``: trees are cut per owner rank, so an atom never spans two ranks (what a
  rank holds of a group shares what is local).

Atoms joined by a rollout (a rollout cut over two tree parts) share a component code, so a drop
never splits a rollout. Tree atoms keep their tries (``depth_sq``) and forest roots, so a bin's
trie adds up over atoms of distinct roots (:func:`bin_tries`; only bins holding two atoms of one
root are counted again). Cost: O(n) numpy for samples; the tree cut is ``trie.step_trees`` once
per step (:class:`StepForest`) and ``StepTrees.cut`` per limit.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..errors import PlanError
from ..prefix import RowRules
from ..trie import StepTrees, TreeCut, TrieSets, forest_roots, set_tries, step_trees
from .context import PlanContext

__all__ = ["Atoms", "StepForest", "bin_tries", "sample_atoms", "tree_atoms"]


class Atoms(NamedTuple):
    """One step's atoms (arrays aligned by atom; ``members[ptr[a]:ptr[a+1]]`` are atom a's samples)."""

    tokens: np.ndarray            # int64 tokens the atom packs as (padding included, no row multiple; trees:
    #                               each owner segment padded, a bound of its row that adds up over atoms)
    costs: np.ndarray             # float64 additive cost (vision included)
    rollouts: np.ndarray          # int64 drop unit: the smallest rollout code of the atom's component
    label: np.ndarray             # int64 a member sample, named in refusals
    members: np.ndarray           # int64 global sample ids, atom by atom
    ptr: np.ndarray               # int64 [A + 1]
    owner: np.ndarray | None      # int64 rank of each atom (placement="local"), else None
    vision: np.ndarray | None     # int64 vision tokens (only when a vision cap applies), else None
    trees: bool                   # True: a micro-batch of these atoms holds the trie of its samples
    one_each: bool = False        # known to hold one sample per atom (sample_atoms): ``single`` without the O(n) test
    flat_fit: bool = False        # trees packed as the unshared plan packs them: the fit prices flat rows
    depth_sq: np.ndarray | None = None   # float64 tree atoms: the trie's Σ end² − start² (real tokens)
    component: np.ndarray | None = None  # int64 tree atoms: the forest root above the atom (atoms of
    #                                      different roots share no token)

    @property
    def size(self) -> int:
        return int(self.tokens.size)

    @property
    def single(self) -> bool:
        """One sample per atom (``samples_of`` is a gather, a bin's samples are its atoms)."""
        return self.one_each or (self.members.size == self.tokens.size
                                 and bool((self.ptr[1:] - self.ptr[:-1] == 1).all()))

    def samples_of(self, atoms: np.ndarray) -> np.ndarray:
        """The member samples of the given atoms, atom by atom."""
        if not atoms.size:
            return np.zeros(0, dtype=np.int64)
        if self.single:
            return self.members[atoms]
        A = self.tokens.size
        if atoms.size == A and int(atoms[0]) == 0 and int(atoms[-1]) == A - 1 and bool((atoms[1:] > atoms[:-1]).all()):
            return self.members.copy()    # every atom in order: the members as they are
        lo, hi = self.ptr[atoms], self.ptr[atoms + 1]
        idx = np.repeat(lo - np.cumsum(np.concatenate([[0], (hi - lo)[:-1]])), hi - lo) + np.arange(int((hi - lo).sum()))
        return self.members[idx]


def sample_atoms(samples: np.ndarray, ctx: PlanContext) -> Atoms:
    """One atom per sample (what the plain planner packs; sharing plans still share inside a bin)."""
    fp, b = ctx.fp, ctx.batch
    vis = None if ctx.vision_cap is None else fp.vision_tokens[samples]  # type: ignore[index]
    tokens = fp.sample_tokens[samples]   # with sharing too: a lone sample's trie is one run, padded as flat
    ptr = np.arange(samples.size + 1, dtype=np.int64)
    return Atoms(tokens, ctx.costs[samples], b.rollout_codes[samples], samples, samples, ptr,
                 None if ctx.owner is None else ctx.owner[samples], vis, ctx.cfg.share_prefixes, True)


class StepForest:
    """What :func:`tree_atoms` finds once per step, whatever the limit: each owner group's trees
    (``trie.step_trees``) and every sample's forest root (``trie.forest_roots``)."""

    def __init__(self) -> None:
        self.trees: list[StepTrees] = []
        self.top: np.ndarray | None = None


def tree_atoms(samples: np.ndarray, ctx: PlanContext, limit: int, forest: StepForest | None = None) -> Atoms:
    """Prefix trees of the step cut into parts of at most ``limit`` trie tokens (per owner rank
    under local placement). ``forest``: kept by the caller across the limits of one step."""
    cfg, fp, b = ctx.cfg, ctx.fp, ctx.batch
    cost = cfg.cost
    if not hasattr(cost, "tree_costs"):
        raise PlanError(f"share_prefixes=True needs a cost model that prices prefix trees (tree_costs): "
                        f"{type(cost).__name__} has none; use TokenCost or FlopsCost.")
    groups = [samples] if ctx.owner is None else \
        [samples[ctx.owner[samples] == r] for r in np.unique(ctx.owner[samples]).tolist()]
    mult = fp.padding.sample_multiple
    forest = StepForest() if forest is None else forest
    if forest.top is None:
        forest.trees = [step_trees(ctx.parent, ctx.shared, b.seq_lens, g, multiple=mult) for g in groups]
        whole = len(groups) == 1 and forest.trees[0].uniq.size == b.num_samples   # the batch's trees, roots and all
        forest.top = forest.trees[0].root if whole else forest_roots(ctx.parent, ctx.shared)
    trees = forest.trees
    atom_of, tokens, dsq, owner, base = [], [], [], [], 0
    for g, st in zip(groups, trees):
        cut = _vision_safe(st.cut(limit), g, ctx)
        atom_of.append(cut.atom_of + base if base else cut.atom_of)   # a fresh array of this cut's
        tokens.append(cut.tokens)
        dsq.append(cut.depth_sq)
        if ctx.owner is not None:
            owner.append(np.full(cut.tokens.size, int(ctx.owner[g[0]]), dtype=np.int64))
        base += cut.tokens.size
    one = len(groups) == 1
    a_of = atom_of[0] if one else np.concatenate(atom_of)
    every = groups[0] if one else np.concatenate(groups)
    members = every.copy() if bool((a_of[1:] >= a_of[:-1]).all()) else every[np.argsort(a_of, kind="stable")]
    tok = np.concatenate(tokens).astype(np.int64)
    ptr = np.concatenate([[0], np.cumsum(np.bincount(a_of, minlength=base))]).astype(np.int64)
    depth_sq = np.concatenate(dsq)
    costs = cost.tree_costs(tok.astype(np.float64), depth_sq)  # type: ignore[attr-defined]
    if fp.vision_costs is not None:
        costs = costs + np.bincount(a_of, weights=fp.vision_costs[every], minlength=base)
    vis = None if ctx.vision_cap is None else \
        np.bincount(a_of, weights=fp.vision_tokens[every], minlength=base).astype(np.int64)  # type: ignore[index]
    label = members[ptr[:-1]]
    return Atoms(tok, costs, _components(members, ptr, b.rollout_codes), label, members, ptr,
                 np.concatenate(owner) if owner else None, vis, True, depth_sq=depth_sq,
                 component=forest.top[label])


def bin_tries(atoms: Atoms, kept: np.ndarray, bin_of: np.ndarray, num_bins: int, ctx: PlanContext) -> TrieSets | None:
    """The trie of each bin of tree atoms (``kept`` atoms in bins ``bin_of``) as ``footprint.bin_footprint``
    counts it, from the atoms' own tries: atoms under different forest roots share no token, so a bin
    whose atoms have distinct roots holds the sum of their tokens and depth_sq; only bins holding two
    atoms of one root are counted by ``set_tries``. None where the row is not the bare trie (padding
    multiples, which pad runs and lay rows flat) or the atoms carry no tries."""
    if atoms.component is None or atoms.depth_sq is None or ctx.fp.row_rules() != RowRules():
        return None
    tokens = np.bincount(bin_of, weights=atoms.tokens[kept], minlength=num_bins).astype(np.int64)
    dsq = np.bincount(bin_of, weights=atoms.depth_sq[kept], minlength=num_bins).astype(np.float64)
    root = atoms.component[kept]
    span = int(root.max()) + 1 if root.size else 1
    if num_bins * span < 2 ** 62:   # (bin, root) pairs as one int64 key, sorted
        key = bin_of.astype(np.int64) * span
        key += root
        key.sort()
        shared = np.unique(key[1:][key[1:] == key[:-1]] // span)
    else:
        o = np.lexsort((root, bin_of))
        bo, ro = bin_of[o], root[o]
        shared = np.unique(bo[1:][(bo[1:] == bo[:-1]) & (ro[1:] == ro[:-1])])
    if shared.size:  # bins where two atoms of one tree may share their root path again
        again = np.zeros(num_bins, dtype=bool)
        again[shared] = True
        sel = kept[again[bin_of]]
        members = atoms.samples_of(sel)
        set_of = np.searchsorted(shared, np.repeat(bin_of[again[bin_of]], atoms.ptr[sel + 1] - atoms.ptr[sel]))
        t = set_tries(ctx.parent, ctx.shared, ctx.batch.seq_lens, members, set_of, int(shared.size))
        tokens[shared], dsq[shared] = t.tokens, t.depth_sq
    return TrieSets(tokens, dsq)


def _vision_safe(cut: TreeCut, g: np.ndarray, ctx: PlanContext) -> TreeCut:
    """Atoms over the vision cap (a tree's images add up; the cut counts only tokens) fall apart
    into one atom per sample, each within the cap (``footprint.check_fits``)."""
    vcap = ctx.vision_cap
    if vcap is None:
        return cut
    vis = np.bincount(cut.atom_of, weights=ctx.fp.vision_tokens[g], minlength=cut.tokens.size)  # type: ignore[index]
    bad = vis > vcap
    if not bad.any():
        return cut
    loose = bad[cut.atom_of]                                   # samples of the atoms over the cap
    keep = np.flatnonzero(~bad)
    renum = np.full(cut.tokens.size, -1, dtype=np.int64)
    renum[keep] = np.arange(keep.size)
    atom_of = renum[cut.atom_of]
    atom_of[loose] = keep.size + np.arange(int(loose.sum()))
    singles = set_tries(ctx.parent, ctx.shared, ctx.batch.seq_lens, g[loose], np.arange(int(loose.sum())),
                        int(loose.sum()), multiple=ctx.fp.padding.sample_multiple)
    return TreeCut(atom_of, np.concatenate([cut.tokens[keep], singles.tokens]),
                   np.concatenate([cut.depth_sq[keep], singles.depth_sq]), np.concatenate([cut.first[keep], g[loose]]))


def _components(members: np.ndarray, ptr: np.ndarray, rollout_codes: np.ndarray) -> np.ndarray:
    """Per atom, the smallest rollout code of its component (atoms joined by shared rollouts).

    When no rollout spans two atoms (the common case: a rollout is rarely cut over tree parts;
    never when each rollout is one sample, ``Batch.rollout_codes`` being dense codes) each atom
    is its own component: the least code of its members, one pass over the atoms' member runs.
    Otherwise label propagation over the bipartite atom–rollout graph: an atom takes the least
    label of its rollouts, a rollout the least label of its atoms, until nothing changes (this
    settles in one or two rounds). O(members) numpy per round."""
    codes = rollout_codes[members]
    A = ptr.size - 1
    runs = A > 0 and bool((ptr[1:] > ptr[:-1]).all())   # no empty atom: reduceat's runs are the atoms
    if runs and int(rollout_codes.max()) + 1 == rollout_codes.size:   # dense codes, one sample each
        return np.minimum.reduceat(codes, ptr[:-1])
    atom = np.repeat(np.arange(A), np.diff(ptr))
    if runs and 0 <= int(codes.min()) and int(codes.max()) < rollout_codes.size:
        where = np.empty(int(codes.max()) + 1, dtype=np.int64)
        where[codes] = atom                  # one atom per code, if every member of the code agrees
        if (where[codes] == atom).all():
            return np.minimum.reduceat(codes, ptr[:-1])
    uniq, inv = np.unique(codes, return_inverse=True)
    label = uniq.astype(np.int64).copy()          # per rollout code
    big = np.iinfo(np.int64).max
    while True:
        per_atom = np.full(A, big, dtype=np.int64)
        np.minimum.at(per_atom, atom, label[inv])
        new = label.copy()
        np.minimum.at(new, inv, per_atom[atom])
        if np.array_equal(new, label):
            return per_atom
        label = new
