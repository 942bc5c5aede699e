"""What every stage of one plan reads: the batch, the config and what is derived from them once.

Design note. ``planner.build_plan`` builds one :class:`PlanContext` per plan: the footprint
rules (``footprint.py``), each sample's additive cost, the prefix forest (sharing), the
placement (owner ranks under ``placement="local"``) and the minimum K. Stages take it instead
of re-deriving these per step, and never import the planner back. O(n) numpy to build.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..batch import Batch
from ..config import PlanConfig
from ..footprint import Footprint, footprint_of, micro_footprint
from ..prefix import forest_of

__all__ = ["PlanContext", "plan_context"]


class PlanContext(NamedTuple):
    """One plan's inputs and derived per-sample arrays (global sample indices)."""

    batch: Batch
    cfg: PlanConfig
    fp: Footprint                 # what any set of samples occupies (layout, padding, vision)
    mfp: Footprint | None         # what each Micro carries (None: a plain varlen row)
    costs: np.ndarray             # float64 additive cost of each sample alone (padding, vision included)
    parent: np.ndarray            # prefix forest (all -1 without sharing)
    shared: np.ndarray
    owner: np.ndarray | None      # rank of each sample under placement="local", else None
    min_k: int                    # fewest micro-batches per rank (pipeline stages, a framework's minimum)

    @property
    def local(self) -> bool:
        return self.owner is not None

    @property
    def vision_cap(self) -> int | None:
        """The vision cap the packers keep, when the batch has vision tokens."""
        return self.cfg.max_vision_tokens_per_micro if self.fp.vision_tokens is not None else None


def plan_context(batch: Batch, cfg: PlanConfig, min_k: int) -> PlanContext:
    fp = footprint_of(batch, cfg)
    assert cfg.cost is not None  # PlanConfig fills the default
    parent, shared = forest_of(batch)
    owner = batch.rank_of if cfg.placement == "local" else None
    return PlanContext(batch, cfg, fp, micro_footprint(fp), fp.sample_costs(cfg.cost), parent, shared, owner, min_k)
