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

A packing's micro-batch costs and slot grid (``assign.arrange``) travel with it (:class:`Slots`):
the lockstep pass starts from them, and the K timer and the layout re-use the grid whenever they
price equal costs — usually, since the lockstep pass seldom moves a sample at the K chosen — so
a step is arranged once, not three times.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .._intmath import cdiv, round_up
from ..config import PlanConfig
from ..cost.gpu import gpu_bin_costs
from ..cost.models import CostModel, bin_costs, is_additive
from ..errors import PlanError
from .._sort import stable_argsort_via
from ..fixes import too_long_fixes
from ..footprint import packing_cap
from .exact import EXACT_MAX_SAMPLES, exact_pack, first_fit_decreasing
from .assign import arrange, grid_time
from .kchoice import KChoice, choose_k, choose_k_pipeline, packed_slope, step_slots, time_lower_bounds
from .layout import StepLayout
from .hedge import hedge_lockstep, hedge_scenarios
from .lockstep import refine_lockstep
from .pack import Extra, bins_lower_bound, lpt_pack_wide, round_robin_pack
from .padded import PaddedSamples, pack_padded
from .pipeline import slot_order, step_pipeline_time
from .refine import refine_bins
from .fitted import Fit, Slots
from .short import drop_trailing, rollout_order

__all__ = ["Fit", "Slots", "fit_step", "effective_cap", "slot_targets", "fill_targets", "min_micro_count", "pack_at",
           "check_cap", "adjusted_slope", "round_up", "cdiv"]

FFD_MAX_SAMPLES = 4096  # first-fit-decreasing fallback is O(n·m) numpy: only for steps up to this size


class _Packing(NamedTuple):
    bin_of: np.ndarray
    num_bins: int
    K: int
    choice: KChoice | None
    slots: Slots | None = None


def min_micro_count(x, cfg: PlanConfig):
    """The fewest micro-batches per rank allowed for a need of ``x``: >= pipeline_stages, aligned."""
    return round_up(np.maximum(x, cfg.pipeline_stages), cfg.align)


def effective_cap(cfg: PlanConfig) -> int | None:
    """Tokens one micro-batch may hold: cap × static CP degree, less the row multiple's padding
    (``footprint.packing_cap``; None for static batching)."""
    return packing_cap(cfg)


def _pack(lens: np.ndarray, costs: np.ndarray, cfg: PlanConfig, layout: StepLayout | None = None) -> _Packing:
    """The packing with the K of lowest predicted time; num_bins < dp·K means placeholders."""
    D, a, n = cfg.dp_size, cfg.align, lens.size
    if layout is not None and layout.padded is not None:
        return _Packing(*pack_padded(layout.padded, K0=_padded_k0(layout.padded, cfg), dp=D, align=a,
                                     cap=effective_cap(cfg), micro_batch_size=cfg.micro_batch_size,
                                     vision_cap=cfg.max_vision_tokens_per_micro, cost=cfg.cost,  # type: ignore[arg-type]
                                     sync=cfg.sync))
    extra = None if layout is None else layout.extra
    if cfg.micro_batch_size is not None:
        K = int(min_micro_count(cdiv(cdiv(n, cfg.micro_batch_size), D), cfg))
        m = min(n, D * K)
        return _Packing(round_robin_pack(costs, m), m, K, None)
    cap = effective_cap(cfg)
    assert cap is not None and cfg.cost is not None
    K0 = int(min_micro_count(cdiv(bins_lower_bound(lens, cap, extra), D), cfg))
    k_hi = (n // D) // a * a  # the largest aligned K that needs no placeholder
    cp, cost = cfg.static_cp_size, cfg.cost
    slots: dict[int, Slots] = {}  # K -> the last packing's costs and grid (_pack_at, _time)
    order = stable_argsort_via(costs, lens, descending=True) if is_additive(cost) else None  # LPT's, every K
    K, bin_of, choice = choose_k(
        K0, k_hi, a, additive=is_additive(cost), sync=cfg.sync, probe="slack",
        lower_bounds=lambda Ks: time_lower_bounds(costs, lens, Ks, bins_per_k=D, gpus=D * cp, max_width=cp,
                                                  cost=cost, cap=cfg.max_tokens_per_micro, lockstep=cfg.sync == "micro"),
        quick_bounds=lambda Ks: time_lower_bounds(costs, lens, Ks, bins_per_k=D, gpus=D * cp, max_width=cp, cost=cost),
        pack=lambda K: _pack_at(lens, costs, min(n, D * K), D, K, cfg, extra, slots, order),  # m == n: one sample per bin
        time=lambda K, b: _time(b, min(n, D * K), K, lens, costs, cfg, slots))
    # the bubble: more, smaller micro-batches may be faster — searched only when the cost prices a
    # micro-batch's fixed overhead (per_micro > 0); without it every sample alone would look free
    if cfg.pipeline_stages > 1 and k_hi > K and float(cost.per_micro) > 0:
        K, bin_of, choice = choose_k_pipeline(
            K, k_hi, a, K0=K0, sync=cfg.sync,
            lower_bounds=lambda Ks: time_lower_bounds(costs, lens, Ks, bins_per_k=D, gpus=D * cp, max_width=cp,
                                                      cost=cost) / cfg.pipeline_stages,  # a stage's share of the work
            pack=lambda k: bin_of if k == K else _pack_at(lens, costs, min(n, D * k), D, k, cfg, extra, slots, order),
            time=lambda k, b: _pipeline_time(b, min(n, D * k), k, lens, costs, cfg, search=False),
            exact=lambda k, b: _pipeline_time(b, min(n, D * k), k, lens, costs, cfg))
    known = slots.get(K)
    known = known if known is not None and known.bin_of is bin_of else None
    if cfg.sync == "micro" and cp == 1 and (scen := hedge_scenarios(cost)):  # a cost known only to ±sd
        known = _hedged(bin_of, known, lens, costs, scen, D, K, cap, cost, extra)
        bin_of = known.bin_of
    return _Packing(bin_of, min(n, D * K), K, choice, known)


def _hedged(bin_of: np.ndarray, known: Slots | None, lens: np.ndarray, costs: np.ndarray, scen: tuple,
            D: int, K: int, cap: int, cost: CostModel, extra: Extra | None) -> Slots:
    """The packing after the hedged lockstep pass (``hedge.py``), with its costs and the slot grid it
    kept (the layout re-uses that grid: re-arranging by the point estimate would undo the hedge)."""
    if known is None:
        mc = bin_costs(cost, *_bin_sums(bin_of, lens, costs, D * K))
        known = Slots(bin_of, mc, arrange(mc, D, K))
    out = hedge_lockstep(bin_of, known.grid, lens, costs, scen, cap, extra=extra)
    if out is bin_of:
        return known
    return Slots(out, bin_costs(cost, *_bin_sums(out, lens, costs, D * K)), known.grid)


def _bin_sums(bin_of: np.ndarray, lens: np.ndarray, costs: np.ndarray, nb: int) -> tuple[np.ndarray, ...]:
    """Each bin's Σ sample costs, Σ tokens and sample count (float64, float64, int64)."""
    return (np.bincount(bin_of, weights=costs, minlength=nb), np.bincount(bin_of, weights=lens, minlength=nb),
            np.bincount(bin_of, minlength=nb))


def _pipeline_time(bin_of: np.ndarray, m: int, K: int, lens: np.ndarray, costs: np.ndarray, cfg: PlanConfig, *,
                   search: bool = True) -> float:
    """Predicted pipeline time of a packing: slots arranged as the planner does, then put in the
    pipeline order the planner will use (``pipeline.pipeline_order``; ``search=False``: its best
    construction, an upper bound), bubble included."""
    cost, D = cfg.cost, cfg.dp_size
    assert cost is not None
    nb = D * K
    tokens = np.bincount(bin_of, weights=lens, minlength=nb)
    mc = gpu_bin_costs(cost, np.bincount(bin_of, weights=costs, minlength=nb), tokens, np.bincount(bin_of, minlength=nb),
                       cfg.static_cp_size)
    grid = mc[arrange(mc, D, K)]
    order = slot_order(grid, cfg, search=search)
    return step_pipeline_time(grid[:, order], cfg)


def _padded_k0(ps: PaddedSamples, cfg: PlanConfig) -> int:
    """The fewest micro-batches per rank a padded step allows: the bins' lower bound on the padded
    lengths (an [n, W] micro-batch holds n·W >= Σ L), pipeline_stages, align; static batching: its K."""
    D, n = cfg.dp_size, ps.lens.size
    if cfg.micro_batch_size is not None:
        return int(min_micro_count(cdiv(cdiv(n, cfg.micro_batch_size), D), cfg))
    cap = effective_cap(cfg)
    assert cap is not None
    vcap = cfg.max_vision_tokens_per_micro
    extra = (ps.vision, vcap) if ps.vision is not None and vcap is not None else None
    return int(min_micro_count(cdiv(bins_lower_bound(round_up(ps.lens, ps.padding.width_multiple), cap, extra), D),
                               cfg))


def _time(bin_of: np.ndarray, m: int, K: int, lens: np.ndarray, costs: np.ndarray, cfg: PlanConfig,
          slots: dict[int, Slots] | None = None) -> float:
    """:func:`~microplan.stages.kchoice.step_time` of a packing at K; its costs and grid are taken
    from (and kept in) ``slots`` when they belong to this very packing."""
    known = None if slots is None else slots.get(K)
    if known is None or known.bin_of is not bin_of:
        known = Slots(bin_of, *step_slots(bin_of, cfg.dp_size, K, lens, costs, cfg.cost,  # type: ignore[arg-type]
                                          width=cfg.static_cp_size))
        if slots is not None:
            slots[K] = known
    return grid_time(known.costs[known.grid], cfg.sync)


def slot_targets(costs: np.ndarray, D: int, K: int, order: np.ndarray | None = None) -> np.ndarray:
    """Per-slot cost targets τ_0 ≥ τ_1 ≥ ... for lockstep balance (length K).

    Lockstep time is Σ_m max_r cost(r, m), so micro-batches need equal cost *within* a slot, not
    across slots. When the heaviest samples exceed the mean micro-batch cost (long samples at
    the truncation limit), slot m's target is the larger of the (m·D+1)-th heaviest sample and
    the mean of what is left; the other micro-batches of that slot are filled up to it, which
    takes work away from later slots instead of leaving GPUs idle. ``order``: the costs' descending
    order if known (then no sort).
    """
    desc = np.sort(costs)[::-1] if order is None else costs[order]
    lead = np.array([float(desc[m * D]) if m * D < desc.size else 0.0 for m in range(K)])
    return fill_targets(lead, float(costs.sum()), D, K)


def fill_targets(lead: np.ndarray, total: float, D: int, K: int) -> np.ndarray:
    """Water-fill ``total`` cost over K slots of D micro-batches, slot m at least ``lead[m]`` (descending)."""
    left, out = total, np.empty(K)
    for m in range(K):
        out[m] = max(left / (D * (K - m)), float(lead[m]))
        left = max(left - D * out[m], 0.0)
    return out


def _pack_at(lens: np.ndarray, costs: np.ndarray, m: int, D: int, K: int, cfg: PlanConfig,
             extra: Extra | None = None, slots: dict[int, Slots] | None = None,
             order: np.ndarray | None = None) -> np.ndarray | None:
    """:func:`pack_at` under the config's cap (``order``: as there), then — under ``sync="micro"`` — refined for the
    lockstep objective on its slot arrangement (``lockstep.py``); None if no packing was found.
    When the lockstep pass moves nothing, the costs and grid it started from are the packing's
    (kept in ``slots[K]``)."""
    cost, cap = cfg.cost, effective_cap(cfg)
    assert cost is not None and cap is not None
    bin_of = pack_at(lens, costs, m, D, K, cap, cost, extra=extra, order=order)
    if bin_of is None or cfg.sync != "micro":
        return bin_of
    additive, tokens, count = _bin_sums(bin_of, lens, costs, D * K)
    mc = gpu_bin_costs(cost, additive, tokens, count, cfg.static_cp_size)
    grid = arrange(mc, D, K)
    out = refine_lockstep(bin_of, grid, lens, costs, cost, cap, extra=extra, sums=(additive, tokens, count))
    if slots is not None and (out is bin_of or np.array_equal(out, bin_of)):  # no move: the same costs and grid
        slots[K] = Slots(out, mc, grid)
    return out


def adjusted_slope(cost: CostModel, lens: np.ndarray, m: int) -> float:
    """g'(T̄) at the mean row length of m bins: the per-token cost the packer adds (0 if additive)."""
    return packed_slope(cost, float(lens.sum()) / m) if m and not is_additive(cost) else 0.0


def pack_at(lens: np.ndarray, costs: np.ndarray, m: int, D: int, K: int, cap: int, cost: CostModel, *,
            targets: np.ndarray | None = None, extra: Extra | None = None,
            order: np.ndarray | None = None) -> np.ndarray | None:
    """A packing into m bins under the cap at K per rank, balanced by cost; None if none was found.

    With a packed-row term the samples are balanced on their first-order cost at the mean row
    length T̄ = N/m: s(L) + g'(T̄)·L (equal rows then cost equal g). Slot-target LPT toward
    ``targets`` (per-slot cost targets, length K, in those first-order units; default: this
    step's own :func:`slot_targets` — local placement passes targets shared by every rank), then
    the same LPT on costs tilted toward long samples (:func:`_tilted`), then first-fit decreasing
    and, for small steps, an exhaustive search, each refined. ``extra``: a second capped resource
    (vision tokens) every packer keeps. ``order``: ``stable_argsort_via(costs, lens, descending=True)``
    when the caller has it (a K search packs the same samples at several K); used only when the
    balance is the costs themselves. No lockstep refinement here.
    """
    slope = adjusted_slope(cost, lens, m)
    bal = costs + slope * lens if slope else costs  # an additive cost balances the costs themselves
    bin_of = _pack_slots(lens, bal, m, D, K, cap, extra, targets, order=None if slope else order)
    n = lens.size
    if bin_of is None:
        bin_of = _tilted(lens, bal, m, D, K, cap, extra, targets)
    if bin_of is None and n <= FFD_MAX_SAMPLES:
        bin_of = first_fit_decreasing(lens, m, cap, extra)
        if bin_of is None and n <= EXACT_MAX_SAMPLES and extra is None:
            bin_of = exact_pack(lens, m, cap)
        if bin_of is not None:
            bin_of = refine_bins(bin_of, lens, bal, m, cap, extra=extra)
    return bin_of


TILTS = (0.5, 1.0)  # exponents of the long-sample emphasis tried when a cap-tight packing fails


def _tilted(lens: np.ndarray, bal: np.ndarray, m: int, D: int, K: int, cap: int,
            extra: Extra | None, targets: np.ndarray | None = None) -> np.ndarray | None:
    """Cap-tight steps (the slot-target LPT found no packing): the same LPT on costs tilted toward
    long samples, bal·(L/L̄)^γ, then refined on the real costs toward the slot targets (``targets``
    when given: local placement's, shared by every rank); None if no tilt packs.

    When the step fills its bins to the last few tokens, LPT on the real costs can stack the long
    samples (a bin's cost headroom lets it take several) until the cap refuses a late sample, and
    first-fit decreasing then stacks them by construction: bins of equal tokens but very unequal
    attention, which moves and swaps of single samples cannot undo under the cap. Tilting makes a
    long sample look heavier, so LPT spreads them one per bin first. Measured
    (tests/test_kchoice.py::test_cap_tight_packing_spreads_the_long_samples, 16 bins filled to
    within 0.6 %): lockstep 1.0071 -> 1.0018 of the mean load. Found by bench_meter's grid
    (bimodal dp 32, 99.8 % of capacity at K = 2). Cost: only where the slot-target LPT failed.
    """
    mean = float(lens.mean())
    for g in TILTS:
        got = _pack_slots(lens, bal * (lens / mean) ** g, m, D, K, cap, extra)
        if got is not None:
            tau = slot_targets(bal, D, K) if targets is None else targets
            offset = np.repeat(tau, D) if m == D * K and K > 1 else None
            return refine_bins(got, lens, bal, m, cap, offset=offset, extra=extra)
    return None


def _pack_slots(lens: np.ndarray, costs: np.ndarray, m: int, D: int, K: int, cap: int,
                extra: Extra | None = None, targets: np.ndarray | None = None, *,
                order: np.ndarray | None = None) -> np.ndarray | None:
    """Pack into m bins toward per-slot targets (see slot_targets); uniform LPT as the fallback.
    ``order``: the costs' LPT order when known."""
    bin_of = None
    if order is None:
        order = stable_argsort_via(costs, lens, descending=True)  # LPT's placement order (both passes), the targets' sort
    if m == D * K and K > 1:
        offset = np.repeat(slot_targets(costs, D, K, order) if targets is None else targets, D)
        load = -offset  # LPT on (load − target): the bin with the most headroom first
        bin_of = lpt_pack_wide(lens, costs, np.ones(m, dtype=np.int64), cap, load=load, extra=extra, order=order)
        if bin_of is not None and np.bincount(bin_of, minlength=m).min() == 0:
            bin_of = None
        if bin_of is not None:
            return refine_bins(bin_of, lens, costs, m, cap, offset=offset, extra=extra)
    bin_of = lpt_pack_wide(lens, costs, np.ones(m, dtype=np.int64), cap, extra=extra, order=order)
    return None if bin_of is None else refine_bins(bin_of, lens, costs, m, cap, extra=extra)


def check_cap(lens: np.ndarray, step_samples: np.ndarray, cfg: PlanConfig) -> None:
    """PlanError naming the longest sample when it fits no micro-batch (cap × static CP degree)."""
    cap = effective_cap(cfg)
    if cap is None or lens.size == 0 or lens.max() <= cap:
        return
    j = int(np.argmax(lens))
    cp = cfg.static_cp_size
    where = f"max_tokens_per_micro={cfg.max_tokens_per_micro}" + (f" × cp size {cp} = {cap}" if cp > 1 else "")
    raise PlanError(f"sample {int(step_samples[j])} has {int(lens[j])} tokens, more than one micro-batch may "
                    f"hold ({where}); {too_long_fixes(cfg, padded=False)}.")


def fit_step(step: int, samples: np.ndarray, lens: np.ndarray, costs: np.ndarray,
             rollouts: np.ndarray, cfg: PlanConfig, layout: StepLayout | None = None) -> Fit:
    """Lay out one step's samples (global ``samples`` with their ``lens``/``costs``/rollout codes;
    ``layout``: the step's view of a non-plain footprint, see ``stages/layout.py``)."""
    check_cap(lens, samples, cfg)
    bin_of, m, K, choice, slots = _pack(lens, costs, cfg, layout)
    if m == cfg.dp_size * K or cfg.short_step == "pad":
        return Fit(np.arange(lens.size, dtype=np.int64), bin_of, K, choice, m, slots=slots, short=m < cfg.dp_size * K)
    if cfg.short_step == "drop":
        return _drop_trailing(step, lens, costs, rollouts, cfg, layout)
    raise PlanError(_short_message(step, lens.size, K, cfg)
                    + " Set short_step='pad' (placeholder micro-batches) or 'drop' (drop trailing rollouts), "
                    "or change the step size (Steps), max_tokens_per_micro or align.")


def _drop_trailing(step: int, lens: np.ndarray, costs: np.ndarray, rollouts: np.ndarray,
                   cfg: PlanConfig, layout: StepLayout | None = None) -> Fit:
    """Keep the longest prefix of whole rollouts that needs no placeholder (``short.drop_trailing``)."""
    D, a = cfg.dp_size, cfg.align
    order = rollout_order(rollouts)
    R = int(order.max()) + 1
    kept_n = np.cumsum(np.bincount(order, minlength=R))
    if cfg.micro_batch_size is not None:
        m_lb = cdiv(kept_n, cfg.micro_batch_size)
    else:
        cap = effective_cap(cfg)
        assert cap is not None
        tok = np.cumsum(np.bincount(order, weights=lens, minlength=R))
        big = np.cumsum(np.bincount(order, weights=2 * lens > cap, minlength=R))
        m_lb = np.maximum(np.maximum(np.ceil(tok / cap), big), 1).astype(np.int64)
    K_lb = min_micro_count(cdiv(m_lb, D), cfg)

    def attempt(pos: np.ndarray) -> _Packing | None:
        got = _pack(lens[pos], costs[pos], cfg, None if layout is None else layout.take(pos))
        return got if got.num_bins == D * got.K else None

    got = drop_trailing(order, attempt, ruled_out=lambda k: int(kept_n[k - 1]) < D * a
                        or D * int(K_lb[k - 1]) > int(kept_n[k - 1]))
    if got is None:
        raise PlanError(_short_message(step, lens.size, None, cfg)
                        + f" short_step='drop' found no prefix of whole rollouts (of {R}) whose samples fill "
                        f"dp_size × align = {D * a}-aligned micro-batches. Change the step size (Steps) or samples "
                        "per rollout so a kept prefix aligns, raise max_tokens_per_micro, or use short_step='pad'.")
    (bin_of, m, K, choice, slots), pos, _ = got
    return Fit(pos, bin_of, K, choice, m, slots=slots)


def _short_message(step: int, n: int, K: int | None, cfg: PlanConfig) -> str:
    D, a = cfg.dp_size, cfg.align
    target = f"the aligned target is {D * K} micro-batches (dp_size={D} × {K} per rank, align={a})" if K else \
        f"the micro-batch count must be a multiple of dp_size × align = {D} × {a} = {D * a}"
    return (f"step {step}: {n} sample{'s' if n != 1 else ''} cannot fill every rank with non-empty micro-batches: "
            f"{target}, but the samples cannot be split into that many micro-batches.")
