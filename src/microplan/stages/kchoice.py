"""Choose K (micro-batches per rank) by predicted step time, and bound the step time from below.

Design note. A micro-batch of samples L_1..L_n (T = Σ L) costs Σ s(L_i) + g(T) + per_micro,
with s the additive sample cost and g the packed-row term of the cost model (g ≡ 0 for varlen
kernels, pq·T² for a dense masked kernel; g convex with g(0) = 0). For B non-empty
micro-batches holding N tokens, convexity gives Σ_b g(T_b) >= B·g(N/B) (Jensen), so with G
GPUs and B <= min(dp·K, n) micro-batches the step time under either sync mode is at least

    LB(K) = max( (Σ s + B·g(N/B)) / G + K·per_micro ,  max_i (s(L_i) + g(L_i)) / c_max + per_micro ).

- Additive costs (g ≡ 0): LB is non-decreasing in K, so the fewest micro-batches that fit the
  cap are best: K starts at K_lb = ⌈bins_lb / dp⌉ (aligned) and grows only when packing fails.
- A packed term: LB(K) trades g (falls with K) against per_micro (grows with K). The search
  packs K_lb and argmin LB(K) over the aligned K without placeholders, then runs a pattern
  search on the *packed* plans' predicted times (±step, doubled after an improvement, halved
  otherwise; at most ``MAX_EVALS`` packings). Every K tried is reported with its predicted time in
  :class:`KChoice`, so ``Plan.stats`` can say why K was chosen.

Guarantees: the chosen K is one of the evaluated candidates with the lowest predicted time
(ties → smaller K); the time lower bound of a step is min_K LB(K) over K >= K_lb, a true lower
bound for every plan the config allows. Cost: O(n) per LB scan, one packing per candidate.
"""

from __future__ import annotations

import numpy as np

from ..cost.models import CostModel, bin_costs, is_additive
from ..types import KChoice
from .assign import arrange

__all__ = ["KChoice", "step_time", "time_lower_bounds", "best_lower_bound", "packed_slope", "MAX_EVALS"]

MAX_EVALS = 12  # packings tried per step when the cost has a packed-row term


def step_time(bin_of: np.ndarray, num_bins: int, dp: int, K: int, lens: np.ndarray, costs: np.ndarray,
              cost: CostModel, sync: str, *, width: int = 1) -> float:
    """Predicted time of a step packed as ``bin_of`` into ``num_bins`` real micro-batches.

    The dp·K − num_bins placeholders cost ``per_micro`` only; micro-batches are arranged into
    slots by :func:`arrange` exactly as the planner will arrange them. ``width``: the static CP
    degree (each GPU of a group does 1/width of the token work).
    """
    nb = dp * K
    additive = np.bincount(bin_of, weights=costs, minlength=nb)
    tokens = np.bincount(bin_of, weights=lens, minlength=nb)
    mc = bin_costs(cost, additive, tokens)
    if width > 1:
        mc = (mc - cost.per_micro) / width + cost.per_micro
    grid = arrange(mc, dp, K)
    per = mc[grid]
    return float(per.max(axis=0).sum()) if sync == "micro" else float(per.sum(axis=1).max())


def packed_slope(cost: CostModel, T: float) -> float:
    """g'(T) of the cost's packed-row term (0 without one): the marginal cost of a token in a row of T."""
    if is_additive(cost) or T <= 0:
        return 0.0
    g = cost.packed_costs  # type: ignore[attr-defined]
    h = max(T * 1e-3, 1.0)
    return float((g(np.array([T + h]))[0] - g(np.array([max(T - h, 0.0)]))[0]) / (T + h - max(T - h, 0.0)))


def time_lower_bounds(costs: np.ndarray, lens: np.ndarray, Ks: np.ndarray, *, bins_per_k: int, gpus: int,
                      max_width: int, cost: CostModel, cap: int | None = None, lockstep: bool = False,
                      single: float | None = None) -> np.ndarray:
    """LB(K) of the module note for each K in ``Ks`` (same order).

    With ``lockstep`` and a ``cap`` (no CP) the slot bound below is added: the slot that runs the
    costliest sample i* waits for it, while its other dp − 1 micro-batches can absorb at most the
    costliest (dp − 1)·cap tokens (a fractional knapsack by cost per token over the other
    samples, plus their per-micro and packed-row terms), so
    lockstep >= M·(1 − 1/dp) + (total work − that absorbable work) / dp.

    ``single``: the items are not samples but pieces of work any plan does at least once (the
    segments of a step's prefix trie, which micro-batches may duplicate): then ``single`` is the
    costliest micro-batch any plan must run (one whole sample, per_micro excluded), the sum bound
    uses only Jensen, and the slot bound is off.
    """
    Ks = np.asarray(Ks, dtype=np.int64)
    n = lens.size
    if n == 0:
        return np.zeros(Ks.size)
    S, N = float(costs.sum()), float(lens.sum())
    pm = float(cost.per_micro)
    B = np.minimum(bins_per_k * Ks, n).astype(np.float64)
    lf = lens.astype(np.float64)
    body = np.full(Ks.size, S)
    one = costs
    if not is_additive(cost):
        g = cost.packed_costs  # type: ignore[attr-defined]
        each = g(lf)
        jensen = B * g(N / B)
        body = body + (jensen if single is not None else np.maximum(jensen, float(each.sum())))  # T_b >= L_i
        one = costs + each
    top_one = float(one.max()) if single is None else single
    lb = np.maximum(body / gpus + Ks * pm, top_one / max_width + pm)
    if lockstep and single is None and cap is not None and max_width == 1 and bins_per_k > 1 and n > 1:
        D = bins_per_k
        top = int(np.argmax(one))
        M = float(one[top]) + pm
        rest = np.delete(np.arange(n), top)
        dens = costs[rest] / lf[rest]
        order = np.argsort(-dens, kind="stable")
        tok = np.cumsum(lf[rest][order])
        budget = float((D - 1) * cap)
        full = int(np.searchsorted(tok, budget, side="right"))
        absorb = float(costs[rest][order][:full].sum())
        if full < order.size:
            left = budget - (float(tok[full - 1]) if full else 0.0)
            absorb += left * float(dens[order[full]])
        extra = 0.0 if is_additive(cost) else float(cost.packed_costs(np.array([float(cap)]))[0])  # type: ignore[attr-defined]
        absorb += (D - 1) * (extra + pm)
        total = body + D * Ks * pm
        lb = np.maximum(lb, M * (1 - 1 / D) + (total - absorb) / D)
    return lb


def best_lower_bound(costs: np.ndarray, lens: np.ndarray, K_lb: int, *, bins_per_k: int, gpus: int,
                     max_width: int, cost: CostModel, cap: int | None = None, lockstep: bool = False,
                     single: float | None = None) -> float:
    """min over K >= K_lb of LB(K): a lower bound on the step time of any plan the config allows."""
    n = lens.size
    if n == 0:
        return 0.0
    if is_additive(cost):
        Ks = np.array([K_lb])
    else:
        top = max(K_lb, -(-n // max(bins_per_k, 1)))  # beyond one sample per micro-batch LB only grows
        Ks = np.arange(K_lb, top + 1)
    return float(time_lower_bounds(costs, lens, Ks, bins_per_k=bins_per_k, gpus=gpus, max_width=max_width,
                                   cost=cost, cap=cap, lockstep=lockstep, single=single).min())
