"""The peers' padded (non-varlen) micro-batching, for benchmarks/bench_layouts.py.

Re-implemented from PEERS.md, not from upstream source. In a padded layout a micro-batch of n
samples is an ``[n, W]`` tensor (W: its longest sample; 2D: longest prompt + longest response),
so the peers' token budgets count n·W.

- :func:`plan_sorted_buckets` — NeMo-RL (NVIDIA-NeMo/RL, 2026-08) dynamic batching: sort the
  step's samples by length (descending), deal them across ranks with a stride (rank r gets sorted
  positions r, r+dp, ...), then compute micro-batch boundaries ONCE for all ranks from the
  longest sample at each position: a micro-batch grows while count × (longest length among the
  ranks' samples in it) <= the budget. Every rank has the same count; the last one may be short.
- :func:`plan_fixed_mbs` — verl / OpenRLHF static mode (``ppo_micro_batch_size_per_gpu``): each
  rank takes a contiguous equal share of the step in arrival order and cuts it into micro-batches
  of a fixed ``micro_batch_size`` samples, chosen as the most that fit the budget at the context
  window (cap // max_len), so no micro-batch ever exceeds it.
- :func:`plan_unirl_2d` — UniRL (Tencent-Hunyuan/UniRL, 2026-06; the UniRL seed): per rank
  (contiguous equal shares), first-fit decreasing under the dense 2D budget count × (max prompt +
  max response); the bin count is all-reduced MAX and every rank re-partitions its samples into
  exactly that many bins (LPT on tokens, no budget check: the seed notes it may exceed it).

Each returns ``plan[r][m]`` (global sample indices) like the other peers (``_common.py``).
"""

from __future__ import annotations

import numpy as np

from ._common import PeerPlan, to_plan

__all__ = ["plan_sorted_buckets", "plan_fixed_mbs", "plan_unirl_2d"]


def plan_sorted_buckets(seq_lens: np.ndarray, *, dp: int, cap: int) -> PeerPlan:
    """NeMo-RL dynamic batching: sorted, dealt with a stride, shared boundaries (see module note)."""
    lens = [int(x) for x in seq_lens]
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    per_rank = [order[r::dp] for r in range(dp)]
    depth = max((len(p) for p in per_rank), default=0)
    ranks: list[list[list[int]]] = [[] for _ in range(dp)]
    start = 0
    while start < depth:
        end, longest = start, 0
        while end < depth:  # grow while count × longest (over every rank's position) fits
            here = max(lens[p[end]] for p in per_rank if end < len(p))
            if (end - start + 1) * max(longest, here) > cap and end > start:
                break
            longest = max(longest, here)
            end += 1
        for r, p in enumerate(per_rank):
            ranks[r].append(p[start:end])
        start = end
    return to_plan(ranks)


def plan_fixed_mbs(seq_lens: np.ndarray, *, dp: int, cap: int, max_len: int) -> PeerPlan:
    """Static micro_batch_size = cap // max_len on contiguous equal shares (see module note)."""
    n = len(seq_lens)
    mbs = max(1, cap // max_len)
    shares = np.array_split(np.arange(n), dp)
    return to_plan([[s[i:i + mbs].tolist() for i in range(0, len(s), mbs)] for s in shares])


def _width_2d(idx: list[int], lens: list[int], plens: list[int]) -> int:
    return max(plens[i] for i in idx) + max(lens[i] - plens[i] for i in idx)


def plan_unirl_2d(seq_lens: np.ndarray, prompt_lens: np.ndarray, *, dp: int, cap: int) -> PeerPlan:
    """UniRL: per-rank FFD under the 2D budget, count MAX, re-partition to exactly k (see module note)."""
    lens = [int(x) for x in seq_lens]
    plens = [int(x) for x in prompt_lens]
    shares = [s.tolist() for s in np.array_split(np.arange(len(lens)), dp)]
    ffd: list[list[list[int]]] = []
    for share in shares:
        bins: list[list[int]] = []
        for i in sorted(share, key=lambda i: (-lens[i], i)):
            for b in bins:
                if (len(b) + 1) * _width_2d(b + [i], lens, plens) <= cap:
                    b.append(i)
                    break
            else:
                bins.append([i])
        ffd.append(bins)
    k = max((len(b) for b in ffd), default=0)
    out = []
    for share, bins in zip(shares, ffd):
        if len(bins) == k:
            out.append(bins)
            continue
        parts: list[list[int]] = [[] for _ in range(k)]  # LPT on tokens into exactly k bins
        load = [0] * k
        for i in sorted(share, key=lambda i: (-lens[i], i)):
            j = min(range(k), key=lambda j: (load[j], j))
            parts[j].append(i)
            load[j] += lens[i]
        out.append(parts)
    return to_plan(out)
