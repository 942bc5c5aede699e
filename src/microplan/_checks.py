"""Small validators shared by the public dataclasses: each raises PlanError naming the field."""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

import numpy as np

from .errors import PlanError


def int_field(name: str, value: Any, *, minimum: int | None = None) -> int:
    """Return ``value`` as an int, refusing bools, floats with fractions, NaN and values < minimum."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        if isinstance(value, Real) and not isinstance(value, bool):
            f = float(value)
            if not math.isfinite(f) or f != int(f):
                raise PlanError(f"{name}={value!r} must be a whole number; pass an int.")
            value = int(f)
        else:
            raise PlanError(f"{name}={value!r} must be an int, got {type(value).__name__}.")
    value = int(value)
    if minimum is not None and value < minimum:
        raise PlanError(f"{name}={value} must be >= {minimum}; pass a value of at least {minimum}.")
    return value


def float_field(name: str, value: Any, *, minimum: float | None = None,
                positive: bool = False) -> float:
    """Return ``value`` as a finite float, refusing NaN/inf, non-numbers and out-of-range values."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise PlanError(f"{name}={value!r} must be a real number, got {type(value).__name__}; pass a float.")
    f = float(value)
    if not math.isfinite(f):
        raise PlanError(f"{name}={value!r} must be finite (NaN and inf are not allowed); pass a finite number.")
    if positive and f <= 0:
        raise PlanError(f"{name}={f} must be > 0; pass a positive number.")
    if minimum is not None and f < minimum:
        raise PlanError(f"{name}={f} must be >= {minimum}; pass a value of at least {minimum}.")
    return f


def int_array(name: str, values: Any, *, minimum: int | None = None) -> np.ndarray:
    """Return a read-only 1-D int64 copy of ``values``; refuse floats with fractions, NaN, inf."""
    try:
        arr = np.asarray(values)
    except Exception as exc:  # ragged nested lists and the like
        raise PlanError(f"{name} must be a 1-D sequence of ints: {exc}") from None
    if arr.ndim != 1:
        raise PlanError(f"{name} must be 1-D, got shape {arr.shape}; pass one value per sample.")
    if arr.size == 0:
        out = np.zeros(0, dtype=np.int64)
    elif arr.dtype == np.bool_:
        raise PlanError(f"{name} must hold ints, got booleans.")
    elif np.issubdtype(arr.dtype, np.integer):
        out = arr.astype(np.int64)
    elif np.issubdtype(arr.dtype, np.floating):
        bad = ~np.isfinite(arr)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise PlanError(f"{name}[{i}]={arr[i].item()!r} is not finite; every value must be a whole number.")
        frac = arr != np.floor(arr)
        if frac.any():
            i = int(np.flatnonzero(frac)[0])
            raise PlanError(f"{name}[{i}]={arr[i].item()!r} is not a whole number; token counts are ints.")
        out = arr.astype(np.int64)
    else:
        raise PlanError(f"{name} must hold ints, got dtype {arr.dtype}.")
    if minimum is not None and out.size and out.min() < minimum:
        i = int(np.argmin(out))
        raise PlanError(f"{name}[{i}]={out[i]} must be >= {minimum}.")
    out = out.copy()
    out.setflags(write=False)
    return out
