"""``MemoryMeter``: learn the memory model online from the peaks a trainer already sees.

Design note. Each record is one flat micro-batch that ran on one GPU and the peak bytes it added
(on CUDA: ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, less what
was allocated before it). :meth:`MemoryMeter.model` returns the model to plan the next step with:

1. With a prior (``from_hf_config`` or a profile): the prior rescaled by the one factor s that
   explains the records best in relative least squares — the micro-batches a balanced plan makes
   are nearly alike (every one near the budget), so they identify one factor reliably and little
   else; directions they do not vary stay at the prior's shape.
2. Without a prior, once ``min_rows`` records of at least two sample counts are in: a full fit
   (``memory/fit.py``, both regimes, phases). Before that, :meth:`model` raises PlanError.
3. Margin (stated, never guessed): the worst under-prediction of the fitted model over the
   records, rounded up to 0.5 %, and never below ``min_margin``; the prior's margin until the
   first record.

The window holds the last ``window`` records (memory O(window)). Guarantees: the model handed out
always has ``per_token`` > 0 and a margin that covers every record in the window.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace
from typing import Any

import numpy as np

from .._checks import float_field, int_field
from ..cost.mapfit import rescale
from ..errors import PlanError
from .fit import fit_memory, relative_errors
from .model import MemoryModel

__all__ = ["MemoryMeter"]


class MemoryMeter:
    """Online memory model from measured peaks (see the module note).

    Args:
        prior: the model before any record (``MemoryModel.from_hf_config`` or a profile), or None.
        window: records kept (the most recent).
        min_rows: records needed for a fit without a prior.
        min_margin: the least margin handed out (relative; 0.02 = 2 %).
    """

    def __init__(self, prior: MemoryModel | None = None, *, window: int = 512, min_rows: int = 8,
                 min_margin: float = 0.0) -> None:
        if prior is not None and not isinstance(prior, MemoryModel):
            raise PlanError(f"MemoryMeter(prior=...) must be a MemoryModel or None, got {type(prior).__name__}.")
        self.prior = prior
        self.window = int_field("MemoryMeter(window)", window, minimum=4)
        self.min_rows = int_field("MemoryMeter(min_rows)", min_rows, minimum=4)
        self.min_margin = float_field("MemoryMeter(min_margin)", min_margin, minimum=0.0)
        self._rows: deque[tuple[tuple[int, ...], float]] = deque(maxlen=self.window)

    def __len__(self) -> int:
        return len(self._rows)

    def record(self, seq_lens: Any, peak_bytes: float) -> None:
        """Add one micro-batch: its sample lengths (or a flat ``Micro`` of cp_size 1) and the peak bytes it added."""
        if getattr(seq_lens, "tree", None) is not None or int(getattr(seq_lens, "cp_size", 1)) != 1:
            raise PlanError("MemoryMeter.record takes flat micro-batches run on one GPU (no prefix tree, cp_size 1): "
                            "their peaks are what the memory model's packed-row terms describe.")
        raw = getattr(seq_lens, "seq_lens", seq_lens)
        try:
            lens = tuple(int(x) for x in np.asarray(raw, dtype=np.int64).reshape(-1))
        except (TypeError, ValueError):
            raise PlanError("MemoryMeter.record needs the micro-batch's sample lengths, got "
                            f"{type(seq_lens).__name__}.") from None
        if not lens or min(lens) < 1:
            raise PlanError("MemoryMeter.record: a micro-batch of samples of >= 1 tokens (placeholders carry no "
                            "activations worth recording).")
        b = float_field("MemoryMeter.record(peak_bytes)", peak_bytes, positive=True)
        self._rows.append((lens, b))

    def model(self) -> MemoryModel:
        """The memory model to plan the next step with (module note)."""
        rows = list(self._rows)
        if not rows:
            if self.prior is None:
                raise PlanError("MemoryMeter has no prior and no record: record measured peaks first, or pass "
                                "prior=MemoryModel.from_hf_config(...).")
            return self.prior
        comps = [r[0] for r in rows]
        y = np.array([r[1] for r in rows])
        if self.prior is not None:
            base = replace(self.prior, margin=0.0)
            pred = np.array([base.micro_bytes(list(c)) for c in comps], dtype=np.float64)
            s = rescale(pred, y, 1.0 / y)  # argmin_s Σ (s·pred/y − 1)²: the relative least-squares factor
            fitted = _scaled(base, s)
            note = f"MemoryMeter: prior x {s:.4g} from {len(rows)} records"
        else:
            counts = {len(c) for c in comps}
            if len(rows) < self.min_rows or len(counts) < 2:
                raise PlanError(f"MemoryMeter has {len(rows)} record(s) of {len(counts)} sample count(s) and no prior; "
                                f"record at least {self.min_rows} of at least two sample counts, or pass a prior.")
            fitted = fit_memory(comps, y, min_tokens=0).model
            note = f"MemoryMeter: fitted on {len(rows)} records"
        err = relative_errors(fitted, comps, y)
        under = float(np.max(-err / (1.0 + err)))
        margin = max(self.min_margin, math.ceil(max(0.0, under) * 200.0) / 200.0)
        return replace(fitted, margin=margin, note=f"{note}; margin {margin:.1%} = worst under-prediction")


def _scaled(m: MemoryModel, s: float) -> MemoryModel:
    """Every byte term (and phase) times s; the forward model keeps the prior's (no forward records)."""
    fields = ("per_token", "per_sample_sq", "per_row_sq", "per_micro", "floor", "kv_per_token", "per_vision_token")
    out = replace(m, **{f: getattr(m, f) * s for f in fields})
    if m.phase2 is not None:
        out = replace(out, phase2=replace(m.phase2, **{f: getattr(m.phase2, f) * s for f in fields}))
    return out
