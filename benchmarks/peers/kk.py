"""Karmarkar–Karp k-way largest differencing, as the peers use it (shared by verl, slime, OpenRLHF).

Design note. Written from the published description (PEERS.md, verl `seqlen_balancing`): every
item starts as a *state* of k sets; states sit in a heap ordered by spread (largest set sum minus
smallest); the two states with the largest spread are popped and merged by pairing the heaviest
set of one with the lightest set of the other (sets kept sorted by sum, descending); the merged
state is pushed back until one state remains. Its k sets are the partition.

- ``equal_size=True``: items are sorted by weight and taken k at a time; each group becomes one
  state with one item per set, so every merge keeps set sizes equal (n must be a multiple of k).
- ``equal_size=False``: each item is its own state (the item in one set, k-1 empty sets). Costs
  O(n · k log k) in plain Python, as upstream.

Plain Python objects (sets and states ordered by rich comparisons) and ``heapq``, like the
peers: no vectorisation, so its speed is theirs. Ties break by state age (deterministic).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["karmarkar_karp"]


class _Set:
    """One part under construction: its weight sum and items; ordered by (sum, size)."""

    __slots__ = ("sum", "items")

    def __init__(self, total: float, items: list[int]) -> None:
        self.sum = total
        self.items = items

    def merge(self, other: _Set) -> None:
        self.sum += other.sum
        self.items.extend(other.items)

    def __lt__(self, other: _Set) -> bool:
        if self.sum != other.sum:
            return self.sum < other.sum
        return len(self.items) < len(other.items)


class _State:
    """k sets kept sorted by sum, heaviest first; heap order: larger spread first, then age."""

    __slots__ = ("sets", "order")

    def __init__(self, sets: list[_Set], order: int) -> None:
        self.sets = sorted(sets, reverse=True)
        self.order = order

    @property
    def spread(self) -> float:
        return self.sets[0].sum - self.sets[-1].sum

    def merge(self, other: _State) -> None:
        """Heaviest set of ``self`` with the lightest of ``other``, and so on down (in place)."""
        k = len(self.sets)
        for i in range(k):
            self.sets[i].merge(other.sets[k - 1 - i])
        self.sets = sorted(self.sets, reverse=True)

    def __lt__(self, other: _State) -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.order < other.order


def _initial_states(weights: Sequence[float], k: int, equal_size: bool) -> list[_State]:
    ordered = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    if equal_size:
        if len(ordered) % k:
            raise ValueError(f"equal_size KK needs a multiple of k={k} items, got {len(ordered)}")
        return [_State([_Set(weights[i], [i]) for i in ordered[g:g + k]], g)
                for g in range(0, len(ordered), k)]
    return [_State([_Set(weights[i], [i])] + [_Set(0.0, []) for _ in range(k - 1)], pos)
            for pos, i in enumerate(ordered)]


def karmarkar_karp(weights: Sequence[float], k: int, *, equal_size: bool) -> list[list[int]]:
    """Partition item indices 0..n-1 into k lists balancing the summed ``weights``.

    Returns k lists of item indices, each sorted ascending (as verl returns them); a list can be
    empty when n < k or in unequal mode with very few items.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    weights = [float(w) for w in weights]
    if not weights:
        return [[] for _ in range(k)]
    heap = _initial_states(weights, k, equal_size)
    heapq.heapify(heap)
    while len(heap) > 1:
        a = heapq.heappop(heap)
        b = heapq.heappop(heap)
        a.merge(b)
        heapq.heappush(heap, a)
    return [sorted(s.items) for s in heap[0].sets]
