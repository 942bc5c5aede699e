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
3. Slots: each rank runs its micro-batches heaviest first (``assign.arrange`` on one rank). For
   fixed micro-batch costs this minimises the lockstep time Σ_m max_r cost(r, m): rank r's k
   heaviest micro-batches occupy k distinct slots, so the k-th largest slot maximum is at least
   max_r (k-th heaviest of rank r), which the sorted arrangement attains.
4. short_step: a rank with fewer samples than K gets placeholders (``pad``), trailing rollouts
   are dropped until every rank fills K (``drop``), or a PlanError names the ranks (``error``).

Guarantees: those of every plan (equal K, aligned, cap, coverage, exact loss scales computed
over the whole step exactly as in global placement) plus: every sample runs on ``rank_of``.
Measured trade-off (benchmarks/bench_planners.py, "local" rows, full run): pinned by verl's
driver split, lockstep / LB is 1.003–1.009 median (global placement: 1.001–1.002); pinned by
arrival order (round robin) it is 1.27–1.40 median, the ranks' unequal totals, which no local
plan can recover (lockstep over the split's own bound stays ≤ 1.012). Planning costs ~10× the
global planner at dp=128 (one packing per rank).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..batch import Batch
from ..config import PlanConfig
from ..cost.models import bin_costs, is_additive
from ..errors import PlanError
from ..types import KChoice, Micro, Step
from .assign import arrange, grid_time
from .fit import adjusted_slope, cdiv, check_cap, effective_cap, fill_targets, pack_at, round_up
from .kchoice import choose_k, time_lower_bounds
from .micros import binned_micros
from .pack import bins_lower_bound, round_robin_pack
from .weigh import loss_coefficients, loss_scales

__all__ = ["plan_local_step", "LocalFit"]


class LocalFit(NamedTuple):
    """One step's local layout; positions are into the step's sample array."""

    kept: np.ndarray            # positions that train
    bin_of: np.ndarray          # rank·K + rank-local bin of each kept position
    K: int
    choice: KChoice | None
    short: bool                 # some rank has fewer samples than K (placeholders)


class _Ranks:
    """The step's samples grouped by owner rank (positions into the step)."""

    def __init__(self, owner: np.ndarray, lens: np.ndarray, costs: np.ndarray, D: int) -> None:
        order = np.argsort(owner, kind="stable")
        bounds = np.searchsorted(owner[order], np.arange(D + 1))
        self.pos = [order[bounds[r]:bounds[r + 1]] for r in range(D)]
        self.lens = [lens[p] for p in self.pos]
        self.costs = [costs[p] for p in self.pos]
        self.n = np.array([p.size for p in self.pos], dtype=np.int64)


def _targets(ranks: _Ranks, K: int, cfg: PlanConfig) -> np.ndarray:
    """Slot targets shared by every rank (module note, step 2), in pack_at's first-order units."""
    lead, total = np.zeros(K), 0.0
    for lens, c, n in zip(ranks.lens, ranks.costs, ranks.n):
        if not n:
            continue
        adj = c + adjusted_slope(cfg.cost, lens, min(int(n), K)) * lens  # type: ignore[arg-type]
        desc = np.sort(adj)[::-1][:K]
        lead[: desc.size] = np.maximum(lead[: desc.size], desc)
        total = max(total, float(adj.sum()))
    return fill_targets(lead, total, 1, K)


def _pack(ranks: _Ranks, K: int, cfg: PlanConfig) -> list[np.ndarray] | None:
    """Rank-local bins of every rank at K (min(n_r, K) real bins each), or None if a rank fails."""
    out: list[np.ndarray] = []
    if cfg.micro_batch_size is not None:
        return [round_robin_pack(c, min(int(n), K)) if n else np.zeros(0, dtype=np.int64)
                for c, n in zip(ranks.costs, ranks.n)]
    cap = effective_cap(cfg)
    tau = _targets(ranks, K, cfg) if K > 1 else None
    for lens, c, n in zip(ranks.lens, ranks.costs, ranks.n):
        if not n:
            out.append(np.zeros(0, dtype=np.int64))
            continue
        got = pack_at(lens, c, min(int(n), K), 1, K, cap, cfg.cost, targets=tau)  # type: ignore[arg-type]
        if got is None:
            return None
        out.append(got)
    return out


def _rank_costs(ranks: _Ranks, bins: list[np.ndarray], K: int, cfg: PlanConfig) -> np.ndarray:
    """``cost[r, b]`` of rank r's bin b on its GPU(s) (empty bins: placeholders, per_micro only)."""
    cost = cfg.cost
    assert cost is not None
    out = np.empty((len(bins), K))
    for r, b in enumerate(bins):
        mc = bin_costs(cost, np.bincount(b, weights=ranks.costs[r], minlength=K),
                       np.bincount(b, weights=ranks.lens[r], minlength=K), np.bincount(b, minlength=K))
        out[r] = mc if cfg.static_cp_size == 1 else (mc - cost.per_micro) / cfg.static_cp_size + cost.per_micro
    return out


def _time(ranks: _Ranks, bins: list[np.ndarray], K: int, cfg: PlanConfig) -> float:
    """Predicted step time with every rank's micro-batches heaviest first."""
    grid = -np.sort(-_rank_costs(ranks, bins, K, cfg), axis=1)
    return grid_time(grid, cfg.sync)


def _min_count(ranks: _Ranks, cfg: PlanConfig) -> int:
    """The fewest micro-batches the busiest rank needs (cap or micro_batch_size)."""
    if cfg.micro_batch_size is not None:
        return int(cdiv(ranks.n, cfg.micro_batch_size).max(initial=1))
    cap = effective_cap(cfg)
    return max((bins_lower_bound(lens, cap) for lens in ranks.lens), default=1)  # type: ignore[arg-type]


def layout_local(lens: np.ndarray, costs: np.ndarray, owner: np.ndarray, cfg: PlanConfig,
                 min_micro_count: int = 1) -> LocalFit:
    """K, packing and slots of one step's samples (``owner``: their ranks); see the module note."""
    D, a = cfg.dp_size, cfg.align
    ranks = _Ranks(owner, lens, costs, D)
    K0 = round_up(max(_min_count(ranks, cfg), min_micro_count, 1), a)
    k_hi = int(ranks.n.min()) // a * a  # the largest aligned K with no placeholder
    if cfg.micro_batch_size is not None:
        K, bins, choice = K0, _pack(ranks, K0, cfg), None
    else:
        cost, cp = cfg.cost, cfg.static_cp_size
        assert cost is not None

        def lower_bounds(Ks: np.ndarray) -> np.ndarray:
            per = [time_lower_bounds(c, ln, Ks, bins_per_k=1, gpus=cp, max_width=cp, cost=cost)
                   for ln, c, n in zip(ranks.lens, ranks.costs, ranks.n) if n]
            return np.max(per, axis=0)
        K, bins, choice = choose_k(K0, k_hi, a, additive=is_additive(cost), sync=cfg.sync, probe="walk",
                                   lower_bounds=lower_bounds, pack=lambda K: _pack(ranks, K, cfg),
                                   time=lambda K, b: _time(ranks, b, K, cfg))
    assert bins is not None  # at K >= n_r every rank packs one sample per bin
    order = [arrange(row, 1, K)[0] for row in _rank_costs(ranks, bins, K, cfg)]  # slot m -> local bin
    slot_of = [np.argsort(o) for o in order]                                    # local bin -> slot
    bin_of = np.empty(lens.size, dtype=np.int64)
    for r, (p, b) in enumerate(zip(ranks.pos, bins)):
        bin_of[p] = r * K + slot_of[r][b]
    kept = np.arange(lens.size, dtype=np.int64)
    return LocalFit(kept, bin_of, K, choice, bool((ranks.n < K).any()))


def plan_local_step(s: int, samples: np.ndarray, batch: Batch, costs: np.ndarray, cfg: PlanConfig, *,
                    min_micro_count: int = 1) -> tuple[Step, np.ndarray, str]:
    """The local-placement counterpart of the planner's per-step function.

    ``min_micro_count``: the hook for a minimum K per rank (pipeline stages: K ≥ p), applied
    before alignment.
    """
    assert batch.rank_of is not None
    D = cfg.dp_size
    lens, c, owner = batch.seq_lens[samples], costs[samples], batch.rank_of[samples]
    check_cap(lens, samples, cfg)
    fit = layout_local(lens, c, owner, cfg, min_micro_count)
    if fit.short and cfg.short_step == "drop":
        fit = _drop_trailing(s, samples, batch, c, cfg, min_micro_count)
    elif fit.short and cfg.short_step == "error":
        raise PlanError(_short_message(s, owner, fit.K, cfg) + " Set short_step='pad' (placeholder micro-batches) "
                        "or 'drop' (drop trailing rollouts), or give those ranks more samples (balance the split "
                        "that dispatched them), raise max_tokens_per_micro, or lower align.")
    K = fit.K
    kept = samples[fit.kept]
    assert cfg.loss is not None
    coef = loss_coefficients(cfg.loss, batch.loss_tokens[kept], batch.prompt_codes[kept], batch.rollout_codes[kept])
    scale = loss_scales(cfg.loss, coef, grad_world=cfg.grad_world, micro_count=K)
    parts = binned_micros(kept, fit.bin_of, D * K, scale, batch)
    cp, trusted = cfg.static_cp_size, Micro._trusted
    micros = [[trusted(*parts[r * K + m], cp, 0, (r,)) for m in range(K)] for r in range(D)]
    dropped = np.setdiff1d(samples, kept)
    why = (f"short_step='drop': trailing rollout dropped so every rank of step {s} fills its K micro-batches "
           "with its own samples (placement='local')")
    return Step(s, micros, np.sort(kept), choice=fit.choice), dropped, why


def _drop_trailing(s: int, samples: np.ndarray, batch: Batch, costs: np.ndarray, cfg: PlanConfig,
                   min_micro_count: int) -> LocalFit:
    """Keep the longest prefix of whole rollouts with which every rank fills K (no placeholder)."""
    D, a = cfg.dp_size, cfg.align
    lens, owner = batch.seq_lens[samples], batch.rank_of[samples]  # type: ignore[index]
    _, inverse = np.unique(batch.rollout_codes[samples], return_inverse=True)  # first-appearance order
    R = int(inverse.max()) + 1
    n = _prefix_sums(owner, inverse, np.ones(lens.size), D, R)
    if cfg.micro_batch_size is not None:
        need = cdiv(n, cfg.micro_batch_size)
    else:
        cap = effective_cap(cfg)
        tok = _prefix_sums(owner, inverse, lens, D, R)
        big = _prefix_sums(owner, inverse, 2 * lens > cap, D, R)  # type: ignore[operator]
        need = np.maximum(np.ceil(tok / cap), big)  # type: ignore[operator]
    K_lb = round_up(np.maximum(need.max(axis=0), max(min_micro_count, 1)).astype(np.int64), a)
    for keep in range(R - 1, 0, -1):  # keep = rollouts kept
        if K_lb[keep - 1] > n[:, keep - 1].min():
            continue
        pos = np.flatnonzero(inverse < keep).astype(np.int64)
        fit = layout_local(lens[pos], costs[pos], owner[pos], cfg, min_micro_count)
        if not fit.short:
            return LocalFit(pos[fit.kept], fit.bin_of, fit.K, fit.choice, False)
    raise PlanError(_short_message(s, owner, None, cfg) + f" short_step='drop' found no prefix of whole rollouts "
                    f"(of {R}) with which every rank fills its micro-batches. Give every rank at least "
                    f"align={a} samples of the first rollouts, raise max_tokens_per_micro, or use short_step='pad'.")


def _prefix_sums(owner: np.ndarray, inverse: np.ndarray, values: np.ndarray, D: int, R: int) -> np.ndarray:
    """``out[r, k]``: Σ values of rank r's samples in the first k+1 rollouts."""
    out = np.zeros((D, R))
    np.add.at(out, (owner, inverse), values)
    return np.cumsum(out, axis=1)


def _short_message(s: int, owner: np.ndarray, K: int | None, cfg: PlanConfig) -> str:
    n = np.bincount(owner, minlength=cfg.dp_size)
    if K is None:
        return (f"step {s}: with placement='local' no rank may run an empty micro-batch, but the ranks hold "
                f"{n.min()}..{n.max()} samples.")
    short = np.flatnonzero(n < K)
    listing = ", ".join(f"rank {r} has {n[r]}" for r in short[:8]) + (" ..." if short.size > 8 else "")
    return (f"step {s}: every rank runs K={K} micro-batches (the busiest rank needs them under "
            f"{'max_tokens_per_micro=' + str(cfg.max_tokens_per_micro) if cfg.dynamic else 'micro_batch_size'}, "
            f"align={cfg.align}), but with placement='local' samples stay on their rank and {listing} sample(s).")
