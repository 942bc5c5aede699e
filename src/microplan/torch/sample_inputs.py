"""Per-sample user inputs read into host tensors, for ``packing.py`` and ``padded.py``.

Design note. ``pack_micro``/``pack_values`` (and their padded twins) take per-sample sources
indexed by GLOBAL sample index (a sequence or a mapping). Each reader here takes one entry,
checks it against the plan (1-D, the sample's length, integer token ids, a 0/1 loss mask whose
sum is the Batch's ``loss_tokens`` and that never marks a sample's first token, a value that is a
scalar or one per token) and returns it as a host tensor, or raises a PlanError naming the sample,
the value and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import PlanError

__all__: list[str] = []


def _entry(source: Any, i: int, what: str) -> Any:
    try:
        return source[i]
    except (KeyError, IndexError):
        kind = "dict" if isinstance(source, Mapping) else f"sequence of length {len(source)}"
        raise PlanError(f"{what} ({kind}) has no entry for global sample {i}; index it by global sample "
                        "index (Micro.indices), as Batch numbered the samples.") from None


def _as_1d(x: Any, i: int, what: str, *, length: int) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    if t.dim() != 1:
        raise PlanError(f"{what}[{i}] must be 1-D, got shape {tuple(t.shape)}.")
    if t.numel() != length:
        raise PlanError(f"{what}[{i}] has {t.numel()} tokens but the plan packs sample {i} with seq_len={length}; "
                        "the Batch's seq_lens must be the lengths of the token tensors you pack.")
    return t.detach().cpu()


def _token_tensor(x: Any, i: int, length: int) -> torch.Tensor:
    t = _as_1d(x, i, "token_ids", length=length)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise PlanError(f"token_ids[{i}] has dtype {t.dtype}; token ids must be integers.")
    return t.to(torch.int64)


def _mask_tensor(masks: Any, i: int, length: int, loss_tokens: int) -> torch.Tensor:
    if masks is None:
        m = torch.zeros(length, dtype=torch.bool)
        if loss_tokens:
            m[length - loss_tokens:] = True
    else:
        raw = _as_1d(_entry(masks, i, "loss_masks"), i, "loss_masks", length=length)
        if raw.dtype != torch.bool and not bool(((raw == 0) | (raw == 1)).all()):
            vals = sorted(set(raw.tolist()))[:5]
            raise PlanError(f"loss_masks[{i}] must hold only 0/1 (or bools), got values {vals}.")
        m = raw.to(torch.bool)
        if int(m.sum()) != loss_tokens:
            raise PlanError(f"loss_masks[{i}] marks {int(m.sum())} tokens but the Batch says loss_tokens={loss_tokens} "
                            f"for sample {i}; the weights are only exact if Batch.loss_tokens is each mask's sum.")
    if bool(m[0]):
        raise PlanError(f"sample {i}: the loss mask marks its first token, which a causal LM never predicts "
                        "(logits at position t predict token t+1 of the same sample). Give samples a prompt "
                        "(Batch(prompt_lens=...) with prompt_lens >= 1) or keep loss_tokens <= seq_len - 1.")
    return m


def _value_tensor(values: Sequence[Any] | Mapping[int, Any], i: int, n: int) -> torch.Tensor:
    """``values[i]`` as a host tensor of sample i's ``n`` tokens (a scalar is broadcast)."""
    v = _entry(values, i, "values")
    t = v.detach().cpu() if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v))
    if t.dim() == 0:
        return t.expand(n)
    if tuple(t.shape) != (n,):
        raise PlanError(f"values[{i}] has shape {tuple(t.shape)}; give a scalar or a 1-D tensor of the "
                        f"sample's {n} tokens.")
    return t
