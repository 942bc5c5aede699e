"""The one exception microplan raises for bad input or an impossible configuration."""

from __future__ import annotations

__all__ = ["PlanError"]


class PlanError(ValueError):
    """Refusal of bad input, an impossible configuration, or a violated plan invariant.

    Every message names the offending value, the constraint it breaks, and what to change.
    It subclasses ``ValueError`` so callers that already catch ``ValueError`` keep working.
    """
