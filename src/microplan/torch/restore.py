"""Restore per-micro outputs (log-probs, values, rewards) to sample order, dropping placeholders.

Design note. A rank runs its samples in the plan's order (micro-batches, then packing order),
which is not the order the trainer holds them in. :func:`restore_order` takes the rank's
micro-batches (``Micro`` or ``PackedMicro``, in execution order) and one output per micro-batch
— a packed ``[T, ...]`` tensor split by the sequence lengths, a stacked ``[n, ...]`` per-sample
tensor, or a list of n per-sample tensors — and returns one value per REAL sample in ascending
global index order (or an explicit ``order``).

The result is sized by the real samples the micro-batches hold, never by the number of outputs
(the slime seed #1860: sizing by outputs left trailing ``None`` where placeholders sat). Each
placeholder's output is checked to exist and then dropped; every real sample must be produced
exactly once, else PlanError. Pure bookkeeping: no copies beyond ``torch.split`` views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ..errors import PlanError
from ..types import Micro
from .packing import PackedMicro
from .padded import PaddedMicro

__all__ = ["Restored", "restore_order"]


@dataclass(frozen=True)
class Restored:
    """Outputs in sample order.

    Attributes:
        sample_indices: int64 global sample indices, in the order of ``values``.
        values: one tensor per sample (``values[j]`` belongs to ``sample_indices[j]``).
    """

    sample_indices: np.ndarray
    values: tuple[torch.Tensor, ...]

    def __len__(self) -> int:
        return len(self.values)

    def as_dict(self) -> dict[int, torch.Tensor]:
        """``{global sample index: value}``."""
        return dict(zip(self.sample_indices.tolist(), self.values))

    def cat(self) -> torch.Tensor:
        """Concatenate along dim 0 (token-level outputs back to one flat tensor)."""
        if not self.values:
            raise PlanError("no real samples to concatenate (only placeholders); check len(restored) first.")
        return torch.cat(self.values)

    def stack(self) -> torch.Tensor:
        """Stack into ``[n, ...]`` (per-sample outputs of equal shape)."""
        if not self.values:
            raise PlanError("no real samples to stack (only placeholders); check len(restored) first.")
        return torch.stack(self.values)


def _layout(m: Micro | PackedMicro | PaddedMicro, pos: int) -> tuple[bool, list[int], list[int]]:
    """(is_placeholder, global indices, sequence lengths) of one micro-batch."""
    if isinstance(m, (PackedMicro, PaddedMicro)):
        return m.is_placeholder, m.sample_indices.tolist(), list(m.real_lens)
    if isinstance(m, Micro):
        return m.is_placeholder, m.indices.tolist(), m.seq_lens.tolist()
    raise PlanError(f"micros[{pos}] is a {type(m).__name__}; pass the rank's Micro or PackedMicro objects, "
                    "flattened over steps: [m for step in plan.rank(r) for m in step].")


def _split_output(out: Any, m: int, idx: list[int], lens: list[int], kind: str,
                  packed: PackedMicro | PaddedMicro | None = None) -> Sequence[torch.Tensor]:
    n = len(idx)
    if isinstance(out, torch.Tensor) and kind == "token" and packed is not None:
        return packed.split(out)  # the micro-batch's own layout: real tokens only, padding left out
    if isinstance(out, torch.Tensor):
        if kind == "sample":
            if out.dim() == 0 or out.shape[0] != n:
                raise PlanError(f"outputs[{m}] has shape {tuple(out.shape)}; with kind='sample' it needs "
                                f"[n, ...] with n={n} samples.")
            return out.unbind(0)
        x = out[0] if out.dim() >= 2 and out.shape[0] == 1 and out.shape[1] == sum(lens) else out
        if x.dim() == 0 or x.shape[0] != sum(lens):
            raise PlanError(f"outputs[{m}] has shape {tuple(out.shape)}; a packed output needs [T, ...] with "
                            f"T={sum(lens)} tokens (pass kind='sample' for [n, ...] per-sample outputs).")
        return torch.split(x, lens)
    if isinstance(out, (list, tuple)):
        if len(out) != n:
            raise PlanError(f"outputs[{m}] holds {len(out)} per-sample values but micro-batch {m} packs {n} samples.")
        return out
    raise PlanError(f"outputs[{m}] is a {type(out).__name__}; give a tensor or a list of per-sample tensors.")


def restore_order(micros: Sequence[Micro | PackedMicro], outputs: Sequence[Any], *,
                  order: Sequence[int] | np.ndarray | None = None,
                  kind: Literal["token", "sample"] = "token") -> Restored:
    """Put per-micro outputs back in sample order, dropping placeholder outputs.

    Args:
        micros: the rank's micro-batches in execution order (``Micro``, ``PackedMicro`` or
            ``PaddedMicro``; pass the packed ones when the plan pads, so padding is left out).
        outputs: ``outputs[m]`` for micro-batch m: a tensor, or a list of per-sample tensors.
        order: global sample indices to return, in this order; must be exactly the real samples
            of ``micros`` (e.g. the rank's own slice of the batch). Default: ascending index.
        kind: how a tensor output is read: ``"token"`` (default) = packed ``[T, ...]`` split by
            sequence lengths; ``"sample"`` = stacked ``[n, ...]``, one row per sample.

    Raises:
        PlanError: an output count that differs from the micro count, a shape that does not
            match its micro-batch, a sample produced twice, or an ``order`` that is not the set of
            real samples.
    """
    if kind not in ("token", "sample"):
        raise PlanError(f"kind={kind!r} must be 'token' (packed [T, ...]) or 'sample' ([n, ...]).")
    if len(outputs) != len(micros):
        raise PlanError(f"got {len(outputs)} outputs for {len(micros)} micro-batches; give one output per "
                        "micro-batch, placeholders included (their outputs are dropped).")
    found: dict[int, torch.Tensor] = {}
    for m, (micro, out) in enumerate(zip(micros, outputs)):
        placeholder, idx, lens = _layout(micro, m)
        if placeholder:
            continue
        packed = micro if isinstance(micro, (PackedMicro, PaddedMicro)) else None
        for i, v in zip(idx, _split_output(out, m, idx, lens, kind, packed)):
            if i in found:
                raise PlanError(f"sample {i} appears in two micro-batches; pass each micro-batch once.")
            found[i] = v
    if order is None:
        keys = np.array(sorted(found), dtype=np.int64)
    else:
        keys = np.asarray(order, dtype=np.int64).reshape(-1)
        missing = sorted(set(keys.tolist()) - set(found))
        extra = sorted(set(found) - set(keys.tolist()))
        if missing or extra or len(set(keys.tolist())) != keys.size:
            raise PlanError(f"order must list each real sample of these micro-batches exactly once; not produced: "
                            f"{missing[:8]}, produced but not in order: {extra[:8]}, "
                            f"duplicates: {keys.size - len(set(keys.tolist()))}.")
    keys.setflags(write=False)
    return Restored(sample_indices=keys, values=tuple(found[int(i)] for i in keys))
