"""Pack a micro-batch of a padded layout: ``[n, W]`` tensors ready for a transformers model.

Design note. In ``layout="padded"`` row j holds sample j's L_j tokens from column 0, then pads
(right padding); in ``layout="padded-2d"`` it holds ``Wp − p_j`` pads, the prompt, the response,
then pads (prompts left-padded to the longest prompt Wp, responses right-padded) — UniRL's dense
2D layout. W is what the plan's footprint says (the longest row, rounded up to the width
multiple), so ``n·W`` is exactly ``Micro.num_tokens``. ``attention_mask`` is 1 on real tokens;
``position_ids`` count 0.. over each row's real tokens (0 on pads); pads are ``pad_token_id``
and carry weight 0. Loss weights are label aligned as in the varlen row: ``loss_weights[j, t]``
weighs the loss of predicting token t of row j from column t−1, which exists only when both are
real tokens of the row, so a row's first real token never carries loss.

``token_logprobs``/``weighted_loss``/``next_token_labels``/``next_token_weights``/``pack_values``
accept a :class:`PaddedMicro` and return ``[n, W]`` tensors; ``model(**p.model_inputs(),
use_cache=False)`` runs it (transformers applies the padding mask; fully-masked pad rows are
handled by its sdpa mask). A placeholder is one row of one dummy token (padded to the width
multiple) with weight 0. Exactness: the tests compare the gradient of a padded plan's loss with
the per-sample reference on a float64 model (tests/test_layouts_torch.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ..errors import PlanError
from ..footprint import round_up
from ..types import Micro
from .sample_inputs import _entry, _mask_tensor, _token_tensor, _value_tensor

__all__ = ["PaddedMicro", "pack_padded_micro", "pack_padded_values"]


@dataclass(frozen=True, eq=False)
class PaddedMicro:
    """One micro-batch as an ``[n, W]`` padded batch (``layout="padded"``/``"padded-2d"``).

    Attributes:
        input_ids: ``[n, W]`` int64 tokens, ``pad_token_id`` on pads.
        attention_mask: ``[n, W]`` int64, 1 on real tokens.
        position_ids: ``[n, W]`` int64, 0.. over each row's real tokens, 0 on pads.
        loss_weights: ``[n, W]`` float, label aligned; the sample's ``loss_scale`` on its loss tokens.
        loss_mask: ``[n, W]`` bool, the loss tokens.
        sample_indices: ``[n]`` int64 global sample indices (empty for a placeholder); host
            bookkeeping, left on the host by ``to``.
        sample_lens: host tuple of each row's real tokens.
        offsets: host tuple: the column of each row's first real token (its left padding).
        layout: ``"padded"`` or ``"padded-2d"``.
        width_multiple: W is a multiple of it.
        is_placeholder: True for the one-row dummy of a placeholder micro-batch.
        cp_size: the micro-batch's context-parallel degree.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    loss_weights: torch.Tensor
    loss_mask: torch.Tensor
    sample_indices: torch.Tensor
    sample_lens: tuple[int, ...]
    offsets: tuple[int, ...]
    layout: str = "padded"
    width_multiple: int = 1
    is_placeholder: bool = False
    cp_size: int = 1

    @property
    def width(self) -> int:
        """W, the row width."""
        return int(self.input_ids.shape[1])

    @property
    def token_shape(self) -> tuple[int, int]:
        """``(n, W)``: the shape of every per-token tensor of this micro-batch."""
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    @property
    def num_tokens(self) -> int:
        """n·W: what the GPU holds (``Micro.num_tokens``; one padded row for a placeholder)."""
        return int(self.input_ids.numel())

    @property
    def num_samples(self) -> int:
        return 0 if self.is_placeholder else len(self.sample_lens)

    @property
    def real_lens(self) -> tuple[int, ...]:
        """Real tokens of each sample (``()`` for a placeholder)."""
        return () if self.is_placeholder else self.sample_lens

    def predicted(self) -> torch.Tensor:
        """``[n, W]`` bool: token t is predicted from column t−1 of its row (both real tokens)."""
        m = self.attention_mask.bool()
        out = torch.zeros_like(m)
        out[:, 1:] = m[:, 1:] & m[:, :-1]
        return out

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> PaddedMicro:
        """A copy with every model/loss tensor on ``device`` (``sample_indices`` stays on the host)."""
        mv = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, input_ids=mv(self.input_ids), attention_mask=mv(self.attention_mask),
                       position_ids=mv(self.position_ids), loss_weights=mv(self.loss_weights),
                       loss_mask=mv(self.loss_mask))

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """``input_ids``, ``attention_mask`` and ``position_ids`` (``[n, W]``) for a transformers model."""
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids}

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-sample views ``x[j, offset_j : offset_j + L_j]`` of an ``[n, W, ...]`` tensor (real tokens)."""
        if x.dim() < 2 or tuple(x.shape[:2]) != self.token_shape:
            raise PlanError(f"cannot split a tensor of shape {tuple(x.shape)} by this micro-batch: it needs "
                            f"[n, W, ...] = {list(self.token_shape)}.")
        if self.is_placeholder:
            return ()
        return tuple(x[j, o:o + k] for j, (o, k) in enumerate(zip(self.offsets, self.sample_lens)))

    def validate(self) -> None:
        """Check the layout of the module note; raise PlanError naming the first violation."""
        n, W = self.token_shape if self.input_ids.dim() == 2 else (-1, -1)
        if self.input_ids.dim() != 2 or n != len(self.sample_lens) or n != len(self.offsets):
            raise PlanError(f"input_ids must be [n, W] with one row per sample; got shape "
                            f"{tuple(self.input_ids.shape)} for {len(self.sample_lens)} samples.")
        for name in ("attention_mask", "position_ids", "loss_weights", "loss_mask"):
            if tuple(getattr(self, name).shape) != (n, W):
                raise PlanError(f"{name} has shape {tuple(getattr(self, name).shape)}; it must be [n, W] = [{n}, {W}].")
        if W % self.width_multiple:
            raise PlanError(f"the row width {W} is not a multiple of {self.width_multiple}.")
        real = torch.zeros(n, W, dtype=torch.bool)
        pos = torch.zeros(n, W, dtype=torch.int64)
        for j, (o, k) in enumerate(zip(self.offsets, self.sample_lens)):
            if k < 1 or o < 0 or o + k > W:
                raise PlanError(f"row {j}: {k} real tokens from column {o} do not fit a width of {W}.")
            real[j, o:o + k] = True
            pos[j, o:o + k] = torch.arange(k)
        if not torch.equal(self.attention_mask.cpu().bool(), real):
            raise PlanError("attention_mask must be 1 exactly on each row's real tokens (offsets, sample_lens).")
        if not torch.equal(self.position_ids.cpu(), pos):
            raise PlanError("position_ids must count 0.. over each row's real tokens and be 0 on pads.")
        w, m = self.loss_weights.cpu(), self.loss_mask.cpu()
        if not bool(torch.isfinite(w).all()) or bool((w[~m] != 0).any()) or bool((m & ~self.predicted().cpu()).any()):
            raise PlanError("loss_weights must be finite and 0 outside loss_mask, and only a token predicted from "
                            "the previous real token of its row may carry loss (never a pad or a row's first token).")
        if self.sample_indices.numel() != self.num_samples:
            raise PlanError(f"sample_indices has {self.sample_indices.numel()} entries for {self.num_samples} samples.")


def _placeholder(micro: Micro, pad_token_id: int, weight_dtype: torch.dtype, unit: int, layout: str) -> PaddedMicro:
    W = int(round_up(1, unit))
    mask = torch.zeros(1, W, dtype=torch.int64)
    mask[0, 0] = 1
    return PaddedMicro(input_ids=torch.full((1, W), int(pad_token_id), dtype=torch.int64), attention_mask=mask,
                       position_ids=torch.zeros(1, W, dtype=torch.int64),
                       loss_weights=torch.zeros(1, W, dtype=weight_dtype), loss_mask=torch.zeros(1, W, dtype=torch.bool),
                       sample_indices=torch.zeros(0, dtype=torch.int64), sample_lens=(1,), offsets=(0,),
                       layout=layout, width_multiple=unit, is_placeholder=True, cp_size=int(micro.cp_size))


def pack_padded_micro(micro: Micro, token_ids: Sequence[Any] | Mapping[int, Any], *,
                      loss_masks: Sequence[Any] | Mapping[int, Any] | None = None, pad_token_id: int = 0,
                      weight_dtype: torch.dtype = torch.float64) -> PaddedMicro:
    """``pack_micro`` for a micro-batch of a padded layout (called by ``pack_micro``; see the module note)."""
    fp = micro.footprint
    assert fp is not None and fp.padded
    unit, layout = fp.padding.width_multiple, fp.padding.layout
    if micro.is_placeholder:
        return _placeholder(micro, pad_token_id, weight_dtype, unit, layout)
    idx = micro.indices
    W = fp.width(idx)
    n = idx.size
    plens = fp.prompt_lens[idx] if fp.prompt_lens is not None else np.zeros(n, dtype=np.int64)
    Wp = int(plens.max()) if fp.prompt_lens is not None else 0
    ids = torch.full((n, W), int(pad_token_id), dtype=torch.int64)
    att = torch.zeros(n, W, dtype=torch.int64)
    pos = torch.zeros(n, W, dtype=torch.int64)
    wts = torch.zeros(n, W, dtype=torch.float64)
    msk = torch.zeros(n, W, dtype=torch.bool)
    offsets = []
    for j, (i, L, k, scale) in enumerate(zip(idx.tolist(), micro.seq_lens.tolist(), micro.loss_tokens.tolist(),
                                             micro.loss_scale.tolist())):
        o = Wp - int(plens[j])  # 2D: left-pad the prompt to the longest prompt; 1D: 0
        tok = _token_tensor(_entry(token_ids, i, "token_ids"), i, L)
        m = _mask_tensor(loss_masks, i, L, k)
        ids[j, o:o + L] = tok
        att[j, o:o + L] = 1
        pos[j, o:o + L] = torch.arange(L)
        msk[j, o:o + L] = m
        wts[j, o:o + L] = m.to(torch.float64) * scale
        offsets.append(o)
    packed = PaddedMicro(input_ids=ids, attention_mask=att, position_ids=pos, loss_weights=wts.to(weight_dtype),
                         loss_mask=msk, sample_indices=torch.from_numpy(idx.astype(np.int64)),
                         sample_lens=tuple(micro.seq_lens.tolist()), offsets=tuple(offsets), layout=layout,
                         width_multiple=unit, cp_size=int(micro.cp_size))
    packed.validate()
    return packed


def pack_padded_values(packed: PaddedMicro, values: Sequence[Any] | Mapping[int, Any], *, fill: float = 0.0,
                       dtype: torch.dtype | None = None) -> torch.Tensor:
    """``pack_values`` for a :class:`PaddedMicro`: ``[n, W]``, ``fill`` on pads."""
    n, W = packed.token_shape
    if packed.is_placeholder:
        return torch.full((n, W), fill, dtype=dtype or torch.float64)
    rows = []
    for i, o, k in zip(packed.sample_indices.tolist(), packed.offsets, packed.sample_lens):
        t = _value_tensor(values, i, k)
        row = torch.full((W,), fill, dtype=t.dtype)
        row[o:o + k] = t
        rows.append(row)
    out = torch.stack(rows)
    return out.to(dtype) if dtype is not None else out
