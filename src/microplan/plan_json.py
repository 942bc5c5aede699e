"""Checked reading of a plan JSON's parts: every damaged field is named, with its place.

Design note. ``Plan.from_dict`` reads a file a user may have edited, truncated or produced with
another tool. Each part is read through :class:`Where` (its place: ``step 0, rank 1,
micro-batch 2``) and a typed getter, so a damaged plan gives one :class:`PlanError` naming the
field, the place and the value — ``plan JSON step 0, rank 1, micro-batch 2: field 'loss_scale'
is missing`` — never a bare ``KeyError: 'loss_scale'`` or ``'int' object is not iterable``.
Sample indices must be whole numbers in 0..N-1 (``-1`` and ``0.5`` are refused, not wrapped or
truncated). Cost: one pass over the JSON (the numpy conversions of ``from_dict`` dominate).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .errors import PlanError

__all__ = ["Where", "field", "rows_of", "index_array", "number_array", "whole", "check_lengths"]

_MAX_LEN = 2 ** 40  # Batch's bound on a token count

_FIX = "the file is damaged: write the plan again (Plan.to_json / microplan plan ... --json)"


class Where(NamedTuple):
    """A place in a plan JSON, for messages."""

    text: str

    def fail(self, what: str) -> PlanError:
        return PlanError(f"plan JSON {self.text}: {what}; {_FIX}.")


def field(d: Any, key: str, where: Where) -> Any:
    """``d[key]``, or a PlanError naming the field and the place."""
    if not isinstance(d, dict):
        raise where.fail(f"expected an object with field {key!r}, got {type(d).__name__}")
    if key not in d:
        raise where.fail(f"field {key!r} is missing")
    return d[key]


def rows_of(v: Any, key: str, where: Where) -> list[Any]:
    """A JSON list, or a PlanError naming the field."""
    if not isinstance(v, list):
        raise where.fail(f"field {key!r} must be a list, got {type(v).__name__} {_short(v)}")
    return v


def whole(v: Any, key: str, where: Where, *, minimum: int = 0) -> int:
    """A whole number >= ``minimum``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise where.fail(f"field {key!r}={_short(v)} must be a whole number")
    if v < minimum:
        raise where.fail(f"field {key!r}={int(v)} must be >= {minimum}")
    return int(v)


def index_array(v: Any, key: str, where: Where, n: int) -> np.ndarray:
    """Sample indices: whole numbers in 0..n-1."""
    items = rows_of(v, key, where)
    for x in items:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or (isinstance(x, float) and not x.is_integer()):
            raise where.fail(f"field {key!r} holds {_short(x)}, not a sample index (a whole number)")
        if not 0 <= x < n:
            raise where.fail(f"field {key!r} holds {_short(x)}, but the plan's batch has samples 0..{n - 1}")
    return np.asarray(items, dtype=np.int64).reshape(-1)


def check_lengths(v: Any, key: str, where: Where) -> None:
    """Token counts: a list of whole numbers in 0..2**40 (1e30 or 2.5 named here, not an
    OverflowError or a silent truncation later)."""
    items = rows_of(v, key, where)
    try:
        arr = np.asarray(items)
    except (ValueError, TypeError, OverflowError):
        arr = np.zeros((0, 0))
    if arr.ndim == 1 and arr.dtype.kind == "i" and (not arr.size or (arr.min() >= 0 and arr.max() <= _MAX_LEN)):
        return
    for x in items:
        if whole(x, key, where) > _MAX_LEN:
            raise where.fail(f"field {key!r} holds {_short(x)}, too large for a token count (at most 2**40)")


def number_array(v: Any, key: str, where: Where, size: int) -> np.ndarray:
    """``size`` finite numbers."""
    items = rows_of(v, key, where)
    if len(items) != size:
        raise where.fail(f"field {key!r} has {len(items)} values for {size} samples")
    for x in items:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not np.isfinite(x):
            raise where.fail(f"field {key!r} holds {_short(x)}, not a finite number")
    return np.asarray(items, dtype=np.float64).reshape(-1)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."
