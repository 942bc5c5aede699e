"""The byte side of the footprint stage: predicted peak bytes of the planner's micro-batches.

Design note. A micro-batch's bytes are read from the same footprint as its tokens and its cost
(``footprint.py``: padding multiples, the row pad, padded ``[n, W]`` rows, prefix tries, vision
patches), priced by the memory model's terms as a cost model in bytes
(:meth:`MemoryModel.as_cost`), then per GPU: a micro-batch of T tokens over a CP group of c GPUs
holds ``per_token·⌈T/c⌉ + (bytes − per_micro − per_token·T)/c + per_micro + kv_per_token·T`` on
its fullest GPU (the ⌈T/c⌉ rows the zigzag cut gives it, ``footprint.gpu_tokens``, its share of
the other terms, plus the gathered keys/values of the whole row), and never less than ``floor``. One function
(:func:`bin_bytes`) serves the budget search, ``Plan.validate`` and ``Plan.stats``.

The invariant (DESIGN.md, invariant 3): with ``PlanConfig(memory=M, max_bytes_per_micro=B)``
every micro-batch, placeholders included, has ``M.with_margin(bytes) <= B``.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from ..errors import PlanError
from ..footprint import Footprint, bin_footprint

if TYPE_CHECKING:  # pragma: no cover
    from ..batch import Batch
    from ..config import PlanConfig
    from ..types import Step
    from .model import MemoryModel

__all__ = ["bytes_footprint", "bin_bytes", "step_micro_bytes", "sample_bytes", "check_byte_cap", "FIXES"]

FIXES = ("enable context parallel (PlanConfig(context_parallel=...)) to split it over GPUs, compute log-probs in "
         "chunks (microplan.torch.chunked_token_logprobs) so its logits are never whole, turn on gradient "
         "checkpointing (and re-profile), raise max_bytes_per_micro, or truncate the sample")


def bytes_footprint(fp: Footprint, model: MemoryModel) -> Footprint:
    """``fp`` with vision patches priced in bytes (``per_vision_token``) instead of time."""
    vc = None if fp.vision_tokens is None or not model.per_vision_token else \
        model.per_vision_token * fp.vision_tokens.astype(np.float64)
    return Footprint(fp.padding, fp.seq_lens, prompt_lens=fp.prompt_lens, vision_tokens=fp.vision_tokens,
                     vision_costs=vc)


def bin_bytes(fp: Footprint, model: MemoryModel, samples: np.ndarray, bin_of: np.ndarray, num_bins: int, *,
              cp_size: np.ndarray | int = 1, forest: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Predicted peak bytes (no margin) on each GPU of every bin: samples ``samples[j]`` in bin
    ``bin_of[j]``, bin b run over ``cp_size[b]`` GPUs; ``forest``: bins hold prefix tries. An
    empty bin (a placeholder: one dummy token) adds ``per_micro + per_token``."""
    bfp = bytes_footprint(fp, model)
    empty = np.bincount(bin_of, minlength=num_bins) == 0
    c = np.asarray(cp_size, dtype=np.float64)
    out = np.full(num_bins, model.floor, dtype=np.float64)
    for phase in model.phases():  # the peak is the largest phase's
        tokens, raw = bin_footprint(bfp, phase.as_cost(), samples, bin_of, num_bins, forest=forest)
        raw = np.where(empty, phase.per_micro + phase.per_token, raw)
        scale = model.tree_factor if forest is not None else 1.0
        if scale != 1.0:  # path tables, gathered path keys
            raw = raw * scale
        cw = np.maximum(c, 1.0)
        lin = scale * phase.per_token * tokens   # the fullest GPU holds ⌈T/c⌉ of the row's T tokens (gpu_tokens)
        per_gpu = np.where(c > 1, (raw - phase.per_micro - lin) / cw + scale * phase.per_token * np.ceil(tokens / cw)
                           + phase.per_micro + model.kv_per_token * tokens, raw)
        out = np.maximum(out, per_gpu)
    return np.ceil(out).astype(np.int64)


def sample_bytes(fp: Footprint, model: MemoryModel, cp_size: int = 1, *,
                 forest: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Predicted bytes of each sample of the batch in a micro-batch of its own over ``cp_size`` GPUs
    (``forest``: packed as a tree row, as under ``share_prefixes``)."""
    n = fp.seq_lens.size
    idx = np.arange(n, dtype=np.int64)
    return bin_bytes(fp, model, idx, idx, n, cp_size=cp_size, forest=forest)


def step_micro_bytes(batch: Batch, cfg: PlanConfig, step: Step, fp: Footprint, model: MemoryModel) -> np.ndarray:
    """``[dp_size, K]`` predicted bytes (no margin) of every micro-batch of a step, per GPU."""
    from ..prefix import forest_of
    micros = list(chain.from_iterable(step.micros))
    sizes = np.fromiter((m.indices.size for m in micros), dtype=np.int64, count=len(micros))
    idx = np.concatenate([m.indices for m in micros]).astype(np.int64) if micros else np.zeros(0, np.int64)
    bin_of = np.repeat(np.arange(len(micros), dtype=np.int64), sizes)
    cp = np.fromiter((m.cp_size for m in micros), dtype=np.int64, count=len(micros))
    forest = forest_of(batch) if cfg.share_prefixes else None
    out = bin_bytes(fp, model, idx, bin_of, len(micros), cp_size=cp, forest=forest)
    return out.reshape(len(step.micros), -1) if micros else out.reshape(len(step.micros), 0)


def plan_micro_bytes(batch: Batch, cfg: PlanConfig, steps: Sequence[Step], fp: Footprint) -> list[np.ndarray]:
    """:func:`step_micro_bytes` of every step under ``cfg.memory``."""
    assert cfg.memory is not None
    return [step_micro_bytes(batch, cfg, s, fp, cfg.memory) for s in steps]


def check_byte_cap(batch: Batch, cfg: PlanConfig, steps: Sequence[Step], fp: Footprint) -> None:
    """Raise PlanError at the first micro-batch whose predicted bytes, margin included, exceed
    ``max_bytes_per_micro`` (validate's byte check; nothing to do without a memory model)."""
    model, budget = cfg.memory, cfg.max_bytes_per_micro
    if model is None or budget is None:
        return
    for s, step in enumerate(steps):
        grid = step_micro_bytes(batch, cfg, step, fp, model)
        over = np.argwhere(model.with_margin(grid) > budget)
        if over.size:
            r, m = (int(x) for x in over[0])
            raise PlanError(f"invalid plan: step {s}, rank {r}, micro {m}: predicted peak {int(grid[r, m]):,} bytes "
                            f"(+{model.margin:.1%} margin = {model.with_margin(int(grid[r, m])):,}) exceeds "
                            f"max_bytes_per_micro={budget:,}")
