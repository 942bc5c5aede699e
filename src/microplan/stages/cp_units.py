"""What dynamic context parallel packs: samples, or prefix-tree atoms (``share_prefixes``).

Design note. ``stages/cp.py`` chooses CP widths and packs *units* into CP groups; this module
says what a unit is and prices a bin of every unit:

- flat rows: one unit per sample (its padded length, additive cost, rollout);
- tree rows (``share_prefixes``): one unit per atom of ``stages/atoms.py`` (a tree or a tree
  part; its unique trie tokens, tree cost, component code).
A GPU of a group of w computes ⌈U/w⌉ rows of the group's row of U tokens
(``footprint.gpu_tokens``), so a group holds w × cap tokens.

:class:`Binner` maps a bin of each kept unit to each bin's cost and footprint (``fp.bin_costs``,
or ``footprint.bin_footprint`` of the union trie); ``build.build_step`` turns the chosen bins into
micro-batches as it does for every layout. Cost: O(samples) plus one trie pass.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..batch import Batch
from ..config import PlanConfig
from ..footprint import Footprint, bin_footprint
from .atoms import Atoms
from .context import PlanContext

__all__ = ["CPUnits", "sample_units", "atom_units", "Binner", "describe_atom"]


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
    """Bins of kept units → each bin's cost and footprint (module note)."""

    def __init__(self, units: CPUnits, keep: np.ndarray, ctx: PlanContext) -> None:
        self.fp, self.cfg = ctx.fp, ctx.cfg
        self.forest = None if units.atoms is None else (ctx.parent, ctx.shared)
        if units.atoms is None:
            members, rep = units.label[keep], np.arange(keep.size, dtype=np.int64)
        else:
            a = units.atoms
            members = a.samples_of(keep)
            rep = np.repeat(np.arange(keep.size, dtype=np.int64), a.ptr[keep + 1] - a.ptr[keep])
        order = np.argsort(members, kind="stable")
        self.kept, self.rep = members[order], rep[order]  # ascending samples, their unit's position in keep

    def costs_tokens(self, unit_bin: np.ndarray, nb: int) -> tuple[np.ndarray, np.ndarray]:
        """(predicted cost, footprint tokens) of every bin (per_micro included)."""
        sb = unit_bin[self.rep]
        if self.forest is None:
            return (self.fp.bin_costs(self.cfg.cost, self.kept, sb, nb),  # type: ignore[arg-type]
                    self.fp.bin_tokens(self.kept, sb, nb))
        tokens, costs = bin_footprint(self.fp, self.cfg.cost, self.kept, sb, nb,  # type: ignore[arg-type]
                                      forest=self.forest,
                                      rules=self.fp.row_rules())
        return costs, tokens


def describe_atom(atoms: Atoms, j: int, tokens: int, ctx: PlanContext) -> str:
    """How a refusal names tree atom ``j`` of ``tokens`` tokens: its samples, and what its tokens
    count (a lone sample's path through the trie, segments padded to the sample multiple)."""
    members = atoms.samples_of(np.array([j], dtype=np.int64))
    m = ctx.fp.padding.sample_multiple
    pad = f", each trie segment padded to pad_to_multiple_of={m}" if m > 1 else ""
    if members.size == 1:
        i = int(members[0])
        return (f"sample {i} ({int(ctx.batch.seq_lens[i])} tokens) occupies {tokens} tokens with share_prefixes (its "
                f"path through the trie, the segments it shares with its ancestors included{pad})")
    head = ", ".join(map(str, members[:6].tolist())) + (", ..." if members.size > 6 else "")
    return f"the prefix tree of samples {head} occupies {tokens} tokens with share_prefixes (its trie{pad})"
