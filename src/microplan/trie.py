"""Sizes of prefix tries over sets of samples, and trees cut into parts under a token limit.

Design note. ``prefix.micro_tree`` builds the trie one micro-batch holds. The planner needs two
aggregate views of it, for many sets at once: the tokens (and attention work) of each set's
union trie (:func:`set_tries`), and a step's prefix trees cut into parts that each fit a limit
(:func:`cut_trees`). Both count a segment ``[start, need)`` of a canonical owner as
⌈(need − start) / multiple⌉·multiple tokens: with ``pad_to_multiple_of=m`` a tree row pads each
segment to the multiple (``torch/tree.py``), as a flat row pads each sample; ``multiple=1`` is the
trie's own ``num_tokens``. ``depth_sq`` counts real tokens only (padding carries no attention
the cost model prices).

Reference implementation: exact, O(Σ path walks) Python (the tests check the fast primitives
against :func:`prefix.micro_tree`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .prefix import micro_tree, sample_forest

__all__ = ["TrieSets", "TreeCut", "set_tries", "cut_trees", "padded_size"]


class TrieSets(NamedTuple):
    """Per set: ``tokens`` (int64, segments padded to the multiple) and ``depth_sq`` (float64)."""

    tokens: np.ndarray
    depth_sq: np.ndarray


class TreeCut(NamedTuple):
    """A step's trees cut into atoms: ``atom_of`` aligned with the samples given, and per atom its
    trie ``tokens`` (padded segments) and ``depth_sq``."""

    atom_of: np.ndarray
    tokens: np.ndarray
    depth_sq: np.ndarray


def padded_size(x: int, multiple: int) -> int:
    """x tokens rounded up to the multiple (0 stays 0)."""
    return -(-x // multiple) * multiple if x > 0 else 0


def set_tries(parent: np.ndarray, shared: np.ndarray, lens: np.ndarray, members: np.ndarray, set_of: np.ndarray,
              num_sets: int, *, multiple: int = 1) -> TrieSets:
    """The union trie of every set: members[j] belongs to set set_of[j]. O(Σ trie walks)."""
    members = np.asarray(members, dtype=np.int64)
    set_of = np.asarray(set_of, dtype=np.int64)
    tokens = np.zeros(num_sets, dtype=np.int64)
    dsq = np.zeros(num_sets, dtype=np.float64)
    if not members.size:
        return TrieSets(tokens, dsq)
    order = np.argsort(set_of, kind="stable")
    bounds = np.searchsorted(set_of[order], np.arange(num_sets + 1))
    for b in range(num_sets):
        m = members[order[bounds[b]:bounds[b + 1]]]
        if not m.size:
            continue
        t = micro_tree(parent, shared, lens, m)
        seg = t.end - t.start
        tokens[b] = int((-(-seg // multiple) * multiple).sum()) if multiple > 1 else int(seg.sum())
        dsq[b] = float(t.depth_sq)
    return TrieSets(tokens, dsq)


class _Part:
    """A growing set of samples and the ``need`` of every owner its trie touches."""

    __slots__ = ("members", "need", "tokens", "depth_sq")

    def __init__(self) -> None:
        self.members: list[int] = []
        self.need: dict[int, int] = {}
        self.tokens = 0
        self.depth_sq = 0

    def gain(self, i: int, parent: np.ndarray, shared: np.ndarray, lens: np.ndarray,
             multiple: int) -> tuple[int, int, list]:
        """(Δ tokens, Δ depth_sq, updates) of adding sample i; walks up until the need is met."""
        du = dd = 0
        updates = []
        a, r = i, int(lens[i])
        while a >= 0 and r > 0:
            old = self.need.get(a, 0)
            if r <= old:
                break
            st = int(shared[a]) if parent[a] >= 0 else 0
            lo = max(old, st)
            if r > lo:
                du += padded_size(r - st, multiple) - padded_size(lo - st, multiple)
                dd += r * r - lo * lo
            updates.append((a, r))
            r = min(r, int(shared[a])) if parent[a] >= 0 else 0
            a = int(parent[a])
        return du, dd, updates

    def add(self, i: int, gain: tuple[int, int, list]) -> None:
        du, dd, updates = gain
        self.members.append(i)
        self.need.update(updates)
        self.tokens += du
        self.depth_sq += dd


def cut_trees(parent: np.ndarray, shared: np.ndarray, lens: np.ndarray, samples: np.ndarray, limit: int, *,
              multiple: int = 1) -> TreeCut:
    """Trees (``prefix.sample_forest`` of ``samples``) whose trie holds at most ``limit`` tokens stay
    whole; a larger one is cut in depth-first order: a subtree that fits the current part joins
    it, one that fits a fresh part starts one, a larger one is split at its own branches. A
    sample longer than ``limit`` is a part of its own. Every part holds at most ``limit`` tokens
    whenever each sample alone does."""
    samples = np.asarray(samples, dtype=np.int64)
    roots, children = sample_forest(parent, shared, samples)
    parts: list[_Part] = []

    def try_subtree(i: int, part: _Part) -> bool:
        sub = _subtree(i, children)
        trial = _Part()
        trial.members, trial.need = list(part.members), dict(part.need)
        trial.tokens, trial.depth_sq = part.tokens, part.depth_sq
        for j in sub:
            trial.add(j, trial.gain(j, parent, shared, lens, multiple))
            if trial.tokens > limit:
                return False
        part.members, part.need, part.tokens, part.depth_sq = trial.members, trial.need, trial.tokens, trial.depth_sq
        return True

    for r in roots:
        part = _Part()
        stack = [r]
        while stack:
            i = stack.pop()
            if try_subtree(i, part):
                continue
            if part.members:
                fresh = _Part()
                if try_subtree(i, fresh):
                    parts.append(part)
                    part = fresh
                    continue
            g = part.gain(i, parent, shared, lens, multiple)
            if part.members and part.tokens + g[0] > limit:
                parts.append(part)
                part = _Part()
                g = part.gain(i, parent, shared, lens, multiple)
            part.add(i, g)
            stack.extend(children.get(i, [])[::-1])
        parts.append(part)
    parts = [p for p in parts if p.members]
    pos = {int(s): k for k, s in enumerate(samples.tolist())}
    atom_of = np.empty(samples.size, dtype=np.int64)
    for a, p in enumerate(parts):
        for i in p.members:
            atom_of[pos[i]] = a
    return TreeCut(atom_of, np.array([p.tokens for p in parts], dtype=np.int64),
                   np.array([p.depth_sq for p in parts], dtype=np.float64))


def _subtree(i: int, children: dict[int, list[int]]) -> list[int]:
    out, stack = [], [i]
    while stack:
        a = stack.pop()
        out.append(a)
        stack.extend(children.get(a, [])[::-1])
    return out
