"""Trie sizes of many sets at once (``set_tries``) and the forest helpers ``trie.py`` and
``treecut.py`` share.

Design note. ``prefix.py`` defines the trie a set S of samples holds under the batch's prefix
forest (``parent``, ``shared``, ``lens``): ``need`` starts at L_i for the members and flows up,
``need[p] = max(need[p], min(need[a], s_a))``; each owner a holds the segment [start_a, need_a).
``set_tries`` visits every (set, node) pair at most once, level by level from the deepest forest
level up (a node's children are one level deeper, so its need is final when its level comes). A
wide level is one numpy step (sort the keys, max per key, push ``min(need, s)`` to the parents);
a narrow one (a chain) runs in plain Python. Multiple 1: a lone member is L and L² outright, and
a set whose climb is down to one (node, need r) pair covers positions [0, r) of one path once
each, so it jumps straight to its next member's level (binary lifting: ancestor and least shared
length) or finishes in closed form.

Padding: ``set_tries(..., multiple=m)`` pads every *owner* segment to ceil(len/m)·m tokens: a
bound of the row the packer can add up over sets (the union of two sets has at most the owner
segments of each, and a run is a merge of owner segments, pad(a + b) <= pad(a) + pad(b)).
``depth_sq`` counts real tokens (Σ need² − start²), as ``PrefixTree.depth_sq``.

Guarantees: ``set_tries(..., multiple=1)`` equals ``micro_tree(...).num_tokens``/``depth_sq`` of
every set (tests/test_trie.py, hypothesis). Cost: O(pairs) (+ O(N log depth) tables); with m > 1
a deep lone climb still visits each level. The public names are re-exported by ``trie.py``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["TrieSets", "set_tries", "forest_depths"]

_NARROW = 24   # levels with at most this many (set, node) pairs run in plain Python


class TrieSets(NamedTuple):
    """Per set: ``tokens`` (int64, padded segments) and ``depth_sq`` (float64, real tokens)."""

    tokens: np.ndarray
    depth_sq: np.ndarray


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


def _ascending(x: np.ndarray) -> bool:
    """Whether ``x`` is non-decreasing (one O(n) pass: the planner's ids mostly come sorted)."""
    return bool((x[1:] >= x[:-1]).all())


def _distinct(x: np.ndarray) -> np.ndarray:
    """Sorted distinct values (a sort, skipped when ``x`` is sorted already, and a mask: numpy's
    hashing unique is slower on int64 keys)."""
    if not _ascending(x):
        x = np.sort(x)
    return x[np.concatenate([[True], x[1:] != x[:-1]])] if x.size else x


def _unique_inverse(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(x, return_inverse=True)`` by one stable sort (numpy's hashing path is slower),
    none when ``x`` is sorted already."""
    if _ascending(x):
        head = np.concatenate([[True], x[1:] != x[:-1]]) if x.size else np.zeros(0, dtype=bool)
        return x[head], np.cumsum(head) - 1
    o = np.argsort(x, kind="stable")
    xs = x[o]
    head = np.concatenate([[True], xs[1:] != xs[:-1]]) if x.size else np.zeros(0, dtype=bool)
    inv = np.empty(x.size, dtype=np.int64)
    inv[o] = np.cumsum(head) - 1
    return xs[head], inv


def _pad(x: np.ndarray | int, m: int):
    return -(-x // m) * m


def set_tries(parent: np.ndarray, shared: np.ndarray, lens: np.ndarray, members: Sequence[int] | np.ndarray,
              set_of: Sequence[int] | np.ndarray, num_sets: int, *, multiple: int = 1,
              depth: np.ndarray | None = None) -> TrieSets:
    """The trie of every set: ``members[j]`` (a global sample id) belongs to set ``set_of[j]``.

    ``tokens[k]`` is ``owner_tree(parent, shared, lens, set k).num_tokens`` with each owner
    segment rounded up to a multiple of ``multiple`` (the packing bound; ``row_tries`` is the
    row); ``depth_sq[k]`` its ``depth_sq`` (unpadded). A
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
    lift = _Jumps(ep, shared)
    if m == 1:
        key = _path_sets(key, n, lens, depth, lift, tokens, dsq)
        if key.size == 0:
            return TrieSets(tokens, dsq.astype(np.float64))
    d = depth[key % n]
    order = np.argsort(-d, kind="stable")
    key, d = key[order], d[order]
    need0 = lens[key % n]
    if m == 1:
        lift.members(key // n, d)
    cuts = (np.flatnonzero(d[1:] != d[:-1]) + 1).tolist()
    inject = {int(d[lo]): (lo, hi) for lo, hi in zip([0] + cuts, cuts + [d.size])}
    small = n <= 8 * key.size          # plain-list copies of the forest pay off
    jumps = lift if m == 1 else None
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

    def __init__(self, ep: np.ndarray, shared: np.ndarray) -> None:
        self.ep, self.shared = ep, shared
        self.anc: list[np.ndarray] = []
        self.mn: list[np.ndarray] = []

    def members(self, sets: np.ndarray, d: np.ndarray) -> None:
        """Where the sets' members are: (set, level) pairs."""
        self.span = int(d.max()) + 2
        self.levels = _distinct(sets * self.span + d)     # (set, member level), sorted
        self.levels_l: list[int] | None = None

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


def _path_sets(key: np.ndarray, n: int, lens: np.ndarray, depth: np.ndarray, lift: _Jumps, tokens: np.ndarray,
               dsq: np.ndarray) -> np.ndarray:
    """Multiple 1: sets whose members all lie on one root path (a chain's micro-batch) in closed
    form, Σ L − Σ lcp over members by depth (consecutive ones: an ancestor x of y shares
    lcp = min(L_x, L_y, least shared from y up to x)), and the same with squares; ordering by
    depth is a trie order here (a token of x that z below y holds, y holds too). Returns the
    keys of the other sets. O(members log depth) numpy."""
    sets, nodes = key // n, key % n
    dd = depth[nodes]
    o = np.lexsort((dd, sets))
    sets, nodes, dd = sets[o], nodes[o], dd[o]
    pair = np.flatnonzero(sets[1:] == sets[:-1])
    if pair.size == 0:
        return key
    x, y = nodes[pair], nodes[pair + 1]
    steps = dd[pair + 1] - dd[pair]
    on = np.flatnonzero(steps > 0)
    anc = np.zeros(pair.size, dtype=bool)
    lcp = np.zeros(pair.size, dtype=np.int64)
    if on.size:
        u, least = lift.up(y[on], steps[on])
        anc[on] = u == x[on]
        lcp[on] = np.minimum(np.minimum(lens[x[on]], lens[y[on]]), least)
    bad = np.zeros(tokens.size, dtype=bool)
    bad[sets[pair[~anc]]] = True
    done = ~bad[sets]
    if not done.any():
        return key
    L = lens[nodes[done]]
    np.add.at(tokens, sets[done], L)
    np.add.at(dsq, sets[done], L * L)
    ok = anc & done[pair]
    np.subtract.at(tokens, sets[pair[ok]], lcp[ok])
    np.subtract.at(dsq, sets[pair[ok]], lcp[ok] * lcp[ok])
    return key[bad[key // n]]


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
                for tt in _distinct(t[cont][live]).tolist():
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
