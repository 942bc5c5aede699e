"""``PlanConfig(memory=..., max_bytes_per_micro=...)``: validation and serialisation (kept out of config.py).

Rules: both or neither; ``memory`` a :class:`MemoryModel`; the budget a whole number of bytes
>= 1; a memory budget plans token-capped (dynamic) micro-batches, so ``micro_batch_size`` is
refused beside it; ``max_tokens_per_micro`` is optional (when given, both caps hold).
"""

from __future__ import annotations

from typing import Any

from .._checks import int_field
from ..errors import PlanError
from .model import MemoryModel, memory_from_dict

__all__ = ["check_memory", "memory_dict", "memory_from_config_dict"]


def check_memory(cfg: Any, set_: Any) -> None:
    """Validate ``cfg.memory`` / ``cfg.max_bytes_per_micro`` (called first in ``PlanConfig.__post_init__``)."""
    mem, budget = cfg.memory, cfg.max_bytes_per_micro
    if mem is None and budget is None:
        return
    if mem is None:
        raise PlanError(f"PlanConfig.max_bytes_per_micro={budget!r} needs a memory model to predict each "
                        "micro-batch's bytes: pass memory=MemoryModel.from_hf_config(...) or "
                        "microplan.torch.profile_memory(...).model, or drop max_bytes_per_micro.")
    if not isinstance(mem, MemoryModel):
        raise PlanError(f"PlanConfig.memory must be a microplan.MemoryModel, got {type(mem).__name__}; build one with "
                        "MemoryModel.from_hf_config(config, dtype=..., attention=...) or profile_memory(...).model.")
    if budget is None:
        raise PlanError("PlanConfig.memory is given but max_bytes_per_micro is not: pass the bytes one GPU may add per "
                        "micro-batch (its memory less parameters, gradients and optimizer state), e.g. "
                        "max_bytes_per_micro=40 * 2**30.")
    try:
        b = int_field("PlanConfig.max_bytes_per_micro", budget, minimum=1)
    except PlanError as exc:
        raise PlanError(f"{exc} Fix: pass the per-GPU budget in bytes, e.g. 40 * 2**30.") from None
    if b > 2 ** 60:
        raise PlanError(f"PlanConfig.max_bytes_per_micro={b} is beyond any GPU (at most 2**60 bytes); pass bytes.")
    set_("max_bytes_per_micro", b)
    if cfg.micro_batch_size is not None:
        raise PlanError(f"PlanConfig(memory=..., max_bytes_per_micro=...) sizes token-capped micro-batches by their "
                        f"bytes; micro_batch_size={cfg.micro_batch_size} (a fixed sample count) cannot honour it. Drop "
                        "micro_batch_size (max_tokens_per_micro is optional beside a byte budget).")


def memory_dict(cfg: Any) -> dict[str, Any]:
    """The memory fields for ``PlanConfig.to_dict`` (absent without a memory model: older JSON unchanged)."""
    if cfg.memory is None:
        return {}
    return {"memory": cfg.memory.to_dict(), "max_bytes_per_micro": cfg.max_bytes_per_micro}


def memory_from_config_dict(d: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`memory_dict`: keyword arguments for ``PlanConfig``."""
    if d.get("memory") is None:
        return {}
    return {"memory": memory_from_dict(d["memory"]), "max_bytes_per_micro": d["max_bytes_per_micro"]}
