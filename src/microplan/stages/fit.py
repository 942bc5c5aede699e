"""Fit one step onto the ranks: choose K, pack real micro-batches, apply ``short_step``.

Design note. K (micro-batches per rank) is chosen by predicted step time (``kchoice.py``): with
an additive cost it is the lower bound — ⌈bins_lb / dp⌉ rounded up to ``align``, where
bins_lb = max(⌈tokens / cap⌉, #samples longer than cap/2), and at least ``pipeline_stages`` (a
pipeline with fewer micro-batches than stages is mostly bubble) — grown by ``align`` until the
packer fills all ``dp·K`` micro-batches under the cap; with a packed-row term (dense attention
over the row) more, smaller micro-batches can be faster and K is searched. Packing at a K is the
slot-target LPT below, then first-fit decreasing, then (small steps) an exhaustive search, so a
K is abandoned only when no packing was found (``exact.py``). When a step has too few samples
to give every rank K non-empty micro-batches (long samples sit alone, or fewer samples than
ranks), ``short_step`` decides: ``pad`` adds the fewest placeholder micro-batches (using as many
real ones as there are samples), ``drop`` drops the fewest whole trailing rollouts until no
placeholder is needed (the slime fix; raises when no prefix of at least dp·align samples
works), ``error`` raises. Every refusal is a PlanError naming the step, the counts and the
settings to change. Cost: one packing per K tried (usually one).

Layouts (``footprint.py``): the planner passes the samples' occupied lengths (pad-to-multiple
included) and the cap is :func:`~microplan.footprint.packing_cap` (the row multiple taken off);
a :class:`~microplan.stages.layout.StepLayout` adds a vision cap every packer keeps (``extra``),
or hands a padded layout to ``stages/padded.py``, whose K choice is recorded the same way.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..config import PlanConfig
from ..cost.models import bin_costs, is_additive
from ..errors import PlanError
from ..footprint import packing_cap
from .exact import EXACT_MAX_SAMPLES, exact_pack, first_fit_decreasing
from .assign import arrange
from .kchoice import MAX_EVALS, KChoice, packed_slope, step_time, time_lower_bounds
from .layout import StepLayout
from .lockstep import refine_lockstep
from .pack import Extra, bins_lower_bound, lpt_pack, lpt_pack_wide, round_robin_pack
from .padded import pack_padded
from .refine import refine_bins

__all__ = ["StepFit", "fit_step", "effective_cap", "slot_targets", "min_micro_count"]

FFD_MAX_SAMPLES = 4096  # first-fit-decreasing fallback is O(n·m) numpy: only for steps up to this size


class StepFit(NamedTuple):
    """Result for one step; positions are local (into the step's sample array)."""

    bin_of: np.ndarray        # bin id of each kept sample (aligned with ``kept``)
    kept: np.ndarray          # local positions that train
    dropped: np.ndarray       # local positions dropped by short_step="drop"
    num_bins: int             # real (non-placeholder) micro-batches
    micro_count: int          # K per rank; dp·K - num_bins placeholders
    choice: KChoice | None = None  # why K (None for static batching)


class _Packing(NamedTuple):
    bin_of: np.ndarray
    num_bins: int
    K: int
    choice: KChoice | None


def _cdiv(x, d):  # ceil division for ints and int arrays
    return -(-x // d)


def _round_up(x, a):
    return _cdiv(x, a) * a


def min_micro_count(x, cfg: PlanConfig):
    """The fewest micro-batches per rank allowed for a need of ``x``: >= pipeline_stages, aligned."""
    return _round_up(np.maximum(x, cfg.pipeline_stages), cfg.align)


def effective_cap(cfg: PlanConfig) -> int | None:
    """Tokens one micro-batch may hold: cap × static CP degree, less the row multiple's padding
    (``footprint.packing_cap``; None for static batching)."""
    return packing_cap(cfg)


def _pack(lens: np.ndarray, costs: np.ndarray, cfg: PlanConfig, layout: StepLayout | None = None) -> _Packing:
    """The packing with the K of lowest predicted time; num_bins < dp·K means placeholders."""
    if layout is not None and layout.padded is not None:
        return _Packing(*pack_padded(layout.padded, dp=cfg.dp_size, align=cfg.align, cap=effective_cap(cfg),
                                     micro_batch_size=cfg.micro_batch_size,
                                     vision_cap=cfg.max_vision_tokens_per_micro, cost=cfg.cost,  # type: ignore[arg-type]
                                     sync=cfg.sync))
    extra = None if layout is None else layout.extra
    D, a, n = cfg.dp_size, cfg.align, lens.size
    if cfg.micro_batch_size is not None:
        K = int(min_micro_count(_cdiv(_cdiv(n, cfg.micro_batch_size), D), cfg))
        m = min(n, D * K)
        return _Packing(round_robin_pack(costs, m), m, K, None)
    cap = effective_cap(cfg)
    assert cap is not None and cfg.cost is not None
    K0 = int(min_micro_count(_cdiv(bins_lower_bound(lens, cap, extra), D), cfg))
    k_hi = (n // D) // a * a  # the largest aligned K that needs no placeholder
    if is_additive(cfg.cost) or k_hi <= K0:
        return _grow(lens, costs, cfg, K0, K0, [], extra)
    return _search(lens, costs, cfg, K0, k_hi, extra)


def _time(bin_of: np.ndarray, m: int, K: int, lens: np.ndarray, costs: np.ndarray, cfg: PlanConfig) -> float:
    return step_time(bin_of, m, cfg.dp_size, K, lens, costs, cfg.cost, cfg.sync,  # type: ignore[arg-type]
                     width=cfg.static_cp_size)


def _grow(lens: np.ndarray, costs: np.ndarray, cfg: PlanConfig, K: int, K0: int,
          tried: list[tuple[int, float]], extra: Extra | None = None) -> _Packing:
    """The smallest K >= the given one that packs (additive costs: the fastest K that fits)."""
    D, n = cfg.dp_size, lens.size
    while True:
        m = min(n, D * K)
        bin_of = _pack_at(lens, costs, m, D, K, cfg, extra)
        if bin_of is not None:
            break
        tried.append((K, float("inf")))
        K += cfg.align  # m == n always packs (one sample per bin), so this terminates
    t = _time(bin_of, m, K, lens, costs, cfg)
    tried.append((K, t))
    if K == K0:
        why = (f"K={K} is the lower bound ⌈bins/dp⌉ (aligned); the cost has no packed-row term, so more "
               "micro-batches only add per-micro cost")
    else:
        why = f"K={K}: the fewest micro-batches per rank a packing under the cap was found for (lower bound {K0})"
    nxt = K + cfg.align
    if D * nxt <= n and t > _bound(lens, costs, cfg, K) * (1 + _SLACK):
        # a cap-tight K leaves no room to balance; one more micro-batch per rank may be faster
        alt = _pack_at(lens, costs, D * nxt, D, nxt, cfg, extra)
        t2 = float("inf") if alt is None else _time(alt, D * nxt, nxt, lens, costs, cfg)
        tried.append((nxt, t2))
        if t2 < t * (1 - 1e-9):
            why = (f"K={nxt}: predicted {t2:.4g} vs {t:.4g} at K={K} — packing to the fewest micro-batches left "
                   "the cap too tight to balance, and the extra per-micro cost is smaller than the gain")
            return _Packing(alt, D * nxt, nxt, KChoice(nxt, K0, tuple(tried), why))  # type: ignore[arg-type]
    return _Packing(bin_of, m, K, KChoice(K, K0, tuple(tried), why))


_SLACK = 2e-3  # try K + align when the packed plan is this far above its lower bound


def _bound(lens: np.ndarray, costs: np.ndarray, cfg: PlanConfig, K: int) -> float:
    cp = cfg.static_cp_size
    return float(time_lower_bounds(costs, lens, np.array([K]), bins_per_k=cfg.dp_size, gpus=cfg.dp_size * cp,
                                   max_width=cp, cost=cfg.cost, cap=cfg.max_tokens_per_micro,  # type: ignore[arg-type]
                                   lockstep=cfg.sync == "micro")[0])


def _search(lens: np.ndarray, costs: np.ndarray, cfg: PlanConfig, K0: int, k_hi: int,
            extra: Extra | None = None) -> _Packing:
    """Search K around argmin LB(K) and K_lb by the packed plans' predicted times (packed-row costs).

    A pattern search over aligned K: from the better of K_lb and argmin LB(K), try ±step, double the
    step after every improvement, halve it when neither side improves; at most MAX_EVALS packings.
    """
    D, a, cap = cfg.dp_size, cfg.align, effective_cap(cfg)
    cp = cfg.static_cp_size
    Ks = np.arange(K0, k_hi + 1, a)
    lb = time_lower_bounds(costs, lens, Ks, bins_per_k=D, gpus=D * cp, max_width=cp, cost=cfg.cost)  # type: ignore[arg-type]
    start = int(Ks[int(np.argmin(lb))])  # where the bound is lowest; K0 is tried too
    done: dict[int, tuple[float, np.ndarray | None]] = {}
    order: list[int] = []

    def evaluate(K: int) -> float:
        bin_of = _pack_at(lens, costs, D * K, D, K, cfg, extra)
        t = float("inf") if bin_of is None else _time(bin_of, D * K, K, lens, costs, cfg)
        done[K] = (t, bin_of)
        order.append(K)
        return t

    evaluate(K0)  # the fewest micro-batches: best when the packed term is small
    if start != K0:
        evaluate(start)
    best = min(done, key=lambda k: (done[k][0], k))
    step = a
    while len(done) < MAX_EVALS and step >= a:  # pattern search: double the step while it improves
        moved = False
        for K in (best + step, best - step):
            if K0 <= K <= k_hi and K not in done and len(done) < MAX_EVALS and evaluate(K) < done[best][0]:
                best, moved = K, True
                break
        step = 2 * step if moved else (step // 2) // a * a
    best_t = done[best][0]
    if not np.isfinite(best_t):  # nothing fitted the cap in range: grow past the searched Ks
        return _grow(lens, costs, cfg, max(done) + a, K0, [(k, done[k][0]) for k in order], extra)
    K = min(k for k in done if done[k][0] == best_t)
    cands = tuple((k, done[k][0]) for k in order)
    listing = ", ".join(f"K={k}: {t:.4g}" for k, t in sorted(cands))
    why = (f"K={K} has the lowest predicted {'lockstep' if cfg.sync == 'micro' else 'step-sync'} time of the "
           f"K tried ({listing}); the cost's packed-row term makes fewer, larger micro-batches slower "
           f"(lower bound K={K0})")
    return _Packing(done[K][1], D * K, K, KChoice(K, K0, cands, why))  # type: ignore[arg-type]


def slot_targets(costs: np.ndarray, D: int, K: int) -> np.ndarray:
    """Per-slot cost targets τ_0 ≥ τ_1 ≥ ... for lockstep balance (length K).

    Lockstep time is Σ_m max_r cost(r, m), so micro-batches need equal cost *within* a slot, not
    across slots. When the heaviest samples exceed the mean micro-batch cost (long samples at
    the truncation limit), slot m's target is the larger of the (m·D+1)-th heaviest sample and
    the mean of what is left; the other micro-batches of that slot are filled up to it, which
    takes work away from later slots instead of leaving GPUs idle.
    """
    desc = np.sort(costs)[::-1]
    left, out = float(costs.sum()), np.empty(K)
    for m in range(K):
        lead = float(desc[m * D]) if m * D < desc.size else 0.0
        out[m] = max(left / (D * (K - m)), lead)
        left = max(left - D * out[m], 0.0)
    return out


def _pack_at(lens: np.ndarray, costs: np.ndarray, m: int, D: int, K: int, cfg: PlanConfig,
             extra: Extra | None = None) -> np.ndarray | None:
    """A packing into m bins under the cap at K per rank, balanced by cost; None if none was found.

    With a packed-row term the samples are balanced on their first-order cost at the mean row
    length T̄ = N/m: s(L) + g'(T̄)·L (equal rows then cost equal g). Under ``sync="micro"`` the
    packing is then refined for the lockstep objective on its slot arrangement (``lockstep.py``).
    """
    cost, cap = cfg.cost, effective_cap(cfg)
    assert cost is not None and cap is not None
    bal = costs
    if not is_additive(cost) and m:
        bal = costs + packed_slope(cost, float(lens.sum()) / m) * lens
    bin_of = _pack_slots(lens, bal, m, D, K, cap, extra)
    n = lens.size
    if bin_of is None and n <= FFD_MAX_SAMPLES:
        bin_of = first_fit_decreasing(lens, m, cap, extra)
        if bin_of is None and n <= EXACT_MAX_SAMPLES and extra is None:
            bin_of = exact_pack(lens, m, cap)
        if bin_of is not None:
            bin_of = refine_bins(bin_of, lens, bal, m, cap, extra=extra)
    if bin_of is None or cfg.sync != "micro":
        return bin_of
    nb = D * K
    mc = bin_costs(cost, np.bincount(bin_of, weights=costs, minlength=nb), np.bincount(bin_of, weights=lens, minlength=nb),
                   np.bincount(bin_of, minlength=nb))
    width = cfg.static_cp_size
    if width > 1:
        mc = (mc - cost.per_micro) / width + cost.per_micro
    return refine_lockstep(bin_of, arrange(mc, D, K), lens, costs, cost, cap, extra=extra)


def _pack_slots(lens: np.ndarray, costs: np.ndarray, m: int, D: int, K: int, cap: int,
                extra: Extra | None = None) -> np.ndarray | None:
    """Pack into m bins toward per-slot targets (see slot_targets); uniform LPT as the fallback."""
    bin_of = None
    if m == D * K and K > 1:
        offset = np.repeat(slot_targets(costs, D, K), D)
        load = -offset  # LPT on (load − target): the bin with the most headroom first
        bin_of = lpt_pack_wide(lens, costs, np.ones(m, dtype=np.int64), cap, load=load, extra=extra)
        if bin_of is not None and np.bincount(bin_of, minlength=m).min() == 0:
            bin_of = None
        if bin_of is not None:
            return refine_bins(bin_of, lens, costs, m, cap, offset=offset, extra=extra)
    bin_of = lpt_pack(lens, costs, m, cap, extra)
    return None if bin_of is None else refine_bins(bin_of, lens, costs, m, cap, extra=extra)


def _check_cap(lens: np.ndarray, step_samples: np.ndarray, cfg: PlanConfig) -> None:
    cap = effective_cap(cfg)
    if cap is None or lens.size == 0 or lens.max() <= cap:
        return
    j = int(np.argmax(lens))
    cp = cfg.static_cp_size
    where = f"max_tokens_per_micro={cfg.max_tokens_per_micro}" + (f" × cp size {cp} = {cap}" if cp > 1 else "")
    raise PlanError(f"sample {int(step_samples[j])} has {int(lens[j])} tokens, more than one micro-batch may "
                    f"hold ({where}); raise max_tokens_per_micro, enable context_parallel, or truncate "
                    "the sample.")


def fit_step(step: int, samples: np.ndarray, lens: np.ndarray, costs: np.ndarray,
             rollouts: np.ndarray, cfg: PlanConfig, layout: StepLayout | None = None) -> StepFit:
    """Lay out one step's samples (global ``samples`` with their ``lens``/``costs``/rollout codes;
    ``layout``: the step's view of a non-plain footprint, see ``stages/layout.py``)."""
    _check_cap(lens, samples, cfg)
    bin_of, m, K, choice = _pack(lens, costs, cfg, layout)
    all_pos = np.arange(lens.size, dtype=np.int64)
    none = np.zeros(0, dtype=np.int64)
    if m == cfg.dp_size * K or cfg.short_step == "pad":
        return StepFit(bin_of, all_pos, none, m, K, choice)
    if cfg.short_step == "drop":
        return _drop_trailing(step, lens, costs, rollouts, cfg, layout)
    raise PlanError(_short_message(step, lens.size, K, cfg)
                    + " Set short_step='pad' (placeholder micro-batches) or 'drop' (drop trailing rollouts), "
                    "or change the step size (Steps), max_tokens_per_micro or align.")


def _drop_trailing(step: int, lens: np.ndarray, costs: np.ndarray, rollouts: np.ndarray,
                   cfg: PlanConfig, layout: StepLayout | None = None) -> StepFit:
    """Keep the longest prefix of whole rollouts that needs no placeholder."""
    D, a = cfg.dp_size, cfg.align
    codes, inverse = np.unique(rollouts, return_inverse=True)  # codes ascend in first-appearance order
    R = codes.size
    n_r = np.bincount(inverse, minlength=R)
    kept_n = np.cumsum(n_r)
    if cfg.micro_batch_size is not None:
        m_lb = _cdiv(kept_n, cfg.micro_batch_size)
    else:
        cap = effective_cap(cfg)
        assert cap is not None
        tok = np.cumsum(np.bincount(inverse, weights=lens, minlength=R))
        big = np.cumsum(np.bincount(inverse, weights=2 * lens > cap, minlength=R))
        m_lb = np.maximum(np.maximum(np.ceil(tok / cap), big), 1).astype(np.int64)
    K_lb = min_micro_count(_cdiv(m_lb, D), cfg)
    for keep in range(R - 1, 0, -1):  # keep = number of rollouts kept
        n_keep = int(kept_n[keep - 1])
        if n_keep < D * a:
            break
        if D * int(K_lb[keep - 1]) > n_keep:
            continue
        pos = np.flatnonzero(inverse < keep).astype(np.int64)
        bin_of, m, K, choice = _pack(lens[pos], costs[pos], cfg, None if layout is None else layout.take(pos))
        if m == D * K:
            return StepFit(bin_of, pos, np.flatnonzero(inverse >= keep).astype(np.int64), m, K, choice)
    raise PlanError(_short_message(step, lens.size, None, cfg)
                    + f" short_step='drop' found no prefix of whole rollouts (of {R}) whose samples fill "
                    f"dp_size × align = {D * a}-aligned micro-batches. Change the step size (Steps) or samples per "
                    "rollout so a kept prefix aligns, raise max_tokens_per_micro, or use short_step='pad'.")


def _short_message(step: int, n: int, K: int | None, cfg: PlanConfig) -> str:
    D, a = cfg.dp_size, cfg.align
    target = f"the aligned target is {D * K} micro-batches (dp_size={D} × {K} per rank, align={a})" if K else \
        f"the micro-batch count must be a multiple of dp_size × align = {D} × {a} = {D * a}"
    return (f"step {step}: {n} samples cannot fill every rank with non-empty micro-batches: {target}, but the "
            "samples cannot be split into that many micro-batches.")
