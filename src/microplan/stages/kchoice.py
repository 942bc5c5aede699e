"""Choose K (micro-batches per rank) by predicted step time, and bound the step time from below.

Design note. A micro-batch of samples L_1..L_n (T = Σ L) costs Σ s(L_i) + g(T) + per_micro,
with s the additive sample cost and g the packed-row term of the cost model (g ≡ 0 for varlen
kernels, pq·T² for a dense masked kernel; g convex with g(0) = 0). For B non-empty
micro-batches holding N tokens, convexity gives Σ_b g(T_b) >= B·g(N/B) (Jensen), so with G
GPUs and B <= min(dp·K, n) micro-batches the step time under either sync mode is at least

    LB(K) = max( (Σ s + B·g((N − N_B)/B)) / G + K·per_micro ,  max_i s(L_i) / c_max + per_micro )

(the packed term is paid only by micro-batches of two or more samples, so at most B samples —
the longest, N_B tokens — escape it).

- Additive costs (g ≡ 0): LB is non-decreasing in K, so the fewest micro-batches that fit the
  cap are best: K starts at K_lb = ⌈bins_lb / dp⌉ (aligned) and grows when packing fails, or —
  ``probe="slack"`` — by one step when the packed plan sits more than ``SLACK`` above its bound
  and the next K packs faster (a cap-tight K leaves no room to balance; ``"walk"`` keeps going).
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

from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from ..cost.models import CostModel, bin_costs, is_additive
from ..types import KChoice
from .assign import arrange, grid_time

__all__ = ["KChoice", "step_time", "time_lower_bounds", "best_lower_bound", "packed_slope", "MAX_EVALS",
           "choose_k", "SLACK"]

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
    mc = bin_costs(cost, additive, tokens, np.bincount(bin_of, minlength=nb))
    if width > 1:
        mc = (mc - cost.per_micro) / width + cost.per_micro
    grid = arrange(mc, dp, K)
    return grid_time(mc[grid], sync)


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
    top_one = float(costs.max()) if single is None else single
    if not is_additive(cost):
        # dense kernel: a pack of >= 2 samples pays linear·T + g(T) and no per-sample attention; at
        # most B samples (the longest: N_B tokens) sit alone, so the packs hold >= N − N_B tokens
        g = cost.packed_costs  # type: ignore[attr-defined]
        lin = float(getattr(cost, "linear", 0.0))
        top = np.cumsum(np.sort(lf)[::-1])
        alone = top[np.minimum(B.astype(np.int64), n) - 1]
        body = np.full(Ks.size, lin * N)
        if single is None:  # (with prefix segments a lone micro-batch holds a whole path: no bound kept)
            body = body + B * g(np.maximum(N - alone, 0.0) / B)
            top_one = float(np.minimum(costs, lin * lf + g(lf)).max())
    lb = np.maximum(body / gpus + Ks * pm, top_one / max_width + pm)
    if lockstep and single is None and cap is not None and max_width == 1 and bins_per_k > 1 and n > 1:
        D = bins_per_k
        top = int(np.argmax(costs))
        M = float(costs[top]) + pm
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


Packer = Callable[[int], Any]            # K -> a packing at K, or None when none was found
Timer = Callable[[int, Any], float]      # (K, packing) -> predicted step time
Probe = Literal["none", "slack", "walk"]

SLACK = 2e-3  # probe="slack": try K + align when the packed plan is this far above its lower bound


def choose_k(K0: int, k_hi: int, align: int, *, additive: bool, lower_bounds: Callable[[np.ndarray], np.ndarray],
             pack: Packer, time: Timer, sync: str, probe: Probe = "slack") -> tuple[int, Any, KChoice]:
    """The K of lowest predicted time and its packing (see the module note), for any packer.

    ``K0``: the aligned lower bound; ``k_hi``: the largest aligned K that needs no placeholder.
    Additive costs (or ``k_hi <= K0``): the smallest K >= K0 that packs, then ``probe``:
    ``"slack"`` tries one more micro-batch per rank when the packed time is more than ``SLACK``
    above its lower bound (a cap-tight K leaves no room to balance); ``"walk"`` keeps trying
    larger K while the next K's lower bound is below the best time and the time improves (local
    placement: a pinned rank whose micro-batches are all nearly full). A packed-row term: a
    pattern search over aligned K from the better of K0 and argmin ``lower_bounds`` (±step,
    doubled after an improvement, halved otherwise; ``MAX_EVALS`` packings at most); when nothing
    in range packs, grow past it. The global planner (``fit.py``) and local placement
    (``local.py``) differ only in ``pack``, ``time`` and ``probe``.
    """
    if additive or k_hi <= K0:
        K, got, choice = _grow(K0, K0, align, pack, time, [])
        if probe == "none" or K + align > k_hi:
            return K, got, choice
        return _probe_above(K, got, choice, k_hi, align, lower_bounds, pack, time, sync, walk=probe == "walk")
    Ks = np.arange(K0, k_hi + 1, align)
    start = int(Ks[int(np.argmin(lower_bounds(Ks)))])  # where the bound is lowest; K0 is tried too
    done: dict[int, tuple[float, Any]] = {}
    order: list[int] = []

    def evaluate(K: int) -> float:
        got = pack(K)
        t = float("inf") if got is None else time(K, got)
        done[K] = (t, got)
        order.append(K)
        return t

    evaluate(K0)  # the fewest micro-batches: best when the packed term is small
    if start != K0:
        evaluate(start)
    best = min(done, key=lambda k: (done[k][0], k))
    step = align
    while len(done) < MAX_EVALS and step >= align:  # pattern search: double the step while it improves
        moved = False
        for K in (best + step, best - step):
            if K0 <= K <= k_hi and K not in done and len(done) < MAX_EVALS and evaluate(K) < done[best][0]:
                best, moved = K, True
                break
        step = 2 * step if moved else (step // 2) // align * align
    best_t = done[best][0]
    if not np.isfinite(best_t):  # nothing fitted the cap in range: grow past the searched Ks
        return _grow(max(done) + align, K0, align, pack, time, [(k, done[k][0]) for k in order])
    K = min(k for k in done if done[k][0] == best_t)
    cands = tuple((k, done[k][0]) for k in order)
    listing = ", ".join(f"K={k}: {t:.4g}" for k, t in sorted(cands))
    why = (f"K={K} has the lowest predicted {'lockstep' if sync == 'micro' else 'step-sync'} time of the "
           f"K tried ({listing}); the cost's packed-row term makes fewer, larger micro-batches slower "
           f"(lower bound K={K0})")
    return K, done[K][1], KChoice(K, K0, cands, why)


def _probe_above(K: int, got: Any, choice: KChoice, k_hi: int, align: int,
                 lower_bounds: Callable[[np.ndarray], np.ndarray], pack: Packer, time: Timer,
                 sync: str, *, walk: bool) -> tuple[int, Any, KChoice]:
    """Try K above the fewest that packs while that can still be faster (see choose_k)."""
    tried = list(choice.candidates)
    best_K, best, best_t = K, got, tried[-1][1]
    if not walk and not best_t > float(lower_bounds(np.array([K]))[0]) * (1 + SLACK):
        return K, got, choice
    k = K + align
    while k <= k_hi and len(tried) < MAX_EVALS and (not walk or float(lower_bounds(np.array([k]))[0]) <
                                                        best_t * (1 - 1e-12)):
        cand = pack(k)
        t = float("inf") if cand is None else time(k, cand)
        tried.append((k, t))
        if not t < best_t * (1 - 1e-9):
            break
        best_K, best, best_t = k, cand, t
        if not walk:
            break
        k += align
    if best_K == K:
        return K, got, KChoice(K, choice.lower_bound, tuple(tried), choice.reason)
    listing = ", ".join(f"K={k}: {t:.4g}" for k, t in sorted(tried))
    why = (f"K={best_K} has the lowest predicted {'lockstep' if sync == 'micro' else 'step-sync'} time of the K "
           f"tried ({listing}): at fewer micro-batches the cap leaves too little room to balance, and the extra "
           f"per-micro cost is smaller than the gain (lower bound K={choice.lower_bound})")
    return best_K, best, KChoice(best_K, choice.lower_bound, tuple(tried), why)


def _grow(K: int, K0: int, align: int, pack: Packer, time: Timer,
          tried: list[tuple[int, float]]) -> tuple[int, Any, KChoice]:
    """The smallest K >= the given one that packs (additive costs: the fastest K that fits)."""
    while True:
        got = pack(K)
        if got is not None:
            break
        tried.append((K, float("inf")))
        K += align  # the caller's packer succeeds once every sample has its own micro-batch
    tried.append((K, time(K, got)))
    if K == K0:
        why = (f"K={K} is the lower bound ⌈bins/dp⌉ (aligned); the cost has no packed-row term, so more "
               "micro-batches only add per-micro cost")
    else:
        why = f"K={K}: the fewest micro-batches per rank a packing under the cap was found for (lower bound {K0})"
    return K, got, KChoice(K, K0, tuple(tried), why)
