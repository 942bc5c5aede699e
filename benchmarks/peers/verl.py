"""verl (verl-project/verl, 2026-08) ``seqlen_balancing`` + PPO trainer ``_balance_batch``.

Re-implemented from PEERS.md, not from upstream source:

1. Workload per sample ``24576·L + L²`` (hard-coded for hidden size 4096; the ``cost`` argument
   is ignored, as upstream ignores the model).
2. DP split (``_balance_batch``): pad the step with 2-token zero-loss samples to a multiple of
   dp, then Karmarkar–Karp with ``equal_size=True`` into dp partitions on workload. Prompt groups
   are not kept together.
3. Micro-batches per rank (``rearrange_micro_batches``): ``k_r = min(n_r, ceil(tokens_r / cap))``
   (pads included), ``k = max_r k_r`` (the all-reduce MAX over the DP group, simulated), rounded
   up to a multiple of the virtual-pipeline group (``align``) and raised to ``min_num_micro_batch``
   (verl's knob for pipeline parallelism; None: no minimum), then KK with ``equal_size=False``
   into k parts on workload. No per-micro cap check, so a micro-batch can exceed the cap; a rank
   with fewer samples than k gets empty micro-batches.
4. Order: micro-batches sorted by workload descending, then the even positions reversed followed
   by the odd positions (light ends, heavy middle).

The 2-token pad samples are dropped from the returned plan (a micro-batch holding only pads is
returned empty).
"""

from __future__ import annotations

import numpy as np

from ._common import PeerPlan, ceil_div, to_plan
from .kk import karmarkar_karp

__all__ = ["plan_verl", "verl_workload", "balance_batch", "micro_count", "rearrange_micro_batches"]

PAD_LEN = 2


def verl_workload(L: int) -> int:
    """verl's FLOPs estimate for one sample of length L (hidden size 4096 baked in)."""
    return 24576 * L + L * L


def _pipeline_order(micros: list[list[int]], work: list[int]) -> list[list[int]]:
    """Sort by workload descending; even positions reversed, then odd positions."""
    loads = [sum(work[i] for i in m) for m in micros]
    desc = sorted(range(len(micros)), key=lambda j: (-loads[j], j))
    order = desc[0::2][::-1] + desc[1::2]
    return [micros[j] for j in order]


def balance_batch(seq_lens: np.ndarray, dp: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Driver side: pad to a multiple of dp, KK equal_size into dp parts -> (parts, lens, work)."""
    n = len(seq_lens)
    lens = [int(x) for x in seq_lens] + [PAD_LEN] * ((-n) % dp)
    work = [verl_workload(L) for L in lens]
    return karmarkar_karp(work, dp, equal_size=True), lens, work


def micro_count(part: list[int], lens: list[int], cap: int) -> int:
    """One rank's own count before the all-reduce: min(n_r, ceil(tokens_r / cap))."""
    return min(len(part), ceil_div(sum(lens[i] for i in part), cap))


def rearrange_micro_batches(part: list[int], work: list[int], k: int, n: int) -> list[list[int]]:
    """Worker side: KK (unequal) into k micro-batches, pipeline order, pads (index >= n) dropped."""
    local = karmarkar_karp([work[i] for i in part], k, equal_size=False)
    micros = _pipeline_order([[part[j] for j in m] for m in local], work)
    return [[i for i in m if i < n] for m in micros]


def plan_verl(seq_lens: np.ndarray, *, dp: int, cap: int, align: int = 1, cost=None,
              min_num_micro_batch: int | None = None) -> PeerPlan:
    """One step laid out the verl way (see module docstring). ``cost`` is ignored (hard-coded).

    Runs every rank's micro-batching in turn; upstream each worker runs its own in parallel
    (bench_speed reports that critical path too).
    """
    parts, lens, work = balance_batch(seq_lens, dp)
    k = max(micro_count(p, lens, cap) for p in parts)  # all_reduce(MAX) over the DP group
    if min_num_micro_batch is not None:
        k = max(k, min_num_micro_batch)                # pipeline parallelism: at least this many
    if align > 1:
        k = ceil_div(k, align) * align                  # virtual-pipeline group
    return to_plan([rearrange_micro_batches(p, work, k, len(seq_lens)) for p in parts])
