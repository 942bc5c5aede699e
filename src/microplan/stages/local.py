"""Local placement: every sample stays on the DP rank that holds it (``PlanConfig(placement="local")``).

Design note. Trainers that dispatch data before planning (verl's workers, OpenRLHF's actors) can
only regroup each rank's own samples. Per step:

1. K: one count for every rank, agreed from every rank's lengths — the smallest aligned K
   (≥ the minimum micro count, e.g. pipeline stages) at which *every* rank packs its own samples
   under the cap (cap-aware LPT, then first-fit decreasing, then exhaustive search for small
   ranks), chosen by predicted time when the cost has a packed-row term (``kchoice.choose_k``,
   shared with the global planner). A MAX of the ranks' own counts is what the peers do; here
   the count is re-derived from all lengths so no rank guesses, and a rank that cannot fill K is
   a ``short_step`` decision, not a silent empty micro-batch.
2. Pack: every rank packs toward per-slot targets shared by all ranks — slot m's target is
   water-filled from the heaviest rank's total, never below the m-th heaviest sample of any rank
   (``fit.fill_targets``) — so the busiest rank spreads its work evenly while the others fill
   each slot no higher than that rank does.
3. Lift (lockstep, ≥ 2 busy ranks): a rank with a few coarse samples (three of 16k tokens among
   16, K = 4) cannot meet slot 0's target, and every slot waits for its heaviest rank, so slot
   0's target is raised to the heaviest bin some rank cannot avoid — first estimated (LPT of each
   rank's 2K heaviest atoms), then measured (the heaviest bin after LPT toward the targets, the
   rank refined and then repaired as in step 4, until the heaviest bin is a repaired one) — and
   every rank is refined toward the lifted targets (``refine.refine_bins`` with per-bin offsets,
   heaviest bin toward slot 0): the other ranks load slot 0 up to what the coarse rank forces
   there anyway and empty their later slots.
4. Repair (lockstep, ≥ 2 busy ranks): each slot's time is its heaviest rank's, so at dp 128 every
   rank must meet the targets, not most of them. A rank still above them is re-packed by
   Karmarkar–Karp differencing toward the targets (``local_refine.differencing_bins``, kept where
   it overshoots less), then up to ``REPAIR_ROUNDS`` exact re-splits of its bin furthest above
   its target pooled with another bin (``local_refine.repartition_pairs``): LPT and two-bin
   exchanges of single samples stop where only a three-way cycle helps (a rank whose two 16k-token
   samples share a micro-batch). Ranks furthest above go first; a rank whose every micro-batch is
   within what the repaired ranks keep above their targets in that slot is left as is.
5. Slots: each rank runs its micro-batches heaviest first (``assign.arrange`` on one rank). For
   fixed micro-batch costs this minimises the lockstep time Σ_m max_r cost(r, m): rank r's k
   heaviest micro-batches occupy k distinct slots, so the k-th largest slot maximum is at least
   max_r (k-th heaviest of rank r), which the sorted arrangement attains.
6. Polish (lockstep, at the chosen K): the ranks holding a slot's maximum move or swap atoms (and
   pairs of atoms) between their own bins against the other ranks' slot maxima
   (``local_refine.polish_local``); the lockstep time never rises.
7. Hedge (lockstep, ≥ 2 busy ranks, a cost whose attention term is known only to ±sd —
   ``FlopsCost.attention_rel_sd``, what ``CostMeter`` hands out): ``hedge.hedge_lockstep`` with
   ``same_rank=True`` moves and swaps atoms among each rank's own bins so every slot is level for
   attention × (1 − sd), × 1 and × (1 + sd); the slots it levelled are kept (bin r·K + m runs in
   slot m). Where one rank sets every slot's maximum there is nothing to level and nothing moves.
8. short_step: a rank with fewer samples than K gets placeholders (``pad``), trailing rollouts
   are dropped until every rank fills K (``drop``), or a PlanError names the ranks (``error``).

Guarantees: those of every plan (equal K, aligned, cap, coverage, exact loss scales computed
over the whole step exactly as in global placement) plus: every sample runs on ``rank_of``.
The bound the split allows is ``stats.split_lower_bound`` (the busiest rank's own bound at the
fewest micro-batches the fullest rank needs); the ranks' unequal totals are the split's, and no
local plan can recover them. benchmarks/bench_planners.py ("local" rows) measures lockstep over
that bound and the price of step 4 (``--planners microplan-local microplan-local-norepair``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import numpy as np

from ..config import PlanConfig
from ..cost.cp import cp_micro_costs
from ..cost.models import bin_costs, is_additive
from ..errors import PlanError
from ..types import KChoice
from .assign import grid_time
from .hedge import hedge_lockstep, hedge_scenarios
from .fit import adjusted_slope, cdiv, check_cap, effective_cap, fill_targets, pack_at, round_up
from .kchoice import choose_k, time_lower_bounds
from .layout import StepLayout
from .local_refine import RankBins, differencing_bins, others_max, overshoot, polish_local, repartition_pairs
from .pack import bins_lower_bound, lpt_pack_wide, round_robin_pack
from .fitted import Fit
from .short import drop_trailing, rollout_order
from .padded import pack_padded_at
from .refine import refine_bins

__all__ = ["fit_local"]

REPAIR = True  # step 4 of the module note (False: the plan before it, for timing side by side)
REPAIR_ROUNDS = 4  # pooled re-splits per rank (local_refine.repartition_pairs)
LIFT_GAP = 1e-3  # slot 0's target is lifted when some rank's heaviest bin exceeds it by this share

BinCost = Callable[[np.ndarray, np.ndarray, int], np.ndarray]  # (positions, bin_of, num_bins) -> cost per bin


class _Ranks:
    """The step's atoms grouped by owner rank (positions into the step)."""

    def __init__(self, owner: np.ndarray, lens: np.ndarray, costs: np.ndarray, D: int,
                 layout: StepLayout | None) -> None:
        order = np.argsort(owner, kind="stable")
        bounds = np.searchsorted(owner[order], np.arange(D + 1))
        self.pos = [order[bounds[r]:bounds[r + 1]] for r in range(D)]
        self.lens = [lens[p] for p in self.pos]
        self.costs = [costs[p] for p in self.pos]
        self.n = np.array([p.size for p in self.pos], dtype=np.int64)
        self.busy = np.flatnonzero(self.n)  # ranks holding atoms (the rest run placeholders only)
        ex = None if layout is None else layout.extra
        self.extra = [None if ex is None else (ex[0][p], ex[1]) for p in self.pos]
        self.padded = None if layout is None or layout.padded is None else [layout.padded.take(p) for p in self.pos]
        self.flat_pos = np.concatenate([self.pos[r] for r in self.busy.tolist()]) if self.busy.size else order
        self.additive_bins = False  # bins cost by the default bin cost (set by layout_local)
        self.leads: dict[tuple[int, bool], tuple[np.ndarray, float]] = {}  # _leads per (K, forced)


def _balance_costs(ranks: _Ranks, r: int, K: int, cfg: PlanConfig) -> np.ndarray:
    """Rank r's atoms in pack_at's first-order units (cost + the packed term's slope × tokens)."""
    if is_additive(cfg.cost):  # type: ignore[arg-type]
        return ranks.costs[r]
    lens, n = ranks.lens[r], int(ranks.n[r])
    return ranks.costs[r] + adjusted_slope(cfg.cost, lens, min(n, K)) * lens  # type: ignore[arg-type]


def _leads(ranks: _Ranks, K: int, cfg: PlanConfig, forced: bool = False) -> tuple[np.ndarray, float]:
    """(the m-th heaviest atom of any rank per slot, the heaviest rank's total), first-order units;
    ``forced``: slot 0 at least the heaviest bin LPT leaves from any rank's 2K heaviest atoms."""
    hit = ranks.leads.get((K, forced))
    if hit is not None:
        return hit[0].copy(), hit[1]
    lead, total = np.zeros(K), 0.0
    for r in ranks.busy.tolist():
        adj = _balance_costs(ranks, r, K, cfg)
        desc = -np.sort(-adj)[:2 * K]
        top = min(K, desc.size)
        lead[:top] = np.maximum(lead[:top], desc[:top])
        if forced and desc.size > K:
            lead[0] = max(lead[0], _lpt_top(desc.tolist(), K))
        total = max(total, float(adj.sum()))
    ranks.leads[K, forced] = (lead.copy(), total)
    return lead, total


def _lpt_top(desc: list[float], K: int) -> float:
    """The heaviest of K bins after LPT of ``desc`` (descending): the micro-batch a rank's coarsest
    atoms force, whatever its smaller atoms do."""
    heap = [0.0] * K
    for x in desc:
        heapq.heapreplace(heap, heap[0] + x)
    return max(heap)


def _targets(ranks: _Ranks, K: int, cfg: PlanConfig) -> np.ndarray:
    """Slot targets shared by every rank (module note, step 2), in pack_at's first-order units."""
    lead, total = _leads(ranks, K, cfg)
    return fill_targets(lead, total, 1, K)


def _pack(ranks: _Ranks, K: int, cfg: PlanConfig) -> list[np.ndarray] | None:
    """Rank-local bins of every rank at K (min(n_r, K) real bins each), or None if a rank fails."""
    out = [np.zeros(0, dtype=np.int64) for _ in ranks.pos]
    if cfg.micro_batch_size is not None and ranks.padded is None:
        for r in ranks.busy.tolist():
            out[r] = round_robin_pack(ranks.costs[r], min(int(ranks.n[r]), K))
        return out
    if K > 1 and ranks.padded is None and cfg.sync == "micro" and ranks.busy.size > 1:
        return _pack_lifted(ranks, K, cfg)
    cap = effective_cap(cfg)
    tau = _targets(ranks, K, cfg) if K > 1 and ranks.padded is None else None
    for r in ranks.busy.tolist():
        m = min(int(ranks.n[r]), K)
        if ranks.padded is not None:
            got = pack_padded_at(ranks.padded[r], m=m, K=K, cap=cap, micro_batch_size=cfg.micro_batch_size,
                                 vision_cap=cfg.max_vision_tokens_per_micro, cost=cfg.cost, sync=cfg.sync)  # type: ignore[arg-type]
        else:
            got = pack_at(ranks.lens[r], ranks.costs[r], m, 1, K, cap, cfg.cost, targets=tau,  # type: ignore[arg-type]
                          extra=ranks.extra[r])
        if got is None:
            return None
        out[r] = got
    return out


def _pack_lifted(ranks: _Ranks, K: int, cfg: PlanConfig) -> list[np.ndarray] | None:
    """Steps 2-3 of the module note: LPT toward the shared targets (slot 0's at least the estimate
    of the heaviest bin a rank cannot avoid), the rank with the heaviest bin refined until that bin
    is measured, slot 0's target lifted to it, then every rank refined toward the targets."""
    cap = effective_cap(cfg)
    assert cap is not None
    lead, total = _leads(ranks, K, cfg, forced=True)
    tau = fill_targets(lead, total, 1, K)
    out = [np.zeros(0, dtype=np.int64) for _ in ranks.pos]
    raw: dict[int, np.ndarray] = {}  # rank -> its atoms' first-order costs, for bins still to refine
    for r in ranks.busy.tolist():
        bal = _balance_costs(ranks, r, K, cfg)
        got = None
        if ranks.n[r] >= K:
            got = lpt_pack_wide(ranks.lens[r], bal, np.ones(K, dtype=np.int64), cap, load=-tau.copy(),
                                extra=ranks.extra[r])
            if got is not None and np.bincount(got, minlength=K).min() == 0:
                got = None
        if got is None:  # the full packer (first-fit decreasing, exhaustive search), refined
            got = pack_at(ranks.lens[r], ranks.costs[r], min(int(ranks.n[r]), K), 1, K, cap, cfg.cost,  # type: ignore[arg-type]
                          targets=tau, extra=ranks.extra[r])
            if got is None:
                return None
        else:
            raw[r] = bal
        out[r] = got
    first = {r: raw[r] if r in raw else _balance_costs(ranks, r, K, cfg) for r in ranks.busy.tolist()}
    prof = _Profiles(out, first, K)
    tops = {r: float(prof.row(r)[0]) for r in first}
    bals = dict(raw)
    repaired: set[int] = set()

    def refine(r: int, tau: np.ndarray) -> None:
        bal = raw.pop(r)
        load = np.bincount(out[r], weights=bal, minlength=K)
        offset = np.empty(K)
        offset[np.argsort(-load, kind="stable")] = tau  # heaviest bin toward slot 0's target, and so on
        out[r] = refine_bins(out[r], ranks.lens[r], bal, K, cap, offset=offset, extra=ranks.extra[r])
        tops[r] = prof.update(r, out[r])

    def repair(r: int, tau: np.ndarray) -> None:
        out[r] = _repair(out[r], bals[r], ranks.lens[r], ranks.extra[r], tau, cap, prof.others(r))
        tops[r] = prof.update(r, out[r])
    while True:  # the heaviest bin of any rank, that rank refined (then repaired) toward the targets first
        r = max(tops, key=tops.__getitem__)
        if r in raw:
            refine(r, tau)
        elif REPAIR and r in bals and r not in repaired and tops[r] > tau[0] * (1 + LIFT_GAP):
            repair(r, tau)
            repaired.add(r)
        else:
            break
    if tops[r] > tau[0] * (1 + LIFT_GAP):
        lead[0] = tops[r]
        tau = fill_targets(lead, total, 1, K)
    for r in list(raw):
        refine(r, tau)
    if REPAIR:  # step 4, the ranks furthest above the targets first
        env = np.full(K, LIFT_GAP * float(tau.mean()))
        for r in sorted(bals, key=lambda r: -float(np.maximum(prof.row(r) - tau, 0).sum())):
            if (prof.row(r) - tau <= env).all():
                continue  # every micro-batch within what the repaired ranks keep above the targets
            repair(r, tau)
            env = np.maximum(env, prof.row(r) - tau)
    return out


class _Profiles:
    """Every busy rank's loads heaviest first (first-order units), for the slot maxima of the others."""

    def __init__(self, out: list[np.ndarray], costs: dict[int, np.ndarray], K: int) -> None:
        self.costs, self.K = costs, K
        self.index = {r: i for i, r in enumerate(costs)}
        self.P = np.zeros((len(costs), K))
        for r in costs:
            self.update(r, out[r])

    def update(self, r: int, bins: np.ndarray) -> float:
        """Store rank r's new loads; its heaviest."""
        self.P[self.index[r]] = -np.sort(-np.bincount(bins, weights=self.costs[r], minlength=self.K))
        return float(self.P[self.index[r], 0])

    def row(self, r: int) -> np.ndarray:
        return self.P[self.index[r]]

    def others(self, r: int) -> np.ndarray:
        """Per slot, the heaviest of every other rank."""
        return others_max(self.P, self.index[r])


def _repair(bins: np.ndarray, bal: np.ndarray, lens: np.ndarray, extra: tuple[np.ndarray, int] | None,
            tau: np.ndarray, cap: int, others: np.ndarray) -> np.ndarray:
    """A rank's bins after step 4 of the module note (unchanged when within ``LIFT_GAP`` of a mean
    target of the targets): differencing toward the targets where it overshoots less, then pooled
    re-splits of its bin furthest above its target; kept only if the step's lockstep time with
    the other ranks' slot maxima ``others`` does not rise (the busiest rank, at its targets' sum,
    must not trade an uneven profile that others match for a flat one they do not)."""
    K = tau.size
    tol = LIFT_GAP * float(tau.mean())

    def over(b: np.ndarray, t: np.ndarray = tau) -> float:
        return overshoot(np.bincount(b, weights=bal, minlength=K), t)
    floor = float(tau.sum()) + tol
    best = bins
    if over(best) <= floor:
        return best
    alt = differencing_bins(bal, lens, tau, cap, extra)
    if alt is not None and over(alt) < over(best):
        best = alt
    if over(best) > floor:
        best = repartition_pairs(best, bal, lens, tau, cap, extra=extra, tol=tol, max_rounds=REPAIR_ROUNDS)
    return best if over(best, others) <= over(bins, others) else bins


def _pack_or_refuse(ranks: _Ranks, K: int, cfg: PlanConfig) -> list[np.ndarray] | None:
    """:func:`_pack`, refusing once K gives every atom a bin of its own and a rank still fails
    (an atom over a cap no K can help: a guard, the fits are checked before)."""
    got = _pack(ranks, K, cfg)
    if got is None and K >= int(ranks.n.max(initial=0)):
        raise PlanError(f"placement='local': a rank's packing fails even with one atom per micro-batch (K={K}); "
                        "an atom exceeds max_tokens_per_micro or max_vision_tokens_per_micro: raise the cap.")
    return got


def _rank_costs(ranks: _Ranks, bins: list[np.ndarray], K: int, cfg: PlanConfig, bin_cost: BinCost) -> np.ndarray:
    """``cost[r, b]`` of rank r's bin b on its GPU(s) (empty bins: placeholders, per_micro only)."""
    cost = cfg.cost
    assert cost is not None
    D = len(bins)
    if ranks.additive_bins and cfg.static_cp_size == 1:  # one bin_cost call over every rank's bins
        flat = np.concatenate([bins[r] + r * K for r in ranks.busy.tolist()]) if ranks.busy.size else bins[0]
        return bin_cost(ranks.flat_pos, flat, D * K).reshape(D, K)
    out = np.full((D, K), float(cost.per_micro))
    for r in ranks.busy.tolist():
        mc = bin_cost(ranks.pos[r], bins[r], K)
        out[r] = mc if cfg.static_cp_size == 1 else \
            cp_micro_costs(cost, mc, np.bincount(bins[r], weights=ranks.lens[r], minlength=K), cfg.static_cp_size)
    return out


def _time(ranks: _Ranks, bins: list[np.ndarray], K: int, cfg: PlanConfig, bin_cost: BinCost) -> float:
    """Predicted step time with every rank's micro-batches heaviest first."""
    return _grid_time(_rank_costs(ranks, bins, K, cfg, bin_cost), cfg.sync)


def _grid_time(grid: np.ndarray, sync: str) -> float:
    """Step time of a ranks × bins cost grid, each rank's bins heaviest first."""
    return grid_time(-np.sort(-grid, axis=1), sync)


def _min_count(ranks: _Ranks, cfg: PlanConfig) -> int:
    """The fewest micro-batches the busiest rank needs (cap or micro_batch_size)."""
    if cfg.micro_batch_size is not None:
        return int(cdiv(ranks.n, cfg.micro_batch_size).max(initial=1))
    cap = effective_cap(cfg)
    return max((bins_lower_bound(ranks.lens[r], cap, ranks.extra[r]) for r in ranks.busy.tolist()),  # type: ignore[arg-type]
               default=1)


def _polish(ranks: _Ranks, bins: list[np.ndarray], K: int, cfg: PlanConfig, bin_cost: BinCost) -> list[np.ndarray]:
    """``local_refine.polish_local`` where it applies (default bin cost, lockstep sync, no CP/padding)."""
    if K < 2 or cfg.sync != "micro" or cfg.micro_batch_size is not None or ranks.padded is not None \
            or cfg.static_cp_size != 1 or ranks.busy.size < 2:  # one busy rank: its total is the time
        return bins
    cap = effective_cap(cfg)
    assert cap is not None and cfg.cost is not None
    ex = ranks.extra
    rb = {r: RankBins(bins[r], ranks.costs[r], ranks.lens[r], None if ex[r] is None else ex[r][0])  # type: ignore[index]
          for r in ranks.busy.tolist()}
    extra_cap = next((e[1] for e in ex if e is not None), None)
    new = polish_local(rb, _rank_costs(ranks, bins, K, cfg, bin_cost), cfg.cost, cap, extra_cap=extra_cap)
    return [new.get(r, b) for r, b in enumerate(bins)]


def layout_local(lens: np.ndarray, costs: np.ndarray, owner: np.ndarray, cfg: PlanConfig, min_micro_count: int = 1,
                 layout: StepLayout | None = None, bin_cost: BinCost | None = None) -> Fit:
    """K, packing and slots of one step's atoms (``owner``: their ranks); see the module note.

    ``bin_cost(positions, bin_of, num_bins)``: the cost of bins of atoms (default: additive with
    the cost model's packed-row term); ``layout``: a vision cap or a padded layout.
    """
    D, a = cfg.dp_size, cfg.align
    cost = cfg.cost
    assert cost is not None
    default_cost = bin_cost is None
    if bin_cost is None:
        def bin_cost(p: np.ndarray, b: np.ndarray, nb: int) -> np.ndarray:
            return bin_costs(cost, np.bincount(b, weights=costs[p], minlength=nb),  # type: ignore[arg-type]
                             np.bincount(b, weights=lens[p], minlength=nb), np.bincount(b, minlength=nb))
    ranks = _Ranks(owner, lens, costs, D, layout)
    ranks.additive_bins = default_cost
    K0 = round_up(max(_min_count(ranks, cfg), min_micro_count, 1), a)
    k_hi = int(ranks.n.min()) // a * a  # the largest aligned K with no placeholder
    if cfg.micro_batch_size is not None:
        K, bins, choice = K0, _pack(ranks, K0, cfg), None
    else:
        cp = cfg.static_cp_size

        def lower_bounds(Ks: np.ndarray) -> np.ndarray:
            per = [time_lower_bounds(ranks.costs[r], ranks.lens[r], Ks, bins_per_k=1, gpus=cp, max_width=cp,
                                     cost=cost) for r in ranks.busy.tolist()]
            return np.max(per, axis=0)
        additive = is_additive(cost) and ranks.padded is None
        K, bins, choice = choose_k(K0, k_hi, a, additive=additive, sync=cfg.sync, probe="walk",
                                   lower_bounds=lower_bounds, pack=lambda K: _pack_or_refuse(ranks, K, cfg),
                                   time=lambda K, b: _time(ranks, b, K, cfg, bin_cost))
    if bins is None:  # a padded rank may need more rows than its lower bound: walk on
        while bins is None:
            K += a
            bins = _pack(ranks, K, cfg)
    if default_cost:
        bins = _polish(ranks, bins, K, cfg, bin_cost)
    slot_of = [np.argsort(np.argsort(-row, kind="stable"), kind="stable")
               for row in _rank_costs(ranks, bins, K, cfg, bin_cost)]  # local bin -> slot, heaviest first
    bin_of = np.empty(lens.size, dtype=np.int64)
    for r in ranks.busy.tolist():
        bin_of[ranks.pos[r]] = r * K + slot_of[r][bins[r]]
    hedged = False
    if default_cost and ranks.padded is None and (scen := _scenarios(cfg, ranks)):  # a cost known to ±sd
        out = hedge_lockstep(bin_of, np.arange(D * K).reshape(D, K), lens, costs, scen, effective_cap(cfg),  # type: ignore[arg-type]
                             extra=None if layout is None else layout.extra, same_rank=True)
        hedged, bin_of = out is not bin_of, out
    kept = np.arange(lens.size, dtype=np.int64)
    grid = np.arange(D * K, dtype=np.int64).reshape(D, K) if hedged else None  # re-sorting would undo the hedge
    return Fit(kept, bin_of, K, choice, int(np.minimum(ranks.n, K).sum()), grid=grid, short=bool((ranks.n < K).any()))


def _scenarios(cfg: PlanConfig, ranks: _Ranks) -> tuple:
    """The hedge's machines (``hedge.hedge_scenarios``) where the pass applies: lockstep sync, a
    cap, no static CP, two or more busy ranks (one busy rank: its total is the time)."""
    if cfg.sync != "micro" or cfg.micro_batch_size is not None or cfg.static_cp_size != 1 or ranks.busy.size < 2:
        return ()
    return hedge_scenarios(cfg.cost)  # type: ignore[arg-type]


def fit_local(s: int, labels: np.ndarray, lens: np.ndarray, costs: np.ndarray, owner: np.ndarray,
              rollouts: np.ndarray, cfg: PlanConfig, min_micro_count: int = 1, layout: StepLayout | None = None,
              bin_cost: BinCost | None = None, *, short_step: str | None = None) -> Fit:
    """The local-placement fit of one step's atoms, ``short_step`` applied (default: the config's).

    ``labels``: the sample each atom names in refusals; ``rollouts``: the drop unit of each atom.
    """
    check_cap(lens, labels, cfg)
    fit = layout_local(lens, costs, owner, cfg, min_micro_count, layout, bin_cost)
    policy = cfg.short_step if short_step is None else short_step
    if fit.short and policy == "drop":
        return _drop_trailing(s, lens, costs, owner, rollouts, cfg, min_micro_count, layout, bin_cost)
    if fit.short and policy == "error":
        raise PlanError(_short_message(s, owner, fit.K, cfg) + " Set short_step='pad' (placeholder micro-batches) "
                        "or 'drop' (drop trailing rollouts), or give those ranks more samples (balance the split "
                        "that dispatched them), raise max_tokens_per_micro, or lower align.")
    return fit


def _drop_trailing(s: int, lens: np.ndarray, costs: np.ndarray, owner: np.ndarray, rollouts: np.ndarray,
                   cfg: PlanConfig, min_micro_count: int, layout: StepLayout | None,
                   bin_cost: BinCost | None) -> Fit:
    """Keep the longest prefix of whole rollouts with which every rank fills K (no placeholder;
    ``short.drop_trailing``)."""
    D, a = cfg.dp_size, cfg.align
    order = rollout_order(rollouts)
    R = int(order.max()) + 1
    n = _prefix_sums(owner, order, np.ones(lens.size), D, R)
    if cfg.micro_batch_size is not None:
        need = cdiv(n, cfg.micro_batch_size)
    else:
        cap = effective_cap(cfg)
        tok = _prefix_sums(owner, order, lens, D, R)
        big = _prefix_sums(owner, order, 2 * lens > cap, D, R)  # type: ignore[operator]
        need = np.maximum(np.ceil(tok / cap), big)  # type: ignore[operator]
    K_lb = round_up(np.maximum(need.max(axis=0), max(min_micro_count, 1)).astype(np.int64), a)

    def attempt(pos: np.ndarray) -> Fit | None:
        sub = None if bin_cost is None else (lambda p, b, nb: bin_cost(pos[p], b, nb))
        fit = layout_local(lens[pos], costs[pos], owner[pos], cfg, min_micro_count,
                           None if layout is None else layout.take(pos), sub)
        return None if fit.short else fit

    got = drop_trailing(order, attempt, ruled_out=lambda k: K_lb[k - 1] > n[:, k - 1].min())
    if got is None:
        raise PlanError(_short_message(s, owner, None, cfg) + f" short_step='drop' found no prefix of whole rollouts "
                        f"(of {R}) with which every rank fills its micro-batches. Give every rank at least "
                        f"align={a} samples of the first rollouts, raise max_tokens_per_micro, or use "
                        "short_step='pad'.")
    fit, pos, _ = got
    return fit._replace(kept=pos[fit.kept])


def _prefix_sums(owner: np.ndarray, inverse: np.ndarray, values: np.ndarray, D: int, R: int) -> np.ndarray:
    """``out[r, k]``: Σ values of rank r's atoms in the first k+1 rollouts."""
    out = np.zeros((D, R))
    np.add.at(out, (owner, inverse), values)
    return np.cumsum(out, axis=1)


def _short_message(s: int, owner: np.ndarray, K: int | None, cfg: PlanConfig) -> str:
    n = np.bincount(owner, minlength=cfg.dp_size)
    if K is None:
        return (f"step {s}: with placement='local' no rank may run an empty micro-batch, but the ranks hold "
                f"{n.min()}..{n.max()} packing atoms (samples, or prefix-tree parts with share_prefixes).")
    short = np.flatnonzero(n < K)
    listing = ", ".join(f"rank {r} has {n[r]}" for r in short[:8]) + (" ..." if short.size > 8 else "")
    return (f"step {s}: every rank runs K={K} micro-batches (the busiest rank needs them under "
            f"{'max_tokens_per_micro=' + str(cfg.max_tokens_per_micro) if cfg.dynamic else 'micro_batch_size'}, "
            f"align={cfg.align}), but with placement='local' samples stay on their rank and {listing} "
            "sample(s) (or prefix-tree parts).")
