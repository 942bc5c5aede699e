"""Bounds every cost coefficient keeps, so no predicted time overflows float64.

Design note. A cost model prices micro-batches of up to :data:`MAX_PRICED_TOKENS` tokens; no
micro-batch may cost more than :data:`MAX_MICRO_COST`, so sums over ranks, slots and steps stay
finite. :func:`check_coefficient` refuses a coefficient whose term alone would break that; the
cost models (``models.py``) and the CP term (``cp.py``) both call it, so it lives below both.
"""

from __future__ import annotations

from ..errors import PlanError

__all__ = ["MAX_PRICED_TOKENS", "MAX_MICRO_COST", "check_coefficient"]

#: The largest micro-batch a cost model must price without overflow: 2**64 tokens, in one sample
#: or one packed row (more than any GPU holds; Batch refuses samples over 2**40 tokens).
MAX_PRICED_TOKENS = 2.0 ** 64
#: The most one micro-batch may cost: float64 overflows at ~1.8e308, and step times sum up to
#: ~1e8 micro-batch costs (ranks × micro-batches × steps), so 1e300 keeps every sum finite.
MAX_MICRO_COST = 1e300


def check_coefficient(name: str, value: float, power: int) -> None:
    """Refuse a coefficient whose term alone (``value · MAX_PRICED_TOKENS**power``) would exceed a
    quarter of :data:`MAX_MICRO_COST`: FlopsCost(quadratic=1e307) used to plan with inf costs."""
    bound = MAX_MICRO_COST / 4 / MAX_PRICED_TOKENS ** power
    if value > bound:
        unit = {0: "", 1: "/token", 2: "/token²"}[power]
        raise PlanError(f"{name}={value:.4g}{unit} exceeds {bound:.3g}{unit}: a micro-batch of up to 2**64 tokens "
                        "would cost more than float64 can sum (predicted times would be inf); express the cost in "
                        "larger units (seconds, or GFLOPs instead of FLOPs) so every coefficient is smaller.")
