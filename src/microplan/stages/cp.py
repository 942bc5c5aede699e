"""Dynamic context parallel: per micro slot, cut the DP×CP plane into power-of-two CP groups.

Design note. With ``ContextParallel(max_size=c)`` the ``dp_size`` GPUs of the plane are one
pool. A sample of L tokens needs a CP group of d = nextpow2(⌈L / cap⌉) GPUs (so no GPU holds
more than ``max_tokens_per_micro`` tokens); d > c is a PlanError. Steps:
1. K starts at the lower bound (tokens, and the GPU-slots of long samples) rounded to align.
2. Bins: one CP group of width d per long sample, plus unit bins for the rest of the dp·K
   GPU-slots. When there are fewer short samples than unit bins, empty bins merge into wider
   ones (and into long samples' groups) until every group can get a sample — the verl seed's
   "fewer sequences than groups" case — so no CP group is ever empty.
3. Short samples go by width-aware LPT (per-GPU load: the CP price of ``cost/cp.py``, Σ cost /
   width without a CP term; capacity width·cap) into all bins, long groups included; a failure
   grows K by ``align``. Step 1's widening (``balanced_degrees``) doubles a costly sample only
   where the price says that lowers its per-GPU time. With a CP term the layout is also made with
   every sample at its token need and short samples kept out of long groups (``need_only``).
4. Slots: wide groups first-fit-decreasing by width into K slots (widths divide dp, so this
   always tiles), then unit bins fill each slot's free GPUs, heaviest unit bins beside the
   heaviest groups. Groups occupy contiguous, width-aligned rank ranges.
5. Uniform candidates: for every power-of-two width w from the widest sample's degree up to
   max_size, the fixed-CP plan of dp_size / w groups (fit.py + assign.py) is one point of the
   same search space; when it needs no placeholder and is predicted strictly faster under
   ``sync``, it replaces the mixed layout (a tie keeps the narrower mixed groups).
6. With a CP term, ``_unsplit`` runs a group whose samples all fit one GPU as unit micro-batches on
   its GPUs wherever the slowest of those is predicted faster than the split.
Every candidate is priced by ``cost.cp.cp_micro_costs``, the function ``Plan.stats`` uses.
Guarantees: every rank has K micro-batches, every CP group non-empty (or an explicit
placeholder under short_step="pad"), each GPU ≤ cap tokens, loss scales exact with W = dp_size,
and the predicted step time is never above that of any fixed CP degree ≤ max_size that fits the
step without placeholders. Trade-off (benchmarks/bench_cp.py, long-context family): without a
CP term a split scales perfectly and the widest uniform layout usually wins (pooling GPUs packs
best); with one (K/V all-gather over InfiniBand, efficiency 0.85) the need-only and mixed layouts
win and the plan is 24-31 % faster than the unpriced one, for ~1-1.5x the planning time of the
unpriced search (~2-3x one fixed-CP plan).
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np

from ..batch import Batch
from ..config import ContextParallel, PlanConfig
from ..cost.cp import cp_micro_costs
from ..cost.models import placeholder_cost
from ..errors import PlanError
from ..footprint import Footprint, footprint_of, micro_footprint
from ..types import Micro, Step
from .assign import arrange, grid_time
from .fit import fit_step, min_micro_count
from .cp_degrees import balanced_degrees, cp_degrees, cp_increments, group_room, per_gpu_cost
from .cp_units import Binner, CPUnits, sample_units
from .layout import StepLayout, step_layout
from .pack import lpt_pack, lpt_pack_wide
from .weigh import loss_coefficients, loss_scales

__all__ = ["plan_dynamic_cp_step", "DynamicCPStep"]


def _cdiv(x: int, d: int) -> int:
    return -(-x // d)


class _Layout:
    """Bins (members, width) and the slot arrangement of one step."""

    def __init__(self, bin_of: np.ndarray, width: np.ndarray, load: np.ndarray, slots: list[list[tuple[int, int]]],
                 placeholders: int = 0):
        self.bin_of, self.width, self.load, self.slots = bin_of, width, load, slots
        self.placeholders = placeholders  # unit bins with no sample (short_step="pad" only)


def _merge_empty(long_w: list[int], unit: int, n_short: int, cmax: int) -> tuple[list[int], dict[int, int]]:
    """Merge empty bins until at most ``n_short`` remain; return long widths and empty-bin counts."""
    empty = {1: unit}
    while sum(empty.values()) > n_short:
        w = next((w for w in sorted(empty) if empty[w] >= 2 and 2 * w <= cmax), None)
        if w is not None:
            empty[w] -= 2
            empty[2 * w] = empty.get(2 * w, 0) + 1
            continue
        # widen a long group with an empty bin of its own width
        j = next((j for j, lw in enumerate(long_w) if empty.get(lw, 0) and 2 * lw <= cmax), None)
        if j is None:
            break
        empty[long_w[j]] -= 1
        long_w[j] *= 2
    return long_w, {w: c for w, c in empty.items() if c}


def _try(lens: np.ndarray, costs: np.ndarray, deg: np.ndarray, cfg: PlanConfig, K: int,
         extra: tuple[np.ndarray, int] | None = None, need_only: bool = False) -> _Layout | None | str:
    """Layout with K slots; None if the packing fails (grow K), "short" if groups would be empty.
    ``extra``: (vision tokens, vision cap per micro-batch) every group keeps; ``need_only``: split
    no sample beyond its token need (no widening, short samples stay out of the long samples'
    groups; only groups merged so none is empty take them)."""
    D, cap = cfg.dp_size, int(group_room(1, cfg))
    cmax = cfg.context_parallel.max_size  # type: ignore[union-attr]
    if not need_only:
        deg = balanced_degrees(lens, costs, deg, D * K, cap, cmax, cfg)  # type: ignore[arg-type]
    long = np.flatnonzero(deg > 1)
    short = np.flatnonzero(deg == 1)
    free = D * K - int(deg[long].sum())
    if free < 0:
        return None
    long_w, empty = _merge_empty(deg[long].tolist(), free, short.size, cmax)  # type: ignore[arg-type]
    if sum(empty.values()) > short.size:
        return "short"
    width = np.array(long_w + [w for w in sorted(empty, reverse=True) for _ in range(empty[w])], dtype=np.int64)
    nb = width.size
    load = np.zeros(nb)
    tokens = np.zeros(nb, dtype=np.int64)
    load[: long.size] = per_gpu_cost(cfg, costs[long], lens[long], width[: long.size])
    tokens[: long.size] = lens[long]
    inc = cp_increments(cfg, width)
    if inc is not None:  # every split group pays its fixed overhead, the empty ones too
        load[long.size:] += np.where(width[long.size:] > 1, cfg.cost.cp.split_overhead, 0.0)  # type: ignore[union-attr]
    bin_of = np.empty(lens.size, dtype=np.int64)
    bin_of[long] = np.arange(long.size)
    if short.size:
        ex, x0 = None, None
        if extra is not None:  # long samples' vision tokens already sit in their groups
            ex, x0 = (extra[0][short], extra[1]), np.zeros(nb, dtype=np.int64)
            x0[: long.size] = extra[0][long]
        room = group_room(width, cfg)
        if need_only:  # the long samples' groups are full
            room = np.where(np.arange(nb) < long.size, tokens, room)
        sb = lpt_pack_wide(lens[short], costs[short], width, cap, load=load, tokens=tokens, extra=ex, extra_load=x0,
                           room=room, increments=inc)
        if sb is None:
            return None
        bin_of[short] = sb
    slots = _arrange(width, load, D, K)
    return None if slots is None else _Layout(bin_of, width, load, slots)


def _arrange(width: np.ndarray, load: np.ndarray, D: int, K: int) -> list[list[tuple[int, int]]] | None:
    """slots[m] = [(bin, start_rank)], groups contiguous and width-aligned, heaviest slot first."""
    free = np.full(K, D, dtype=np.int64)
    members: list[list[int]] = [[] for _ in range(K)]
    wide = [b for b in np.lexsort((-load, -width)) if width[b] > 1]
    for b in wide:
        fit = np.flatnonzero(free >= width[b])
        if not fit.size:
            return None
        m = int(fit[0])
        members[m].append(int(b))
        free[m] -= width[b]
    slot_max = np.array([max((load[b] for b in mem), default=0.0) for mem in members])
    units = [int(b) for b in np.argsort(-load, kind="stable") if width[b] == 1]
    u = 0
    for m in np.argsort(-slot_max, kind="stable"):
        take = int(free[m])
        members[m].extend(units[u:u + take])
        u += take
    if u != len(units):
        return None
    order = np.argsort([-max(load[b] for b in mem) for mem in members], kind="stable")
    slots = []
    for m in order:
        start, placed = 0, []
        for b in sorted(members[m], key=lambda b: (-width[b], -load[b])):
            placed.append((b, start))
            start += int(width[b])
        slots.append(placed)
    return slots


def _min_slots(lens: np.ndarray, deg: np.ndarray, cfg: PlanConfig) -> int:
    """Lower bound on K: GPU-slots for the tokens and for the long samples' groups (and the
    pipeline stages), aligned."""
    D, cap = cfg.dp_size, cfg.max_tokens_per_micro
    gpu_slots = max(_cdiv(int(lens.sum()), cap), int(deg[deg > 1].sum()), 1)  # type: ignore[arg-type]
    return int(min_micro_count(_cdiv(gpu_slots, D), cfg))


def _layout_step(lens: np.ndarray, costs: np.ndarray, deg: np.ndarray, cfg: PlanConfig, allow_short: bool,
                 extra: tuple[np.ndarray, int] | None = None, need_only: bool = False) -> tuple[_Layout, int] | None:
    a, K = cfg.align, _min_slots(lens, deg, cfg)
    if extra is not None:  # the vision cap bounds K from below too
        K = max(K, int(min_micro_count(_cdiv(_cdiv(int(extra[0].sum()), extra[1]), cfg.dp_size), cfg)))
    while True:
        got = _try(lens, costs, deg, cfg, K, extra, need_only)
        if isinstance(got, _Layout):
            return got, K
        # "short": the greedy merge found no tiling without empty groups; the one-sample-per-group
        # layout is the exact test (it tiles with no placeholder whenever any layout can). No
        # packing while every sample still has a group of its own: more slots would only add
        # placeholders, so one group per sample is the layout.
        if got == "short" or (lens.size <= cfg.dp_size * K and int(deg.sum()) <= cfg.dp_size * K):
            padded = _padded(lens, costs, deg, cfg, K)
            return (padded, K) if allow_short or not padded.placeholders else None
        K += a


def _padded(lens: np.ndarray, costs: np.ndarray, deg: np.ndarray, cfg: PlanConfig, K: int) -> _Layout:
    """Too few samples for the plane: one group per sample (widest that fits), placeholders after."""
    D, cmax = cfg.dp_size, cfg.context_parallel.max_size  # type: ignore[union-attr]
    n = lens.size
    width = deg.copy()
    while True:  # widen the costliest groups while GPUs are left
        spare = D * K - int(width.sum())
        now = per_gpu_cost(cfg, costs, lens, width)
        per_gpu = np.where((2 * width <= np.minimum(cmax, width + spare))
                           & (per_gpu_cost(cfg, costs, lens, 2 * width) < now), now, -1.0)
        if spare <= 0 or per_gpu.max() < 0:
            break
        width[int(np.argmax(per_gpu))] *= 2
    spare = D * K - int(width.sum())
    width = np.concatenate([width, np.ones(spare, dtype=np.int64)])  # unit placeholders
    load = np.concatenate([per_gpu_cost(cfg, costs, lens, width[:n]), np.zeros(spare)])
    slots = _arrange(width, load, D, K)
    assert slots is not None  # widths are powers of two dividing D and sum to D·K
    return _Layout(np.arange(n, dtype=np.int64), width, load, slots, placeholders=spare)


def plan_dynamic_cp_step(s: int, samples: np.ndarray, batch: Batch, costs: np.ndarray,
                         cfg: PlanConfig, fp: Footprint | None = None, *, units: CPUnits | None = None,
                         forest: tuple[np.ndarray, np.ndarray] | None = None) -> DynamicCPStep:
    """Fit, arrangement and CP groups of one step under dynamic context parallel.

    ``fp``: the plan's footprint (``footprint.py``): samples occupy their padded lengths
    (``pad_to_multiple_of``), rows round to ``pad_row_to_multiple_of`` within the group's cap, and
    a vision cap holds per micro-batch (CP group). Default: plain varlen rows. ``units`` (with the
    batch's prefix ``forest``): prefix-tree atoms to pack instead of samples (``cp_units``).
    """
    D = cfg.dp_size
    fp = footprint_of(batch, cfg) if fp is None else fp
    units = sample_units(samples, batch, costs, fp, cfg) if units is None else units
    lens, c = units.lens, units.costs
    vcap = cfg.max_vision_tokens_per_micro
    extra = (units.vision, vcap) if vcap is not None and units.vision is not None else None
    deg = cp_degrees(lens, units.label, cfg)
    keep = np.arange(lens.size)
    got = _layout_step(lens, c, deg, cfg, allow_short=cfg.short_step == "pad", extra=extra)
    if got is None and cfg.short_step == "drop":
        got, keep = _drop(units, c, deg, cfg, lens, extra)
    if got is None:
        raise PlanError(_short_message(s, samples.size, lens, deg, cfg))
    layout, K = got
    binner = Binner(units, keep, samples, batch, fp, cfg, forest)
    kept = binner.kept
    assert cfg.loss is not None
    coef = loss_coefficients(cfg.loss, batch.loss_tokens[kept], batch.prompt_codes[kept], batch.rollout_codes[kept])
    best = _mixed_grid(layout, K, binner, coef, cfg, fp)
    if getattr(cfg.cost, "cp", None) is not None:  # priced CP: also split no sample beyond its need
        alt = _layout_step(lens[keep], c[keep], deg[keep], cfg, allow_short=cfg.short_step == "pad", extra=None
                           if extra is None else (extra[0][keep], extra[1]), need_only=True)
        cand = None if alt is None else _mixed_grid(alt[0], alt[1], binner, coef, cfg, fp)
        if cand is not None and cand.time < best.time * (1 - 1e-9):
            best = cand
    for w in _uniform_widths(deg[keep], cfg):
        cand = _uniform_grid(w, units, keep, binner, coef, cfg, fp)
        if cand is not None and cand.time < best.time * (1 - 1e-9):
            best = cand
    best = _unsplit(best, cfg, fp)
    dropped = np.setdiff1d(samples, kept)
    why = f"short_step='drop': trailing rollout dropped so step {s} fills every CP group of the {D}-GPU plane"
    return DynamicCPStep(Step(s, best.grid, kept), dropped, why, best.time)  # type: ignore[arg-type]


class DynamicCPStep(NamedTuple):
    """A planned step, the samples dropped, why, and its predicted time under ``cfg.sync``."""

    step: Step
    dropped: np.ndarray
    why: str
    time: float


class _Candidate(NamedTuple):
    """One step layout: ``grid[r][m]``, its predicted time under ``cfg.sync`` and per-GPU costs."""

    grid: list[list[Micro]]
    time: float
    cost: np.ndarray  # [D, K] per-GPU cost, per_micro included


def _step_time(rank_cost: np.ndarray, cfg: PlanConfig) -> float:
    """Predicted step time of a ranks × slots per-GPU cost grid (per_micro included)."""
    return grid_time(rank_cost, cfg.sync)


def _mixed_grid(layout: _Layout, K: int, binner: Binner, coef: np.ndarray, cfg: PlanConfig,
                fp: Footprint) -> _Candidate:
    """The mixed-width layout found by width-aware packing, as a grid of Micros."""
    D = cfg.dp_size
    scale = loss_scales(cfg.loss, coef, grad_world=D, micro_count=K)  # type: ignore[arg-type]
    nb = layout.width.size
    mc, tokens = binner.costs_tokens(layout.bin_of, nb)
    empty = np.bincount(layout.bin_of, minlength=nb) == 0  # placeholders run one dummy token (stats.py)
    mc[empty] = placeholder_cost(cfg.cost)  # type: ignore[arg-type]
    tokens = np.where(empty, 1, tokens)
    per_gpu = cp_micro_costs(cfg.cost, mc, tokens, layout.width)  # the one CP price (stats.py's too)
    rank_cost = np.zeros((D, K))
    bins = binner.parts(layout.bin_of, nb, scale)
    mfp = micro_footprint(fp)
    grid: list[list[Micro | None]] = [[None] * K for _ in range(D)]
    for m, slot in enumerate(layout.slots):
        for b, start in slot:
            w = int(layout.width[b])
            group = tuple(range(start, start + w))
            rank_cost[start:start + w, m] = per_gpu[b]
            cols, tree = bins[b]
            for q, r in enumerate(group):
                grid[r][m] = Micro._trusted(*cols, w, q, group, tree, footprint=mfp)  # type: ignore[arg-type]
    return _Candidate(grid, _step_time(rank_cost, cfg), rank_cost)  # type: ignore[arg-type]


def _uniform_widths(deg: np.ndarray, cfg: PlanConfig) -> list[int]:
    """Every power-of-two width from the widest sample's degree up to max_size."""
    cmax = int(cfg.context_parallel.max_size)  # type: ignore[union-attr]
    w, out = max(int(deg.max()) if deg.size else 1, 1), []
    while w <= cmax:
        out.append(w)
        w *= 2
    return out


def _uniform_grid(w: int, units: CPUnits, keep: np.ndarray, binner: Binner, coef: np.ndarray,
                  cfg: PlanConfig, fp: Footprint) -> _Candidate | None:
    """Every group w wide: the fixed-CP plan of D / w groups, when it needs no placeholder.

    Fixed CP is one point of the dynamic search space; trying it makes dynamic CP never predicted
    slower than fixed CP at any degree it could use. None when the step is short at width w.
    """
    D = cfg.dp_size
    sub = replace(cfg, dp_size=D // w, context_parallel=ContextParallel(size=w), short_step="pad")
    lens = units.lens[keep]
    vcap = cfg.max_vision_tokens_per_micro
    if units.atoms is None:
        view = step_layout(micro_footprint(fp), units.label[keep], sub)
    else:
        view = StepLayout(None, (units.vision[keep], vcap)) if units.vision is not None and vcap is not None else None
    try:
        fit = fit_step(0, units.label[keep], lens, units.costs[keep], units.rollouts[keep], sub, view)
    except PlanError:
        return None
    K, groups = fit.micro_count, D // w
    if fit.num_bins != groups * K:
        return None
    unit_bin = np.empty(keep.size, dtype=np.int64)
    unit_bin[fit.kept] = fit.bin_of
    scale = loss_scales(cfg.loss, coef, grad_world=D, micro_count=K)  # type: ignore[arg-type]
    mc, tokens = binner.costs_tokens(unit_bin, groups * K)
    per_gpu = cp_micro_costs(cfg.cost, mc, tokens, w)
    placed = arrange(per_gpu, groups, K)
    bins = binner.parts(unit_bin, groups * K, scale)
    mfp = micro_footprint(fp)
    grid: list[list[Micro]] = []
    for g in range(groups):
        group = tuple(range(g * w, (g + 1) * w))
        grid.extend([Micro._trusted(*bins[b][0], w, q, group, bins[b][1], footprint=mfp)  # type: ignore[arg-type]
                     for b in placed[g]] for q in range(w))
    rank_cost = per_gpu[placed]
    return _Candidate(grid, _step_time(rank_cost, cfg), np.repeat(rank_cost, w, axis=0))


def _unsplit(cand: _Candidate, cfg: PlanConfig, fp: Footprint) -> _Candidate:
    """Run a CP group's micro-batch as one unsplit micro-batch per member GPU (same slot, same
    GPUs, same K and loss scales) wherever its samples all fit one GPU and the CP price says the
    slowest of those is faster than the split; only ever lowers a GPU's cost, so the step's
    predicted time never rises. A priced cost only (perfect scaling never favours the unsplit run);
    groups with vision caps or prefix trees are left as they are."""
    if getattr(cfg.cost, "cp", None) is None or cfg.max_vision_tokens_per_micro is not None:
        return cand
    cap, mfp = int(group_room(1, cfg)), micro_footprint(fp)
    grid, rank_cost = [row[:] for row in cand.grid], cand.cost.copy()
    changed = False
    for m in range(rank_cost.shape[1]):
        for r in range(cfg.dp_size):
            mi = grid[r][m]
            w = mi.cp_size
            if mi.cp_rank or w == 1 or mi.indices.size < w or mi.tree is not None:
                continue
            idx = mi.indices
            b = lpt_pack(fp.sample_tokens[idx], fp.sample_costs(cfg.cost, idx), w, cap)  # type: ignore[arg-type]
            if b is None or (fp.bin_tokens(idx, b, w) > cap).any():
                continue
            per = fp.bin_costs(cfg.cost, idx, b, w)  # type: ignore[arg-type]
            if per.max() >= rank_cost[r, m] * (1 - 1e-12):
                continue
            for q, g in enumerate(mi.cp_group):
                sel = np.flatnonzero(b == q)
                parts = [a[sel] for a in (idx, mi.seq_lens, mi.loss_tokens, mi.loss_scale)]
                for a in parts:
                    a.setflags(write=False)
                grid[g][m] = Micro._trusted(*parts, 1, 0, (g,), footprint=mfp)
                rank_cost[g, m] = per[q]
            changed = True
    return _Candidate(grid, _step_time(rank_cost, cfg), rank_cost) if changed else cand


def _short_message(s: int, n: int, lens: np.ndarray, deg: np.ndarray, cfg: PlanConfig) -> str:
    """The refusal of a short step: how many samples the step needs, and the ways out."""
    D, cmax = cfg.dp_size, cfg.context_parallel.max_size  # type: ignore[union-attr]
    K = _min_slots(lens, deg, cfg)
    need = K * (D // cmax)  # type: ignore[operator]
    fixes = "set short_step='pad' (placeholder micro-batches)"
    if cfg.short_step == "error":
        fixes += " or short_step='drop'"
    why = " even after dropping trailing rollouts" if cfg.short_step == "drop" else ""
    return (f"step {s}: {n} samples cannot give every CP group of the {D}-GPU plane a sample{why}: "
            f"{K} micro slot(s) cut into groups of at most ContextParallel.max_size={cmax} GPUs need at least "
            f"{need} samples. To fix: {fixes}, put at least {need} samples in each step (Steps), or raise "
            "ContextParallel.max_size.")


def _drop(units: CPUnits, c: np.ndarray, deg: np.ndarray, cfg: PlanConfig, lens: np.ndarray,
          extra: tuple[np.ndarray, int] | None) -> tuple[tuple[_Layout, int] | None, np.ndarray]:
    """Keep the longest prefix of whole rollouts that needs no placeholder."""
    codes = units.rollouts
    uniq = np.unique(codes)
    for keep_r in range(uniq.size - 1, 0, -1):
        pos = np.flatnonzero(codes < uniq[keep_r])
        got = _layout_step(lens[pos], c[pos], deg[pos], cfg, allow_short=False,
                           extra=None if extra is None else (extra[0][pos], extra[1]))
        if got is not None:
            return got, pos
    return None, np.arange(lens.size)
