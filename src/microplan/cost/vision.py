"""The vision encoder's share of a micro-batch's cost: patches, and patches² within each image.

Design note. In a VLM a sample's images (or video clips) go through the vision tower before the
LLM. A ViT runs full attention *within* each image, so an image of P patches costs
``linear·P + quadratic·P²`` and a sample with ``vision_tokens`` patches over ``num_images``
equal-size images costs ``linear·V + quadratic·V²/num_images``; a sample without images costs
nothing. This term adds to the LLM cost of the micro-batch (``CostModel.micro_cost`` of its
token shape) and is additive over samples, so the planner balances it like any sample cost.

Guarantees: coefficients finite and >= 0; ``to_dict``/``from_dict`` round-trip exactly.
Trade-off: equal-size images per sample is an approximation for mixed resolutions (the
quadratic term is then under-counted by the variance of the image sizes); pass one sample per
image group if that matters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .._checks import float_field

__all__ = ["VisionCost"]


@dataclass(frozen=True, kw_only=True)
class VisionCost:
    """Cost of the vision tokens (patches) of one sample: ``linear·V + quadratic·V²/images``.

    Attributes:
        linear: cost per patch (the vision tower's weights, forward + backward), in the units of
            the plan's cost model (FLOPs for ``FlopsCost.from_hf_config``, tokens for ``TokenCost``).
        quadratic: cost per squared patch of ONE image (ViT attention within the image).
    """

    linear: float = 1.0
    quadratic: float = 0.0

    def __post_init__(self) -> None:
        for name in ("linear", "quadratic"):
            object.__setattr__(self, name, float_field(f"VisionCost.{name}", getattr(self, name), minimum=0.0))

    def sample_costs(self, vision_tokens: np.ndarray, num_images: np.ndarray) -> np.ndarray:
        """float64 cost of each sample's vision work (0 where it has no patches)."""
        v = np.asarray(vision_tokens, dtype=np.float64)
        imgs = np.maximum(np.asarray(num_images, dtype=np.float64), 1.0)
        return self.linear * v + self.quadratic * (v * v) / imgs

    def to_dict(self) -> dict[str, Any]:
        return {"linear": self.linear, "quadratic": self.quadratic}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VisionCost:
        return cls(linear=d["linear"], quadratic=d["quadratic"])
