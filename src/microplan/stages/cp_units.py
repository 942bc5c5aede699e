"""What dynamic context parallel packs: samples, or prefix-tree atoms (``share_prefixes``).

Design note. ``stages/cp.py`` chooses CP widths and packs *units* into CP groups; this module
says what a unit is and turns a bin of every unit back into micro-batches:

- flat rows: one unit per sample (its padded length, additive cost, rollout);
- tree rows (``share_prefixes``): one unit per atom of ``stages/atoms.py`` (a tree or a tree
  part; its unique trie tokens, tree cost, component code).
A GPU of a group of w computes ⌈U/w⌉ rows of the group's row of U tokens
(``footprint.gpu_tokens``), so a group holds w × cap tokens.

:class:`Binner` maps a bin of each kept unit to each bin's cost and footprint (``fp.bin_costs``,
or ``footprint.bin_footprint`` of the union trie) and to Micro columns (ascending samples, or
depth-first with the bin's trie: ``build.tree_parts``). Cost: O(samples) plus one trie pass.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..batch import Batch
from ..config import PlanConfig
from ..footprint import Footprint, bin_footprint
from .atoms import Atoms
from .build import tree_parts
from .micros import binned_micros

__all__ = ["CPUnits", "sample_units", "atom_units", "Binner"]


class CPUnits(NamedTuple):
    """A step's units, arrays aligned by unit (``members``/``ptr`` only for tree atoms)."""

    lens: np.ndarray             # int64 tokens a unit occupies alone (padding included)
    costs: np.ndarray            # float64 additive cost
    label: np.ndarray            # int64 a member sample, named in refusals
    rollouts: np.ndarray         # int64 drop unit code
    vision: np.ndarray | None    # int64 vision tokens, None without a vision cap
    atoms: Atoms | None          # the atoms (tree rows), None for samples


def sample_units(samples: np.ndarray, batch: Batch, costs: np.ndarray, fp: Footprint, cfg: PlanConfig) -> CPUnits:
    vis = fp.vision_tokens[samples] if cfg.max_vision_tokens_per_micro is not None and fp.vision_tokens is not None \
        else None
    return CPUnits(fp.sample_tokens[samples], costs[samples], samples, batch.rollout_codes[samples], vis, None)


def atom_units(atoms: Atoms) -> CPUnits:
    """Tree atoms as units."""
    return CPUnits(atoms.tokens, atoms.costs, atoms.label, atoms.rollouts, atoms.vision, atoms)


class Binner:
    """Bins of kept units → bin costs, footprints and Micro columns (module note)."""

    def __init__(self, units: CPUnits, keep: np.ndarray, samples: np.ndarray, batch: Batch, fp: Footprint,
                 cfg: PlanConfig, forest: tuple[np.ndarray, np.ndarray] | None) -> None:
        self.batch, self.fp, self.cfg, self.forest = batch, fp, cfg, forest
        if units.atoms is None:
            members, rep = samples[keep], np.arange(keep.size, dtype=np.int64)
        else:
            a = units.atoms
            members = a.samples_of(keep)
            rep = np.repeat(np.arange(keep.size, dtype=np.int64), a.ptr[keep + 1] - a.ptr[keep])
        order = np.argsort(members, kind="stable")
        self.kept, self.rep = members[order], rep[order]  # ascending samples, their unit's position in keep

    def sample_bin(self, unit_bin: np.ndarray) -> np.ndarray:
        return unit_bin[self.rep]

    def costs_tokens(self, unit_bin: np.ndarray, nb: int) -> tuple[np.ndarray, np.ndarray]:
        """(predicted cost, footprint tokens) of every bin (per_micro included)."""
        sb = self.sample_bin(unit_bin)
        if self.forest is None:
            return (self.fp.bin_costs(self.cfg.cost, self.kept, sb, nb),  # type: ignore[arg-type]
                    self.fp.bin_tokens(self.kept, sb, nb))
        tokens, costs = bin_footprint(self.fp, self.cfg.cost, self.kept, sb, nb, forest=self.forest)  # type: ignore[arg-type]
        return costs, tokens

    def parts(self, unit_bin: np.ndarray, nb: int, scale: np.ndarray) -> list[tuple[tuple, object]]:
        """Per bin: (the four Micro columns, its prefix trie or None); ``scale`` aligned with ``kept``."""
        sb = self.sample_bin(unit_bin)
        if self.forest is None:
            return [(p, None) for p in binned_micros(self.kept, sb, nb, scale, self.batch)]
        empty = binned_micros(self.kept[:0], sb[:0], 1, scale[:0], self.batch)[0]
        return [(empty, None) if t is None else t
                for t in tree_parts(self.forest[0], self.forest[1], self.batch, self.kept, sb, nb, scale)]
