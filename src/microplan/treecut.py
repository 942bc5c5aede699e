"""Cutting a step's prefix trees into packing atoms: whole trees that fit, parts of larger ones.

Design note. ``stages/atoms.py`` packs prefix trees as atoms; a tree over the limit is cut by a
depth-first greedy (a subtree that fits the current part joins it, one that fits a fresh part
starts one, a larger one is split at its own branches). Steps:

1. Trees by pointer doubling over the forest (nearest member ancestor, the tree's root):
   O(N log depth) numpy (a step of the whole batch: a sample's nearest member is its parent, so
   only the roots are climbed); a tree whose trie fits stays whole (stars in closed form, the
   others by one ``trie_sets.set_tries`` call for all trees, padded segments counted). This part
   does not read the limit: :func:`step_trees` does it once per step, with which trees are stars
   and where each given sample sits, and :meth:`StepTrees.cut` cuts at any number of limits.
2. Stars (a root and leaves hanging directly from it: GRPO groups; multiple 1) are cut in numpy
   lockstep over their children, their parts' tries in closed form (``treecut_stars.py``).
3. Other trees run the greedy in Python. A subtree "fits" exactly: it is added to the part
   sample by sample and, as soon as the part passes the limit, the logged changes are undone
   (a trial costs what it adds, so a chain whose parts hold k samples costs O(n·k) at worst,
   O(n) in practice: once samples grow past the limit every trial stops at its first sample).
   A part keeps its needs in a dict, but a fresh part holds its first sample's root path
   implicitly (size L, or its padded path from a memo) until a later walk climbs above it, so
   a chain costs O(1) per sample instead of a walk to the root.

Guarantees: the parts, and their order, of the exact-trial greedy (tests/test_trie.py's
reference :func:`ref_cut`: a walk to the root per part, a dict copy per trial, quadratic), for
every multiple: every part holds <= limit tokens unless it is one sample that alone exceeds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .trie_sets import TrieSets, _ascending, _distinct, _i64, _links, _unique_inverse, set_tries
from .treecut_stars import _cut_stars, _star_parts, _stars

__all__ = ["TreeCut", "StepTrees", "cut_trees", "step_trees", "forest_roots"]


class TreeCut(NamedTuple):
    """Atoms of a step's samples: ``atom_of`` (aligned with the samples given), per atom its
    ``tokens`` (padded), ``depth_sq`` (real tokens) and ``first`` sample in depth-first order."""

    atom_of: np.ndarray
    tokens: np.ndarray
    depth_sq: np.ndarray
    first: np.ndarray



class _Above(NamedTuple):
    """Per global sample (meaningful at the step's members): nearest member ancestor ``near``
    (-1: a tree root) and the tree's ``root``."""

    near: np.ndarray
    root: np.ndarray


def _above(ep: np.ndarray, is_member: np.ndarray) -> _Above:
    """Pointer doubling over the forest: O(N log depth) numpy."""
    n = ep.size
    idx = np.arange(n, dtype=np.int64)
    link = np.where((ep >= 0) & ~is_member[np.maximum(ep, 0)], ep, -1)   # climb through non-members
    end = _last(np.where(link >= 0, link, idx))
    near = ep[end]                     # a member or -1
    root = _last(np.where(near >= 0, near, idx))
    return _Above(near, root)


def forest_roots(parent: np.ndarray, shared: np.ndarray) -> np.ndarray:
    """Per sample, the root of its prefix tree in the whole forest (climbing every link that shares
    a token, members of a step or not): samples of different roots share no token. O(N log depth)."""
    return _roots(_links(_i64(parent), _i64(shared))[0])


def _roots(ep: np.ndarray) -> np.ndarray:
    """Per sample, the root above it along the links ``ep`` (-1: none)."""
    return _last(np.where(ep >= 0, ep, np.arange(ep.size, dtype=np.int64)))


def _last(step: np.ndarray) -> np.ndarray:
    """Follow ``step`` (a forest of pointers, roots point to themselves) to its fixpoint by
    pointer doubling: O(N log depth) numpy."""
    while True:
        nxt = step[step]
        if np.array_equal(nxt, step):
            return step
        step = nxt


class _Part:
    """A growing part: members, the ``need`` of every sample its trie touches, its size. A fresh
    part's first sample (``base``) holds its root path implicitly until a walk climbs above it."""

    __slots__ = ("members", "need", "tokens", "dsq", "base")

    def __init__(self) -> None:
        self.members: list[int] = []
        self.need: dict[int, int] = {}
        self.tokens = 0
        self.dsq = 0
        self.base = -1     # >= 0: the base's ancestors are not written out yet


class _Cutter:
    """The depth-first greedy over one forest (shared arrays, memos)."""

    def __init__(self, ep: np.ndarray, start: np.ndarray, shared: np.ndarray, lens: np.ndarray, m: int,
                 limit: int) -> None:
        # plain lists: a Python walk reads them ~4x faster than numpy scalars
        self.ep, self.start, self.shared, self.lens = ep.tolist(), start.tolist(), shared.tolist(), lens.tolist()
        self.m, self.limit = m, limit
        self.path: dict[int, int] = {}     # padded size of a sample's own root path (m > 1)
        self.cut: dict[int, int] = {}      # padded size of positions [0, s_a) of a's path (m > 1)

    def pad(self, x: int) -> int:
        return -(-x // self.m) * self.m

    def path_tokens(self, i: int) -> int:
        """Padded tokens of sample i alone (L_i when m = 1)."""
        L = self.lens[i]
        if self.m == 1:
            return L
        if i not in self.path:
            self.path[i] = self.pad(L - self.start[i]) + self._below_start(i)
        return self.path[i]

    def _below_start(self, a: int) -> int:
        """Padded tokens of positions [0, s_a) on a's root path: the segment of the nearest
        ancestor q whose own segment starts below s_a (nodes in between start at >= s_a, so hold
        none of these positions), then q's own [0, s_q). Memoised; iterative."""
        cut, ep, start = self.cut, self.ep, self.start
        stack = [a]
        while stack:
            b = stack[-1]
            if b in cut:
                stack.pop()
                continue
            if ep[b] < 0:
                cut[b] = 0
                stack.pop()
                continue
            s = start[b]
            q = ep[b]
            while start[q] >= s:
                q = ep[q]
            if q not in cut:
                stack.append(q)
                continue
            cut[b] = self.pad(s - start[q]) + cut[q]
            stack.pop()
        return cut[a]

    def gain(self, part: _Part, i: int) -> tuple[int, int, list]:
        """(Δ tokens, Δ depth_sq, need updates) of adding sample i to ``part``."""
        L = self.lens[i]
        if not part.members:
            return self.path_tokens(i), L * L, []
        need, ep, start, shared, m = part.need, self.ep, self.start, self.shared, self.m
        du = dd = 0
        ups = []
        a, r = i, L
        while a >= 0 and r > 0:
            if a < part.base:
                self._write_base(part)
            old = need.get(a, 0)
            if r <= old:
                break
            st = start[a]
            lo = max(old, st)
            if r > lo:
                du += (-(-(r - st) // m) * m - -(-(lo - st) // m) * m) if m > 1 else r - lo
                dd += r * r - lo * lo
            ups.append((a, r))
            a = ep[a]
            if a >= 0:
                r = min(r, shared[ups[-1][0]])
        return du, dd, ups

    def _write_base(self, part: _Part) -> None:
        """Write out the needs of the base's root path (held implicitly so far)."""
        b = part.base
        part.base = -1
        r = self.lens[b]
        a = b
        while True:
            p = self.ep[a]
            if p < 0:
                return
            r = min(r, self.shared[a])
            if r > part.need.get(p, 0):
                part.need[p] = r
            a = p

    def add(self, part: _Part, i: int, du: int, dd: int, ups: list) -> None:
        if not part.members:
            part.base = i
            part.need[i] = self.lens[i]
        else:
            part.need.update(ups)
        part.members.append(i)
        part.tokens += du
        part.dsq += dd

    def cut_tree(self, root: int, children: dict[int, list[int]], top: dict[int, int], out: list[_Part]) -> None:
        """Cut the tree of ``root`` into parts (appended to ``out``) in depth-first order; ``top``
        is the largest lone-sample size in each subtree (a trial that cannot fit is skipped)."""
        self.top = top
        part = _Part()
        stack = [root]
        limit = self.limit
        while stack:
            i = stack.pop()
            kids = children.get(i)
            if kids:
                if self._try_subtree(i, children, part):
                    continue
                if part.members:
                    fresh = _Part()
                    if self._try_subtree(i, children, fresh):
                        out.append(part)
                        part = fresh
                        continue
            # a leaf (trying its subtree is this same step) or a subtree too large for a part:
            # place i alone, then its branches
            g = self.gain(part, i)
            if part.members and part.tokens + g[0] > limit:
                out.append(part)
                part = _Part()
                g = self.gain(part, i)
            self.add(part, i, *g)
            if kids:
                stack.extend(kids[::-1])
        if part.members:
            out.append(part)

    def _try_subtree(self, i: int, children: dict[int, list[int]], part: _Part) -> bool:
        """Add the subtree of i to ``part`` in depth-first order; if the part passes the limit,
        undo every change and return False (the need writes are logged, so an undo costs what
        the trial did)."""
        if self.top[i] > self.limit:   # a sample of the subtree alone passes the limit
            return False
        kept = (len(part.members), part.tokens, part.dsq)
        was_empty = not part.members
        log: list[tuple[int, int | None]] = []
        need = part.need
        stack = [i]
        while stack:
            j = stack.pop()
            du, dd, ups = self.gain(part, j)
            if part.members:
                for a, r in ups:
                    log.append((a, need.get(a)))
                    need[a] = r
                part.members.append(j)
                part.tokens += du
                part.dsq += dd
            else:
                self.add(part, j, du, dd, ups)
            if part.tokens > self.limit:
                if was_empty:
                    part.members, part.need, part.tokens, part.dsq, part.base = [], {}, 0, 0, -1
                    return False
                for a, old in reversed(log):
                    if old is None:
                        del need[a]
                    else:
                        need[a] = old
                del part.members[kept[0]:]
                part.tokens, part.dsq = kept[1], kept[2]
                return False
            kids = children.get(j)
            if kids:
                stack.extend(kids[::-1])
        return True


class StepTrees(NamedTuple):
    """What :func:`cut_trees` finds before it reads the limit (the step's trees and each tree's
    padded trie): :func:`step_trees` once per step, then :meth:`cut` at any number of limits."""

    parent: np.ndarray
    shared: np.ndarray
    lens: np.ndarray
    samples: np.ndarray   # as given (distinct global ids)
    multiple: int
    ep: np.ndarray
    start: np.ndarray
    uniq: np.ndarray      # the samples ascending
    near: np.ndarray      # per uniq: nearest member ancestor (-1: a tree root)
    root: np.ndarray      # per uniq: its tree's root
    roots: np.ndarray     # per tree: its root
    tree: np.ndarray      # per uniq: its tree
    exact: TrieSets       # per tree: its whole trie (padded segments)
    star: np.ndarray      # per tree: a star (:func:`_stars`; multiple 1 only, else all False)
    at: np.ndarray | None  # per sample as given: its index in ``uniq`` (None: the samples are ``uniq``)

    def cut(self, limit: int) -> TreeCut:
        """``cut_trees(parent, shared, lens, samples, limit, multiple=multiple)``."""
        return _cut(self, int(limit))


def step_trees(parent: np.ndarray, shared: np.ndarray, lens: np.ndarray, samples: Sequence[int] | np.ndarray, *,
               multiple: int = 1) -> StepTrees:
    """The trees of ``samples`` and their whole tries (see :func:`cut_trees`): O(N log depth) numpy
    and one ``set_tries``."""
    parent, shared, lens = _i64(parent), _i64(shared), _i64(lens)
    samples = _i64(samples)
    m = int(multiple)
    ep, start = _links(parent, shared)
    uniq = _distinct(samples)
    at = None if uniq.size == samples.size and _ascending(samples) else np.searchsorted(uniq, samples)
    if uniq.size == 0:
        z = np.zeros(0, dtype=np.int64)
        return StepTrees(parent, shared, lens, samples, m, ep, start, z, z, z, z, z, TrieSets(z, np.zeros(0)),
                         np.zeros(0, dtype=bool), at)
    if uniq.size == parent.size:   # the whole batch (uniq is 0 .. n − 1): a sample's nearest member is its parent
        near, root, ep_u = ep, _roots(ep), ep
    else:
        is_member = np.zeros(parent.size, dtype=bool)
        is_member[uniq] = True
        ab = _above(ep, is_member)
        near, root, ep_u = ab.near[uniq], ab.root[uniq], ep[uniq]
    roots, tree = _unique_inverse(root)
    T = roots.size
    star = _stars(ep_u, near, root, tree, np.ones(T, dtype=bool)) if m == 1 else np.zeros(T, dtype=bool)
    return StepTrees(parent, shared, lens, samples, m, ep, start, uniq, near, root, roots, tree,
                     _whole_tries(parent, shared, lens, m, uniq, near, roots, tree, star), star, at)


def _whole_tries(parent: np.ndarray, shared: np.ndarray, lens: np.ndarray, m: int, uniq: np.ndarray,
                 near: np.ndarray, roots: np.ndarray, tree: np.ndarray, star: np.ndarray) -> TrieSets:
    """Each tree's whole trie: stars (multiple 1) in closed form (:func:`_star_parts`, the root in
    the part), the others by one ``set_tries``."""
    T = roots.size
    if not star.any():
        return set_tries(parent, shared, lens, uniq, tree, T, multiple=m)
    if star.all():
        st, tokens_st, dsq_st, _ = _star_parts(tree, uniq, near >= 0, shared, lens, T)
    else:
        sm = np.flatnonzero(star[tree])
        st, tokens_st, dsq_st, _ = _star_parts(tree[sm], uniq[sm], near[sm] >= 0, shared, lens, T)
    if st.size == T:   # every tree a star: st is 0 .. T − 1
        return TrieSets(tokens_st, dsq_st)
    tokens = np.zeros(T, dtype=np.int64)
    dsq = np.zeros(T, dtype=np.float64)
    tokens[st], dsq[st] = tokens_st, dsq_st
    if not star.all():
        other = np.flatnonzero(~star)
        sel = np.flatnonzero(~star[tree])
        got = set_tries(parent, shared, lens, uniq[sel], np.searchsorted(other, tree[sel]), other.size, multiple=m)
        tokens[other], dsq[other] = got.tokens, got.depth_sq
    return TrieSets(tokens, dsq)


def cut_trees(parent: np.ndarray, shared: np.ndarray, lens: np.ndarray, samples: Sequence[int] | np.ndarray,
              limit: int, *, multiple: int = 1) -> TreeCut:
    """Atoms of ``samples`` (distinct global ids): their prefix trees (grouped as
    ``prefix.sample_forest`` groups them), whole when they hold at most ``limit`` tokens, else
    cut depth-first into parts: a subtree that fits the current part's room joins it, one that
    fits a fresh part starts one, a larger one is split at its own branches; a sample longer
    than ``limit`` is a part of its own. Atoms are numbered by tree root, parts in depth-first
    order (``stages/share._atoms``' order). Cost: O(N log depth) numpy to find the trees, one
    ``set_tries`` for the whole ones (both shared by every limit through :func:`step_trees`),
    O(members + ancestors climbed) Python for the cut ones (O(1) per sample on a chain).
    """
    return step_trees(parent, shared, lens, samples, multiple=multiple).cut(limit)


def _cut(st: StepTrees, limit: int) -> TreeCut:
    """The atoms of :func:`cut_trees` at ``limit`` from the step's trees."""
    parent, shared, lens, m = st.parent, st.shared, st.lens, st.multiple
    ep, start, uniq, near, roots, tree, exact = st.ep, st.start, st.uniq, st.near, st.roots, st.tree, st.exact
    if uniq.size == 0:
        z = np.zeros(0, dtype=np.int64)
        return TreeCut(z, z, np.zeros(0), z)
    whole = exact.tokens <= limit
    local = np.zeros(uniq.size, dtype=np.int64)      # each member's part within its tree
    count = np.ones(roots.size, dtype=np.int64)       # parts per tree
    star = st.star & ~whole                           # the stars to cut (none unless multiple 1)
    if star.any():
        _cut_stars(star, roots, tree, uniq, near, shared, lens, limit, local, count)
    parts_of: dict[int, list[_Part]] = {}
    big = np.flatnonzero(~whole & ~star)
    if big.size:
        cutter = _Cutter(ep, start, shared, lens, m, limit)
        sel = np.flatnonzero((~whole & ~star)[tree])        # members of the trees to cut, ascending
        children: dict[int, list[int]] = {}
        for x, a in zip(uniq[sel].tolist(), near[sel].tolist()):
            if a >= 0:
                children.setdefault(a, []).append(x)
        pos = {x: k for k, x in zip(sel.tolist(), uniq[sel].tolist())}
        top: dict[int, int] = {}
        for x in reversed(uniq[sel].tolist()):               # children (later samples) first
            top[x] = max([cutter.path_tokens(x)] + [top[j] for j in children.get(x, ())])
        for t in big.tolist():
            out: list[_Part] = []
            cutter.cut_tree(int(roots[t]), children, top, out)
            parts_of[t] = out
            count[t] = len(out)
            for q, part in enumerate(out):
                local[[pos[x] for x in part.members]] = q
    offset = np.concatenate([[0], np.cumsum(count)[:-1]])
    A = int(count.sum())
    atom_u = offset[tree] + local
    tokens = np.zeros(A, dtype=np.int64)
    dsq = np.zeros(A, dtype=np.float64)
    first = np.full(A, np.iinfo(np.int64).max, dtype=np.int64)
    w = offset[whole]
    tokens[w], dsq[w], first[w] = exact.tokens[whole], exact.depth_sq[whole], roots[whole]
    if star.any():   # star parts: their tries in closed form; first = least member (root, then children in order)
        sm = np.flatnonzero(star[tree])
        at, tokens_at, dsq_at, first_at = _star_parts(atom_u[sm], uniq[sm], near[sm] >= 0, shared, lens, A)
        tokens[at], dsq[at], first[at] = tokens_at, dsq_at, first_at
    for t, ps in parts_of.items():
        for q, part in enumerate(ps):
            a = int(offset[t]) + q
            tokens[a], dsq[a], first[a] = part.tokens, part.dsq, part.members[0]
    return TreeCut(atom_u if st.at is None else atom_u[st.at], tokens, dsq, first)
