"""Lay a step's atoms out: placement → K by predicted time → pack under the cap → bin footprints → slots.

Design note. One function, :func:`lay_out`, whatever the atoms are (samples or prefix-tree
parts) and wherever they may go:

1. placement: ``global`` packs every atom into dp·K bins (``fit.fit_step``: K by predicted time,
   slot-target packing, ``short_step``); ``local`` packs each owner rank's atoms into its own K
   bins with one K for every rank (``local.fit_local``). Both see the same atom arrays and the
   same layout view (a vision cap every packer keeps; a padded layout's row geometry);
2. bins: the footprint of each bin (``footprint.bin_footprint``: padded samples, or the union
   trie of its samples — two parts of one tree in one bin share their root path again) and its
   cost, from the one footprint function the cap, ``validate`` and the stats use;
3. slots: ``assign.arrange`` (global) or each rank's bins heaviest first (local), and the
   predicted step time under ``sync`` (static CP divides a bin's work over its group).

Guarantees: the fit's (equal K, aligned, every bin under the cap as the footprint counts it,
no rollout split by a drop). Cost: one fit (usually one packing) and one footprint pass.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np

from ..config import PlanConfig
from ..cost.cp import cp_micro_costs
from ..cost.models import placeholder_cost
from ..footprint import bin_footprint
from ..types import KChoice
from .assign import arrange, grid_time
from .atoms import Atoms
from .context import PlanContext
from .fit import fit_step
from .layout import StepLayout, step_layout
from .local import fit_local

__all__ = ["Layout", "lay_out"]


class Layout(NamedTuple):
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

    @property
    def placeholders(self) -> int:
        """Bins holding no atom."""
        return int((np.bincount(self.bin_of, minlength=self.grid.size) == 0).sum())

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


def lay_out(s: int, atoms: Atoms, ctx: PlanContext, *, short_step: str | None = None) -> Layout:
    """Fit, bin footprints and slots of one step's atoms (``short_step``: the config's by default)."""
    cfg = ctx.cfg
    D = cfg.dp_size
    policy = cfg.short_step if short_step is None else short_step
    view = _view(atoms, ctx)
    run_cfg = cfg if policy == cfg.short_step else replace(cfg, short_step=policy)
    slots = None  # the fit's costs and grid of its packing, when it arranged them
    fixed = False  # local placement: the fit's bin r·K + m is slot m
    if ctx.local:
        fit = fit_local(s, atoms.label, atoms.tokens, atoms.costs, atoms.owner, atoms.rollouts, run_cfg,  # type: ignore[arg-type]
                        ctx.min_k, view, _atom_bin_cost(atoms, ctx), short_step=policy)
        kept, bin_of, K, choice, fixed = fit.kept, fit.bin_of, fit.K, fit.choice, fit.hedged
    else:
        f = fit_step(s, atoms.label, atoms.tokens, atoms.costs, atoms.rollouts, run_cfg, view)
        kept, bin_of, K, choice, slots = f.kept, f.bin_of, f.micro_count, f.choice, f.slots
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
    tokens, costs = bin_footprint(ctx.fp, cfg.cost, samples, sample_bin, D * K, forest=forest)  # type: ignore[arg-type]
    cp = cfg.static_cp_size
    per_gpu = costs if cp == 1 else cp_micro_costs(cfg.cost, costs, tokens, cp)
    if ctx.local and fixed:  # the hedge levelled bin r·K + m against slot m: re-sorting would undo it
        grid = np.arange(D * K, dtype=np.int64).reshape(D, K)
    elif ctx.local:  # each rank's own bins, heaviest first
        grid = np.argsort(-per_gpu.reshape(D, K), axis=1, kind="stable") + (np.arange(D) * K)[:, None]
    elif slots is not None and np.array_equal(slots.costs, per_gpu):  # arrange is a function of the costs
        grid = slots.grid
    else:
        grid = arrange(per_gpu, D, K)
    return Layout(atoms, kept, dropped, bin_of, grid, K, choice, samples, sample_bin, tokens, costs,
                  grid_time(per_gpu[grid], cfg.sync),
                  grid_time(_priced_placeholders(per_gpu, tokens, cfg)[grid], cfg.sync))


def _priced_placeholders(per_gpu: np.ndarray, tokens: np.ndarray, cfg: PlanConfig) -> np.ndarray:
    """Per-GPU costs with each placeholder (a bin holding no token) at its dummy token's price
    (``placeholder_cost``, as stats price it), so candidates with more placeholders are not
    predicted faster than they run."""
    empty = tokens == 0
    if not empty.any():
        return per_gpu
    one = np.ones(1)
    price = cp_micro_costs(cfg.cost, one * placeholder_cost(cfg.cost), one, cfg.static_cp_size)[0]
    return np.where(empty, price, per_gpu)


def _atom_bin_cost(atoms: Atoms, ctx: PlanContext):
    """Local placement's bin cost for atoms at positions ``p`` in bins ``b`` (padded layouts: the
    rows' real shape; otherwise additive over atoms with the packed-row term)."""
    if atoms.trees or ctx.mfp is None or not ctx.mfp.padded:
        return None

    def cost(p: np.ndarray, b: np.ndarray, nb: int) -> np.ndarray:
        return ctx.fp.bin_costs(ctx.cfg.cost, atoms.label[p], b, nb)  # type: ignore[arg-type]
    return cost
