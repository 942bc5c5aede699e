"""Dynamic context parallel: the fit of the flow when each bin also gets a CP width (``max_size=c``).

Design note. ``place.lay_out`` calls :func:`fit_dynamic_cp` where the other configs call
``fit.fit_step`` / ``local.fit_local``; it returns the same things (kept units, the bin of each,
K and its :class:`~microplan.types.KChoice`) plus a width per bin and the ranks × slots grid in
which a group's w ranks share its bin, and the rest of the flow (bin footprints, ``short_step``
across granularities, ``build.build_step``, pipeline order) is the one every plan runs. The
``dp_size`` GPUs of the plane are one pool. A sample of L tokens needs a CP group of
d = nextpow2(⌈L / cap⌉) GPUs (so no GPU holds more than ``max_tokens_per_micro`` tokens); d > c
is a PlanError. Candidate layouts:
1. K starts at the lower bound (tokens, and the GPU-slots of long samples) rounded to align.
2. Bins: one CP group of width d per long sample, plus unit bins for the rest of the dp·K
   GPU-slots. When there are fewer short samples than unit bins, empty bins merge into wider
   ones (and into long samples' groups) until every group can get a sample — the verl seed's
   "fewer sequences than groups" case.
3. Short samples go by width-aware LPT (per-GPU load: the CP price of ``cost/cp.py``, Σ cost /
   width without a CP term; capacity width·cap) into all bins, long groups included; a failure
   grows K by ``align``. Step 1's widening (``balanced_degrees``) doubles a costly sample only
   where the price says that lowers its per-GPU time. With a CP term the layout is also made with
   every sample at its token need and short samples kept out of long groups (``need_only``).
   A group the priced packer leaves empty is a placeholder.
4. Short steps: when that layout has placeholders, one group per unit widened until no GPU is
   idle (the exact test: it tiles whenever any layout can) is one more candidate.
5. Slots: wide groups first-fit-decreasing by width into K slots (widths divide dp, so this
   always tiles), then unit bins fill each slot's free GPUs, heaviest unit bins beside the
   heaviest groups. Groups occupy contiguous, width-aligned rank ranges; placeholder groups take
   a slot's highest ranks and the slots with fewest idle GPUs run first, so every rank runs its
   placeholders after its real micro-batches.
6. Uniform candidates: for every power-of-two width w from the widest sample's degree up to
   max_size, the fixed-CP plan of dp_size / w groups (fit.py + assign.py) is one point of the
   same search space (never with a placeholder).
7. ``short_step``: ``pad`` keeps the fastest candidate, ``drop``/``error`` the fastest with no
   placeholder (a later candidate replaces an earlier one only when strictly faster, so a tie
   keeps the narrower mixed groups); whenever the ``pad`` plan needs none the three agree.
   ``drop`` keeps the longest prefix of whole rollouts that has such a layout.
8. With a CP term, ``_unsplit`` runs a group whose samples all fit one GPU as unit bins on its
   GPUs wherever the slowest of those is predicted faster than the split.
Every candidate is priced by ``cost.gpu.gpu_costs`` (the CP price, placeholders at a dummy
token's), the function ``Plan.stats`` uses, and every K a candidate took is in the step's KChoice.
Guarantees: every rank has K micro-batches, every CP group non-empty (or an explicit
placeholder under short_step="pad"), each GPU ≤ cap tokens, loss scales exact with W = dp_size,
and the predicted step time is never above that of any fixed CP degree ≤ max_size that fits the
step without placeholders. Trade-offs and planning cost: benchmarks/bench_cp.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np

from .._intmath import cdiv
from ..config import ContextParallel, PlanConfig
from ..cost.gpu import gpu_costs
from ..errors import PlanError
from ..types import KChoice
from .assign import arrange, grid_time
from .context import PlanContext
from .cp_degrees import balanced_degrees, cp_degrees, cp_increments, group_room, per_gpu_cost
from .cp_units import Binner, CPUnits, describe_atom
from .fit import fit_step, min_micro_count
from .fitted import Fit
from .layout import StepLayout, step_layout
from .pack import lpt_pack, lpt_pack_wide
from .short import drop_trailing, rollout_order

__all__ = ["fit_dynamic_cp"]


class _WidthPacking:
    """A width-aware packing of one step: each unit's bin, each bin's width and per-GPU load, and the
    slot arrangement (a candidate before it is priced as a ``_Candidate``)."""

    def __init__(self, bin_of: np.ndarray, width: np.ndarray, load: np.ndarray, slots: list[list[tuple[int, int]]],
                 placeholders: int = 0):
        self.bin_of, self.width, self.load, self.slots = bin_of, width, load, slots
        self.placeholders = placeholders  # bins holding no unit (placeholders)


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
         extra: tuple[np.ndarray, int] | None = None, need_only: bool = False) -> _WidthPacking | None | str:
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
    empty = np.bincount(bin_of, minlength=nb) == 0  # a group the packer left empty (priced CP) is a placeholder
    slots = _arrange(width, load, D, K, empty)
    return None if slots is None else _WidthPacking(bin_of, width, load, slots, placeholders=int(empty.sum()))


def _arrange(width: np.ndarray, load: np.ndarray, D: int, K: int,
             empty: np.ndarray | None = None) -> list[list[tuple[int, int]]] | None:
    """slots[m] = [(bin, start_rank)], groups contiguous and width-aligned, heaviest slot first.

    ``empty``: bins holding no sample (placeholders). They take the highest ranks of their slot
    and the slots with the fewest placeholder GPUs run first, so on every rank placeholders come
    after its real micro-batches (as ``assign.arrange`` orders them)."""
    empty = np.zeros(width.size, dtype=bool) if empty is None else empty
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
    units = [int(b) for b in np.lexsort((-load, empty)) if width[b] == 1]  # real units heaviest first
    u = 0
    for m in np.argsort(-slot_max, kind="stable"):
        take = int(free[m])
        members[m].extend(units[u:u + take])
        u += take
    if u != len(units):
        return None
    idle = [int(width[[b for b in mem if empty[b]]].sum()) for mem in members]
    order = np.lexsort(([-max(load[b] for b in mem) for mem in members], idle))
    slots = []
    for m in order:
        start, top, placed = 0, D, []
        for b in sorted(members[m], key=lambda b: (-width[b], -load[b])):
            if empty[b]:  # from the top down, widest first: aligned, since every width divides D
                top -= int(width[b])
                placed.append((b, top))
            else:
                placed.append((b, start))
                start += int(width[b])
        slots.append(placed)
    return slots


def _min_slots(lens: np.ndarray, deg: np.ndarray, cfg: PlanConfig) -> int:
    """Lower bound on K: GPU-slots for the tokens and for the long samples' groups (and the
    pipeline stages), aligned."""
    D, cap = cfg.dp_size, cfg.max_tokens_per_micro
    gpu_slots = max(cdiv(int(lens.sum()), cap), int(deg[deg > 1].sum()), 1)  # type: ignore[arg-type]
    return int(min_micro_count(cdiv(gpu_slots, D), cfg))


def _layout_step(lens: np.ndarray, costs: np.ndarray, deg: np.ndarray, cfg: PlanConfig,
                 extra: tuple[np.ndarray, int] | None = None, need_only: bool = False) -> tuple[_WidthPacking, int]:
    """The mixed-width layout at the fewest slots that pack (placeholders where the step is short)."""
    a, K = cfg.align, _min_slots(lens, deg, cfg)
    if extra is not None:  # the vision cap bounds K from below too
        K = max(K, int(min_micro_count(cdiv(cdiv(int(extra[0].sum()), extra[1]), cfg.dp_size), cfg)))
    while True:
        got = _try(lens, costs, deg, cfg, K, extra, need_only)
        if isinstance(got, _WidthPacking):
            return got, K
        # "short": the greedy merge found no tiling without empty groups. No packing while every
        # sample still has a group of its own: more slots would only add placeholders, so one group
        # per sample is the layout.
        if got == "short" or (lens.size <= cfg.dp_size * K and int(deg.sum()) <= cfg.dp_size * K):
            return _padded(lens, costs, deg, cfg, K), K
        K += a


def _padded(lens: np.ndarray, costs: np.ndarray, deg: np.ndarray, cfg: PlanConfig, K: int,
            fill: bool = False) -> _WidthPacking:
    """Too few samples for the plane: one group per sample (widest that fits), placeholders after. Groups widen while that lowers their per-GPU cost; ``fill``: then on,
    costliest first, until no GPU is idle where the GPUs allow — the exact test of a short step
    (one group per sample, each as wide as it may be, tiles the plane whenever any layout can)."""
    D, cmax = cfg.dp_size, cfg.context_parallel.max_size  # type: ignore[union-attr]
    n = lens.size
    width = deg.copy()
    for forced in (False, True) if fill else (False,):
        while True:  # widen the costliest groups while GPUs are left
            spare = D * K - int(width.sum())
            now = per_gpu_cost(cfg, costs, lens, width)
            ok = 2 * width <= np.minimum(cmax, width + spare)  # a wider group of a unit that fits fits too
            if not forced:
                ok &= per_gpu_cost(cfg, costs, lens, 2 * width) < now
            per_gpu = np.where(ok, now, -1.0)
            if spare <= 0 or per_gpu.max() < 0:
                break
            width[int(np.argmax(per_gpu))] *= 2
    spare = D * K - int(width.sum())
    width = np.concatenate([width, np.ones(spare, dtype=np.int64)])  # unit placeholders
    load = np.concatenate([per_gpu_cost(cfg, costs, lens, width[:n]), np.zeros(spare)])
    slots = _arrange(width, load, D, K, np.arange(width.size) >= n)
    assert slots is not None  # widths are powers of two dividing D and sum to D·K
    return _WidthPacking(np.arange(n, dtype=np.int64), width, load, slots, placeholders=spare)


def fit_dynamic_cp(s: int, units: CPUnits, ctx: PlanContext, policy: str) -> Fit:
    """Widths, bins and slots of one step's units under dynamic context parallel.

    Every candidate layout is searched once; ``policy`` (``short_step``) ``pad`` keeps the fastest,
    ``drop`` and ``error`` the fastest with no placeholder, so whenever the ``pad`` plan needs none
    the three agree; ``drop`` keeps the longest prefix of whole rollouts that has one.
    """
    cfg = ctx.cfg
    deg = cp_degrees(units.lens, units.label, cfg, name=None if units.atoms is None else
                     lambda j: describe_atom(units.atoms, j, int(units.lens[j]), ctx))  # type: ignore[arg-type]
    best = _best(np.arange(units.lens.size), units, deg, ctx, full=policy != "pad")
    if best is None and policy == "drop":  # the longest prefix of whole rollouts with no placeholder
        got = drop_trailing(rollout_order(units.rollouts), lambda pos: _best(pos, units, deg, ctx, full=True))
        best = None if got is None else got[0]
    if best is None:
        n = units.lens.size if units.atoms is None else units.atoms.members.size
        raise PlanError(_short_message(s, n, units, deg, cfg))
    return best


class _Candidate(NamedTuple):
    """One step layout of the kept units: bins, widths, the ranks × slots grid and its price."""

    name: str
    bin_of: np.ndarray
    width: np.ndarray
    grid: np.ndarray       # [D, K] bin of each GPU and slot
    K: int
    time: float
    cost: np.ndarray       # [D, K] per-GPU cost, per_micro included
    placeholders: int


def _best(keep: np.ndarray, units: CPUnits, deg: np.ndarray, ctx: PlanContext, full: bool) -> Fit | None:
    """The fastest layout of the units at ``keep`` (``full``: among those with no placeholder, None
    when there is none): the mixed-width layout, one group per unit widened to fill the plane when
    that one has placeholders, the need-only layout (priced CP), then every uniform width; a later
    candidate replaces an earlier one only when strictly faster."""
    cfg = ctx.cfg
    lens, c, dk = units.lens[keep], units.costs[keep], deg[keep]
    vcap = cfg.max_vision_tokens_per_micro
    extra = (units.vision[keep], vcap) if vcap is not None and units.vision is not None else None
    layouts = [("mixed-width", *_layout_step(lens, c, dk, cfg, extra))]
    if layouts[0][1].placeholders:  # short at K, or groups the priced packer left empty: fill them
        K = layouts[0][2]
        # (with more units than GPU-slots no group is merged, and the packer gives every unit bin a
        # unit before doubling one up: an empty bin is the cheapest place for the next unit)
        if lens.size <= cfg.dp_size * K:
            layouts.append(("one-group-per-unit (widened to fill the plane)",
                            _padded(lens, c, dk, cfg, K, fill=True), K))
    if getattr(cfg.cost, "cp", None) is not None:  # priced CP: also split no sample beyond its need
        layouts.append(("need-only", *_layout_step(lens, c, dk, cfg, extra, need_only=True)))
    binner = Binner(units, keep, ctx)
    tried: list[_Candidate] = [_mixed(name, lay, K, binner, cfg) for name, lay, K in layouts]
    tried += [u for w in _uniform_widths(dk, cfg) if (u := _uniform(w, units, keep, binner, ctx)) is not None]
    best = None
    for cand in tried:
        if (not full or not cand.placeholders) and (best is None or _better(cand, best)):
            best = cand
    if best is None:
        return None
    choice = _choice(tried, best, _min_slots(lens, dk, cfg))
    best = _unsplit(best, keep, units, ctx)
    if best.time < dict(choice.candidates)[best.K]:  # the unsplit groups' time is the plan's at that K
        choice = replace(choice, candidates=tuple((k, min(t, best.time) if k == best.K else t)
                                                  for k, t in choice.candidates))
    nb = best.width.size
    full_bins = int(np.count_nonzero(np.bincount(best.bin_of, minlength=nb)))
    return Fit(keep, best.bin_of, best.K, choice, full_bins, width=best.width, grid=best.grid, time=best.time,
               short=full_bins < nb)


def _better(cand: _Candidate, best: _Candidate) -> bool:
    """``cand`` replaces ``best`` when strictly faster, or as fast (within float noise) with fewer
    placeholders: under ``short_step="pad"`` a tie never keeps an empty group that another layout
    of the same time does without, so ``pad`` agrees with ``drop``/``error`` whenever it can."""
    if cand.time < best.time * (1 - 1e-9):
        return True
    return cand.placeholders < best.placeholders and cand.time <= best.time * (1 + 1e-9)


def _choice(tried: list[_Candidate], best: _Candidate, k_lb: int) -> KChoice:
    """The step's KChoice: every K a candidate layout with no placeholder took (and the chosen one's),
    with the least predicted time at it — the same record whatever ``short_step`` when the plans agree."""
    times: dict[int, float] = {}
    for c in tried:
        if not c.placeholders or c is best:
            times[c.K] = min(times.get(c.K, float("inf")), c.time)
    names = ", ".join(f"{c.name} K={c.K}" + (" with placeholders" if c.placeholders else "") for c in tried)
    return KChoice(best.K, k_lb, tuple(times.items()),
                   f"dynamic CP: the {best.name} layout (K={best.K}) has the least predicted step time of the "
                   f"layouts tried ({names}) that short_step allows (placeholders under 'pad' only).")


def _mixed(name: str, layout: _WidthPacking, K: int, binner: Binner, cfg: PlanConfig) -> _Candidate:
    """A width-aware packing's layout on the ranks × slots grid, priced."""
    D = cfg.dp_size
    nb = layout.width.size
    mc, tokens = binner.costs_tokens(layout.bin_of, nb)
    per_gpu = gpu_costs(cfg.cost, mc, tokens, layout.width)  # type: ignore[arg-type]  # the one price (stats.py's too)
    grid = np.empty((D, K), dtype=np.int64)
    for m, slot in enumerate(layout.slots):
        for b, start in slot:
            grid[start:start + int(layout.width[b]), m] = b
    rank_cost = per_gpu[grid]
    return _Candidate(name, layout.bin_of, layout.width, grid, K, grid_time(rank_cost, cfg.sync), rank_cost,
                      layout.placeholders)


def _uniform_widths(deg: np.ndarray, cfg: PlanConfig) -> list[int]:
    """Every power-of-two width from the widest sample's degree up to max_size."""
    cmax = int(cfg.context_parallel.max_size)  # type: ignore[union-attr]
    w, out = max(int(deg.max()) if deg.size else 1, 1), []
    while w <= cmax:
        out.append(w)
        w *= 2
    return out


def _uniform(w: int, units: CPUnits, keep: np.ndarray, binner: Binner, ctx: PlanContext) -> _Candidate | None:
    """Every group w wide: the fixed-CP plan of D / w groups, when it needs no placeholder.

    Fixed CP is one point of the dynamic search space; trying it makes dynamic CP never predicted
    slower than fixed CP at any degree it could use. None when the step is short at width w.
    """
    cfg = ctx.cfg
    D = cfg.dp_size
    sub = replace(cfg, dp_size=D // w, context_parallel=ContextParallel(size=w), short_step="pad")
    lens = units.lens[keep]
    vcap = cfg.max_vision_tokens_per_micro
    if units.atoms is None:
        view = step_layout(ctx.mfp, units.label[keep], sub)
    else:
        view = StepLayout(None, (units.vision[keep], vcap)) if units.vision is not None and vcap is not None else None
    try:
        fit = fit_step(0, units.label[keep], lens, units.costs[keep], units.rollouts[keep], sub, view)
    except PlanError:
        return None
    K, groups = fit.K, D // w
    if fit.num_bins != groups * K:
        return None
    unit_bin = np.empty(keep.size, dtype=np.int64)
    unit_bin[fit.kept] = fit.bin_of
    mc, tokens = binner.costs_tokens(unit_bin, groups * K)
    per_gpu = gpu_costs(cfg.cost, mc, tokens, w)  # type: ignore[arg-type]
    grid = np.repeat(arrange(per_gpu, groups, K), w, axis=0)  # group g on ranks g·w .. g·w + w − 1
    rank_cost = per_gpu[grid]
    return _Candidate(f"uniform width-{w}", unit_bin, np.full(groups * K, w, dtype=np.int64), grid, K,
                      grid_time(rank_cost, cfg.sync), rank_cost, 0)


def _unsplit(cand: _Candidate, keep: np.ndarray, units: CPUnits, ctx: PlanContext) -> _Candidate:
    """Run a CP group's bin as one unsplit bin per member GPU (same slot, same GPUs, same K)
    wherever its samples all fit one GPU and the CP price says the slowest of those is faster than
    the split; only ever lowers a GPU's cost, so the step's predicted time never rises. A priced
    cost only (perfect scaling never favours the unsplit run); groups with vision caps or prefix
    trees are left as they are, and so is a split that would leave a GPU without a sample."""
    cfg, fp = ctx.cfg, ctx.fp
    if getattr(cfg.cost, "cp", None) is None or cfg.max_vision_tokens_per_micro is not None or units.atoms is not None:
        return cand
    cap = int(group_room(1, cfg))
    label = units.label[keep]
    bin_of, width, grid, rank_cost = cand.bin_of.copy(), list(cand.width.tolist()), cand.grid.copy(), cand.cost.copy()
    members = np.split(np.argsort(bin_of, kind="stable"), np.cumsum(np.bincount(bin_of, minlength=len(width)))[:-1])
    changed = False
    for m in range(grid.shape[1]):
        r = 0
        while r < cfg.dp_size:
            b = int(grid[r, m])
            w = width[b]
            start, r = r, r + w
            pos = members[b]
            if w == 1 or pos.size < w:
                continue
            pos = pos[np.argsort(label[pos], kind="stable")]  # ascending samples, as the Micro holds them
            idx = label[pos]
            q_of = lpt_pack(fp.sample_tokens[idx], fp.sample_costs(cfg.cost, idx), w, cap)  # type: ignore[arg-type]
            if q_of is None or (fp.bin_tokens(idx, q_of, w) > cap).any() or np.bincount(q_of, minlength=w).min() == 0:
                continue
            per = fp.bin_costs(cfg.cost, idx, q_of, w)  # type: ignore[arg-type]
            if per.max() >= rank_cost[start, m] * (1 - 1e-12):
                continue
            new = [b] + list(range(len(width), len(width) + w - 1))
            width[b] = 1
            width.extend([1] * (w - 1))
            bin_of[pos] = np.asarray(new)[q_of]
            grid[start:start + w, m] = new
            rank_cost[start:start + w, m] = per
            changed = True
    if not changed:
        return cand
    return cand._replace(bin_of=bin_of, width=np.asarray(width, dtype=np.int64), grid=grid,
                         time=grid_time(rank_cost, cfg.sync), cost=rank_cost)


def _short_message(s: int, n: int, units: CPUnits, deg: np.ndarray, cfg: PlanConfig) -> str:
    """The refusal of a short step: what the plane needs, what every layout left idle, the ways out."""
    D, cmax = cfg.dp_size, int(cfg.context_parallel.max_size)  # type: ignore[union-attr,arg-type]
    K = _min_slots(units.lens, deg, cfg)
    u = units.lens.size
    what = f"{n} sample{'s' if n != 1 else ''}" + ("" if units.atoms is None or u == n else
                                                      f" (packed as {u} prefix-tree atoms)")
    need = cdiv(D * K, cmax)
    fixes = "set short_step='pad' (placeholder micro-batches)"
    if cfg.short_step == "error":
        fixes += " or short_step='drop' (drop trailing rollouts)"
    why = " even after dropping trailing rollouts" if cfg.short_step == "drop" else ""
    return (f"step {s}: {what} cannot give every GPU of the {D}-GPU plane a non-empty micro-batch in each of "
            f"K={K} slot(s){why}: every layout tried, one CP group per {'sample' if units.atoms is None else 'atom'} "
            f"widened up to ContextParallel.max_size={cmax} GPUs included, leaves GPUs idle (a group of c GPUs "
            f"needs a sample whose rows split c ways within max_tokens_per_micro={cfg.max_tokens_per_micro}). "
            f"To fix: {fixes}, put at least {need} samples in each step (Steps), or raise ContextParallel.max_size.")
