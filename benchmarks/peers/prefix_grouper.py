"""verl's PrefixGrouper path (``actor.use_prefix_grouper=True``, arXiv 2506.05433) as a step planner.

Design note. Follows verl (volcengine/verl, 2026-01: ``ray_trainer._balance_batch``,
``seqlen_balancing.get_group_balanced_partitions``, ``dp_actor.update_policy``,
``trainer/ppo/prefix_grouper_utils.py``) and its ``examples/prefix_grouper/README.md``; written from
their documented behaviour, not their code:

1. DP split (``trainer.balance_batch=True``, the README's recommended setting): whole uid groups
   (a GRPO prompt's n responses) per rank, Karmarkar–Karp ``equal_size`` over the groups'
   workloads Σ (24576·L + L²); verl raises when the number of groups is not a multiple of the DP
   size (the README's ``batch_size % (world_size · n) == 0``): :class:`PeerCrash` here. A rank's
   samples keep their original order, so each group is contiguous.
2. Micro-batches: the path needs ``use_dynamic_bsz=False`` (with it verl silently falls back to the
   unshared forward), so a rank's samples are cut into chunks of ``ppo_micro_batch_size_per_gpu``
   samples: a fixed sample count, no token cap.
3. Inside a micro-batch each run of consecutive samples with one uid is a group: its prompt is
   computed once and each response once, laid out as one row ``[prompt, r_1, ..., r_k]``, rows
   right-padded to the longest (``use_remove_padding=False``). A group that a micro-batch boundary
   cuts computes its prompt in both micro-batches.

:func:`pg_micro_tokens` counts a micro-batch by rule 3: real tokens (prompt once per run +
responses), the ``[runs, W]`` padded grid, and the attention work Σ over real tokens of
(2·position + 1) (prompt P: P²; response r: (P + r)² − P²) — the quantity microplan's sharing
plans are priced by, so the peer's cost is comparable (its padding is not charged: favourable to
the peer). Plain Python, as upstream.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._common import PeerCrash, PeerPlan, ceil_div
from .kk import karmarkar_karp
from .verl import verl_workload

__all__ = ["plan_prefix_grouper", "pg_micro_tokens", "PGTokens", "contiguous_groups"]


class PGTokens(NamedTuple):
    """One PrefixGrouper micro-batch: real tokens, padded grid tokens, attention work (depth_sq)."""

    real: int
    padded: int
    depth_sq: int


def contiguous_groups(group_ids: np.ndarray) -> list[list[int]]:
    """Runs of consecutive equal ids, as sample index lists (verl assumes a uid is contiguous)."""
    runs: list[list[int]] = []
    for i, g in enumerate(np.asarray(group_ids).tolist()):
        if runs and group_ids[runs[-1][0]] == g:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def plan_prefix_grouper(seq_lens: np.ndarray, group_ids: np.ndarray, *, dp: int, micro_batch_size: int) -> PeerPlan:
    """One step laid out the PrefixGrouper way: ``plan[r][m]`` = sample indices (see module note).

    ``group_ids``: the uid of each sample (a GRPO group; contiguous). Raises :class:`PeerCrash`
    when the group count is not a multiple of ``dp`` (verl's ValueError) or below it (its assert).
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    lens = [int(x) for x in seq_lens]
    groups = contiguous_groups(np.asarray(group_ids))
    if len(groups) < dp or len(groups) % dp:
        raise PeerCrash(f"PrefixGrouper with balance_batch requires num_uid_groups ({len(groups)}) % dp_size ({dp}) "
                        f"== 0 (batch_size % (world_size · n) == 0)")
    work = [sum(verl_workload(lens[i]) for i in g) for g in groups]
    parts = karmarkar_karp(work, dp, equal_size=True)
    plan: PeerPlan = []
    for part in parts:
        samples = sorted(i for gi in part for i in groups[gi])
        k = ceil_div(len(samples), micro_batch_size)
        plan.append([np.asarray(samples[m * micro_batch_size:(m + 1) * micro_batch_size], dtype=np.int64)
                     for m in range(k)])
    return plan


def pg_micro_tokens(idx: np.ndarray, seq_lens: np.ndarray, prompt_lens: np.ndarray, group_ids: np.ndarray) -> PGTokens:
    """Tokens of one micro-batch under rule 3: each run of one uid = prompt once + its responses."""
    idx = np.asarray(idx, dtype=np.int64)
    if not idx.size:
        return PGTokens(0, 0, 0)
    real = depth = 0
    widths = []
    for run in contiguous_groups(np.asarray(group_ids)[idx]):
        members = idx[run]
        P = int(prompt_lens[members[0]])
        resp = [int(seq_lens[i]) - P for i in members.tolist()]
        row = P + sum(resp)
        real += row
        widths.append(row)
        depth += P * P + sum((P + r) ** 2 - P * P for r in resp)
    return PGTokens(real, len(widths) * max(widths), depth)
