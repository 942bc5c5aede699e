"""One step's view of the plan's footprint, for ``fit.py``: what its packers must respect.

Design note. ``fit.py`` packs local positions of a step. A varlen footprint reaches it as the
samples' padded lengths (``Footprint.sample_tokens``) under :func:`~microplan.footprint.packing_cap`
plus, with vision tokens under a cap, a second resource (``extra``) every packer checks. A padded
footprint is not a sum over samples, so the step is handed whole to ``stages/padded.py``. The view
is sliced with :meth:`StepLayout.take` when ``short_step="drop"`` re-packs a prefix.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..config import PlanConfig
from ..footprint import Footprint
from .padded import PaddedSamples

__all__ = ["StepLayout", "step_layout"]


class StepLayout(NamedTuple):
    """``padded``: the samples of a padded layout (None for varlen); ``extra``: (vision tokens,
    vision cap) when the varlen packers must also keep a vision cap (else None)."""

    padded: PaddedSamples | None
    extra: tuple[np.ndarray, int] | None

    def take(self, pos: np.ndarray) -> StepLayout:
        return StepLayout(None if self.padded is None else self.padded.take(pos),
                          None if self.extra is None else (self.extra[0][pos], self.extra[1]))


def step_layout(fp: Footprint | None, samples: np.ndarray, cfg: PlanConfig) -> StepLayout | None:
    """The view of the global ``samples`` of one step; None when the plain varlen packers suffice."""
    if fp is None:
        return None
    vcap = cfg.max_vision_tokens_per_micro
    vis = None if fp.vision_tokens is None else fp.vision_tokens[samples]
    if fp.padded:
        pl = None if fp.prompt_lens is None else fp.prompt_lens[samples]
        xc = None if fp.vision_costs is None else fp.vision_costs[samples]
        return StepLayout(PaddedSamples(fp.seq_lens[samples], pl, vis, xc, fp.padding), None)
    if vis is not None and vcap is not None:
        return StepLayout(None, (vis, vcap))
    return None
