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
  The slack test tries the O(n) bound without the lockstep slot term first (``quick_bounds``, never
  above LB): a plan within ``SLACK`` of it needs no slot term's O(n log n) sort (the usual case:
  steps sit just above it).
- A packed term: LB(K) trades g (falls with K) against per_micro (grows with K), and the packed
  plans' predicted time is not unimodal in K (lone samples skip the packed term, so it drops
  wherever a few more samples get a micro-batch of their own). The search is global over the
  aligned K from K_lb (the cap) to n/dp (one sample per micro-batch; no placeholder by choice):
  both ends, argmin LB(K) and an even grid of ``GRID`` points, then bracketing — halve the gaps
  on both sides of the best K so far until they close. A K whose LB(K) is not below the best
  time found is never packed (the cost model's bound on both sides); at most ``MAX_EVALS``
  packings. Every K tried is reported with its predicted time in :class:`KChoice`, so
  ``Plan.stats`` can say why K was chosen (benchmarks/bench_meter.py compares the chosen K with
  every K of the same packer).

Guarantees: the chosen K is one of the evaluated candidates with the lowest predicted time
(ties → smaller K); the time lower bound of a step is min_K LB(K) over K >= K_lb, a true lower
bound for every plan the config allows. Cost: O(n) per LB scan, one packing per candidate (at
most ``MAX_EVALS``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from .._sort import stable_argsort
from ..cost.gpu import gpu_bin_costs
from ..cost.models import CostModel, is_additive
from ..types import KChoice
from .assign import arrange, grid_time

__all__ = ["KChoice", "step_time", "step_slots", "time_lower_bounds", "best_lower_bound", "packed_slope", "MAX_EVALS",
           "choose_k", "choose_k_pipeline", "SLACK"]

MAX_EVALS = 24  # packings tried per step when the cost has a packed-row term
PIPELINE_EVALS = 12  # ... when K is chosen by pipeline time (each also times the step's constructed orders)
GRID = 6        # interior points of the first, even look over the K range


def step_time(bin_of: np.ndarray, num_bins: int, dp: int, K: int, lens: np.ndarray, costs: np.ndarray,
              cost: CostModel, sync: str, *, width: int = 1) -> float:
    """Predicted time of a step packed as ``bin_of`` into ``num_bins`` real micro-batches.

    The dp·K − num_bins placeholders cost ``per_micro`` only; micro-batches are arranged into
    slots by :func:`arrange` exactly as the planner will arrange them. ``width``: the static CP
    degree (each GPU of a group pays :func:`~microplan.cost.cp.cp_micro_costs`).
    """
    mc, grid = step_slots(bin_of, dp, K, lens, costs, cost, width=width)
    return grid_time(mc[grid], sync)


def step_slots(bin_of: np.ndarray, dp: int, K: int, lens: np.ndarray, costs: np.ndarray, cost: CostModel, *,
               width: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The per-GPU cost of each of the dp·K micro-batches of ``bin_of`` and their slot grid
    (:func:`arrange`), as :func:`step_time` prices them."""
    nb = dp * K
    additive = np.bincount(bin_of, weights=costs, minlength=nb)
    tokens = np.bincount(bin_of, weights=lens, minlength=nb)
    mc = gpu_bin_costs(cost, additive, tokens, np.bincount(bin_of, minlength=nb), width)
    return mc, arrange(mc, dp, K)


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
        order = stable_argsort(dens, descending=True)
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
             pack: Packer, time: Timer, sync: str, probe: Probe = "slack",
             quick_bounds: Callable[[np.ndarray], np.ndarray] | None = None) -> tuple[int, Any, KChoice]:
    """The K of lowest predicted time and its packing (see the module note), for any packer.

    ``K0``: the aligned lower bound; ``k_hi``: the largest aligned K that needs no placeholder.
    Additive costs (or ``k_hi <= K0``): the smallest K >= K0 that packs, then ``probe``:
    ``"slack"`` tries one more micro-batch per rank when the packed time is more than ``SLACK``
    above its lower bound (a cap-tight K leaves no room to balance); ``"walk"`` keeps trying
    larger K while the next K's lower bound is below the best time and the time improves (local
    placement: a pinned rank whose micro-batches are all nearly full). A packed-row term: the
    global search of the module note over aligned K in [K0, k_hi] (``MAX_EVALS`` packings at most); when nothing
    in range packs, grow past it. The global planner (``fit.py``) and local placement
    (``local.py``) differ only in ``pack``, ``time`` and ``probe``. ``quick_bounds``: a cheaper
    bound, never above ``lower_bounds``, tried first by the ``"slack"`` test (a plan within
    ``SLACK`` of it is within ``SLACK`` of the full bound: the same decision, without the full
    bound's O(n log n) slot term).
    """
    if additive or k_hi <= K0:
        K, got, choice = _grow(K0, K0, align, pack, time, [])
        if probe == "none" or K + align > k_hi:
            return K, got, choice
        return _probe_above(K, got, choice, k_hi, align, lower_bounds, pack, time, sync, walk=probe == "walk",
                            quick_bounds=quick_bounds)
    return _search(K0, k_hi, align, lower_bounds, pack, time, sync)


def choose_k_pipeline(K_flat: int, k_hi: int, align: int, *, K0: int, lower_bounds: Callable[[np.ndarray], np.ndarray],
                      pack: Packer, time: Timer, exact: Timer, sync: str) -> tuple[int, Any, KChoice]:
    """K by predicted *pipeline* time, bubble included: the global search of the module note over
    aligned K in [K_flat, k_hi] on ``time`` (the makespan in the best constructed order, no local
    search: cheap), then ``exact`` (the makespan in the order the planner will run: ``exact <=
    time``) for ``K_flat`` and for the best K until the best one is exactly timed. ``K_flat`` —
    the K of least lockstep time — is ``candidates[0]``, so the K returned is never predicted
    slower than it (``K0``: the cap's lower bound, reported). More, smaller micro-batches shrink
    the bubble ((p − 1) stage-slots of the heaviest ones) at the price of per_micro."""
    return _search(K_flat, max(k_hi, K_flat), align, lower_bounds, pack, time, sync, max_evals=PIPELINE_EVALS,
                   lower_bound=K0, exact=exact,
                   why="the pipeline bubble (1F1B / interleaved, in the pipeline order) shrinks with more, smaller "
                       f"micro-batches while per_micro grows; K={K_flat}, first, is the K of least lockstep time")


def _search(K0: int, k_hi: int, align: int, lower_bounds: Callable[[np.ndarray], np.ndarray], pack: Packer,
            time: Timer, sync: str, *, max_evals: int | None = None, why: str | None = None,
            lower_bound: int | None = None, exact: Timer | None = None) -> tuple[int, Any, KChoice]:
    """The global search of a packed-row cost over the aligned K in [K0, k_hi] (module note)."""
    budget = MAX_EVALS if max_evals is None else max_evals
    Ks = np.arange(K0, k_hi + 1, align)
    lbs = lower_bounds(Ks)
    lb_of = dict(zip(Ks.tolist(), lbs.tolist()))
    done: dict[int, tuple[float, Any]] = {}
    order: list[int] = []

    def evaluate(K: int) -> None:
        if K in done or len(done) >= budget:
            return
        got = pack(K)
        done[K] = (float("inf") if got is None else time(K, got), got)
        order.append(K)

    def best() -> tuple[int, float]:
        k = min(done, key=lambda k: (done[k][0], k))
        return k, done[k][0]

    # 1. both ends, where the bound is lowest, and an even grid over the range (the predicted time is
    #    not unimodal in K: a coarse look first, so no basin is missed)
    for K in (K0, int(Ks[int(np.argmin(lbs))]), k_hi):
        evaluate(K)
    for K in np.unique(Ks[np.linspace(0, Ks.size - 1, GRID + 2).round().astype(np.int64)]).tolist():
        if lb_of[K] < best()[1]:
            evaluate(K)
    # 2. bracketing: halve the gaps on both sides of the best K tried until they close; a K whose
    #    lower bound is not below the best time so far is never packed (the cost-model bounds)
    while len(done) < budget:
        k, t = best()
        tried = sorted(done)
        i = tried.index(k)
        mids = []
        for a, b in ((tried[i - 1] if i else None, k), (k, tried[i + 1] if i + 1 < len(tried) else None)):
            if a is None or b is None:
                continue
            mid = (a + b) // 2 // align * align
            mid = mid if mid > a else mid + align
            if a < mid < b and lb_of[mid] < t:
                mids.append(mid)
        if not mids:
            break
        for mid in mids:
            evaluate(mid)
    if exact is not None:  # re-time with the exact timer until the best K is exactly timed (exact <= time)
        timed: set[int] = set()
        for k in [K0] + sorted(done, key=lambda k: (done[k][0], k)):
            if k in timed or done[k][1] is None:
                continue
            if timed and done[k][0] >= min(done[j][0] for j in timed):
                break  # no K left whose upper bound beats an exactly timed one
            done[k] = (exact(k, done[k][1]), done[k][1])
            timed.add(k)
    K, best_t = best()
    if not np.isfinite(best_t):  # nothing fitted the cap in range: grow past the searched Ks
        return _grow(max(done) + align, K0, align, pack, time, [(k, done[k][0]) for k in order])
    cands = tuple((k, done[k][0]) for k in order)
    live = [k for k in Ks.tolist() if lb_of[k] < best_t * (1 - 1e-12)]
    span = f"K={min(live)}..{max(live)}" if live else "no other K"
    listing = ", ".join(f"K={k}: {t:.4g}" for k, t in sorted(cands))
    what = "pipeline" if why else ("lockstep" if sync == "micro" else "step-sync")
    start = "the lockstep K" if why else "the cap's lower bound"
    why = (f"K={K} has the lowest predicted {what} time of the K tried ({listing}); "
           f"{why or 'the cost’s packed-row term makes fewer, larger micro-batches slower'}. Searched "
           f"K={K0}..{k_hi} ({start} to one sample per micro-batch); by the cost's lower bound only {span} could beat it")
    return K, done[K][1], KChoice(K, K0 if lower_bound is None else lower_bound, cands, why)


def _probe_above(K: int, got: Any, choice: KChoice, k_hi: int, align: int,
                 lower_bounds: Callable[[np.ndarray], np.ndarray], pack: Packer, time: Timer,
                 sync: str, *, walk: bool,
                 quick_bounds: Callable[[np.ndarray], np.ndarray] | None = None) -> tuple[int, Any, KChoice]:
    """Try K above the fewest that packs while that can still be faster (see choose_k)."""
    tried = list(choice.candidates)
    best_K, best, best_t = K, got, tried[-1][1]
    if not walk:
        for bounds in ((quick_bounds, lower_bounds) if quick_bounds is not None else (lower_bounds,)):
            if not best_t > float(bounds(np.array([K]))[0]) * (1 + SLACK):  # within the slack of a bound <= LB
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
