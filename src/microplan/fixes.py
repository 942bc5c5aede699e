"""The ways out of a "too long for one micro-batch" refusal, worded for the config at hand.

Design note. A sample (or a prefix-tree atom) that fits no micro-batch can be fixed by a larger
cap, by more GPUs per micro-batch (context parallel), by less padding, or by truncation. Which of
these a user can act on depends on the config: "enable context_parallel" is advice only when it
is off (when it is on: raise its size or max_size, up to dp_size for dynamic CP), and "lower the
padding multiples" only when a multiple is set. Every refusal of an over-long unit
(``footprint.check_fits``, ``stages/fit.check_cap``) ends with :func:`too_long_fixes`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import PlanConfig

__all__ = ["too_long_fixes"]


def too_long_fixes(cfg: PlanConfig, *, padded: bool = True) -> str:
    """``"raise max_tokens_per_micro, ..., or truncate the sample"`` for ``cfg``. ``padded``: the
    unit's footprint includes padding the config's multiples add (then lowering them is a fix)."""
    fixes = ["raise max_tokens_per_micro"]
    cp = cfg.context_parallel
    if cp is None:
        fixes.append("enable context parallel (PlanConfig(context_parallel=ContextParallel(size=c)) or "
                     "max_size=c: a micro-batch split over c GPUs may hold c × the cap)")
    elif cp.dynamic:
        c = int(cp.max_size)  # type: ignore[arg-type]
        fixes.append(f"raise ContextParallel.max_size from {c} (to a power of two dividing dp_size={cfg.dp_size})"
                     if 2 * c <= cfg.dp_size and cfg.dp_size % (2 * c) == 0 else
                     f"raise dp_size={cfg.dp_size} and ContextParallel.max_size={c} together "
                     "(max_size cannot exceed dp_size)")
    else:
        fixes.append(f"raise ContextParallel.size from {cp.size}")
    multiples = [f"{name}={v}" for name, v in (("pad_to_multiple_of", cfg.pad_to_multiple_of),
                                               ("pad_row_to_multiple_of", cfg.pad_row_to_multiple_of)) if v > 1]
    if padded and multiples:
        fixes.append("lower " + " or ".join(multiples))
    return ", ".join(fixes) + ", or truncate the sample"
