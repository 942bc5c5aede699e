"""microplan.trie / treecut against slow references: tries built by ``micro_tree`` set by set, and
the depth-first greedy cut as main's reference ``trie.cut_trees`` writes it (per-member walks to
the root, a copy of the part per subtree trial: :func:`ref_cut`).

Forests are drawn in the shapes the planner meets: GRPO groups (a prompt and n children),
append-only chains (each sample continues the previous one whole), edited chains (a sample
keeps only part of the previous one), random branching trees; members are any subset (so
ancestors outside the set are common) and are spread over several sets.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from microplan.prefix import RowRules, dfs_flat, dfs_order, dfs_orders, micro_tree, owner_tree, sample_forest
from microplan.trie import cut_trees, forest_depths, micro_trees, row_tries, set_tries

SHAPES = ("grpo", "append", "edited", "branching", "mixed")


def forest(rng: np.random.Generator, n: int, shape: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(parent, shared, lens) of a valid prefix forest of n samples (parents earlier, shared <=
    both lengths, shared 0 exactly where there is no parent, or a parent sharing nothing)."""
    lens = rng.integers(1, 40, size=n).astype(np.int64)
    parent = np.full(n, -1, dtype=np.int64)
    shared = np.zeros(n, dtype=np.int64)
    for i in range(1, n):
        if shape == "grpo":
            g = int(rng.integers(2, 9))
            p = i - i % g
            if p == i:
                continue
            lens[i] = lens[p] + int(rng.integers(0, 30))
            parent[i], shared[i] = p, lens[p] if rng.random() < 0.8 else int(rng.integers(1, lens[p] + 1))
            continue
        if shape in ("append", "edited"):
            p = i - 1
            if rng.random() < 0.05:
                continue
        elif shape == "branching":
            p = int(rng.integers(max(0, i - 6), i))
        else:
            p = int(rng.integers(0, i)) if rng.random() < 0.8 else -1
            if p < 0:
                continue
        if shape == "append":
            lens[i] = lens[p] + int(rng.integers(0, 12))
            s = int(lens[p])
        else:
            s = int(rng.integers(0, min(lens[i], lens[p]) + 1))
        if s > 0 or rng.random() < 0.1:
            parent[i], shared[i] = p, s     # a parent that shares nothing is a root in effect
    return parent, shared, lens


def padded(tree, m: int) -> int:
    return int((-(-(tree.end - tree.start) // m) * m).sum())


@st.composite
def forests(draw, max_n: int = 40):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    n = draw(st.integers(1, max_n))
    shape = draw(st.sampled_from(SHAPES))
    return rng, (*forest(rng, n, shape),)


@given(data=forests(), num_sets=st.integers(1, 6), multiple=st.sampled_from([1, 2, 8]),
       density=st.sampled_from([0.1, 0.5, 1.0]))
def test_set_tries_match_micro_tree_per_set(data, num_sets, multiple, density):
    rng, (parent, shared, lens) = data
    n = parent.size
    members, set_of = [], []
    for k in range(num_sets):
        mine = np.flatnonzero(rng.random(n) < density)
        if k == 0 and rng.random() < 0.5:
            mine = mine[:1]                  # lone members take the fast path
        members += mine.tolist()
        set_of += [k] * mine.size
    got = set_tries(parent, shared, lens, members, set_of, num_sets, multiple=multiple)
    assert got.tokens.dtype == np.int64 and got.depth_sq.dtype == np.float64
    for k in range(num_sets):
        mine = [i for i, s in zip(members, set_of) if s == k]
        if not mine:
            assert got.tokens[k] == 0 and got.depth_sq[k] == 0
            continue
        t = owner_tree(parent, shared, lens, mine)   # set_tries pads owner segments: the packing bound
        assert got.tokens[k] == padded(t, multiple)
        assert got.depth_sq[k] == t.depth_sq
        if multiple == 1:
            assert got.tokens[k] == t.num_tokens == micro_tree(parent, shared, lens, mine).num_tokens


@given(data=forests(), num_sets=st.integers(1, 6), multiple=st.sampled_from([1, 2, 8]),
       density=st.sampled_from([0.1, 0.5, 1.0]), row=st.sampled_from([1, 4]))
def test_row_tries_match_the_rows_micro_tree_lays_out(data, num_sets, multiple, density, row):
    """row_tries is what micro_tree(..., multiple) lays out: its runs padded (or the flat row), the
    attention work of that layout; never more than the members unshared, and never a longer row
    (rounded to the row multiple, what ``packing_cap`` bounds) than the owner-segment bound the
    packer uses. A flat row may hold more tokens than that bound before the row multiple: flat
    wins on attention work when the shared tokens are few (two samples sharing 1 token: trie 90,
    flat 91, both rows 92 at a multiple of 4)."""
    rng, (parent, shared, lens) = data
    n = parent.size
    members, set_of = [], []
    for k in range(num_sets):
        mine = np.flatnonzero(rng.random(n) < density)
        members += mine.tolist()
        set_of += [k] * mine.size
    rules = RowRules(multiple, row)
    got = row_tries(parent, shared, lens, members, set_of, num_sets, rules=rules)
    bound = set_tries(parent, shared, lens, members, set_of, num_sets, multiple=multiple)
    for k in range(num_sets):
        mine = [i for i, s in zip(members, set_of) if s == k]
        if not mine:
            assert got.tokens[k] == 0 and got.depth_sq[k] == 0
            continue
        t = micro_tree(parent, shared, lens, mine, rules=rules)
        flat = int((-(-lens[mine] // multiple) * multiple).sum())
        up = lambda x: -(-x // row) * row  # noqa: E731
        is_flat = t != micro_tree(parent, shared, lens, mine)
        assert got.tokens[k] == padded(t, multiple) <= flat
        assert up(got.tokens[k]) <= up(bound.tokens[k])  # the row the cap sees: within the packer's bound
        assert is_flat or got.tokens[k] <= bound.tokens[k]
        assert got.depth_sq[k] == (int(((-(-lens[mine] // multiple) * multiple) ** 2).sum()) if is_flat else t.depth_sq)
        sq = int(((-(-lens[mine] // multiple) * multiple) ** 2).sum())
        tok = padded(t, multiple)    # the work the cost sees, the row pad one more sequence: never above flat
        assert got.depth_sq[k] + (up(tok) - tok) ** 2 <= sq + (up(flat) - flat) ** 2
        assert up(tok) <= up(flat)   # the row, so per GPU of a CP group too (⌈row/c⌉)


@given(data=forests(max_n=60), num_sets=st.integers(1, 6), density=st.sampled_from([0.05, 0.3, 1.0]),
       multiple=st.sampled_from([1, 1, 4]))
def test_micro_trees_equal_micro_tree_per_set(data, num_sets, density, multiple):
    rng, (parent, shared, lens) = data
    n = parent.size
    members = np.flatnonzero(rng.random(n * num_sets) < density)
    set_of, members = members // n, members % n
    got = micro_trees(parent, shared, lens, members, set_of, num_sets, rules=RowRules(multiple))
    orders = dfs_orders(parent, shared, members, set_of, num_sets)
    assert len(got) == num_sets == len(orders)
    flat, bounds = dfs_flat(parent, shared, members, set_of, num_sets)  # what build.tree_columns slices
    assert bounds.tolist() == np.cumsum([0] + [o.size for o in orders]).tolist()
    assert flat.dtype == np.int64 and flat.tolist() == [int(i) for o in orders for i in o]
    for k in range(num_sets):
        want = dfs_order(parent, shared, members[set_of == k]) if (set_of == k).any() else np.zeros(0, int)
        assert orders[k].dtype == np.int64 and orders[k].tolist() == want.tolist()
    for k in range(num_sets):
        want = micro_tree(parent, shared, lens, members[set_of == k], rules=RowRules(multiple))
        assert got[k] == want
        for f in ("owners", "parent", "start", "end", "members", "anchor"):
            assert getattr(got[k], f).dtype == np.int64


def test_set_tries_deep_chain_and_repeats():
    """A chain far deeper than the narrow-level threshold, as one set, as one-sample sets, and with
    repeated (set, member) pairs; wide GRPO levels take the numpy path."""
    n = 600
    lens = 5 + 3 * np.arange(n)
    parent = np.arange(-1, n - 1)
    shared = np.concatenate([[0], lens[:-1]])
    one = set_tries(parent, shared, lens, np.arange(n), np.zeros(n, dtype=np.int64), 1)
    assert one.tokens.tolist() == [lens[-1]] and one.depth_sq.tolist() == [lens[-1] ** 2]
    lone = set_tries(parent, shared, lens, np.arange(n), np.arange(n), n, multiple=2)
    assert lone.tokens.tolist() == [padded(owner_tree(parent, shared, lens, [i]), 2) for i in range(n)]
    rng = np.random.default_rng(0)   # deep sets with members far apart: lone climbs jump between members
    ep_, sh_, ln_ = forest(rng, 400, "edited")
    for par_, shr_, lns_ in ((parent, shared, lens), (ep_, sh_, ln_)):
        size = par_.size
        mem = rng.integers(0, size, 300)
        sets = rng.integers(0, 12, 300)
        for mult in (1, 8):
            got = set_tries(par_, shr_, lns_, mem, sets, 12, multiple=mult)
            trees = micro_trees(par_, shr_, lns_, mem, sets, 12)
            for k in range(12):
                t = owner_tree(par_, shr_, lns_, mem[sets == k])
                assert (got.tokens[k], got.depth_sq[k]) == (padded(t, mult), t.depth_sq)
                assert trees[k] == micro_tree(par_, shr_, lns_, mem[sets == k])
    rep = set_tries(parent, shared, lens, [5, 5, 9, 5], [0, 0, 0, 1], 2)
    assert rep.tokens.tolist() == [lens[9], lens[5]]
    g = np.arange(4096)
    gp = np.where(g % 8 == 0, -1, g - g % 8)
    gl = np.where(g % 8 == 0, 100, 130)
    gs = np.where(gp >= 0, 100, 0)
    sets = set_tries(gp, gs, gl, g, g // 16, 256, multiple=8)   # two groups per set
    assert (sets.tokens == 2 * (104 + 7 * 32)).all()
    assert np.array_equal(forest_depths(gp, gs), (g % 8 != 0).astype(int))


# -- cut_trees ------------------------------------------------------------------------------------

def ref_cut(samples, parent, shared, lens, limit, multiple=1) -> list[list[int]]:
    """The greedy as main's reference trie.cut_trees writes it: a subtree fits when adding it,
    sample by sample, to a copy of the part keeps the part within the limit (exact, padded)."""
    roots, children = sample_forest(parent, shared, samples)

    def subtree(i):
        out, stack = [], [i]
        while stack:
            a = stack.pop()
            out.append(a)
            stack.extend(children.get(a, [])[::-1])
        return out

    def gain(need, i):
        du, ups = 0, []
        a, r = i, int(lens[i])
        while a >= 0 and r > 0:
            old = need.get(a, 0)
            if r <= old:
                break
            st_ = int(shared[a]) if parent[a] >= 0 else 0
            lo = max(old, st_)
            if r > lo:
                du += -(-(r - st_) // multiple) * multiple - (-(-(lo - st_) // multiple) * multiple if lo > st_ else 0)
            ups.append((a, r))
            r = min(r, int(shared[a])) if parent[a] >= 0 else 0
            a = int(parent[a])
        return du, ups

    def try_subtree(i, part):
        members, need, tokens = list(part[0]), dict(part[1]), part[2]
        for j in subtree(i):
            du, ups = gain(need, j)
            members.append(j)
            need.update(ups)
            tokens += du
            if tokens > limit:
                return None
        return [members, need, tokens]

    atoms: list[list[int]] = []
    for r in roots:
        part = [[], {}, 0]
        stack = [r]
        while stack:
            i = stack.pop()
            got = try_subtree(i, part)
            if got is not None:
                part = got
                continue
            if part[0]:
                got = try_subtree(i, [[], {}, 0])
                if got is not None:
                    atoms.append(part[0])
                    part = got
                    continue
            du, ups = gain(part[1], i)
            if part[0] and part[2] + du > limit:
                atoms.append(part[0])
                part = [[], {}, 0]
                du, ups = gain(part[1], i)
            part[0].append(i)
            part[1].update(ups)
            part[2] += du
            stack.extend(children.get(i, [])[::-1])
        atoms.append(part[0])
    return [a for a in atoms if a]


def _parts(cut, samples) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(cut.tokens.size)]
    for x, a in zip(samples.tolist(), cut.atom_of.tolist()):
        out[a].append(x)
    return out


@given(data=forests(), limit=st.integers(1, 150), frac=st.sampled_from([0.3, 0.7, 1.0]),
       multiple=st.sampled_from([1, 1, 2, 8]))
def test_cut_trees_equal_the_exact_greedy(data, limit, frac, multiple):
    rng, (parent, shared, lens) = data
    n = parent.size
    samples = np.flatnonzero(rng.random(n) < frac)
    if samples.size == 0:
        samples = np.array([n - 1])
    rng.shuffle(samples)                         # atom_of follows the order given
    cut = cut_trees(parent, shared, lens, samples, limit, multiple=multiple)
    ref = ref_cut(np.sort(samples), parent, shared, lens, limit, multiple)
    got = _parts(cut, samples)
    assert [sorted(a) for a in got] == [sorted(a) for a in ref]
    assert cut.first.tolist() == [a[0] for a in ref]
    for a, members in enumerate(got):
        t = owner_tree(parent, shared, lens, members)
        assert (cut.tokens[a], cut.depth_sq[a]) == (padded(t, multiple), t.depth_sq)


def star_forest(rng: np.random.Generator, groups: int, size: int, ragged: bool,
                interleave: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(parent, shared, lens) of GRPO-shaped groups: a prompt and its responses (stars), ``size``
    responses each (``ragged``: 0 .. size), groups one after another or interleaved."""
    sizes = rng.integers(0, size + 1, groups) if ragged else np.full(groups, size)
    labels = np.repeat(np.arange(groups), sizes + 1)
    if interleave:
        rng.shuffle(labels)
    n = labels.size
    lens = rng.integers(1, 60, n).astype(np.int64)
    parent, shared, first = np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.int64), {}
    for i, g in enumerate(labels.tolist()):
        if g in first:    # a response: it shares part of its prompt (all of it, mostly)
            p = first[g]
            top = int(min(lens[i], lens[p]))
            parent[i], shared[i] = p, top if rng.random() < 0.7 else int(rng.integers(1, top + 1))
        else:
            first[g] = i
    return parent, shared, lens


@given(seed=st.integers(0, 2 ** 31), groups=st.integers(1, 12), size=st.integers(1, 9), ragged=st.booleans(),
       interleave=st.booleans(), every=st.booleans(), limit=st.integers(1, 300), multiple=st.sampled_from([1, 1, 4]))
def test_star_cuts_equal_the_exact_greedy(seed, groups, size, ragged, interleave, every, limit, multiple):
    """GRPO-shaped steps as the planner meets them: every sample of the batch in order (the whole-
    batch path of ``step_trees``) or a shuffled subset, groups of one size (the star cut's rounds as
    rows of a grid) or ragged, one after another (star parts summed run by run) or interleaved
    (scattered): the parts, their order and exact tries of the reference greedy, at several limits
    of one ``step_trees``."""
    from microplan.trie import step_trees
    rng = np.random.default_rng(seed)
    parent, shared, lens = star_forest(rng, groups, size, ragged, interleave)
    n = parent.size
    samples = np.arange(n) if every else rng.permutation(n)[: int(rng.integers(1, n + 1))]
    st_ = step_trees(parent, shared, lens, samples, multiple=multiple)
    for lim in (limit, 2 * limit, 10 ** 6):
        cut = st_.cut(lim)
        ref = ref_cut(np.sort(samples), parent, shared, lens, lim, multiple)
        got = _parts(cut, samples)
        assert [sorted(a) for a in got] == [sorted(a) for a in ref]
        assert cut.first.tolist() == [a[0] for a in ref]
        assert cut.tokens.dtype == np.int64 and cut.depth_sq.dtype == np.float64 and cut.atom_of.dtype == np.int64
        for a, members in enumerate(got):
            t = owner_tree(parent, shared, lens, members)
            assert (cut.tokens[a], cut.depth_sq[a]) == (padded(t, multiple), t.depth_sq)


@given(data=forests(), limit=st.integers(1, 150), multiple=st.sampled_from([2, 8]))
def test_cut_trees_padded_parts_fit(data, limit, multiple):
    """With a padding multiple: a partition, each part's padded trie as set_tries counts it, within
    the limit unless it is one sample whose padded path alone exceeds it, whole trees kept whole
    when they fit, each part contiguous in the depth-first order of its tree."""
    rng, (parent, shared, lens) = data
    n = parent.size
    samples = np.flatnonzero(rng.random(n) < 0.7)
    if samples.size == 0:
        samples = np.array([0])
    cut = cut_trees(parent, shared, lens, samples, limit, multiple=multiple)
    got = _parts(cut, samples)
    assert sorted(x for a in got for x in a) == samples.tolist()
    roots, _ = sample_forest(parent, shared, samples)
    order = dfs_order(parent, shared, samples).tolist()
    for a, members in enumerate(got):
        t = owner_tree(parent, shared, lens, members)   # the cut sizes parts by the owner-segment bound
        assert (cut.tokens[a], cut.depth_sq[a]) == (padded(t, multiple), t.depth_sq)
        if cut.tokens[a] > limit:
            assert len(members) == 1 and padded(owner_tree(parent, shared, lens, members), multiple) > limit
        at = sorted(order.index(x) for x in members)
        assert at == list(range(at[0], at[0] + len(at)))          # one depth-first run
        assert cut.first[a] == order[at[0]]
    for r in roots:   # whole trees that fit stay one atom
        tree = [x for x in order if _root(x, parent, shared, set(samples.tolist())) == r]
        if padded(owner_tree(parent, shared, lens, tree), multiple) <= limit:
            assert len(set(cut.atom_of[np.searchsorted(samples, tree)].tolist())) == 1


def _root(x: int, parent, shared, members: set[int]) -> int:
    top, a = x, x
    while a >= 0:
        a = int(parent[a]) if shared[a] > 0 else -1
        if a in members:
            top = a
    return top


@pytest.mark.parametrize("n", [1500])
def test_cut_trees_chain_is_linear(n):
    """An append-only chain whose samples each exceed the limit: n parts of one sample (the
    reference walks every part's first sample to the root: quadratic)."""
    import time
    lens = 100 + 10 * np.arange(n)
    parent = np.arange(-1, n - 1)
    shared = np.concatenate([[0], lens[:-1]])
    t = time.perf_counter()
    cut = cut_trees(parent, shared, lens, np.arange(n), 50)
    cut2 = cut_trees(parent, shared, lens, np.arange(n), 4000, multiple=8)
    assert time.perf_counter() - t < 1.0
    assert np.array_equal(cut.atom_of, np.arange(n)) and np.array_equal(cut.tokens, lens)
    sizes = np.bincount(cut2.atom_of)
    assert ((cut2.tokens <= 4000) | (sizes == 1)).all() and (sizes > 1).any()


# -- micro_tree / dfs_order: bit-identical to the heap-based originals ----------------------------

def ref_micro_tree(parent, shared, lens, members):
    """prefix.owner_tree (micro_tree before runs were merged) as it was (a heap of pending samples):
    (owners, parent, start, end, anchor)."""
    import heapq
    need, heap = {}, []
    for i in np.asarray(members, dtype=np.int64).tolist():
        if i not in need:
            heapq.heappush(heap, -i)
        need[i] = int(lens[i])
    while heap:
        a = -heapq.heappop(heap)
        p = int(parent[a])
        r = min(need[a], int(shared[a])) if p >= 0 else 0
        if r <= 0:
            continue
        if p not in need:
            need[p] = r
            heapq.heappush(heap, -p)
        elif r > need[p]:
            need[p] = r
    start_of = lambda a: int(shared[a]) if parent[a] >= 0 else 0  # noqa: E731
    owners = sorted(a for a, n in need.items() if n > start_of(a))
    pos = {a: k for k, a in enumerate(owners)}
    par = []
    for a in owners:
        q = -1
        if start_of(a) > 0:
            q, t = int(parent[a]), start_of(a) - 1
            while t < start_of(q):
                q = int(parent[q])
        par.append(pos[q] if q >= 0 else -1)
    anchor = []
    for i in sorted(set(np.asarray(members, dtype=np.int64).tolist())):
        q, t = i, int(lens[i]) - 1
        while t < start_of(q):
            q = int(parent[q])
        anchor.append(pos[q])
    return owners, par, [start_of(a) for a in owners], [need[a] for a in owners], anchor


@given(data=forests(max_n=60), frac=st.sampled_from([0.05, 0.3, 1.0]))
def test_micro_tree_and_dfs_order_are_unchanged(data, frac):
    rng, (parent, shared, lens) = data
    n = parent.size
    members = np.flatnonzero(rng.random(n) < frac)
    members = np.concatenate([members, members[:2]])          # repeats count once
    rng.shuffle(members)
    t = owner_tree(parent, shared, lens, members)
    owners, par, start, end, anchor = ref_micro_tree(parent, shared, lens, members)
    for got, want in ((t.owners, owners), (t.parent, par), (t.start, start), (t.end, end), (t.anchor, anchor),
                      (t.members, sorted(set(members.tolist())))):
        assert got.dtype == np.int64 and got.tolist() == list(want)
    roots, children = sample_forest(parent, shared, members)
    want_order, stack = [], roots[::-1]
    while stack:
        i = stack.pop()
        want_order.append(i)
        stack.extend(children.get(i, [])[::-1])
    got_order = dfs_order(parent, shared, members)
    assert got_order.dtype == np.int64 and got_order.tolist() == want_order
    assert sorted(want_order) == sorted(set(members.tolist()))


@given(data=forests(max_n=60), frac=st.sampled_from([0.05, 0.3, 1.0]), multiple=st.sampled_from([1, 8]))
def test_micro_tree_segments_start_only_where_paths_branch(data, frac, multiple):
    """micro_tree's segments are the owner segments merged along non-branching chains: the same
    tokens and attention work; no segment is its parent's only continuation at the parent's end
    (a segment starts only at a branch); every member's path covers its L positions in order; a
    lone sample is one segment; and with a multiple the row is flat exactly when that is smaller."""
    rng, (parent, shared, lens) = data
    n = parent.size
    members = np.flatnonzero(rng.random(n) < frac)
    if members.size == 0:
        members = np.array([n - 1])
    t = micro_tree(parent, shared, lens, members, rules=RowRules(multiple))
    o = owner_tree(parent, shared, lens, members)
    merged = micro_tree(parent, shared, lens, members)
    pl = -(-lens[members] // multiple) * multiple
    if t != merged:     # laid out flat (every member its own root segment) only where the trie is worse
        assert t.parent.tolist() == [-1] * members.size and t.end.tolist() == lens[members].tolist()
        assert padded(merged, multiple) > pl.sum() or merged.depth_sq > (pl * pl).sum()
        return
    assert t == merged
    assert t.num_tokens == o.num_tokens and t.depth_sq == o.depth_sq and t.start.size <= o.start.size
    for k in range(t.start.size):
        q = int(t.parent[k])
        assert (q < 0) == (t.start[k] == 0) and q < k          # parents first
        if q >= 0 and t.start[k] == t.end[q]:
            same = [j for j in range(t.start.size) if t.parent[j] == q and t.start[j] == t.start[k]]
            assert len(same) > 1, "a segment continues its parent's end without a branch there"
    offsets = np.concatenate([[0], np.cumsum(t.end - t.start)])
    for j, i in enumerate(t.members.tolist()):
        rows = t.path_rows(offsets, int(t.anchor[j]), int(lens[i]) - 1)
        assert rows.size == lens[i] and len(set(rows.tolist())) == rows.size
    for i in members[:3].tolist():
        lone = micro_tree(parent, shared, lens, [i], rules=RowRules(multiple, 4))
        assert lone.start.tolist() == [0] and lone.end.tolist() == [int(lens[i])]


@given(data=forests(), limits=st.lists(st.integers(1, 150), min_size=2, max_size=4),
       multiple=st.sampled_from([1, 1, 2, 8]))
def test_one_step_trees_cut_at_many_limits_equals_fresh_cuts(data, limits, multiple):
    """The planner finds a step's trees once (``step_trees``) and cuts them at several limits (the
    granularity candidates): each cut equals ``cut_trees`` at that limit from scratch, whatever
    was cut before (a cut that wrote into the shared trees would change the next)."""
    from microplan.trie import step_trees
    rng, (parent, shared, lens) = data
    samples = rng.permutation(parent.size)[: max(1, int(rng.integers(1, parent.size + 1)))]
    st_ = step_trees(parent, shared, lens, samples, multiple=multiple)
    for limit in limits + limits[:1]:
        got, fresh = st_.cut(limit), cut_trees(parent, shared, lens, samples, limit, multiple=multiple)
        for f in fresh._fields:
            assert getattr(got, f).dtype == getattr(fresh, f).dtype
            assert np.array_equal(getattr(got, f), getattr(fresh, f)), (limit, f)


@given(data=forests(), multiple=st.sampled_from([1, 1, 2, 8]), frac=st.sampled_from([0.4, 1.0]))
def test_step_trees_whole_tries_equal_set_tries(data, multiple, frac):
    """Each tree's whole trie (stars in closed form, the rest by set_tries) equals set_tries of the
    tree's members, tokens and depth_sq, dtypes included."""
    from microplan.trie import step_trees
    rng, (parent, shared, lens) = data
    samples = np.flatnonzero(rng.random(parent.size) < frac)
    if samples.size == 0:
        samples = np.array([parent.size - 1])
    st_ = step_trees(parent, shared, lens, samples, multiple=multiple)
    want = set_tries(parent, shared, lens, st_.uniq, st_.tree, st_.roots.size, multiple=multiple)
    assert st_.exact.tokens.dtype == want.tokens.dtype and st_.exact.depth_sq.dtype == want.depth_sq.dtype
    np.testing.assert_array_equal(st_.exact.tokens, want.tokens)
    np.testing.assert_array_equal(st_.exact.depth_sq, want.depth_sq)


@given(st.integers(1, 40), st.integers(1, 9), st.integers(0, 2 ** 32 - 1))
def test_lex_order_packed_equals_lexsort(n, sets, seed):
    """``prefix._lex_order`` (dfs_flat's sort by set, root, sample): the packed int64 key and lexsort agree."""
    from microplan.prefix import _lex_order
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(0, sets * n * n, 3 * n))
    a, b, c = keys // (n * n), keys // n % n, keys % n
    p = rng.permutation(keys.size)
    a, b, c = a[p], b[p], c[p]
    assert _lex_order(a, b, c, n, packed=True).tolist() == _lex_order(a, b, c, n, packed=False).tolist() \
        == c[np.lexsort((c, b, a))].tolist()
