"""Cost models: the predicted time of a micro-batch, used for balancing and predicted times.

A cost model maps each sample's packed length L to ``linear·L + quadratic·L²`` (the varlen
attention term is per sample, so the quadratic part adds up sample by sample) and charges a
fixed ``per_micro`` for every micro-batch a rank runs (kernel launches, FSDP gathers, the
optimizer-free part of a forward/backward). Units are whatever the coefficients are in:
FLOPs for :meth:`FlopsCost.from_hf_config`, seconds after :func:`microplan.calibrate`.

Both models are frozen dataclasses with ``sample_costs`` (vectorised, O(n)) and ``to_dict``;
:func:`cost_from_dict` inverts ``to_dict`` so plans round-trip through JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ._checks import float_field
from .errors import PlanError

__all__ = ["CostModel", "TokenCost", "FlopsCost", "cost_from_dict"]


@runtime_checkable
class CostModel(Protocol):
    """What the planner needs from a cost model."""

    per_micro: float

    def sample_costs(self, seq_lens: np.ndarray) -> np.ndarray:
        """float64 cost of each sample (same shape as ``seq_lens``), excluding ``per_micro``."""
        ...

    def to_dict(self) -> dict[str, Any]:
        ...


@dataclass(frozen=True, kw_only=True)
class TokenCost:
    """Cost = tokens. The right model when step time is dominated by linear layers.

    Attributes:
        per_micro: fixed cost charged per micro-batch, in tokens-equivalent (default 0).
    """

    per_micro: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_micro", float_field("TokenCost.per_micro", self.per_micro, minimum=0.0))

    @property
    def linear(self) -> float:
        return 1.0

    @property
    def quadratic(self) -> float:
        return 0.0

    def sample_costs(self, seq_lens: np.ndarray) -> np.ndarray:
        return np.asarray(seq_lens, dtype=np.float64)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "TokenCost", "per_micro": self.per_micro}


@dataclass(frozen=True, kw_only=True)
class FlopsCost:
    """Cost = ``linear·L + quadratic·L²`` per sample plus ``per_micro`` per micro-batch.

    Attributes:
        linear: cost per token (e.g. forward+backward FLOPs of the dense/MoE/LM-head layers).
        quadratic: cost per squared token of one sample (causal attention score/value FLOPs).
        per_micro: fixed cost per micro-batch a rank runs (launch, all-gather, sync overhead).

    All three are finite and >= 0, and ``linear + quadratic > 0``. Build one from a model's
    dimensions with :meth:`from_hf_config`, or fit one to measured step times with
    :func:`microplan.calibrate`.
    """

    linear: float
    quadratic: float = 0.0
    per_micro: float = 0.0

    def __post_init__(self) -> None:
        for name in ("linear", "quadratic", "per_micro"):
            object.__setattr__(self, name, float_field(f"FlopsCost.{name}", getattr(self, name), minimum=0.0))
        if self.linear == 0.0 and self.quadratic == 0.0:
            raise PlanError("FlopsCost.linear and FlopsCost.quadratic are both 0: every sample would "
                            "cost nothing and balancing is meaningless; give at least one a positive value.")

    def sample_costs(self, seq_lens: np.ndarray) -> np.ndarray:
        L = np.asarray(seq_lens, dtype=np.float64)
        return self.linear * L + self.quadratic * (L * L)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "FlopsCost", "linear": self.linear, "quadratic": self.quadratic,
                "per_micro": self.per_micro}


def cost_from_dict(d: dict[str, Any]) -> TokenCost | FlopsCost:
    """Inverse of ``to_dict`` for the built-in cost models."""
    kind = d.get("type")
    fields = {k: v for k, v in d.items() if k != "type"}
    if kind == "TokenCost":
        return TokenCost(**fields)
    if kind == "FlopsCost":
        return FlopsCost(**fields)
    raise PlanError(f"unknown cost model type {kind!r}; expected 'TokenCost' or 'FlopsCost'.")
