"""Feasibility fallbacks for the packer: does a packing into exactly m non-empty bins exist?

Design note. The LPT packer balances cost and can fail to fit the token cap where a packing
exists (``Batch([2,3,8,2,4,3])``, cap 11: LPT needs 3 bins, {8,3} {4,3,2,2} uses 2). Before the
planner adds a micro-batch per rank it asks, in order:

1. :func:`first_fit_decreasing` — tokens descending, each sample to the first bin with room,
   then every empty bin takes the shortest sample of the fullest multi-sample bin. Without a second
   resource the samples over half the cap take bins 0, 1, ... (no two share one) and the first
   bins with room for the rest are found per block of samples at once and kept as lower bounds
   (a bin without room never regains it), so most samples cost a few list lookups; with one, one
   masked search per sample. Either way the same bins; O(n·m) numpy at worst. The empty bins
   are filled from a heap of the donors (O(m log m)).
2. :func:`exact_pack` — for small steps (n <= ``EXACT_MAX_SAMPLES``), a depth-first search over
   assignments, tokens descending, with symmetry breaking (bins of equal load tried once, at most
   one new bin per level) and the pruning "samples left >= bins still empty". Bounded by
   ``node_limit`` nodes; returns None when the limit is hit (the caller then grows K).

Guarantees: a returned packing has every bin non-empty and within the cap; ``exact_pack``
returning None without hitting the limit proves no such packing exists. The refine pass then
balances cost without breaking the cap.
"""

from __future__ import annotations

import heapq

import numpy as np

__all__ = ["first_fit_decreasing", "exact_pack", "EXACT_MAX_SAMPLES"]

EXACT_MAX_SAMPLES = 24


def first_fit_decreasing(lens: np.ndarray, m: int, cap: int,
                         extra: tuple[np.ndarray, int] | None = None) -> np.ndarray | None:
    """Bin of each sample in exactly ``m`` non-empty bins under ``cap`` (and the ``extra``
    resource under its cap), or None."""
    n = lens.size
    if n < m:
        return None
    order = np.argsort(-lens, kind="stable")
    load = np.zeros(m, dtype=np.int64)
    xload = np.zeros(m, dtype=np.int64)
    count = np.zeros(m, dtype=np.int64)
    bin_of = np.empty(n, dtype=np.int64)
    if extra is None and lens.dtype.kind in "iu" and bool((lens >= 0).all()):  # rooms only shrink
        if not _first_fits(lens, order, m, cap, bin_of, load, count):
            return None
        return _fill_empty(bin_of, lens, load, count)
    for i in order.tolist():
        ok = load + lens[i] <= cap
        if extra is not None:
            ok &= xload + extra[0][i] <= extra[1]
        room = np.flatnonzero(ok)
        if not room.size:
            return None
        b = int(room[0])
        bin_of[i] = b
        load[b] += lens[i]
        if extra is not None:
            xload[b] += extra[0][i]
        count[b] += 1
    return _fill_empty(bin_of, lens, load, count)


def _fill_empty(bin_of: np.ndarray, lens: np.ndarray, load: np.ndarray, count: np.ndarray) -> np.ndarray | None:
    """Each empty bin (ascending) takes the shortest sample (then the lowest index) of the fullest
    bin (then the lowest) holding two or more (None when no bin does). A heap of the donors and each
    bin's samples sorted once: a donor only loses samples, an empty bin never becomes one."""
    empty = np.flatnonzero(count == 0).tolist()
    if not empty:
        return bin_of
    by = np.lexsort((np.arange(lens.size), lens, bin_of))          # per bin: shortest first, then index
    at = np.searchsorted(bin_of[by], np.arange(count.size)).tolist()  # each bin's next sample to give
    by_l, lens_l, load_l, count_l = by.tolist(), lens.tolist(), load.tolist(), count.tolist()
    heap = [(-load_l[d], d) for d in np.flatnonzero(count >= 2).tolist()]
    heapq.heapify(heap)
    for b in empty:
        if not heap:
            return None
        _, d = heapq.heappop(heap)
        i = by_l[at[d]]
        at[d] += 1
        bin_of[i] = b
        load_l[d] -= lens_l[i]
        load_l[b] += lens_l[i]
        count_l[d] -= 1
        count_l[b] += 1
        if count_l[d] >= 2:
            heapq.heappush(heap, (-load_l[d], d))
    load[:] = load_l
    count[:] = count_l
    return bin_of


def exact_pack(lens: np.ndarray, m: int, cap: int, *, node_limit: int = 200_000) -> np.ndarray | None:
    """An assignment of every sample to exactly ``m`` non-empty bins under ``cap``, or None.

    Exhaustive (see the module note) for ``len(lens) <= EXACT_MAX_SAMPLES``; None for larger
    inputs, when none exists, or when ``node_limit`` nodes were explored without an answer.
    """
    n = lens.size
    if n < m or n > EXACT_MAX_SAMPLES or (n and int(lens.max()) > cap) or int(lens.sum()) > m * cap:
        return None
    order = np.argsort(-lens, kind="stable")
    L = [int(x) for x in lens[order]]
    load = [0] * m
    assign = [0] * n
    nodes = 0

    def dfs(i: int, used: int) -> bool:
        nonlocal nodes
        nodes += 1
        if nodes > node_limit:
            raise _Budget
        if i == n:
            return used == m
        if n - i < m - used:
            return False
        seen: set[int] = set()
        for b in range(used):
            lb = load[b]
            if lb in seen or lb + L[i] > cap:
                continue
            seen.add(lb)
            load[b] += L[i]
            assign[i] = b
            if dfs(i + 1, used):
                return True
            load[b] -= L[i]
        if used < m:
            load[used] = L[i]
            assign[i] = used
            if dfs(i + 1, used + 1):
                return True
            load[used] = 0
        return False

    try:
        found = dfs(0, 0)
    except _Budget:
        return None
    if not found:
        return None
    out = np.empty(n, dtype=np.int64)
    out[order] = assign
    return out


class _Budget(Exception):
    """The node limit was reached."""


FFD_BLOCK = 32  # samples per refresh of the first-fit lower bounds (_first_fits)
FFD_SCAN = 64  # bins tried one by one after a stale bound before a masked search (_next_fit)


def _first_fits(lens: np.ndarray, order: np.ndarray, m: int, cap: int, bin_of: np.ndarray,
                load: np.ndarray, count: np.ndarray) -> bool:
    """First fit of the samples ``order`` into m bins under ``cap`` (no second resource): the same
    bins as one masked search per sample. Per block of ``FFD_BLOCK`` samples the first bin with room
    for each is found at once (``searchsorted`` on the running maximum of room); bins before it
    lack room then and only lose room later, so it is the sample's first fit whenever it still has
    room, and otherwise the first fit lies after it (one masked search from there). Samples over
    half the cap (they lead the order) fit no bin that already holds one: the first of them into
    bin 0, the next into bin 1, and so on, in one numpy step."""
    free = cap - load
    big = int(np.count_nonzero(2 * lens > cap)) if not load.any() else 0
    if big:  # the samples over half the cap come first, and no two share a bin: bins 0, 1, ... in order
        if big > m or int(lens[order[0]]) > cap:
            return False
        head = order[:big]
        bin_of[head] = np.arange(big)
        free[:big] -= lens[head]
        count[:big] += 1
    free_l = free.tolist()
    for at in range(big, order.size, FFD_BLOCK):
        idx = order[at:at + FFD_BLOCK]
        ls = lens[idx]
        ls_l = ls.tolist()
        first = np.searchsorted(np.maximum.accumulate(free), ls, side="left").tolist()
        for k, (L, b) in enumerate(zip(ls_l, first)):
            if b >= m:
                return False
            if free_l[b] < L:
                b = _next_fit(free, free_l, b + 1, L)
                if b < 0:
                    return False
            first[k] = b
            free_l[b] -= L
        np.subtract.at(free, first, ls)  # the block's bins, written once: ``free`` is stale within a block
        bin_of[idx] = first
    load[:] = cap - free
    count += np.bincount(bin_of[order[big:]], minlength=m)
    return True


def _next_fit(free: np.ndarray, free_l: list[int], lo: int, L: int) -> int:
    """The first bin from ``lo`` on with room for L (-1 if none): the next ``FFD_SCAN`` bins one by
    one, then one masked search over the rest. ``free`` may be stale (never below ``free_l``, the
    current rooms): a masked hit is confirmed in ``free_l``."""
    for b in range(lo, min(lo + FFD_SCAN, len(free_l))):
        if free_l[b] >= L:
            return b
    lo += FFD_SCAN
    while lo < free.size:
        b = lo + int(np.argmax(free[lo:] >= L))
        if free_l[b] >= L:
            return b
        if free[b] < L:  # argmax of no hit: none left
            return -1
        lo = b + 1  # a stale hit: its room went to this block
    return -1
