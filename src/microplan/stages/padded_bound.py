"""A lower bound on padded lockstep time that counts row granularity (``layout="padded"``).

Design note. In a padded layout a micro-batch of k samples is ``[k, W]``, W its longest sample
rounded up to the width multiple, and costs ``per_micro + k·r(W, k)`` (``row_costs``: every row
is a sequence of W); placeholders cost per_micro. The lockstep time of dp·K micro-batches is
Σ_m max_r, attained by ``assign.arrange``. The bound rests on three facts:

1. *Contiguity lemma.* Some optimal plan cuts the samples, sorted by length, into contiguous
   runs. Proof: take any plan, order its micro-batches by width W_1 ≥ W_2 ≥ ... and give the
   first one the k_1 longest samples, the next one the next k_2, and so on (same counts). Every
   sample longer than W_j lies in micro-batches 1..j-1, so the (k_1+...+k_{j-1}+1)-th longest
   sample, the new width of micro-batch j, is at most W_j. Counts are kept and widths do not
   grow, so no cost (monotone in W) and no footprint k·W grows, nor does the lockstep time
   (monotone in every cost). So exhaustive search and this bound need only runs.
2. *Padding volume.* Lockstep time ≥ (Σ of all dp·K costs) / dp = K·per_micro + P/dp, P the
   padded cost of the runs: P ≥ P*(dp·K), the least padded cost of any cut into at most dp·K
   runs under the cap. Each micro-batch costs a whole multiple of its row — the granularity the
   token bound ignores. P*(M) is bounded from below by Lagrangian duality: for every λ ≥ 0,
   P*(M) ≥ g(λ) − λ·M with g(λ) = min over cuts of (P + λ·runs), one O(n·k_max) dynamic program
   per λ (a run is [a, a+k), costs k·r(W_a, k); fewer runs than M are allowed, so g is
   monotone and the best λ on a grid is kept; any λ gives a valid bound).
3. *Forced heads.* Let u_i be the least body holding sample i (alone, or two rows of its
   width) and v_i = 2·r(w_i, 2) the least body of a multi-row run holding it (inf when two rows
   of w_i break the cap); both fall with the length. If slot 0's head is τ, no run costs more
   than τ, so the J(τ) = #{i: v_i > τ} longest samples sit in J distinct runs (two of them in
   one run would cost at least v_J > τ): at least s·dp + 1 runs cost u_{s·dp+1} or more, and
   slot s's head is at least that for s·dp + 1 ≤ J. So the heads sum to at least
   τ + Σ_{s=1}^{K-1} [s·dp + 1 ≤ J(τ)]·u_{s·dp+1} (no plan at all when J > dp·K), least over
   τ ∈ {u_1} ∪ {v_i ≥ u_1} (J steps down at each v_i). Long samples that cannot share a row
   pair (the cap, or a lone row much cheaper than a padded one) are where this beats the volume.

The bound is min over K of K·per_micro + max(P*(dp·K)/dp, forced heads at K), K from the fewest
runs the cap allows (over dp) to ⌈n/dp⌉: more slots than ⌈n/dp⌉ leave a whole slot of
placeholders, which a plan can drop for per_micro less. It is valid for ``padded-2d`` too (a 2D
row is at least as wide as the sample). It is *not* tight: slots of dp micro-batches whose costs
are few multiples of a row cannot be levelled, and that residue is what the exhaustive optimum
(benchmarks/padded_optimum.py) measures. On a long tail fact 3 rarely exceeds the volume (plenty
of short samples fill slot 0); it helps where several samples share the longest length. Cost:
one O(n·k_max·λ) pass over the starts for ~50 λ at once (a benchmark and test tool, not on the
plan path); fact 3 is O(n·K).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..cost.models import CostModel, row_costs

__all__ = ["PaddedBound", "padded_lower_bound", "min_padded_cost"]

LAMBDAS = 48  # Lagrange multipliers tried (geometric grid); any multiplier gives a valid bound


class PaddedBound(NamedTuple):
    """A lower bound on the padded lockstep time of every plan of one step."""

    time: float        # the bound: min over K of bound_at[K]
    K: int             # the K attaining it
    K_min: int         # the fewest micro-batches per rank the cap allows
    volume: float      # min over K of K·per_micro + P*(dp·K)/dp (the padding-volume part alone)


def _sorted(lens: np.ndarray, width_multiple: int) -> np.ndarray:
    w = -np.sort(-np.asarray(lens, dtype=np.int64))
    return -(-w // width_multiple) * width_multiple


def _max_rows(w: np.ndarray, cap: int | None) -> np.ndarray:
    """Most rows of a run starting at each sorted position (cap and the samples left)."""
    n = w.size
    left = n - np.arange(n)
    return left if cap is None else np.minimum(left, np.maximum(cap // w, 1))


def _fewest_runs(k_max: np.ndarray) -> int:
    """Fewest contiguous runs under the cap (greedy longest run is optimal: k_max never falls)."""
    i, runs = 0, 0
    while i < k_max.size:
        i += int(k_max[i])
        runs += 1
    return runs


def min_padded_cost(w: np.ndarray, k_max: np.ndarray, cost: CostModel, lams: np.ndarray) -> np.ndarray:
    """g(λ) for every λ in ``lams``: the least (padded cost + λ·runs) of any cut of the sorted widths
    ``w`` into runs; a run [a, a+k) costs k·r(w_a, k), k ≤ k_max[a]. One pass over the starts, all λ
    at once."""
    n = w.size
    lams = np.asarray(lams, dtype=np.float64)
    f = np.full((n + 1, lams.size), np.inf)
    f[0] = 0.0
    top = int(k_max.max(initial=1))
    ks = np.arange(1, top + 1)
    wf = np.repeat(w.astype(np.float64)[:, None], top, axis=1)
    body = ks * row_costs(cost, wf, ks[None, :])  # body[a, k-1]: k rows of the width at a
    for a in range(n):
        k = int(k_max[a])
        seg = f[a + 1:a + 1 + k]
        np.minimum(seg, f[a] + body[a, :k, None] + lams, out=seg)
    return f[n]


def _heads(w: np.ndarray, row: np.ndarray, cost: CostModel, cap: int | None, dp: int, Ks: np.ndarray) -> np.ndarray:
    """For every K: the least Σ of slot heads the longest samples force (module note, fact 3).

    ``w``: widths sorted descending; ``row``: u_i, the least body holding sample i (alone or in a
    multi-row run). v_i = 2·r(w_i, 2) is the least cost of a run holding sample i and another (inf
    when two rows of w_i break the cap). With slot 0's head τ ≥ u_1, the J(τ) = #{v_i > τ} longest
    samples sit in J distinct runs, so the (s·dp+1)-th costliest run costs at least u_{s·dp+1}
    for s·dp + 1 <= J: the heads sum to at least τ + Σ_{s=1}^{K-1} [s·dp+1 <= J] u_{s·dp+1}, and
    no plan with J > dp·K runs exists. The least over τ in {u_1} ∪ {v_i} (J is a step function
    of τ, the sum grows with τ between steps) is the bound."""
    v = 2 * row_costs(cost, w, 2)
    if cap is not None:
        v = np.where(2 * w > cap, np.inf, v)
    taus = np.unique(np.concatenate([[row[0]], v[np.isfinite(v) & (v >= row[0])]]))
    J = np.searchsorted(-v, -taus, side="left")  # #{v_i > τ} (v is non-increasing)
    lead = row[::dp]  # u_{s·dp+1}, s = 0, 1, ...
    csum = np.concatenate([[0.0], np.cumsum(lead[1:])])  # csum[q] = Σ_{s=1}^{q} u_{s·dp+1}
    q = np.minimum(Ks[None, :] - 1, np.maximum(J[:, None] - 1, 0) // dp)  # slots s >= 1 forced
    q = np.minimum(q, lead.size - 1)
    f = taus[:, None] + csum[q]
    f = np.where(J[:, None] > dp * Ks[None, :], np.inf, f)
    return f.min(axis=0)


def padded_lower_bound(lens, *, dp: int, cap: int | None, cost: CostModel, width_multiple: int = 1,
                       K_min: int = 1) -> PaddedBound:
    """A lower bound on the lockstep time of every padded plan of these samples (module note).

    ``lens``: the step's sample lengths (tokens); ``cap``: the most padded tokens of one
    micro-batch (None: no cap); ``K_min``: the fewest micro-batches per rank the config allows
    otherwise (pipeline stages, ...).
    """
    w = _sorted(lens, width_multiple)
    n = int(w.size)
    pm = float(cost.per_micro)
    if n == 0:
        return PaddedBound(K_min * pm, K_min, K_min, K_min * pm)
    k_max = _max_rows(w, cap)
    k_lo = max(K_min, -(-_fewest_runs(k_max) // dp))
    k_hi = max(k_lo, -(-n // dp))
    Ks = np.arange(k_lo, k_hi + 1)
    wf = w.astype(np.float64)
    row = np.minimum(row_costs(cost, wf, 1), 2 * row_costs(cost, wf, 2))  # least body holding each sample
    top = float(n * row.max())  # a multiplier past this never changes the cut: all runs alone
    lams = np.concatenate([[0.0], np.geomspace(top * 1e-6, top, LAMBDAS)])
    g = min_padded_cost(w, k_max, cost, lams)
    p_star = np.max(g[None, :] - lams[None, :] * dp * Ks[:, None], axis=1)
    volume = Ks * pm + p_star / dp
    at = np.maximum(volume, Ks * pm + _heads(wf, row, cost, cap, dp, Ks))
    j = int(np.argmin(at))
    return PaddedBound(float(at[j]), int(Ks[j]), int(k_lo), float(volume.min()))
