"""Cutting star trees (a root and leaves hanging directly from it: GRPO groups) in numpy.

Design note. ``treecut.py``'s depth-first greedy, specialised to stars with multiple 1, all trees
in lockstep over their children: the root comes first (its subtree is over the limit, so it is
placed alone), then each child c in order covers min(s_c, H) of its tokens, H being how far the
part reaches into the root's sequence (L_root when the root is in it, else the largest s of its
children); the child joins if the rest fits, else starts a fresh part (L_c tokens). Round r takes
every tree's r-th child; with equal groups the rounds are the rows of the children × trees grid
(:func:`_grid_rounds`), otherwise one gather per round (:func:`_ragged_rounds`). A part's trie is
closed-form: H + Σ (L_c − s_c) tokens, H² + Σ (L_c² − s_c²) depth_sq (:func:`_star_parts`).

Guarantees: the parts, and their order, of the greedy of ``treecut.py`` (tests/test_trie.py
against its exact reference). Cost: O(children per star) numpy rounds over the stars; stars of
more than ``_STAR_MAX`` children go to the Python greedy instead.
"""

from __future__ import annotations

import numpy as np

from .trie_sets import _ascending, _distinct

def _star_parts(a: np.ndarray, x: np.ndarray, kid: np.ndarray, shared: np.ndarray, lens: np.ndarray,
                A: int) -> tuple[np.ndarray, ...]:
    """(atoms, tokens, depth_sq, least member) of the star parts of members ``x`` (part ``a`` of
    each, among ``A``; ``kid``: not its tree's root; multiple 1), the atoms ascending: a part
    holds the root's positions [0, H) — H = L_root when the root is in it, else the longest prefix
    a child shares with the root — and each child c's own [s_c, L_c), so tokens = H + Σ (L_c − s_c)
    and depth_sq = H² + Σ (L_c² − s_c²) (``set_tries`` of the part, exactly: integers). Members
    grouped by part already (``a`` non-decreasing: the planner's samples come sorted) are reduced
    run by run, others scattered."""
    L = lens[x]
    s = np.where(kid, np.minimum(shared[x], L), L)   # a root reaches its own L and owns nothing past H
    own, sq = L - s, L * L - s * s
    if _ascending(a):
        heads = np.flatnonzero(np.concatenate([[True], a[1:] != a[:-1]]))
        H = np.maximum(np.maximum.reduceat(s, heads), 0)
        return (a[heads], H + np.add.reduceat(own, heads), (H * H + np.add.reduceat(sq, heads)).astype(np.float64),
                np.minimum.reduceat(x, heads))
    at = _distinct(a)
    H, tok, sq_a = np.zeros(A, dtype=np.int64), np.zeros(A, dtype=np.int64), np.zeros(A, dtype=np.int64)
    first = np.full(A, np.iinfo(np.int64).max, dtype=np.int64)
    np.maximum.at(H, a, s)
    np.add.at(tok, a, own)
    np.add.at(sq_a, a, sq)
    np.minimum.at(first, a, x)
    return at, (H + tok)[at], (H * H + sq_a)[at].astype(np.float64), first[at]


_STAR_MAX = 64   # stars with more children are cut by the Python greedy (fewer, longer lockstep rounds)


def _stars(ep_u: np.ndarray, near: np.ndarray, root: np.ndarray, tree: np.ndarray, cut: np.ndarray) -> np.ndarray:
    """Trees to cut that are stars: every other member a leaf whose parent is the root itself."""
    kid = near >= 0
    bad = kid & ((near != root) | (ep_u != near))
    nt = cut.size
    return cut & (np.bincount(tree[bad], minlength=nt) == 0) & (np.bincount(tree[kid], minlength=nt) <= _STAR_MAX)


def _cut_stars(star: np.ndarray, roots: np.ndarray, tree: np.ndarray, uniq: np.ndarray, near: np.ndarray,
               shared: np.ndarray, lens: np.ndarray, limit: int, local: np.ndarray, count: np.ndarray) -> None:
    """The depth-first greedy on star trees, all trees in lockstep over their children (numpy).

    In a star the root comes first (its subtree is too large: it is placed alone), then each
    child c in order covers min(s_c, H) of its tokens, H being how far the part's members reach
    into the root's sequence (L_root if the root is in the part, else the largest s of its
    children): the child joins if the rest fits, else it starts a fresh part (L_c tokens).
    Round r takes the r-th child of every tree that has one; when every tree has as many
    children (GRPO groups) the rounds are the rows of the children × trees grid."""
    count[star] = 1                                   # the root's part
    kids = np.flatnonzero(star[tree] & (near >= 0))
    if not kids.size:
        return
    kt = tree[kids]
    if not _ascending(kt):
        o = np.argsort(kt, kind="stable")
        kids, kt = kids[o], kt[o]
    heads = np.flatnonzero(np.concatenate([[True], kt[1:] != kt[:-1]]))
    sizes = np.diff(np.concatenate([heads, [kids.size]]))
    trees = kt[heads]                                  # the stars with children, ascending; compact ids 0 .. nt − 1
    nt, c0 = trees.size, int(sizes[0])
    if (sizes == c0).all():
        order = kids.reshape(nt, c0).T.ravel()        # round by round
        x = uniq[order]
        part, local[order] = _grid_rounds(lens[roots[trees]], shared[x].reshape(c0, nt), lens[x].reshape(c0, nt),
                                          limit)
    else:
        rank = np.arange(kids.size) - np.repeat(heads, sizes)
        by_rank = np.argsort(rank, kind="stable")
        order = kids[by_rank]
        x = uniq[order]
        bounds = [0] + (np.flatnonzero(np.diff(rank[by_rank])) + 1).tolist() + [kids.size]
        part, local[order] = _ragged_rounds(lens[roots[trees]], shared[x], lens[x],
                                            np.repeat(np.arange(nt), sizes)[by_rank], bounds, limit)
    count[trees] = part + 1


def _grid_rounds(T: np.ndarray, S: np.ndarray, L: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_cut_stars`' rounds when every tree has as many children: row r of ``S``/``L`` (shared
    and own lengths) holds each tree's r-th child, ``T`` the roots' lengths. (parts per tree − 1,
    each child's part, row by row)."""
    H = T
    part = np.zeros(T.size, dtype=np.int64)
    parts = np.empty(S.shape, dtype=np.int64)
    for r in range(S.shape[0]):
        s, ln = S[r], L[r]
        grown = T + ln - np.minimum(s, H)
        fresh = grown > limit
        part += fresh
        T = np.where(fresh, ln, grown)
        H = np.where(fresh, s, np.maximum(H, s))
        parts[r] = part
    return part, parts.ravel()


def _ragged_rounds(T: np.ndarray, S: np.ndarray, L: np.ndarray, which: np.ndarray, bounds: list[int],
                   limit: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_cut_stars`' rounds in general: children ``bounds[r]:bounds[r + 1]`` are round r's, of
    trees ``which`` (compact ids), ``T`` the roots' lengths. (parts per tree − 1, each child's part)."""
    T, H = T.copy(), T.copy()
    part = np.zeros(T.size, dtype=np.int64)
    out = np.empty(S.size, dtype=np.int64)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        t = which[lo:hi]
        s, ln = S[lo:hi], L[lo:hi]
        Ht = H[t]
        grown = T[t] + ln - np.minimum(s, Ht)
        fresh = grown > limit
        part[t] += fresh
        T[t] = np.where(fresh, ln, grown)
        H[t] = np.where(fresh, s, np.maximum(Ht, s))
        out[lo:hi] = part[t]
    return part, out
