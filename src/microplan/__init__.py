"""microplan: exact, balanced, deadlock-free data layout for distributed LLM RL training.

Plan which optimizer step, data-parallel rank, micro-batch, context-parallel group and loss
weight every sample of an RL step gets — deterministically, from the global lengths alone::

    import microplan as mp
    batch = mp.Batch(seq_lens, prompt_ids=uids)
    plan = mp.plan(batch, mp.PlanConfig(dp_size=8, max_tokens_per_micro=16384,
                                        steps=mp.Steps(prompts_per_step=32)))
    for micro in plan.rank(rank)[step]: ...

The core depends on numpy only; ``microplan.torch`` adds packing, loss and collectives.
"""

from .batch import Batch
from .config import LOSS_MODES, ContextParallel, Loss, PlanConfig, Steps
from .cost import CalibrationResult, CostMeter, CostModel, CPCost, FlopsCost, MeterReport, TokenCost, calibrate, calibration_row
from .cost.vision import VisionCost
from .footprint import LAYOUTS, Footprint
from .errors import PlanError
from .forward import plan_forward
from .memory import MemoryMeter, MemoryModel, logits_bytes, logits_token_cap
from .plan import Plan
from .planner import plan
from .prefix import PrefixTree, find_shared_prefixes
from .types import KChoice, Micro, PlanStats, Step, StepStats

__version__ = "0.1.0"

__all__ = [
    "Batch", "PlanConfig", "Steps", "Loss", "ContextParallel", "LOSS_MODES",
    "TokenCost", "FlopsCost", "CPCost", "CostModel", "plan", "Plan", "Step", "Micro", "PlanStats",
    "StepStats", "KChoice", "PlanError", "calibrate", "calibration_row", "CalibrationResult", "CostMeter",
    "MeterReport", "VisionCost", "LAYOUTS", "Footprint", "find_shared_prefixes", "PrefixTree", "plan_forward",
    "logits_token_cap", "logits_bytes", "MemoryModel", "MemoryMeter", "__version__",
]
