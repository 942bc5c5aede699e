"""Cost: what a micro-batch costs, and how microplan learns it from the machine.

- ``models``: :class:`TokenCost`, :class:`FlopsCost` (linear, per-sample quadratic, packed-row
  quadratic, per-micro terms) and the binding ``micro_cost``.
- ``cp``: :class:`CPCost`, the context-parallel term, and ``cp_micro_costs``, the one price of a
  micro-batch split over a CP group.
- ``hf``: FLOPs from a Hugging Face config (``FlopsCost.from_hf_config``); ``presets``: the
  attention-kernel presets and hedged defaults.
- ``calibrate``: fit a model to timed rows (exact nonnegative least squares).
- ``meter``: :class:`CostMeter`, the online loop — record micro-batch timings, plan the next
  step with the refitted model, see the drift.
The planner's stages price micro-batches only through ``models.bin_costs`` / ``row_costs`` (and
``tree_costs`` for prefix tries); ``micro_cost`` and ``micro_features`` give the same price per micro-batch.
"""

from .cp import CPCost, cp_micro_costs
from .calibrate import FIELDS, CalibrationResult, calibrate, calibration_row
from .hf import ForwardFlops, forward_flops
from .meter import CostMeter, MeterReport
from .models import FEATURES, CostModel, FlopsCost, TokenCost, cost_from_dict, micro_features
from .presets import ATTENTION_KERNELS, DEFAULT_ATTENTION, DEFAULT_PER_MICRO_TOKENS, AttentionKernel

__all__ = ["CPCost", "cp_micro_costs", "CostModel", "TokenCost", "FlopsCost", "cost_from_dict", "micro_features", "FEATURES",
           "ForwardFlops", "forward_flops", "calibrate", "calibration_row", "CalibrationResult", "FIELDS",
           "CostMeter", "MeterReport", "ATTENTION_KERNELS", "AttentionKernel", "DEFAULT_ATTENTION",
           "DEFAULT_PER_MICRO_TOKENS"]
