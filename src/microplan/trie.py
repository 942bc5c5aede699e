"""Fast prefix-trie arithmetic for many sets at once: trie sizes, PrefixTrees, and atoms.

Design note. ``prefix.py`` defines the trie a set S of samples holds under the batch's prefix
forest (``parent``, ``shared``, ``lens``): ``need`` starts at L_i for the members and flows up,
``need[p] = max(need[p], min(need[a], s_a))``; each owner a holds the segment [start_a, need_a).
The planner needs that for thousands of sets per step (one per sample, per tree, per bin):

1. ``set_tries`` (sizes, ``trie_sets.py``): every (set, node) pair visited at most once, level by
   level from the deepest forest level up, a numpy step per wide level and plain Python for a
   chain; a set whose climb is down to one path finishes by binary lifting or in closed form.
2. ``micro_trees`` (whole ``PrefixTree``s, here): the same pass recording every (set, owner) need;
   a segment's parent and a member's anchor are the nearest ancestor starting below a position,
   by binary lifting on min start.
3. ``cut_trees`` (``treecut.py``): a step's trees, whole or cut into parts of bounded size.

This module is the public face of the three (it re-exports ``set_tries``, ``TrieSets``,
``forest_depths``, ``forest_roots``, ``cut_trees``, ``step_trees``, ``StepTrees`` and ``TreeCut``); ``trie_sets.py``
sits below both it and ``treecut.py``, so the imports form no circle.

Padding: ``set_tries(..., multiple=m)`` pads every *owner* segment to ceil(len/m)·m tokens: a
bound of the row the packer can add up over sets (the union of two sets has at most the owner
segments of each, and a run is a merge of owner segments, pad(a + b) <= pad(a) + pad(b)).
``row_tries`` counts the row itself (``micro_trees``' runs, or the samples flat where that wins,
``prefix.flat_wins``). ``depth_sq`` counts real tokens (Σ need² − start²), as ``PrefixTree.depth_sq``.

Guarantees: ``set_tries(..., multiple=1)`` equals ``micro_tree(...).num_tokens``/``depth_sq`` of
every set, ``micro_trees`` and ``row_tries`` equal ``micro_tree`` field by field / padded, never
above the members unshared (tests/test_trie.py, hypothesis).
Cost: O(pairs) (+ O(N log depth) tables); with m > 1 a deep lone climb still visits each level.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .prefix import PrefixTree, RowRules, flat_tree, flat_wins, merge_runs
from .treecut import StepTrees, TreeCut, cut_trees, forest_roots, step_trees
from .trie_sets import TrieSets, _Look, _NARROW, _distinct, _i64, _int_bincount, _links, _pad, forest_depths, set_tries

__all__ = ["TrieSets", "TreeCut", "StepTrees", "set_tries", "row_tries", "cut_trees", "step_trees", "forest_depths",
           "forest_roots", "micro_trees"]


# ------------------------------------------------------------------------------------------------
# micro_trees: the PrefixTree of many sets at once
# ------------------------------------------------------------------------------------------------


def micro_trees(parent: np.ndarray, shared: np.ndarray, lens: np.ndarray, members: Sequence[int] | np.ndarray,
                set_of: Sequence[int] | np.ndarray, num_sets: int, *,
                rules: RowRules | None = None) -> list[PrefixTree]:
    """``[micro_tree(parent, shared, lens, set k, rules=rules) for k in range(num_sets)]``,
    equal field by field (segments merged into runs, a flat row where that is smaller).

    The needs of every (set, owner) come from one level-by-level pass (as ``set_tries``, every
    pair recorded); a segment's parent is the nearest ancestor whose own segment starts below it
    (the owner of position s_a − 1: every ancestor is in the set's trie) and a member's anchor is
    itself or that ancestor, both by binary lifting over the forest; then ``prefix.merge_runs``
    over all sets at once. Cost: O(P) for the P (set, owner) pairs plus O(N log depth) for the
    lifting tables, a numpy step per level.
    """
    rows = _row_arrays(parent, shared, lens, members, set_of, num_sets, rules)
    seg_set, owners, par, st, end, mset, mem, anchor, flat = rows
    off = np.searchsorted(seg_set, np.arange(num_sets + 1))
    moff = np.searchsorted(mset, np.arange(num_sets + 1))
    parent, shared, lens = _i64(parent), _i64(shared), _i64(lens)
    par = par - np.where(par >= 0, off[seg_set], 0)   # indices local to each set's segments, all at once
    anchor = anchor - off[mset]
    out = []
    flat_l, off_l, moff_l = flat.tolist(), off.tolist(), moff.tolist()
    new = PrefixTree._trusted
    for k in range(num_sets):
        c, d = moff_l[k], moff_l[k + 1]
        if flat_l[k]:
            out.append(flat_tree(parent, shared, lens, mem[c:d]))
            continue
        a, b = off_l[k], off_l[k + 1]
        out.append(new(owners[a:b], par[a:b], st[a:b], end[a:b], mem[c:d], anchor[c:d]))
    return out


def row_tries(parent: np.ndarray, shared: np.ndarray, lens: np.ndarray, members: Sequence[int] | np.ndarray,
              set_of: Sequence[int] | np.ndarray, num_sets: int, *, rules: RowRules | None = None,
              depth: np.ndarray | None = None) -> TrieSets:
    """What each set's row holds (``micro_trees(..., rules=rules)``' rows, before the row
    multiple): its runs padded to ``rules.multiple``, or its members flat where that wins
    (``prefix.flat_wins``), and the attention work of that layout (``depth_sq``: Σ ⌈L/m⌉²·m² for a flat
    row). Without padding: ``set_tries`` (the trie is never larger than its members).
    Never more than Σ ⌈L/m⌉·m of the members."""
    rules = RowRules() if rules is None else rules
    if rules.multiple <= 1 and rules.row <= 1:
        return set_tries(parent, shared, lens, members, set_of, num_sets, depth=depth)
    m = int(rules.multiple)
    seg_set, _, _, st, end, mset, mem, _, flat = _row_arrays(parent, shared, lens, members, set_of, num_sets, rules)
    lens = _i64(lens)
    run = _int_bincount(seg_set, _pad(end - st, m), num_sets)
    dsq = np.bincount(seg_set, weights=(end * end - st * st).astype(np.float64), minlength=num_sets)
    pl = _pad(lens[mem], m)
    flat_tok = _int_bincount(mset, pl, num_sets)
    flat_dsq = np.bincount(mset, weights=(pl * pl).astype(np.float64), minlength=num_sets)  # as an unshared row
    return TrieSets(np.where(flat, flat_tok, run), np.where(flat, flat_dsq, dsq))


def _row_arrays(parent: np.ndarray, shared: np.ndarray, lens: np.ndarray, members: Sequence[int] | np.ndarray,
                set_of: Sequence[int] | np.ndarray, num_sets: int, rules: RowRules | None) -> tuple[np.ndarray, ...]:
    """The runs of every set's trie, concatenated set by set (``par``/``anchor`` global), the
    members (sorted per set) and per set whether its row is laid out flat (``prefix.flat_wins``):
    (seg_set, owners, par, start, end, member_set, member, anchor, flat)."""
    parent, shared, lens = _i64(parent), _i64(shared), _i64(lens)
    n = parent.size
    ep, start = _links(parent, shared)
    mkey = _distinct(_i64(set_of) * n + _i64(members)) if n else np.zeros(0, dtype=np.int64)
    keys, need = _owner_needs(ep, start, shared, lens, mkey, n)
    o = np.argsort(keys)
    keys, need = keys[o], need[o]
    sets, nodes = keys // n, keys % n
    st = start[nodes]
    up = _below(ep, start, np.where(st > 0, nodes, -1), st)         # owner of position s_a − 1
    par = np.where(st > 0, np.searchsorted(keys, sets * n + np.maximum(up, 0)), -1)
    mset, mem = mkey // n, mkey % n
    inside = lens[mem] <= start[mem]                                # ends inside its parent's prefix
    anchor_node = np.where(inside, _below(ep, start, np.where(inside, mem, -1), lens[mem]), mem)
    anchor = np.searchsorted(keys, mset * n + anchor_node)
    owners, par, st, end, anchor, heads = merge_runs(nodes, par, st, need, anchor)
    heads_set = sets[heads]
    flat = np.zeros(num_sets, dtype=bool)
    if rules is not None and rules != RowRules() and mem.size:
        m = int(rules.multiple)
        run = _int_bincount(heads_set, _pad(end - st, m), num_sets)
        work = _int_bincount(heads_set, end * end - st * st, num_sets)
        pl = _pad(lens[mem], m)
        count = np.bincount(mset, minlength=num_sets)
        flat = flat_wins((run, work), (_int_bincount(mset, pl, num_sets), _int_bincount(mset, pl * pl, num_sets)),
                         rules) & (count > 0)
    return heads_set, owners, par, st, end, mset, mem, anchor, flat
def _owner_needs(ep: np.ndarray, start: np.ndarray, shared: np.ndarray, lens: np.ndarray, mkey: np.ndarray,
                 n: int) -> tuple[np.ndarray, np.ndarray]:
    """(key, need) of every (set, node) whose need exceeds its start: one numpy step per level."""
    if mkey.size == 0:
        return mkey, mkey
    d = forest_depths(np.where(ep >= 0, ep, -1), np.where(ep >= 0, 1, 0))[mkey % n]
    order = np.argsort(-d, kind="stable")
    mkey, d = mkey[order], d[order]
    cuts = (np.flatnonzero(d[1:] != d[:-1]) + 1).tolist()
    inject = {int(d[lo]): (lo, hi) for lo, hi in zip([0] + cuts, cuts + [d.size])}
    k_out, r_out = [], []
    py_k: list[int] = []
    py_r: list[int] = []
    look: _Look | None = None
    key_l: list[int] | None = None
    pk: np.ndarray | list[int] = np.zeros(0, dtype=np.int64)
    pr: np.ndarray | list[int] = np.zeros(0, dtype=np.int64)
    for lvl in range(int(d[0]), -1, -1):
        lo, hi = inject.get(lvl, (0, 0))
        if len(pk) + hi - lo <= _NARROW:   # plain Python for a narrow level (a chain)
            if len(pk) + hi - lo == 0:
                continue
            look = look or _Look(ep, start, shared, n <= 8 * mkey.size)
            if key_l is None:
                key_l = mkey.tolist()
            need: dict[int, int] = {}
            for k, r in zip(pk if isinstance(pk, list) else pk.tolist(), pr if isinstance(pr, list) else pr.tolist()):
                if r > need.get(k, 0):
                    need[k] = r
            for k in key_l[lo:hi]:
                r = int(lens[k % n])
                if r > need.get(k, 0):
                    need[k] = r
            pk, pr = [], []
            nxt: dict[int, int] = {}
            for k, r in need.items():
                p, st, sh = look(k % n)
                if r > st:
                    py_k.append(k)
                    py_r.append(r)
                if p >= 0 and sh > 0:
                    kp = k - k % n + p
                    u = min(r, sh)
                    if u > nxt.get(kp, 0):
                        nxt[kp] = u
            pk, pr = list(nxt), list(nxt.values())
            continue
        pk_a = np.asarray(pk, dtype=np.int64)
        k = np.concatenate([pk_a, mkey[lo:hi]])
        r = np.concatenate([np.asarray(pr, dtype=np.int64), lens[mkey[lo:hi] % n]])
        if pk_a.size:
            o = np.argsort(k, kind="stable")
            k, r = k[o], r[o]
            first = np.flatnonzero(np.concatenate([[True], k[1:] != k[:-1]]))
            k, r = k[first], np.maximum.reduceat(r, first)
        nd = k % n
        own = r > start[nd]
        k_out.append(k[own])
        r_out.append(r[own])
        p = ep[nd]
        u = np.minimum(r, shared[nd])
        go = (p >= 0) & (u > 0)
        pk, pr = (k[go] // n) * n + p[go], u[go]
    k_out.append(np.array(py_k, dtype=np.int64))
    r_out.append(np.array(py_r, dtype=np.int64))
    return np.concatenate(k_out), np.concatenate(r_out)


def _below(ep: np.ndarray, start: np.ndarray, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Per x (>= 0), the nearest strict ancestor whose segment starts below ``pos``: the owner of
    position pos − 1 on x's path (exists: a root starts at 0). Binary lifting on min start."""
    res = np.full(x.size, -1, dtype=np.int64)
    ok = np.flatnonzero(x >= 0)
    if ok.size == 0:
        return res
    y, thr = ep[x[ok]], pos[ok]
    anc, mn = [ep], [start]
    while True:   # tables up to the deepest jump needed
        a, m = anc[-1], mn[-1]
        if not (a >= 0).any():
            break
        anc.append(np.where(a >= 0, a[np.maximum(a, 0)], -1))
        mn.append(np.where(a >= 0, np.minimum(m, m[np.maximum(a, 0)]), m))
    for k in range(len(anc) - 1, -1, -1):
        skip = mn[k][y] >= thr          # all 2^k nodes from y start at or above pos: none holds it
        y = np.where(skip, anc[k][y], y)
    res[ok] = y
    return res
