"""Integer fields of the configs: the check, and the fix each field's refusal names.

Design note. ``_checks.int_field`` refuses what is not an int >= minimum; :func:`int_field` adds
the field's own fix (``_INT_FIX``), refuses whole-number floats (a count computed with ``/``) and
caps every count that sizes a plan (``MAX_COUNT``, ``MAX_SLOTS``) before anything is allocated.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

from ._checks import int_field as _int_field
from .errors import PlanError

__all__ = ["int_field", "MAX_COUNT", "MAX_SLOTS"]

_INT_FIX = {
    "Steps.num_steps": "ask for a positive number of optimizer steps, e.g. Steps(num_steps=4).",
    "Steps.prompts_per_step": "pass the prompts (GRPO groups) per optimizer step, e.g. Steps(prompts_per_step=32).",
    "Steps.rollouts_per_step": "pass the rollouts per optimizer step, e.g. Steps(rollouts_per_step=256).",
    "ContextParallel.size": "pass the CP degree, an int >= 1, e.g. ContextParallel(size=2).",
    "ContextParallel.max_size": "pass the largest CP group, a power of two, e.g. ContextParallel(max_size=4).",
    "PlanConfig.dp_size": "set dp_size to the number of data-parallel ranks, an int >= 1.",
    "PlanConfig.max_tokens_per_micro": "set max_tokens_per_micro to the most tokens one GPU may process in one "
                                       "micro-batch, an int >= 1.",
    "PlanConfig.micro_batch_size": "set micro_batch_size to the samples per micro-batch, an int >= 1.",
    "PlanConfig.align": "set align to 1, or to Megatron's microbatch_group_size_per_vp_stage under virtual "
                        "pipeline parallelism.",
    "PlanConfig.seed": "pass a non-negative int seed.",
    "PlanConfig.pipeline_stages": "set pipeline_stages to the pipeline-parallel degree p (1 without pipeline "
                                  "parallelism), an int >= 1.",
    "PlanConfig.virtual_stages": "set virtual_stages to the model chunks per pipeline stage (Megatron's "
                                 "virtual_pipeline_model_parallel_size; 1 without interleaving), an int >= 1.",
    "PlanConfig.pad_to_multiple_of": "pass the multiple every sample is padded to (1: none; 2·cp for zigzag ring "
                                     "attention, 16 for FP8/Transformer Engine kernels).",
    "PlanConfig.pad_row_to_multiple_of": "pass the multiple the packed row is padded to (1: none; tp for "
                                         "sequence-parallel TP, cp·tp under context parallel).",
    "PlanConfig.max_vision_tokens_per_micro": "set it to the most vision-encoder patches one GPU may process in "
                                              "one micro-batch, an int >= 1, or None for no vision cap.",
}


#: Upper bound of every count that sizes the plan (ranks, CP degree, pipeline stages, align):
#: far above any cluster, far below what would exhaust memory. dp_size=2**40 used to reach the
#: planner and die in MemoryError; now it is refused here, before anything is allocated.
MAX_COUNT = 2 ** 20
#: Bound on dp_size × max(align, pipeline_stages): the micro-batch slots of one step's smallest plan.
MAX_SLOTS = 2 ** 24


def int_field(name: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``_checks.int_field`` with the fix for this field appended to its message.

    Stricter than ``_checks.int_field``: a whole-number float (``dp_size=2.0``) is refused too — a
    count that arrives as a float was computed or read with the wrong type, and silently
    truncating the next one (2.5) would be worse.
    """
    try:
        if isinstance(value, Real) and not isinstance(value, Integral) and math.isfinite(float(value)) \
                and float(value).is_integer():
            raise PlanError(f"{name}={value!r} is a {type(value).__name__}, not an int; pass the int "
                            f"{int(value)} (a count computed with / is a float: use //).")
        v = _int_field(name, value, minimum=minimum)
        if maximum is not None and v > maximum:
            raise PlanError(f"{name}={v} exceeds {maximum:,} (2**{maximum.bit_length() - 1}), far above any "
                            "cluster; a value this large is a bug in how it was computed.")
        return v
    except PlanError as exc:
        raise PlanError(f"{exc} Fix: {_INT_FIX[name]}") from None
