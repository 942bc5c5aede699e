"""Shared prefixes: the prefix forest of a batch, the trie a micro-batch holds, and how to find them.

Design note. ``Batch(prefix_parent=p, shared_prefix_lens=s)`` declares that sample i's first
s_i tokens equal those of sample p_i (an earlier sample; -1: none). So every token position
(i, t) has a *canonical owner*: follow parents while t < s, i.e. the earliest sample whose own
tokens include it. A set S of samples (a micro-batch) holds each canonical token once — a
prefix tree (trie) of segments:

1. need: every member needs its whole sequence, need[i] = L_i; a sample needs positions
   [0, min(need, s)) of its parent, so need[p] = max(need[p], min(need[i], s_i)), propagated
   from the deepest samples up (parents are earlier, so descending index order works);
2. each owner a with need[a] > start[a] (start = s_a, or 0 for a root) holds the *owner
   segment* [start[a], need[a]) of its own positions; owners may be ancestors outside S (their
   tokens come from a descendant in S, which has the same tokens there);
3. a segment starts only where paths branch: an owner segment that begins exactly where its
   parent's ends, as its only continuation there, is merged into it (``merge_runs``), so a
   sample stored with its ancestors (step-wise turns) is one segment — padded once, one
   attention call — held by its deepest owner's sequence;
4. the trie's size is Σ (need − start) tokens (``PrefixTree.num_tokens``), its attention work
   Σ (need² − start²) = Σ over tokens of (2·position + 1), which is L² for a lone sample
   (``PrefixTree.depth_sq``: the varlen attention term of a cost model, per token depth).

Guarantees: ``micro_tree`` is a pure function of the batch's forest, the member set (sorted
members give the same tree) and the plan's padding multiples (where a row is laid out flat
instead, ``flat_wins``, it never holds more than its samples unshared), so a plan re-derives it
on load instead of storing it.
``find_shared_prefixes`` finds, for every sample, the longest common prefix with any earlier
sample, exactly (64-bit prefix hashes, then each claimed prefix is verified token by token).
Cost: ``micro_tree`` O(|S| + ancestors) Python steps; ``find_shared_prefixes`` O(N log N) numpy
for N tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ._intmath import round_up
from .errors import PlanError

__all__ = ["PrefixTree", "micro_tree", "owner_tree", "merge_runs", "flat_tree", "flat_is_smaller", "flat_wins",
           "RowRules", "find_shared_prefixes", "forest_of", "dfs_order", "dfs_orders", "sample_forest"]


@dataclass(frozen=True)
class PrefixTree:
    """The segments of one micro-batch's prefix trie (arrays aligned, parents before children).

    Attributes:
        owners: int64 global sample ids whose sequence holds each segment's positions (for a run
            merged along a chain, its deepest owner); ordered by the first owner of each segment (a
            row laid out flat: its samples in depth-first order).
        parent: int64 index into ``owners`` of the segment holding position ``start - 1`` of this
            segment's path (where it branches off), -1 for a root segment (start 0).
        start, end: int64 the segment's positions [start, end) in its owner's sequence.
        members: int64 the micro-batch's samples, sorted.
        anchor: int64 index into ``owners`` of the segment holding each member's LAST token (a
            member entirely inside another's prefix owns no segment of its own).
    """

    owners: np.ndarray
    parent: np.ndarray
    start: np.ndarray
    end: np.ndarray
    members: np.ndarray
    anchor: np.ndarray

    @property
    def num_tokens(self) -> int:
        """Unique tokens the micro-batch holds."""
        return int((self.end - self.start).sum())

    @property
    def depth_sq(self) -> int:
        """Σ over tokens of (2·position + 1): the attention work, L² for one sample alone."""
        return int((self.end * self.end - self.start * self.start).sum())

    @classmethod
    def _trusted(cls, owners: np.ndarray, parent: np.ndarray, start: np.ndarray, end: np.ndarray,
                 members: np.ndarray, anchor: np.ndarray) -> PrefixTree:
        """Internal fast path (``trie.micro_trees``: thousands per step): the fields as given, int64
        arrays already; frozen, so ``__setattr__`` is bypassed with one dict."""
        self = object.__new__(cls)
        object.__setattr__(self, "__dict__", {"owners": owners, "parent": parent, "start": start, "end": end,
                                              "members": members, "anchor": anchor})
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PrefixTree):
            return NotImplemented
        return all(np.array_equal(getattr(self, f), getattr(other, f))
                   for f in ("owners", "parent", "start", "end", "members", "anchor"))

    def path_rows(self, offsets: np.ndarray, k: int, last: int) -> np.ndarray:
        """Row indices (in a row laying segments out at ``offsets``) of positions 0..last of the
        path through segment k, in position order."""
        parts = []
        while k >= 0:
            a = int(self.start[k])
            parts.append(np.arange(offsets[k], offsets[k] + last - a + 1, dtype=np.int64))
            last, k = a - 1, int(self.parent[k])
        return np.concatenate(parts[::-1]) if parts else np.zeros(0, dtype=np.int64)

    __hash__ = None  # type: ignore[assignment]


def micro_tree(parent: np.ndarray, shared: np.ndarray, lens: np.ndarray, members: Sequence[int] | np.ndarray, *,
               rules: RowRules | None = None) -> PrefixTree:
    """The trie the samples ``members`` form under the forest (``parent``, ``shared``, ``lens``),
    one segment per run (a segment starts only where paths branch, ``merge_runs``). Under the
    plan's ``rules`` (padding multiples, static CP; None: none) the row is laid out flat instead
    where that holds fewer tokens or costs less attention work (``flat_wins``), so a row never
    holds more than its samples unshared.

    O(|S| + ancestors) plus a sort of the touched samples (``owner_tree``), then ``merge_runs``."""
    tree = owner_tree(parent, shared, lens, members)
    if not tree.members.size:
        return tree
    o, p, st, en, an, _ = merge_runs(tree.owners, tree.parent, tree.start, tree.end, tree.anchor)
    tree = PrefixTree(o, p, st, en, tree.members, an)
    if rules is None or rules == RowRules() or not flat_is_smaller(tree, np.asarray(lens, dtype=np.int64), rules):
        return tree
    return flat_tree(parent, shared, lens, tree.members)


def owner_tree(parent: np.ndarray, shared: np.ndarray, lens: np.ndarray,
               members: Sequence[int] | np.ndarray) -> PrefixTree:
    """The trie of ``members`` with one segment per owner sample (before ``merge_runs``): the
    segments ``trie.set_tries`` pads, a bound of the row that adds up over sets.

    O(|S| + ancestors) plus a sort of the touched samples: the samples whose tokens the members
    reach (each member climbs until a sample already reached), then ``need`` flows up once in
    descending sample order (parents are earlier, so children come first)."""
    lens = np.asarray(lens, dtype=np.int64)
    mem = sorted(set(np.asarray(members, dtype=np.int64).tolist()))
    if not mem:
        z = np.zeros(0, dtype=np.int64)
        return PrefixTree(z, z, z, z, z, z)
    arr = np.asarray(mem, dtype=np.int64)
    L = lens[arr].tolist()
    need: dict[int, int] = dict(zip(mem, L))
    up: dict[int, int] = {}            # touched sample -> its parent, where it shares tokens with it
    start_of: dict[int, int] = {}      # each touched sample's segment start (s_a, or 0 for a root)
    for i, p, s in zip(mem, parent[arr].tolist(), shared[arr].tolist()):
        a = i
        while True:
            start_of[a] = s if p >= 0 else 0
            if p < 0 or s <= 0:
                break
            up[a] = p
            if p in start_of or p in need:   # reached: its own climb is done (or will be)
                break
            a = p
            p, s = int(parent[a]), int(shared[a])
    for a in sorted(start_of, reverse=True):   # children (later samples) before parents
        p = up.get(a, -1)
        if p >= 0:
            r = min(need.get(a, 0), start_of[a])
            if r > need.get(p, 0):
                need[p] = r
    owners = sorted(a for a, st in start_of.items() if need.get(a, 0) > st)
    pos = {a: k for k, a in enumerate(owners)}
    par, start, end = [], [], []
    for a in owners:
        s = start_of[a]
        q = -1
        if s > 0:  # the segment continues the canonical owner of position s - 1 on a's path
            q, t = up[a], s - 1
            while t < start_of[q]:
                q = up[q]
        par.append(pos[q] if q >= 0 else -1)
        start.append(s)
        end.append(need[a])
    anchor = []
    for i, n in zip(mem, L):  # the segment holding the member's last token
        q, t = i, n - 1
        while t < start_of[q]:
            q = up[q]
        anchor.append(pos[q])
    i64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
    return PrefixTree(i64(owners), i64(par), i64(start), i64(end), arr, i64(anchor))


def merge_runs(owners: np.ndarray, par: np.ndarray, start: np.ndarray, end: np.ndarray,
               anchor: np.ndarray) -> tuple[np.ndarray, ...]:
    """Owner segments merged into runs: a segment that starts exactly where its parent segment
    ends, as that parent's only such child, continues it (the path does not branch there), so
    the two are one segment. ``par``/``anchor`` index the given segments (parents first; several
    trees may be concatenated, ``par`` global). A run is held by its deepest owner's sequence
    (which equals its ancestors' on the shared positions) and keeps its head's parent; runs stay
    in the order of their heads, so parents still come first. Returns (owners, par, start, end,
    anchor, heads) of the runs, ``heads`` the given segment each run starts with. O(S log depth)
    numpy."""
    n = par.size
    has = par >= 0
    pp = np.where(has, par, 0)
    cand = has & (end[pp] == start)
    cont = cand & (np.bincount(par[cand], minlength=n)[pp] == 1) if n else cand
    if not cont.any():
        return owners, par, start, end, anchor, np.arange(n, dtype=np.int64)
    head = np.where(cont, par, np.arange(n, dtype=np.int64))
    while True:   # pointer doubling to each chain's head
        nxt = head[head]
        if np.array_equal(nxt, head):
            break
        head = nxt
    has_child = np.zeros(n, dtype=bool)
    has_child[par[cont]] = True
    tails = np.flatnonzero(~has_child)
    tail_of = np.empty(n, dtype=np.int64)
    tail_of[head[tails]] = tails
    heads = np.flatnonzero(~cont)
    index = np.full(n, -1, dtype=np.int64)
    index[heads] = np.arange(heads.size, dtype=np.int64)
    run_of = index[head]
    t = tail_of[heads]
    hp = par[heads]
    new_par = np.where(hp >= 0, run_of[np.maximum(hp, 0)], -1)
    return owners[t], new_par, start[heads], end[t], run_of[anchor], heads


class RowRules(NamedTuple):
    """What decides a tree row's layout (``Footprint.row_rules``): ``pad_to_multiple_of`` (each
    segment padded to it) and ``pad_row_to_multiple_of``."""

    multiple: int = 1
    row: int = 1


def flat_wins(trie: tuple[Any, Any], flat: tuple[Any, Any], rules: RowRules) -> Any:
    """True where a row is laid out flat. ``trie`` and ``flat`` are (tokens before the row
    multiple, attention work) of the trie's padded runs and of the members flat (each
    its own sequence padded to the multiple; work Σ ⌈L/m⌉²·m², as an unshared row is priced). The
    trie is kept only where it is no larger on every count the cost and the cap see: tokens, the
    row rounded to ``rules.row`` (so no more per GPU of a CP group either: ⌈row/c⌉), and the
    attention work plus the row pad's (one more sequence). So a row never holds more, nor costs
    more under any cost model with non-negative terms, than its samples unshared. Ints or int
    arrays."""
    T, W = (np.asarray(x) for x in trie)
    F, V = (np.asarray(x) for x in flat)
    r = rules.row
    RT, RF = round_up(T, r), round_up(F, r)
    out = (F < T) | (RF < RT) | (V + (RF - F) ** 2 < W + (RT - T) ** 2)
    return bool(out) if out.ndim == 0 else out


def flat_is_smaller(tree: PrefixTree, lens: np.ndarray, rules: RowRules) -> bool:
    """``flat_wins`` for one trie (its runs padded to ``rules.multiple``)."""
    m = int(rules.multiple)
    run = int(round_up(tree.end - tree.start, m).sum())
    pl = round_up(lens[tree.members], m)
    return flat_wins((run, tree.depth_sq), (int(pl.sum()), int((pl * pl).sum())), rules)


def flat_tree(parent: np.ndarray, shared: np.ndarray, lens: np.ndarray, members: np.ndarray) -> PrefixTree:
    """The row of ``members`` (sorted) without sharing: each member one root segment [0, L), in
    depth-first order (``dfs_order``, the order a micro-batch lists its samples), so the row is
    laid out as the same samples unshared."""
    members = np.asarray(members, dtype=np.int64)
    order = dfs_order(parent, shared, members)
    anchor = np.empty(members.size, dtype=np.int64)
    anchor[np.searchsorted(members, order)] = np.arange(order.size, dtype=np.int64)
    return PrefixTree(order, np.full(order.size, -1, dtype=np.int64), np.zeros(order.size, dtype=np.int64),
                      np.asarray(lens, dtype=np.int64)[order], members, anchor)


def forest_of(batch: Any) -> tuple[np.ndarray, np.ndarray]:
    """(prefix_parent, shared_prefix_lens) of a Batch; a flat forest (no sharing) when none is declared."""
    if batch.prefix_parent is None:
        n = batch.num_samples
        return np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.int64)
    return batch.prefix_parent, batch.shared_prefix_lens


def sample_forest(parent: np.ndarray, shared: np.ndarray, samples: np.ndarray) -> tuple[list[int], dict[int, list[int]]]:
    """(roots, children) of ``samples`` under their nearest ancestor in the set (through a positive
    shared prefix), children in sample order. O(|S| + ancestors climbed)."""
    mem = sorted(set(np.asarray(samples, dtype=np.int64).tolist()))
    members = set(mem)
    arr = np.asarray(mem, dtype=np.int64)
    children: dict[int, list[int]] = {}
    roots: list[int] = []
    for i, a, s in zip(mem, parent[arr].tolist() if mem else [], shared[arr].tolist() if mem else []):
        if s <= 0:
            a = -1
        while a >= 0 and a not in members:
            a = int(parent[a]) if shared[a] > 0 else -1
        if a >= 0:
            children.setdefault(a, []).append(i)
        else:
            roots.append(i)
    return roots, children


def dfs_order(parent: np.ndarray, shared: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """``samples`` in depth-first pre-order of the forest (children by sample index), so every
    subtree is contiguous and samples sharing long prefixes sit together. O(|S| + ancestors)."""
    roots, children = sample_forest(parent, shared, samples)
    if not children:
        return np.asarray(roots, dtype=np.int64)
    out: list[int] = []
    stack = roots[::-1]
    while stack:
        i = stack.pop()
        out.append(i)
        kids = children.get(i)
        if kids:
            stack.extend(kids[::-1])
    return np.asarray(out, dtype=np.int64)


def dfs_orders(parent: np.ndarray, shared: np.ndarray, members: np.ndarray, set_of: np.ndarray,
               num_sets: int) -> list[np.ndarray]:
    """``[dfs_order(parent, shared, set k) for k in range(num_sets)]`` (:func:`dfs_flat` cut set by set)."""
    flat, bounds = dfs_flat(parent, shared, members, set_of, num_sets)
    b = bounds.tolist()
    return [flat[b[k]:b[k + 1]] for k in range(num_sets)]


def _lex_order(a: np.ndarray, b: np.ndarray, c: np.ndarray, n: int, *, packed: bool) -> np.ndarray:
    """``c[np.lexsort((c, b, a))]`` for int64 keys with b, c in [0, n) and the triples distinct:
    ``c`` in the order of (a, b, c). ``packed`` (when max(a)·n² fits int64): the key
    (a·n + b)·n + c — ``c`` itself where that key is ascending already (GRPO micro-batches: a
    sample's root precedes it), else one plain sort of the key, whose low part is c (distinct keys
    need no stable sort nor permutation)."""
    if not packed:
        return c[np.lexsort((c, b, a))]
    key = a * n
    key += b
    key *= n
    key += c
    if bool((key[1:] > key[:-1]).all()):
        return c
    key.sort()
    key %= n
    return key


def dfs_flat(parent: np.ndarray, shared: np.ndarray, members: np.ndarray, set_of: np.ndarray,
             num_sets: int) -> tuple[np.ndarray, np.ndarray]:
    """Every set's ``dfs_order``, concatenated set after set, and the bounds of set k
    (``flat[bounds[k]:bounds[k + 1]]``): sets whose sample forest is one level deep (a root and
    samples hanging from it, or from a root outside the set: GRPO micro-batches) in one sort by
    (set, root, sample); the others one by one. A sample's parent is looked up in the sets by a
    table over the batch where every sample is in one set (the planner's bins), else by binary
    search. O(M log M)."""
    members, set_of = np.asarray(members, dtype=np.int64), np.asarray(set_of, dtype=np.int64)
    n = parent.size
    key = set_of * n
    key += members
    key.sort()
    step = key[1:] != key[:-1]
    key = key if step.all() else key[np.concatenate([[True], step])]
    sets, x = np.divmod(key, n) if n else (key, key)
    ep = np.where((parent >= 0) & (shared > 0), parent, -1)
    p1 = ep[x]
    has = p1 >= 0
    q = np.maximum(p1, 0)
    at = np.full(n, -1, dtype=np.int64)               # each sample's place in key, if it is in one set only
    at[x] = np.arange(x.size)
    if int(np.count_nonzero(at >= 0)) == x.size:      # every sample in one set
        pos = at[q]
        held = has & (pos >= 0)
        held &= sets[pos] == sets                                    # p1 is in the same set
    else:
        pos = np.searchsorted(key, sets * n + q)
        held = np.zeros(x.size, dtype=bool)
        held[has] = key[np.minimum(pos, key.size - 1)][has] == (sets * n + p1)[has]
        pos[~held] = 0
    root = ~has | (~held & (ep[q] < 0))                              # nothing above it in the set
    slow = ~held & ~root                                             # an outside sample in between
    slow |= held & ~root[pos]                                        # two levels deep
    bad = np.zeros(num_sets, dtype=bool)
    bad[sets[slow]] = True
    x_o = _lex_order(sets, np.where(root, x, p1), x, n, packed=num_sets * n * n < 2 ** 62)
    cut = np.searchsorted(sets, np.arange(num_sets + 1))            # sets ascending (the key's order)
    for k in np.flatnonzero(bad).tolist():  # deeper forests: the set's own depth-first walk, in place
        lo, hi = int(cut[k]), int(cut[k + 1])
        x_o[lo:hi] = dfs_order(parent, shared, x_o[lo:hi])
    return x_o, cut


# ------------------------------------------------------------------------------------------------
# find_shared_prefixes
# ------------------------------------------------------------------------------------------------

_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd, so invertible mod 2**64
_MIX = np.uint64(0xD6E8FEB86659FD93)


def _inverse_u64(a: np.uint64) -> np.uint64:
    """a⁻¹ mod 2**64 for odd a (Newton iteration on the 2-adic inverse)."""
    x = np.uint64(1)
    with np.errstate(over="ignore"):
        for _ in range(7):
            x = x * (np.uint64(2) - a * x)
    return x


def find_shared_prefixes(token_ids: Sequence[Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(prefix_parent, shared_prefix_lens)`` for ``Batch``: each sample's longest common prefix
    with ANY earlier sample, and one such sample (the earliest); -1 and 0 when it shares nothing.

    ``token_ids[i]`` is sample i's 1-D sequence of integer token ids (list, numpy array, or a
    CPU tensor). Vectorised: 64-bit polynomial prefix hashes of every prefix (one cumulative sum
    over all tokens), the earliest sample holding each (length, hash), and a binary search over
    lengths for all samples at once; every claimed prefix is then verified token by token, so a
    hash collision can only shorten a result, never make it wrong.
    """
    seqs = [_as_ids(t, i) for i, t in enumerate(token_ids)]
    n = len(seqs)
    lens = np.array([s.size for s in seqs], dtype=np.int64)
    parent = np.full(n, -1, dtype=np.int64)
    shared = np.zeros(n, dtype=np.int64)
    if n < 2 or lens.sum() == 0:
        return parent, shared
    flat = np.concatenate(seqs).astype(np.uint64)
    owner = np.repeat(np.arange(n, dtype=np.int64), lens)
    offs = np.concatenate([[0], np.cumsum(lens)[:-1]])
    pos = np.arange(flat.size, dtype=np.int64) - np.repeat(offs, lens)      # 0-based position in sample
    inv = _inverse_u64(_BASE)
    powers = np.empty(int(lens.max()), dtype=np.uint64)
    powers[0] = np.uint64(1)
    with np.errstate(over="ignore"):
        if powers.size > 1:
            powers[1:] = inv
            powers = np.cumprod(powers, dtype=np.uint64)                     # B^-k, wrapping mod 2**64
        terms = (flat + np.uint64(1)) * powers[pos]
        csum = np.cumsum(terms, dtype=np.uint64)
        base = np.concatenate([[np.uint64(0)], csum])[np.repeat(offs, lens)]
        h = csum - base                                                      # hash of prefix of length pos+1
        key = h + (pos.astype(np.uint64) + np.uint64(1)) * _MIX               # (length, hash) in one word
    order = np.argsort(key, kind="stable")                                   # stable: earliest sample first
    skey = key[order]
    first_owner = owner[order]
    starts = np.concatenate([[True], skey[1:] != skey[:-1]])
    uniq = skey[starts]
    earliest = first_owner[starts]                                           # earliest sample per key
    # binary search per sample over the prefix length l in [0, L_i]: is prefix l held earlier?
    lo, hi = np.zeros(n, dtype=np.int64), lens.copy()
    while True:
        active = lo < hi
        if not active.any():
            break
        mid = (lo + hi + 1) // 2
        idx = np.flatnonzero(active)
        k = key[offs[idx] + mid[idx] - 1]
        at = np.searchsorted(uniq, k)
        ok = (at < uniq.size) & (uniq[np.minimum(at, uniq.size - 1)] == k)
        ok &= earliest[np.minimum(at, uniq.size - 1)] < idx
        lo[idx] = np.where(ok, mid[idx], lo[idx])
        hi[idx] = np.where(ok, hi[idx], mid[idx] - 1)
    has = np.flatnonzero(lo > 0)
    if has.size:
        k = key[offs[has] + lo[has] - 1]
        at = np.searchsorted(uniq, k)
        parent[has] = earliest[at]
        shared[has] = lo[has]
        for i in has.tolist():  # verify (and repair a hash collision by the true common prefix)
            a, b = seqs[i][: shared[i]], seqs[parent[i]][: shared[i]]
            if not np.array_equal(a, b):
                diff = np.flatnonzero(a != b)
                shared[i] = int(diff[0])
                if shared[i] == 0:
                    parent[i] = -1
    return parent, shared


def _as_ids(t: Any, i: int) -> np.ndarray:
    if hasattr(t, "detach"):  # a torch tensor, without importing torch
        t = t.detach().cpu().numpy()
    arr = np.asarray(t)
    if arr.ndim != 1:
        raise PlanError(f"token_ids[{i}] must be a 1-D sequence of token ids, got shape {arr.shape}.")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise PlanError(f"token_ids[{i}] must hold integer token ids, got dtype {arr.dtype}.")
    if arr.size and arr.min() < 0:
        raise PlanError(f"token_ids[{i}] holds a negative token id ({int(arr.min())}); token ids are >= 0.")
    return arr.astype(np.int64, copy=False)
