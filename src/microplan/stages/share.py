"""Plan one step with shared prefixes: prefix trees as packing atoms, every shared token once.

Design note. With ``PlanConfig(share_prefixes=True)`` a micro-batch holds the prefix trie of
its samples (``microplan.prefix``). Steps:

1. Trees. The step's samples are grouped by the root of their prefix tree (a GRPO group's
   prompt, a trajectory's first turn, an agent rollout's root). A tree whose trie fits the cap
   is one atom; a larger one is cut in depth-first order into parts that each fit, so a part
   recomputes only the root path it needs and samples sharing long prefixes stay together.
2. Atoms are pseudo-samples for the ordinary fit (``fit.py``): their tokens are their unique
   tokens U, their cost the cost model's ``tree_costs(U, depth_sq)`` (attention per token
   grows with its depth on its path). K is chosen by predicted time, placeholders, align and
   pad/drop/error work unchanged; ``drop`` removes whole components of atoms and rollouts
   (a rollout cut over two parts drops with both), so no rollout is ever split.
3. Micro-batches. Each bin's samples, in depth-first order, get the trie of their union (two
   parts of one tree in one micro-batch share their root path again), its exact cost, and the
   usual arrangement into slots and loss scales.

4. Granularity by predicted time. Whole trees save the most tokens but balance coarsely when a
   step holds few large trees per rank; cutting them duplicates root paths. The step is planned
   with whole trees, with trees cut into parts of about the mean micro-batch load and half of
   it, and with one atom per sample (micro-batch tries still share what their samples share);
   the plan with the fewest drops, then the least predicted step time, then the fewest tokens
   is kept.

Guarantees: every core invariant (the cap now counting unique tokens); a micro-batch never
holds more tokens than its samples unshared; the step is never predicted slower than the
per-sample candidate, which packs exactly what the plain planner packs (and its micro-batches
share whatever their samples share). Cost: up to four packings per step; the trie arithmetic
(atoms, bin tries, micro-batch trees and orders) is ``microplan.trie``'s, near-linear. Measured
side by side on a busy VM (``benchmarks/bench_share_speed.py``): 16,384 GRPO samples at dp 128
17x the unshared plan (was 59x; the four packings are ~2/3 of it), chains of 250-1,500 samples
2.4-4.8x (were 53-86x).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..batch import Batch
from ..config import PlanConfig
from ..cost.models import bin_costs
from ..errors import PlanError
from ..prefix import dfs_orders, forest_of
from ..trie import TreeCut, _unique_inverse, cut_trees, micro_trees, set_tries
from ..types import Micro, Step
from .assign import arrange, grid_time
from .fit import StepFit, effective_cap, fit_step
from .weigh import loss_coefficients, loss_scales

__all__ = ["plan_shared_step"]


def _atoms(samples: np.ndarray, parent: np.ndarray, shared: np.ndarray, lens: np.ndarray,
           limit: int) -> TreeCut:
    """Trees whose trie holds at most ``limit`` tokens stay whole; a larger one is cut into parts,
    subtree by subtree (a branch that fits in the current part's room joins it, one that fits a
    fresh part starts one, a larger one is split at its own branches), so parts break where
    branches diverge. ``limit`` <= the cap; a sample longer than ``limit`` is a part of its own
    (never above the cap when the sample fits it). ``trie.cut_trees``: linear on chains."""
    return cut_trees(parent, shared, lens, samples, limit)


def _components(cut: TreeCut, rollouts: np.ndarray) -> np.ndarray:
    """Per atom, the smallest rollout code of its component (atoms joined by shared rollouts):
    labels spread between atoms and rollouts until they settle (one round unless rollouts chain)."""
    codes, r = _unique_inverse(rollouts)
    comp = codes.copy()
    A = cut.tokens.size
    while True:
        at = np.full(A, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(at, cut.atom_of, comp[r])
        nxt = comp.copy()
        np.minimum.at(nxt, r, at[cut.atom_of])
        if np.array_equal(nxt, comp):
            return at
        comp = nxt


class _Candidate(NamedTuple):
    """One way to cut a step's trees into atoms, packed: its bins, drops and predicted time."""

    bin_of: np.ndarray         # bin (of the dp·K) of each of the step's samples, -1: dropped
    grid: np.ndarray           # [dp, K] bin of each (rank, slot)
    kept: np.ndarray
    dropped: np.ndarray
    fit: StepFit
    time: float              # predicted step time under cfg.sync (lockstep Σ_m max_r, or max_r Σ_m)
    bin_tokens: np.ndarray   # unique tokens each bin's trie holds

    def key(self) -> tuple[int, float, int]:
        return (self.dropped.size, self.time, int(self.bin_tokens.sum()))


CUT_FRACTIONS = (1.0, 0.5)  # tree-cut limits tried, as fractions of the mean micro-batch load


def plan_shared_step(s: int, samples: np.ndarray, batch: Batch, costs: np.ndarray,
                     cfg: PlanConfig) -> tuple[Step, np.ndarray, str]:
    """The share-prefixes counterpart of the planner's per-step function.

    Plans the step with whole-tree atoms, with trees cut at branches into parts of about the mean
    micro-batch load (and half of it), and with one atom per sample (tries of each micro-batch's
    samples still shared); keeps the fewest drops, then the least predicted time, then the fewest
    tokens. The per-sample candidate makes a sharing plan never predicted slower than the
    same step planned without sharing.
    """
    cost = cfg.cost
    if not hasattr(cost, "tree_costs"):
        raise PlanError(f"share_prefixes=True needs a cost model that prices prefix trees (tree_costs): "
                        f"{type(cost).__name__} has none; use TokenCost or FlopsCost.")
    parent, shared = forest_of(batch)
    lens = batch.seq_lens
    cap = effective_cap(cfg)
    assert cap is not None and cfg.loss is not None
    singles = _singles(samples, lens)
    try:
        best = _candidate(s, _atoms(samples, parent, shared, lens, cap), samples, batch, cfg)
    except PlanError:  # whole trees may be too few for dp·K micro-batches: finer atoms may fill them
        best = _candidate(s, singles, samples, batch, cfg)  # the plain planner's feasibility
        return _step(s, best, samples, batch, cfg), best.dropped, _why(s, cfg)
    mean = best.bin_tokens.sum() / best.bin_tokens.size
    largest = int(best.bin_tokens.max())
    tried = {cap}
    for frac in CUT_FRACTIONS:
        limit = max(1, int(mean * frac))
        if limit < largest and limit not in tried:
            tried.add(limit)
            best = min(best, _candidate(s, _atoms(samples, parent, shared, lens, limit), samples, batch, cfg),
                       key=_Candidate.key)
    best = min(best, _candidate(s, singles, samples, batch, cfg), key=_Candidate.key)
    return _step(s, best, samples, batch, cfg), best.dropped, _why(s, cfg)


def _why(s: int, cfg: PlanConfig) -> str:
    return (f"short_step='drop': trailing rollouts (whole prefix-tree components) dropped so step {s} aligns to "
            f"dp_size × align = {cfg.dp_size} × {cfg.align} micro-batches")


def _singles(samples: np.ndarray, lens: np.ndarray) -> TreeCut:
    """One atom per sample, in the step's order (what the plain planner packs)."""
    L = lens[samples].astype(np.int64)
    return TreeCut(np.arange(samples.size, dtype=np.int64), L, (L * L).astype(np.float64), samples)


def _candidate(s: int, atoms: TreeCut, samples: np.ndarray, batch: Batch, cfg: PlanConfig) -> _Candidate:
    """Pack ``atoms`` with the ordinary fit; each bin gets the trie of its samples' union."""
    cost = cfg.cost
    parent, shared = forest_of(batch)
    a_costs = cost.tree_costs(atoms.tokens, atoms.depth_sq)  # type: ignore[union-attr]
    a_codes = _components(atoms, batch.rollout_codes[samples])
    fit = fit_step(s, atoms.first, atoms.tokens, a_costs, a_codes, cfg)   # first samples: named in cap refusals
    D, K = cfg.dp_size, fit.micro_count
    bin_of_atom = np.full(atoms.tokens.size, -1, dtype=np.int64)
    bin_of_atom[fit.kept] = fit.bin_of
    bin_of = bin_of_atom[atoms.atom_of]
    held = bin_of >= 0
    kept = np.sort(samples[held])
    unions = set_tries(parent, shared, batch.seq_lens, samples[held], bin_of[held], D * K)  # each bin's trie
    U = unions.tokens.astype(np.float64)
    counts = np.bincount(bin_of[held], minlength=D * K)
    bc = bin_costs(cost, cost.tree_costs(U, unions.depth_sq), U, counts)  # type: ignore[union-attr,arg-type]
    grid = arrange(bc, D, K)
    dropped = np.sort(samples[~held])
    return _Candidate(bin_of, grid, kept, dropped, fit, grid_time(bc[grid], cfg.sync), U)


def _step(s: int, c: _Candidate, samples: np.ndarray, batch: Batch, cfg: PlanConfig) -> Step:
    """The chosen candidate as a Step: loss scales, samples in depth-first order per micro-batch."""
    parent, shared = forest_of(batch)
    K = c.fit.micro_count
    assert cfg.loss is not None
    kept = c.kept
    coef = loss_coefficients(cfg.loss, batch.loss_tokens[kept], batch.prompt_codes[kept], batch.rollout_codes[kept])
    scale = np.zeros(batch.num_samples)
    scale[kept] = loss_scales(cfg.loss, coef, grad_world=cfg.grad_world, micro_count=K)
    held = c.bin_of >= 0
    trees = micro_trees(parent, shared, batch.seq_lens, samples[held], c.bin_of[held], c.grid.size)
    orders = dfs_orders(parent, shared, samples[held], c.bin_of[held], c.grid.size)
    micros = []
    for r in range(cfg.dp_size):
        row = []
        for b in c.grid[r].tolist():
            row.append(_micro(orders[b], batch, scale, r, trees[b] if orders[b].size else None))
        micros.append(row)
    return Step(s, micros, kept, choice=c.fit.choice)


def _micro(idx: np.ndarray, batch: Batch, scale: np.ndarray, rank: int, tree) -> Micro:
    cols = [idx, batch.seq_lens[idx], batch.loss_tokens[idx], scale[idx].astype(np.float64)]
    for c in cols:
        c.setflags(write=False)
    return Micro._trusted(*cols, 1, 0, (rank,), tree)
