"""Integer rounding used throughout the planner: ceil division and rounding up to a multiple.

Design note. One definition, for Python ints and numpy int arrays alike (floor division of the
negation, exact for any integers), so every cap, K bound and padding rule rounds the same way.
"""

from __future__ import annotations

from typing import Any

__all__ = ["cdiv", "round_up"]


def cdiv(x: Any, d: Any) -> Any:
    """⌈x / d⌉ for ints or int arrays (d > 0)."""
    return -(-x // d)


def round_up(x: Any, m: Any) -> Any:
    """x rounded up to a multiple of m (ints or int arrays, m > 0)."""
    return cdiv(x, m) * m
