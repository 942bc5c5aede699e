"""Fast prefix-trie arithmetic for many sets at once: trie sizes of sets, and cutting trees into parts.

Design note. ``prefix.py`` defines the trie a set S of samples holds under the batch's prefix
forest (``parent``, ``shared``, ``lens``): ``need`` starts at L_i for the members and flows up,
``need[p] = max(need[p], min(need[a], s_a))``; each owner a holds the segment [start_a, need_a).
The planner needs that size for thousands of sets per step (one per sample, per tree, per bin),
and needs trees cut into parts of bounded size. This module does both without per-member walks:

1. ``set_tries``: every (set, node) pair the sets touch is visited once, level by level from the
   deepest forest level up (a node's children are one level deeper, so its need is final when
   its level comes). A wide level is one numpy step (sort the pairs' keys, max per key, push
   ``min(need, s)`` to the parents); a narrow one (a chain) runs in plain Python, so a chain of
   n costs O(n) small steps, not n numpy calls. Lone members (multiple 1) are L and L² outright.
2. ``cut_trees``: trees are found with pointer doubling (nearest member ancestor, the least
   shared length on the way, the tree's root: O(N log depth) numpy); a tree whose (conservative)
   size fits stays whole — one ``set_tries`` call for all of them. Only larger trees are cut by
   the depth-first greedy of ``stages/share.py`` in Python, whose part keeps its needs in a dict
   but starts *lazily*: a fresh part holds its first sample's whole root path implicitly (size
   L, or its padded path size from a memo) and writes that path out only when a later sample's
   walk climbs above it; so a chain costs O(1) per sample instead of a walk to the root.

Padding: with ``multiple`` m every segment occupies ceil(len/m)·m tokens (``tokens``);
``depth_sq`` always counts real tokens only (Σ need² − start²), as ``PrefixTree.depth_sq``.

Guarantees: ``set_tries(..., multiple=1)`` equals ``micro_tree(...).num_tokens``/``depth_sq`` of
every set exactly; ``cut_trees(..., multiple=1)`` returns the parts of the depth-first greedy
of ``stages/share._atoms`` (same parts, same order); with m > 1 a subtree's padded size is
estimated, and a part that would pass the limit while a subtree is added is closed there (so
every part holds <= limit tokens whenever each sample's padded path fits). Measured trade-off
(this machine): 16,384 GRPO samples (n = 8) as one-sample sets take ~2 ms, as 2,048 trees
~4 ms; a 1,500-sample append-only chain as one set ~3 ms (the per-member walk: ~0.3 s).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["TrieSets", "TreeCut", "set_tries", "cut_trees", "forest_depths"]

_NARROW = 24   # levels with at most this many (set, node) pairs run in plain Python


class TrieSets(NamedTuple):
    """Per set: ``tokens`` (int64, padded segments) and ``depth_sq`` (float64, real tokens)."""

    tokens: np.ndarray
    depth_sq: np.ndarray


class TreeCut(NamedTuple):
    """Atoms of a step's samples: ``atom_of`` (aligned with the samples given), per atom its
    ``tokens`` (padded), ``depth_sq`` (real tokens) and ``first`` sample in depth-first order."""

    atom_of: np.ndarray
    tokens: np.ndarray
    depth_sq: np.ndarray
    first: np.ndarray


def _i64(x: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def _links(parent: np.ndarray, shared: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(effective parent: -1 where nothing is shared, segment start: s_a, 0 for a root)."""
    ep = np.where((parent >= 0) & (shared > 0), parent, -1)
    return ep, np.where(parent >= 0, shared, 0)


def forest_depths(parent: np.ndarray, shared: np.ndarray) -> np.ndarray:
    """Depth of every sample along positive shared links (roots 0). Pointer doubling (Wyllie):
    O(N log depth) numpy."""
    ep, _ = _links(_i64(parent), _i64(shared))
    dist = (ep >= 0).astype(np.int64)
    jump = ep.copy()
    while True:
        has = np.flatnonzero(jump >= 0)
        if has.size == 0:
            return dist
        j = jump[has]
        dist[has] += dist[j]
        jump[has] = jump[j]


def _distinct(x: np.ndarray) -> np.ndarray:
    """Sorted distinct values (a sort and a mask: numpy's hashing unique is slower on int64 keys)."""
    x = np.sort(x)
    return x[np.concatenate([[True], x[1:] != x[:-1]])] if x.size else x


def _pad(x: np.ndarray | int, m: int):
    return -(-x // m) * m


def set_tries(parent: np.ndarray, shared: np.ndarray, lens: np.ndarray, members: Sequence[int] | np.ndarray,
              set_of: Sequence[int] | np.ndarray, num_sets: int, *, multiple: int = 1,
              depth: np.ndarray | None = None) -> TrieSets:
    """The trie of every set: ``members[j]`` (a global sample id) belongs to set ``set_of[j]``.

    ``tokens[k]`` is ``micro_tree(parent, shared, lens, set k).num_tokens`` with each segment
    rounded up to a multiple of ``multiple``; ``depth_sq[k]`` its ``depth_sq`` (unpadded). A
    repeated (set, member) pair counts once; an empty set holds 0. ``depth`` (``forest_depths``)
    may be passed to save its O(N log depth). Cost: O(P) for the P (set, node) pairs the sets
    touch (members and the ancestors their tokens reach, each once per set), in one numpy step
    per forest level with more than a few pairs and plain Python below that.
    """
    parent, shared, lens = _i64(parent), _i64(shared), _i64(lens)
    members, set_of = _i64(members), _i64(set_of)
    m = int(multiple)
    n = parent.size
    tokens = np.zeros(num_sets, dtype=np.int64)
    dsq = np.zeros(num_sets, dtype=np.int64)
    if members.size == 0:
        return TrieSets(tokens, dsq.astype(np.float64))
    ep, start = _links(parent, shared)
    key = _distinct(set_of * n + members)
    sid = key // n
    if m == 1:   # a lone member's trie is its own sequence: L tokens, L² work
        cnt = np.bincount(sid, minlength=num_sets)
        lone = cnt[sid] == 1
        L = lens[key[lone] % n]
        tokens[sid[lone]] = L
        dsq[sid[lone]] = L * L
        key = key[~lone]
        if key.size == 0:
            return TrieSets(tokens, dsq.astype(np.float64))
    if depth is None:
        depth = forest_depths(parent, shared)
    d = depth[key % n]
    order = np.argsort(-d, kind="stable")
    key, d = key[order], d[order]
    need0 = lens[key % n]
    cuts = (np.flatnonzero(d[1:] != d[:-1]) + 1).tolist()
    inject = {int(d[lo]): (lo, hi) for lo, hi in zip([0] + cuts, cuts + [d.size])}
    small = n <= 8 * key.size          # plain-list copies of the forest pay off
    jumps = _Jumps(ep, shared, key // n, d) if m == 1 else None
    key_l: list[int] | None = None
    pend_np: dict[int, list] = {}            # level -> [(keys, needs)] arrays (from wide levels)
    pend_py: dict[int, dict[int, int]] = {}  # level -> {key: need} (from narrow levels)
    out: tuple[list, list, list] = ([], [], [])   # per (set, owner): set, padded tokens, need² − start²
    py: tuple[list[int], list[int], list[int]] = ([], [], [])
    look: _Look | None = None
    for lvl in range(int(d[0]), -1, -1):
        chunks = pend_np.pop(lvl, [])
        cur = pend_py.pop(lvl, None)
        lo, hi = inject.get(lvl, (0, 0))
        size = hi - lo + sum(len(c[0]) for c in chunks) + (len(cur) if cur else 0)
        if size == 0:
            continue
        if size <= _NARROW:   # plain Python: a dict of needs, pushes merged into later levels' dicts
            if hi > lo:
                if key_l is None:
                    key_l, need_l = key.tolist(), need0.tolist()
                chunks.append((key_l[lo:hi], need_l[lo:hi]))
            look = look or _Look(ep, start, shared, small)
            _narrow_level(cur or {}, chunks, n, m, lvl, look, jumps, pend_py, py)
            continue
        if cur:
            chunks.append((np.fromiter(cur.keys(), np.int64, len(cur)), np.fromiter(cur.values(), np.int64, len(cur))))
        if hi > lo:
            chunks.append((key[lo:hi], need0[lo:hi]))
        for t, k, r in _wide_level(chunks, n, m, lvl, jumps, ep, start, shared, out):
            pend_np.setdefault(t, []).append((k, r))
    out_s, out_t, out_d = out
    if py[0]:
        out_s.append(np.array(py[0], dtype=np.int64))
        out_t.append(np.array(py[1], dtype=np.int64))
        out_d.append(np.array(py[2], dtype=np.int64))
    if out_s:
        s_all = np.concatenate(out_s)
        tokens += _int_bincount(s_all, np.concatenate(out_t), num_sets)
        dsq += _int_bincount(s_all, np.concatenate(out_d), num_sets)
    return TrieSets(tokens, dsq.astype(np.float64))


class _Look:
    """(effective parent, start, shared) of a sample, from plain lists (small forests) or numpy."""

    def __init__(self, ep: np.ndarray, start: np.ndarray, shared: np.ndarray, as_lists: bool) -> None:
        self.arrays = (ep.tolist(), start.tolist(), shared.tolist()) if as_lists else (ep, start, shared)
        self.as_lists = as_lists

    def __call__(self, a: int) -> tuple[int, int, int]:
        ep, st, sh = self.arrays
        return (ep[a], st[a], sh[a]) if self.as_lists else (int(ep[a]), int(st[a]), int(sh[a]))


class _Jumps:
    """Multiple 1: a set whose climb is down to ONE (node a, need r) pair covers exactly positions
    [0, r) of a's root path, once each. So with no member of the set above, it is done in closed
    form (r tokens, r² work); and up to the level t of its next member it adds positions
    [r_u, r), r_u = min(r, least shared on the way), and goes on from a's ancestor u at level t.
    Ancestors and least shared lengths by binary lifting (tables built on first use)."""

    def __init__(self, ep: np.ndarray, shared: np.ndarray, sets: np.ndarray, d: np.ndarray) -> None:
        self.ep, self.shared = ep, shared
        self.span = int(d.max()) + 2
        self.levels = _distinct(sets * self.span + d)     # (set, member level), sorted
        self.levels_l: list[int] | None = None
        self.anc: list[np.ndarray] = []
        self.mn: list[np.ndarray] = []

    def next_level(self, sets: np.ndarray, lvl: int) -> np.ndarray:
        """Per set, the deepest level < lvl holding one of its members, or -1."""
        q = sets * self.span + lvl
        i = np.searchsorted(self.levels, q) - 1
        ok = i >= 0
        v = self.levels[np.maximum(i, 0)]
        return np.where(ok & (v // self.span == sets), v % self.span, -1)

    def next_level1(self, sset: int, lvl: int) -> int:
        if self.levels_l is None:
            self.levels_l = self.levels.tolist()
        i = bisect_left(self.levels_l, sset * self.span + lvl) - 1
        if i < 0:
            return -1
        v = self.levels_l[i]
        return v % self.span if v // self.span == sset else -1

    def _tables(self, steps: int) -> None:
        if not self.anc:
            self.anc, self.mn = [self.ep], [np.where(self.ep >= 0, self.shared, 0)]
        while (1 << len(self.anc)) <= steps:
            a, m = self.anc[-1], self.mn[-1]
            up = a[np.maximum(a, 0)]
            self.anc.append(np.where(a >= 0, up, -1))
            self.mn.append(np.where(a >= 0, np.minimum(m, m[np.maximum(a, 0)]), m))

    def up(self, x: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ancestor ``steps`` levels up, least shared length of the nodes climbed from)."""
        self._tables(int(steps.max()))
        x = x.copy()
        least = np.full(x.size, np.iinfo(np.int64).max, dtype=np.int64)
        for k in range(len(self.anc)):
            sel = np.flatnonzero((steps >> k) & 1)
            if sel.size:
                least[sel] = np.minimum(least[sel], self.mn[k][x[sel]])
                x[sel] = self.anc[k][x[sel]]
        return x, least

    def up1(self, x: int, steps: int) -> tuple[int, int]:
        self._tables(steps)
        least = 1 << 62
        k = 0
        while steps:
            if steps & 1:
                least = min(least, int(self.mn[k][x]))
                x = int(self.anc[k][x])
            steps >>= 1
            k += 1
        return x, least


def _narrow_level(cur: dict[int, int], chunks: list, n: int, m: int, lvl: int, look: _Look, jumps: _Jumps | None,
                  pend: dict[int, dict[int, int]], out: tuple[list[int], list[int], list[int]]) -> None:
    """One narrow level in plain Python: the max need per (set, node) key, its segment (appended
    to ``out``), the needs pushed up into ``pend`` (a lone pair of a set jumps, ``_Jumps``)."""
    for ks, rs in chunks:
        ks = ks if isinstance(ks, list) else ks.tolist()
        rs = rs if isinstance(rs, list) else rs.tolist()
        for k, r in zip(ks, rs):
            if r > cur.get(k, 0):
                cur[k] = r
    out_s, out_t, out_d = out
    per: dict[int, int] = {}
    if jumps is not None:
        for k in cur:
            per[k // n] = per.get(k // n, 0) + 1
    for k, r in cur.items():
        sset, a = divmod(k, n)
        if per.get(sset) == 1:
            t = jumps.next_level1(sset, lvl)  # type: ignore[union-attr]
            if t < lvl - 1:
                ru = 0
                if t >= 0:
                    u, least = jumps.up1(a, lvl - t)  # type: ignore[union-attr]
                    ru = min(r, least)
                out_s.append(sset)
                out_t.append(r - ru)
                out_d.append(r * r - ru * ru)
                if ru > 0:
                    nxt = pend.setdefault(t, {})
                    ku = sset * n + u
                    if ru > nxt.get(ku, 0):
                        nxt[ku] = ru
                continue
        p, st, sh = look(a)
        if r > st:
            out_s.append(sset)
            out_t.append(-(-(r - st) // m) * m)
            out_d.append(r * r - st * st)
        if p >= 0 and sh > 0:
            up = min(r, sh)
            kp = sset * n + p
            nxt = pend.setdefault(lvl - 1, {})
            if up > nxt.get(kp, 0):
                nxt[kp] = up


def _wide_level(chunks: list, n: int, m: int, lvl: int, jumps: _Jumps | None, ep: np.ndarray, start: np.ndarray,
                shared: np.ndarray, out: tuple[list, list, list]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """One wide level in numpy: sort the keys, max need per key, segments, and the pushes as
    (level, keys, needs); lone pairs of a set jump (``_Jumps``)."""
    k = np.concatenate([np.asarray(c[0], dtype=np.int64) for c in chunks])
    r = np.concatenate([np.asarray(c[1], dtype=np.int64) for c in chunks])
    if k.size > 1:   # pushes repeat keys (siblings in one set)
        o = np.argsort(k, kind="stable")
        k, r = k[o], r[o]
        first = np.flatnonzero(np.concatenate([[True], k[1:] != k[:-1]]))
        k, r = k[first], np.maximum.reduceat(r, first)
    pushes: list[tuple[int, np.ndarray, np.ndarray]] = []
    if jumps is not None:   # keys are sorted, so a set's pairs are adjacent
        sets = k // n
        heads = np.flatnonzero(np.concatenate([[True], sets[1:] != sets[:-1], [True]]))
        lone = np.flatnonzero(np.repeat(np.diff(heads) == 1, np.diff(heads)))
        t = jumps.next_level(sets[lone], lvl)
        go = t < lvl - 1
        if go.any():
            j, t = lone[go], t[go]
            ru = np.zeros(j.size, dtype=np.int64)
            cont = np.flatnonzero(t >= 0)
            if cont.size:
                u, least = jumps.up(k[j[cont]] % n, lvl - t[cont])
                ru[cont] = np.minimum(r[j[cont]], least)
                live = ru[cont] > 0
                for tt in np.unique(t[cont][live]).tolist():
                    w = cont[live][t[cont][live] == tt]
                    pushes.append((tt, sets[j[w]] * n + u[live][t[cont][live] == tt], ru[w]))
            rj = r[j]
            out[0].append(sets[j])
            out[1].append(rj - ru)
            out[2].append(rj * rj - ru * ru)
            keep = np.ones(k.size, dtype=bool)
            keep[j] = False
            k, r = k[keep], r[keep]
            if k.size == 0:
                return pushes
    nd = k % n
    st = start[nd]
    seg = r - st
    own = seg > 0
    out[0].append(k[own] // n)
    out[1].append(_pad(seg[own], m))
    out[2].append(r[own] * r[own] - st[own] * st[own])
    p = ep[nd]
    up = np.minimum(r, shared[nd])
    go2 = (p >= 0) & (up > 0)
    if go2.any():
        pushes.append((lvl - 1, (k[go2] // n) * n + p[go2], up[go2]))
    return pushes


def _int_bincount(idx: np.ndarray, w: np.ndarray, size: int) -> np.ndarray:
    """Exact int64 sums per index (float64 bincount is exact below 2**53, checked)."""
    if w.size == 0 or int(np.abs(w).max()) * w.size < 2**53:
        return np.bincount(idx, weights=w, minlength=size).astype(np.int64)
    out = np.zeros(size, dtype=np.int64)
    np.add.at(out, idx, w)
    return out


# ------------------------------------------------------------------------------------------------
# cut_trees
# ------------------------------------------------------------------------------------------------


class _Above(NamedTuple):
    """Per global sample (meaningful at the step's members): nearest member ancestor ``near``
    (-1: a tree root), the least shared length on the way to it ``sw``, the tree's ``root``."""

    near: np.ndarray
    sw: np.ndarray
    root: np.ndarray


def _above(ep: np.ndarray, shared: np.ndarray, is_member: np.ndarray) -> _Above:
    """Pointer doubling over the forest: O(N log depth) numpy."""
    n = ep.size
    idx = np.arange(n, dtype=np.int64)
    link = np.where((ep >= 0) & ~is_member[np.maximum(ep, 0)], ep, -1)   # climb through non-members
    mn = shared.copy()
    end = np.where(link >= 0, link, idx)
    jump = link.copy()
    while True:
        has = np.flatnonzero(jump >= 0)
        if has.size == 0:
            break
        j = jump[has]
        mn[has] = np.minimum(mn[has], mn[j])
        jump[has] = jump[j]
    while True:
        nxt = end[end]
        if np.array_equal(nxt, end):
            break
        end = nxt
    near = ep[end]                     # a member or -1
    root = np.where(near >= 0, near, idx)
    while True:
        nxt = root[root]
        if np.array_equal(nxt, root):
            break
        root = nxt
    return _Above(near, mn, root)


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
    """The depth-first greedy of ``stages/share._atoms`` over one forest (shared arrays, memos)."""

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

    def cut_tree(self, root: int, children: dict[int, list[int]], sub: dict[int, int], size: dict[int, int],
                 out: list[_Part]) -> None:
        """Cut the tree of ``root`` into parts (appended to ``out``) in depth-first order."""
        part = _Part()
        stack = [root]
        limit = self.limit
        while stack:
            i = stack.pop()
            kids = children.get(i)
            g = self.gain(part, i)
            if kids:
                placed, part = self._place_subtree(i, g, children, sub, size, part, out)
                if placed:
                    continue
            # a leaf (its subtree is itself: placing it whole is this same step) or a subtree too
            # large for a part: place i alone, then its branches
            if part.members and part.tokens + g[0] > limit:
                out.append(part)
                part = _Part()
                g = self.gain(part, i)
            self.add(part, i, *g)
            if kids:
                stack.extend(kids[::-1])
        if part.members:
            out.append(part)

    def _place_subtree(self, i: int, g: tuple[int, int, list], children: dict[int, list[int]],
                       sub: dict[int, int], size: dict[int, int], part: _Part,
                       out: list[_Part]) -> tuple[bool, _Part]:
        """Put the whole subtree of i into ``part`` or a fresh part (share._place_subtree); ``g``
        is i's gain in ``part``. The subtree meets the part only on i's own sequence, of which
        the part covers ``L_i − gain``."""
        L = self.lens[i]
        if self.m == 1:
            covered = L - g[0] if part.members else 0
            est, alone = part.tokens + sub[i] - covered, sub[i]
        else:   # i's exact padded gain, the rest unpadded plus one multiple per further sample
            rest = sub[i] - L + (self.m - 1) * (size[i] - 1)
            est = part.tokens + g[0] + rest
            alone = self.path_tokens(i) + rest
        if est > self.limit:
            if not part.members or alone > self.limit:
                return False, part
            out.append(part)
            part = _Part()
        stack = [i]
        while stack:
            j = stack.pop()
            du, dd, ups = self.gain(part, j)
            if part.members and part.tokens + du > self.limit:   # only when an estimate was low (m > 1)
                out.append(part)
                part = _Part()
                du, dd, ups = self.gain(part, j)
            self.add(part, j, du, dd, ups)
            kids = children.get(j)
            if kids:
                stack.extend(kids[::-1])
        return True, part


def cut_trees(parent: np.ndarray, shared: np.ndarray, lens: np.ndarray, samples: Sequence[int] | np.ndarray,
              limit: int, *, multiple: int = 1) -> TreeCut:
    """Atoms of ``samples`` (distinct global ids): their prefix trees (grouped as
    ``prefix.sample_forest`` groups them), whole when they hold at most ``limit`` tokens, else
    cut depth-first into parts: a subtree that fits the current part's room joins it, one that
    fits a fresh part starts one, a larger one is split at its own branches; a sample longer
    than ``limit`` is a part of its own. Atoms are numbered by tree root, parts in depth-first
    order (``stages/share._atoms``' order). Cost: O(N log depth) numpy to find the trees, one
    ``set_tries`` for the whole ones, O(members + ancestors climbed) Python for the cut ones
    (O(1) per sample on a chain).
    """
    parent, shared, lens = _i64(parent), _i64(shared), _i64(lens)
    samples = _i64(samples)
    m = int(multiple)
    ep, start = _links(parent, shared)
    uniq = _distinct(samples)
    if uniq.size == 0:
        z = np.zeros(0, dtype=np.int64)
        return TreeCut(z, z, np.zeros(0), z)
    is_member = np.zeros(parent.size, dtype=bool)
    is_member[uniq] = True
    ab = _above(ep, shared, is_member)
    near, root = ab.near[uniq], ab.root[uniq]
    sw = np.where(near >= 0, ab.sw[uniq], 0)
    roots, tree = np.unique(root, return_inverse=True)
    # share._subtree_tokens of each root: Σ over the tree of L − (tokens shared with the nearest member above)
    est = np.bincount(tree, weights=lens[uniq] - sw, minlength=roots.size).astype(np.int64)
    if m == 1:   # share._atoms keeps a tree whole when its (conservative) size fits
        whole = est <= limit
        keep = whole[tree]
        exact = set_tries(parent, shared, lens, uniq[keep], tree[keep], roots.size)
    else:
        exact = set_tries(parent, shared, lens, uniq, tree, roots.size, multiple=m)
        whole = exact.tokens <= limit
    local = np.zeros(uniq.size, dtype=np.int64)      # each member's part within its tree
    count = np.ones(roots.size, dtype=np.int64)       # parts per tree
    star = np.zeros(roots.size, dtype=bool)
    if m == 1 and not whole.all():
        star = _stars(ep[uniq], near, root, tree, ~whole)
        if star.any():
            _cut_stars(star, roots, tree, uniq, near, shared, lens, limit, local, count)
    parts_of: dict[int, list[_Part]] = {}
    big = np.flatnonzero(~whole & ~star)
    if big.size:
        cutter = _Cutter(ep, start, shared, lens, m, limit)
        sel = np.flatnonzero(np.isin(tree, big))          # members of the trees to cut, ascending
        children: dict[int, list[int]] = {}
        for x, a in zip(uniq[sel].tolist(), near[sel].tolist()):
            if a >= 0:
                children.setdefault(a, []).append(x)
        sub: dict[int, int] = {}
        size: dict[int, int] = {}
        sw_of = dict(zip(uniq[sel].tolist(), sw[sel].tolist()))
        for x in reversed(uniq[sel].tolist()):               # children (later samples) first
            kids = children.get(x, ())
            sub[x] = int(lens[x]) + sum(sub[j] - sw_of[j] for j in kids)
            size[x] = 1 + sum(size[j] for j in kids)
        pos = {x: k for k, x in zip(sel.tolist(), uniq[sel].tolist())}
        for t in big.tolist():
            out: list[_Part] = []
            cutter.cut_tree(int(roots[t]), children, sub, size, out)
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
    if star.any():   # star parts: one trie count for all; first = least member (root, then children in order)
        sm = np.flatnonzero(star[tree])
        cnt = set_tries(parent, shared, lens, uniq[sm], atom_u[sm], A)
        at = np.unique(atom_u[sm])
        tokens[at], dsq[at] = cnt.tokens[at], cnt.depth_sq[at]
        np.minimum.at(first, atom_u[sm], uniq[sm])
    for t, ps in parts_of.items():
        for q, part in enumerate(ps):
            a = int(offset[t]) + q
            tokens[a], dsq[a], first[a] = part.tokens, part.dsq, part.members[0]
    return TreeCut(atom_u[np.searchsorted(uniq, samples)], tokens, dsq, first)


_STAR_MAX = 64   # stars with more children are cut by the Python greedy (fewer, longer lockstep rounds)


def _stars(ep_u: np.ndarray, near: np.ndarray, root: np.ndarray, tree: np.ndarray, cut: np.ndarray) -> np.ndarray:
    """Trees to cut that are stars: every other member a leaf whose parent is the root itself."""
    kid = near >= 0
    bad = kid & ((near != root) | (ep_u != near))
    nt = cut.size
    ok = cut & (np.bincount(tree, weights=bad, minlength=nt) == 0)
    return ok & (np.bincount(tree, weights=kid, minlength=nt) <= _STAR_MAX)


def _cut_stars(star: np.ndarray, roots: np.ndarray, tree: np.ndarray, uniq: np.ndarray, near: np.ndarray,
               shared: np.ndarray, lens: np.ndarray, limit: int, local: np.ndarray, count: np.ndarray) -> None:
    """The depth-first greedy on star trees, all trees in lockstep over their children (numpy).

    In a star the root comes first (its subtree is too large: it is placed alone), then each
    child c in order covers min(s_c, H) of its tokens, H being how far the part's members reach
    into the root's sequence (L_root if the root is in the part, else the largest s of its
    children): the child joins if the rest fits, else it starts a fresh part (L_c tokens)."""
    kids = np.flatnonzero(star[tree] & (near >= 0))
    kids = kids[np.argsort(tree[kids], kind="stable")]
    kt = tree[kids]
    heads = np.flatnonzero(np.concatenate([[True], kt[1:] != kt[:-1]])) if kids.size else kids
    rank = np.arange(kids.size) - np.repeat(heads, np.diff(np.concatenate([heads, [kids.size]])))
    T = np.zeros(roots.size, dtype=np.int64)
    H = np.zeros(roots.size, dtype=np.int64)
    part = np.zeros(roots.size, dtype=np.int64)
    T[star] = H[star] = lens[roots[star]]
    by_rank = np.argsort(rank, kind="stable")
    cuts = np.flatnonzero(np.diff(rank[by_rank])) + 1
    for idx in np.split(kids[by_rank], cuts) if kids.size else []:
        t = tree[idx]
        x = uniq[idx]
        s, L = shared[x], lens[x]
        cov = np.minimum(s, H[t])
        grown = T[t] + L - cov
        fresh = grown > limit
        part[t] += fresh
        T[t] = np.where(fresh, L, grown)
        H[t] = np.where(fresh, s, np.maximum(H[t], s))
        local[idx] = part[t]
    count[star] = part[star] + 1
