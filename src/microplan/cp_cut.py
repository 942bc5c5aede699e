"""The context-parallel cut of a packed row: which member of a CP group owns each token.

Design note. A micro-batch of CP degree c is one packed row — flat (one segment per sample) or
a prefix tree (one segment per trie node, ``microplan.prefix``) — whose tokens the c members of
its CP group share out. :func:`zigzag_owner` cuts **every segment** into 2c chunks and gives
member q chunks q and 2c−1−q (the zigzag of ring/all-gather CP). A token at position p attends
to p+1 keys, so within a segment the early chunks are cheap and the late ones dear; pairing
chunk q with its mirror gives every member the same token count *and* the same attention cost
(exactly when the segment's length is a multiple of 2c, which ``pad_to_multiple_of=2c`` makes
true: then the cut is the standard zigzag Transformer Engine and Megatron expect). A segment of
L = 2c·b + r tokens gives its r leftover tokens one each to the members next in a rotation
that runs over the whole row, so token counts over the row differ by at most one; a member's
first leftover lengthens its early chunk, the second its mirror. Cutting per segment rather
than per row is what balances a tree row by attention cost: a branch at depth 16k costs 16k per
token however short it is, and each branch is split evenly.

:func:`cp_loads` counts what each member computes under a cut (tokens, and attention cost as
Σ (position+1) over its tokens): the planner can use it for the per-GPU balance of a CP group.
Numpy only (the torch layer's ``PackedMicro.cp_shard`` uses this cut).

``benchmarks/bench_tree_cp.py`` measures the per-member balance. Per-segment chunks cost nothing extra:
``torch/cp_shard.py`` scores each owned row's successors wherever they live, so a member
computes only its ⌈U/c⌉ rows whatever the number of chunk boundaries.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .errors import PlanError

__all__ = ["zigzag_owner", "cp_loads", "CPLoads"]


class CPLoads(NamedTuple):
    """Per-member work of a cut: ``tokens[q]`` tokens owned, ``attention[q]`` = Σ (position+1)."""

    tokens: np.ndarray
    attention: np.ndarray


def _check(seg_lens: np.ndarray, cp_size: int) -> None:
    if not isinstance(cp_size, (int, np.integer)) or isinstance(cp_size, bool) or cp_size < 1:
        raise PlanError(f"cp_size={cp_size!r} must be an int >= 1 (the members of the CP group).")
    if seg_lens.ndim != 1 or (seg_lens.size and int(seg_lens.min()) < 1):
        raise PlanError(f"segment lengths must be a 1-D array of positive ints, got {seg_lens.tolist()[:8]}.")


def zigzag_owner(seg_lens: np.ndarray | list[int], cp_size: int) -> np.ndarray:
    """``[Σ seg_lens]`` int64: the member (0..cp_size−1) owning each token of the row (module note)."""
    lens = np.asarray(seg_lens, dtype=np.int64)
    _check(lens, cp_size)
    c = int(cp_size)
    n = 2 * c
    mirror = np.concatenate([np.arange(c), np.arange(c)[::-1]])   # chunk k → its member
    out, ptr = [], 0
    for L in lens.tolist():
        base, rem = divmod(int(L), n)
        sizes = np.full(n, base, dtype=np.int64)
        for j in range(rem):  # leftovers: one per member in rotation, early chunk first, then its mirror
            m = (ptr + j) % c
            sizes[m if j < c else n - 1 - m] += 1
        ptr = (ptr + rem) % c
        out.append(np.repeat(mirror, sizes))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def cp_loads(seg_lens: np.ndarray | list[int], seg_starts: np.ndarray | list[int], cp_size: int,
             owner: np.ndarray | None = None) -> CPLoads:
    """What each member computes under ``owner`` (default: :func:`zigzag_owner`).

    ``seg_starts[k]`` is the position of segment k's first token in its samples (0 for a flat
    row's samples, the branch depth for a tree segment).
    """
    lens = np.asarray(seg_lens, dtype=np.int64)
    starts = np.asarray(seg_starts, dtype=np.int64)
    if starts.shape != lens.shape:
        raise PlanError(f"seg_starts has {starts.size} entries for {lens.size} segments; give one per segment.")
    own = zigzag_owner(lens, cp_size) if owner is None else np.asarray(owner, dtype=np.int64)
    if own.size != int(lens.sum()):
        raise PlanError(f"owner has {own.size} entries for a row of {int(lens.sum())} tokens.")
    first = np.repeat(np.cumsum(lens) - lens, lens)
    pos = np.repeat(starts, lens) + (np.arange(own.size) - first)
    tokens = np.bincount(own, minlength=cp_size).astype(np.int64)
    attention = np.bincount(own, weights=(pos + 1).astype(np.float64), minlength=cp_size)
    return CPLoads(tokens, attention)
