"""Exact loss weights for verl's loss aggregation modes, and the global counts verl's ``agg_loss`` needs.

Design note. verl's ``agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size, batch_num_tokens,
global_batch_size, loss_scale_factor)`` is split-invariant exactly when its counts are GLOBAL:
the loss tokens and samples of the whole mini-batch over every DP rank. Each micro-batch then
contributes Σ_i w_i Σ_t ℓ_{i,t} with w_i = c_i · dp, the per-sample coefficient of the objective
(microplan's ``loss_scale`` for ``grad_reduction="mean"``), and the DP average of the summed
micro-batch gradients is ∇J whatever the split. :func:`loss_weights` all-gathers the loss-token
counts over ``dp_group`` (one ``gather_batch``), computes the coefficients with microplan's weigh
stage, and returns this rank's weights plus the ``global_batch_info`` dict verl's actor config
takes. Mode map: token-mean, token-sum, seq-mean-token-sum, seq-mean-token-mean and
seq-mean-token-sum-norm (H = ``loss_scale_factor``, verl's default the mask's width) are the
microplan modes of the same name; |S| counts every sample, as verl's ``global_batch_size`` does
(verl's seq-mean-token-mean adds 1e-8 to n_i: a relative difference below 1e-8).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..config import Loss
from ..errors import PlanError
from ..stages.weigh import loss_coefficients, loss_scales

__all__ = ["VERL_LOSS_MODES", "VerlLossWeights", "loss_weights"]

VERL_LOSS_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


class VerlLossWeights(NamedTuple):
    """This rank's exact per-sample loss weights and the global counts verl's ``agg_loss`` needs.

    Attributes:
        weights: float64 tensor ``[B]``: multiply sample i's masked token-loss sum by it, sum over
            the micro-batches and backward; the DP gradient average is then exactly ∇J.
        global_batch_info: ``{"dp_size", "batch_num_tokens", "global_batch_size",
            "loss_scale_factor"}`` — pass as ``agg_loss(..., **global_batch_info)`` or update the
            actor config's ``global_batch_info`` with it.
        loss: the microplan :class:`~microplan.Loss` of the mode.
    """

    weights: Any
    global_batch_info: dict[str, Any]
    loss: Loss


def loss_weights(loss_mask: Any, loss_agg_mode: str, *, dp_group: Any = None,
                 loss_scale_factor: float | None = None) -> VerlLossWeights:
    """Weights and global counts for this rank's ``loss_mask`` ([B, T] 0/1, or nested) under ``loss_agg_mode``.

    Collective over ``dp_group`` when ``torch.distributed`` is initialised and a group is given.
    """
    import torch
    if loss_agg_mode not in VERL_LOSS_MODES:
        raise PlanError(f"loss_agg_mode={loss_agg_mode!r} is not one of verl's modes {', '.join(VERL_LOSS_MODES)}.")
    nested = bool(getattr(loss_mask, "is_nested", False))
    n_local = (torch.stack([r.sum() for r in loss_mask.unbind()]) if nested else loss_mask.sum(dim=-1))
    n_local = n_local.detach().to("cpu", torch.float64).numpy()
    if (n_local != np.round(n_local)).any() or (n_local < 0).any():
        raise PlanError("loss_mask must be a 0/1 mask (its row sums are the loss-token counts).")
    n_local = n_local.astype(np.int64)
    H = None
    if loss_agg_mode == "seq-mean-token-sum-norm":
        H = float(loss_scale_factor) if loss_scale_factor is not None else float(
            max(int(r.numel()) for r in loss_mask.unbind()) if nested else loss_mask.shape[-1])
    loss = Loss(loss_agg_mode, norm_constant=H)  # type: ignore[arg-type]
    n_all, offset, dp = _gather_counts(n_local, dp_group)
    codes = np.arange(n_all.size, dtype=np.int64)  # verl's modes need no groups: each sample its own
    coef = loss_coefficients(loss, n_all, codes, codes)
    w = loss_scales(loss, coef, grad_world=dp, micro_count=1)[offset:offset + n_local.size]
    info = {"dp_size": dp, "batch_num_tokens": int(n_all.sum()), "global_batch_size": int(n_all.size),
            "loss_scale_factor": H}
    return VerlLossWeights(torch.from_numpy(np.ascontiguousarray(w)), info, loss)


def _gather_counts(n_local: np.ndarray, dp_group: Any) -> tuple[np.ndarray, int, int]:
    """(every rank's loss-token counts in rank order, this rank's offset, DP size)."""
    import torch.distributed as dist
    if dp_group is None or not (dist.is_available() and dist.is_initialized()):
        return n_local, 0, 1
    from ..torch.distributed import local_view
    view = local_view({"seq_lens": n_local + 1, "loss_tokens": n_local}, group=dp_group)
    return view.batch.loss_tokens.copy(), view.offset, view.world_size
