"""Lay a step's atoms out: placement → K by predicted time → pack under the cap → bin footprints → slots.

Design note. One function, :func:`lay_out`, whatever the atoms are (samples or prefix-tree
parts) and wherever they may go:

1. placement: ``global`` packs every atom into dp·K bins (``fit.fit_step``: K by predicted time,
   slot-target packing, ``short_step``); ``local`` packs each owner rank's atoms into its own K
   bins with one K for every rank (``local.fit_local``). Both see the same atom arrays and the
   same layout view (a vision cap every packer keeps; a padded layout's row geometry). Under
   dynamic CP (``max_size``) ``cp.fit_dynamic_cp`` fits the
   atoms with a CP width per bin and places the groups itself. Every fitter returns one
   ``fitted.Fit``, so what follows is the same for all three;
2. bins: the footprint of each bin (``footprint.bin_footprint``: padded samples, or the union
   trie of its samples — two parts of one tree in one bin share their root path again) and its
   cost, from the one footprint function the cap, ``validate`` and the stats use;
3. slots: ``assign.arrange`` (global), each rank's bins heaviest first (local), or the fitter's
   grid (dynamic CP's groups, the local hedge), and the predicted step time under ``sync``
   (``cost.gpu.gpu_costs``: a bin's work over its CP group, placeholders at a dummy token's
   price). A static-batching step gets the KChoice its count fixes.

Guarantees: the fit's (equal K, aligned, every bin under the cap as the footprint counts it,
no rollout split by a drop). Cost: one fit (usually one packing) and one footprint pass.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np

from ..config import PlanConfig
from ..cost.cp import cp_micro_costs
from ..cost.gpu import gpu_costs
from ..errors import PlanError
from ..fixes import too_long_fixes
from ..footprint import bin_footprint
from ..types import KChoice
from .assign import arrange, grid_time
from .atoms import Atoms, bin_tries
from .context import PlanContext
from .cp import fit_dynamic_cp
from .cp_units import atom_units, describe_atom, sample_units
from .fit import effective_cap, fit_step
from .fitted import Fit
from .layout import StepLayout, step_layout
from .local import fit_local

__all__ = ["PlacedStep", "lay_out"]


class PlacedStep(NamedTuple):
    """One step's atoms laid out on the ranks × slots grid."""

    atoms: Atoms
    kept: np.ndarray          # atom positions that train
    dropped: np.ndarray       # atom positions dropped by short_step="drop"
    bin_of: np.ndarray        # bin (0..dp·K-1) of each kept atom
    grid: np.ndarray          # [dp, K] bin run by rank r in slot m
    K: int
    choice: KChoice | None
    samples: np.ndarray       # member samples of the kept atoms, atom by atom
    sample_bin: np.ndarray    # bin of each of those samples
    bin_tokens: np.ndarray    # footprint of each bin (what the cap counts)
    bin_costs: np.ndarray     # predicted cost of each bin (whole group under static CP)
    time: float               # predicted step time under cfg.sync, as the fit priced it (placeholders: per_micro)
    run_time: float           # the same with each placeholder at its dummy token's price, as stats price the plan
    width: np.ndarray | None = None  # dynamic CP: each bin's CP width (its group's ranks share the bin in ``grid``)

    @property
    def placeholders(self) -> int:
        """Bins holding no atom."""
        nb = self.grid.size if self.width is None else self.width.size
        return int((np.bincount(self.bin_of, minlength=nb) == 0).sum())

    @property
    def dropped_samples(self) -> np.ndarray:
        return np.sort(self.atoms.samples_of(self.dropped))

    def key(self) -> tuple[int, float, int]:
        """Candidates compare by fewest dropped samples, then predicted time (placeholders priced as
        they run: a candidate with more of them is not faster for it), then tokens."""
        return (int(self.atoms.ptr[self.dropped + 1].sum() - self.atoms.ptr[self.dropped].sum()), self.run_time,
                int(self.bin_tokens.sum()))


def _view(atoms: Atoms, ctx: PlanContext) -> StepLayout | None:
    """What the packers must respect besides the cap: a padded layout (samples) or a vision cap."""
    if not atoms.trees and ctx.mfp is not None:
        return step_layout(ctx.mfp, atoms.members, ctx.cfg)
    if atoms.vision is not None:
        return StepLayout(None, (atoms.vision, ctx.vision_cap))  # type: ignore[arg-type]
    return None


def lay_out(s: int, atoms: Atoms, ctx: PlanContext, *, short_step: str | None = None) -> PlacedStep:
    """Fit, bin footprints and slots of one step's atoms (``short_step``: the config's by default)."""
    cfg = ctx.cfg
    D = cfg.dp_size
    policy = cfg.short_step if short_step is None else short_step
    f = _fit(s, atoms, ctx, policy)
    kept, bin_of, K = f.kept, f.bin_of, f.K
    if kept.size == atoms.size:  # distinct atom positions, all of them: nothing dropped
        dropped = np.zeros(0, dtype=np.int64)
    else:
        gone = np.ones(atoms.size, dtype=bool)
        gone[kept] = False
        dropped = np.flatnonzero(gone)  # ascending, as np.setdiff1d (which sorts: 3-6 ms at 16k atoms)
    single = atoms.single
    samples = atoms.members[kept] if single else atoms.samples_of(kept)
    sample_bin = bin_of if single else np.repeat(bin_of, atoms.ptr[kept + 1] - atoms.ptr[kept])
    forest = (ctx.parent, ctx.shared) if atoms.trees else None
    nb = D * K if f.width is None else f.width.size
    tries = bin_tries(atoms, kept, bin_of, nb, ctx) if atoms.trees and not single else None
    tokens, costs = bin_footprint(ctx.fp, cfg.cost, samples, sample_bin, nb, forest=forest,  # type: ignore[arg-type]
                                  tries=tries)
    if f.width is not None:  # dynamic CP: the fitter placed its groups and priced them (gpu_costs)
        assert f.grid is not None and f.time is not None
        time = f.time
        if atoms.flat_fit and atoms.trees:  # the unshared plan's groups, each bin priced as its tree row
            time = grid_time(gpu_costs(cfg.cost, costs, tokens, f.width)[f.grid], cfg.sync)
        return PlacedStep(atoms, kept, dropped, bin_of, f.grid, K, f.choice, samples, sample_bin, tokens, costs,
                      time, time, f.width)
    cp = cfg.static_cp_size
    per_gpu = costs if cp == 1 else cp_micro_costs(cfg.cost, costs, tokens, cp)
    priced = gpu_costs(cfg.cost, costs, tokens, cp)  # type: ignore[arg-type]  # placeholders at their price
    if f.grid is not None:  # the local hedge levelled bin r·K + m against slot m: re-sorting would undo it
        grid = f.grid
    elif ctx.local:  # each rank's own bins, heaviest first
        grid = np.argsort(-per_gpu.reshape(D, K), axis=1, kind="stable") + (np.arange(D) * K)[:, None]
    elif f.slots is not None and np.array_equal(f.slots.costs, per_gpu):  # arrange is a function of the costs
        grid = f.slots.grid
    else:
        grid = arrange(per_gpu, D, K)
        if atoms.trees and atoms.single:  # never a worse arrangement than the unshared plan's
            grid = _no_worse_than_flat(grid, priced, samples, sample_bin, f.slots, ctx, K)
    run_time = grid_time(priced[grid], cfg.sync)
    choice = f.choice if f.choice is not None else _static_choice(K, run_time, cfg)  # static batching
    return PlacedStep(atoms, kept, dropped, bin_of, grid, K, choice, samples, sample_bin, tokens, costs,
                  grid_time(per_gpu[grid], cfg.sync), run_time)


def _fit(s: int, atoms: Atoms, ctx: PlanContext, policy: str) -> Fit:
    """The step's fit by the fitter its placement and CP mode call for (``fitted.Fit``, one result)."""
    cfg = ctx.cfg
    if cfg.context_parallel is not None and cfg.context_parallel.dynamic:  # a width per bin, chosen in the fit
        units = atom_units(atoms) if atoms.trees and not atoms.flat_fit else \
            sample_units(atoms.members, ctx.batch, ctx.costs, ctx.fp, cfg)
        return fit_dynamic_cp(s, units, ctx, policy)
    view = _view(atoms, ctx)
    lens = atoms.tokens
    if atoms.trees:
        _check_tree_cap(atoms, lens, ctx)
    run_cfg = cfg if policy == cfg.short_step else replace(cfg, short_step=policy)
    if ctx.local:
        return fit_local(s, atoms.label, lens, atoms.costs, atoms.owner, atoms.rollouts, run_cfg,  # type: ignore[arg-type]
                         ctx.min_k, view, _atom_bin_cost(atoms, ctx), short_step=policy)
    return fit_step(s, atoms.label, lens, atoms.costs, atoms.rollouts, run_cfg, view)


def _static_choice(K: int, time: float, cfg: PlanConfig) -> KChoice:
    """The KChoice of a static-batching step: K is the fewest micro-batches per rank that hold the
    step's samples ``micro_batch_size`` at a time, aligned — fixed by the count, not timed."""
    where = "the busiest rank's samples" if cfg.placement == "local" else \
        f"the step's samples over dp_size={cfg.dp_size}"
    return KChoice(K, K, ((K, time),),
                   f"static batching: K={K} micro-batches per rank hold {where} at most micro_batch_size="
                   f"{cfg.micro_batch_size} at a time (align={cfg.align}, pipeline_stages={cfg.pipeline_stages}); "
                   "the count fixes K, so no other K is timed")


def _check_tree_cap(atoms: Atoms, lens: np.ndarray, ctx: PlanContext) -> None:
    """PlanError naming the prefix-tree atom that fits no micro-batch: its samples, its trie tokens
    and what they count (segments padded to the sample multiple)."""
    cfg = ctx.cfg
    cap = effective_cap(cfg)
    if cap is None or not lens.size or int(lens.max()) <= cap:
        return
    j = int(np.argmax(lens))
    who = describe_atom(atoms, j, int(atoms.tokens[j]), ctx)
    cp = cfg.static_cp_size
    where = f"max_tokens_per_micro={cfg.max_tokens_per_micro}" + (f" × cp size {cp}" if cp > 1 else "") + \
        (f", {cap} after the row multiple" if cap != cfg.max_tokens_per_micro * cp else "")
    raise PlanError(f"{who}, more than one micro-batch may hold ({where}); "
                    f"{too_long_fixes(cfg, padded=ctx.fp.padding.sample_multiple > 1)}.")


def _no_worse_than_flat(grid: np.ndarray, priced: np.ndarray, samples: np.ndarray, sample_bin: np.ndarray,
                        slots: Any, ctx: PlanContext, K: int) -> np.ndarray:
    """Per-sample atoms with shared prefixes pack exactly the bins the unshared plan packs, each
    costing no more (a trie row never holds more than its samples flat); the unshared plan's
    arrangement of them is kept when it is the faster one under the shared costs, so the
    candidate's predicted time is never above the unshared plan's (``arrange`` is a heuristic,
    not monotone in the costs under ``sync="step"``)."""
    cfg = ctx.cfg
    D = cfg.dp_size
    tokens, costs = ctx.fp.bin_shape(cfg.cost, samples, sample_bin, D * K)  # type: ignore[arg-type]
    flat = costs if cfg.static_cp_size == 1 else cp_micro_costs(cfg.cost, costs, tokens, cfg.static_cp_size)
    other = slots.grid if slots is not None and np.array_equal(slots.costs, flat) else arrange(flat, D, K)
    if grid_time(priced[other], cfg.sync) < grid_time(priced[grid], cfg.sync):
        return other
    return grid


def _atom_bin_cost(atoms: Atoms, ctx: PlanContext):
    """Local placement's bin cost for atoms at positions ``p`` in bins ``b`` (padded layouts: the
    rows' real shape; otherwise additive over atoms with the packed-row term)."""
    if atoms.trees or ctx.mfp is None or not ctx.mfp.padded:
        return None

    def cost(p: np.ndarray, b: np.ndarray, nb: int) -> np.ndarray:
        return ctx.fp.bin_costs(ctx.cfg.cost, atoms.label[p], b, nb)  # type: ignore[arg-type]
    return cost
