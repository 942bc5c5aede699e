"""The loss side of a packed micro-batch: per-token log-probs, shifted labels, the weighted scalar.

Design note — alignment. microplan weights are *label aligned*: ``loss_weights[t]`` weighs
ℓ[t], the loss of predicting token t, whose logits are at position t-1 of the same sample.
:func:`token_logprobs` returns log-probs in that alignment (0 at every sample start, where no
prediction exists), so ``weighted_loss(per_token_loss(token_logprobs(logits, p)), p)`` is the
whole recipe. Frameworks that compute losses at *logit* positions (fused linear cross-entropy
with labels shifted left) use :func:`next_token_labels` / :func:`next_token_weights`, or pass
``aligned="logit"`` to :func:`weighted_loss`: the logits at the last token of a sample would
predict the next sample's first token, and get label ``ignore_index`` and weight 0.

Every function takes a varlen :class:`PackedMicro` (tensors ``[T]``, or ``[1, T]``) or a
:class:`~microplan.torch.padded.PaddedMicro` of a padded layout (tensors ``[n, W]``; a token is
predicted only from the previous real token of its row), and returns tensors of that shape.

The scalar to backward is ``Σ_t loss_weights[t] · ℓ[t]`` — a plain weighted SUM. Do not divide by
token counts, micro counts or world sizes: the plan's ``loss_scale`` already folds in the loss
mode's normaliser, the engine's 1/K (``engine_divides_by_micro_count``) and the gradient
averaging over W ranks (``grad_reduction``), so the reduced gradient is exactly ∇J.
"""

from __future__ import annotations

from typing import Literal

import torch

from ..errors import PlanError
from .packing import PackedMicro
from .padded import PaddedMicro
from .row import predecessor_index

Packed = PackedMicro | PaddedMicro

__all__ = ["token_logprobs", "next_token_labels", "next_token_weights", "weighted_loss"]


def _tokens_first(x: torch.Tensor, packed: Packed, name: str, *, extra_dims: int) -> torch.Tensor:
    """Accept the micro-batch's token shape (``[T, ...]`` or ``[1, T, ...]``; padded: ``[n, W, ...]``)."""
    if not isinstance(packed, (PackedMicro, PaddedMicro)):
        raise PlanError(f"expected a PackedMicro or PaddedMicro (from pack_micro), got {type(packed).__name__}.")
    shape = packed.token_shape
    if len(shape) == 1 and x.dim() == extra_dims + 2 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != extra_dims + len(shape) or tuple(x.shape[:len(shape)]) != shape:
        if len(shape) == 1:
            want = "[T]" if extra_dims == 0 else "[T, V]"
            raise PlanError(f"{name} has shape {tuple(x.shape)}; this micro-batch needs {want} (or a leading batch "
                            f"dim of 1) with T={shape[0]}.")
        want = "[n, W]" if extra_dims == 0 else "[n, W, V]"
        raise PlanError(f"{name} has shape {tuple(x.shape)}; this padded micro-batch needs {want} with "
                        f"n, W = {shape[0]}, {shape[1]}.")
    return x


def token_logprobs(logits: torch.Tensor, packed: Packed, *, temperature: float = 1.0) -> torch.Tensor:
    """Label-aligned log-probs ``[T]``: entry t = log p(token t | the sample's tokens < t).

    ``logits`` is the packed model output ``[T, V]`` or ``[1, T, V]`` (position t predicts
    token t+1). Entry t is 0 where t starts a sample (no prediction; the logits at t-1 belong to
    the previous sample). Differentiable; computed in the logits' dtype (upcast bf16 logits
    yourself if you want float32 log-probs). ``temperature`` divides the logits first.

    A CP shard (:meth:`PackedMicro.cp_shard`) returns its per-sample layout ``[S]`` instead: the
    log-prob of each token its rows' logits predict (``cp_shard.py``; ``expand`` keeps it as is).
    """
    x = _tokens_first(logits, packed, "logits", extra_dims=1)
    if temperature != 1.0:
        x = x / temperature
    if getattr(packed, "tree", None) is not None:  # a prefix-shared row or a CP shard: gather through the table
        q, ids, ok = prediction_table(packed, x.device)
        lp = x[q, ids] - torch.logsumexp(x, dim=-1)[q]  # no [U, V] copy of the logits
        return torch.where(ok, lp, torch.zeros_like(lp))
    ids = packed.input_ids.to(x.device)
    prev = x[..., :-1, :]
    lp = prev.gather(-1, ids[..., 1:, None]).squeeze(-1) - torch.logsumexp(prev, dim=-1)
    lp = torch.cat([lp.new_zeros(*lp.shape[:-1], 1), lp], dim=-1)
    return torch.where(packed.predicted().to(x.device), lp, torch.zeros_like(lp))


def prediction_table(packed: PackedMicro, device: torch.device | str | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logit row, label, predicted) of every entry :func:`token_logprobs` returns: for a row, its
    tokens ``[T]`` (t's predecessor row, token t, t not a sample start); for a CP shard, its
    per-sample layout ``[S]`` (``cp_shard.py``: the owned row whose logits score the entry, the
    token it scores — several entries share a branch node's row, one per child — and False at a
    sample's position 0)."""
    cp = getattr(packed, "cp", None)
    if cp is not None:
        return packed.tree.flat_rows.to(device), cp.target_ids.to(device), cp.predicted.to(device)  # type: ignore[union-attr]
    prev = predecessor_index(packed, device)
    return prev.clamp(min=0), packed.input_ids.to(device), prev >= 0


def _continues(packed: Packed, device: torch.device) -> torch.Tensor:
    """Token-shaped bool: position t+1 exists and is predicted from t (same sample)."""
    pred = packed.predicted().to(device)
    out = torch.zeros_like(pred)
    out[..., :-1] = pred[..., 1:]
    return out


def _no_tree(packed: Packed, what: str) -> None:
    if getattr(packed, "tree", None) is not None:
        raise PlanError(f"{what} is logit aligned, and in a prefix-shared row a token's logits predict every "
                        "branch that continues it; use token_logprobs (label aligned) and weighted_loss(..., "
                        "aligned='token').")


def next_token_labels(packed: Packed, *, ignore_index: int = -100) -> torch.Tensor:
    """Logit-aligned labels ``[T]``: ``input_ids[t+1]`` where t+1 is in t's sample, else ``ignore_index``.

    Only loss tokens matter for the weighted loss; non-loss positions keep their real label (pair
    these labels with :func:`next_token_weights`, which is 0 there). Not for prefix-shared rows.
    """
    _no_tree(packed, "next_token_labels")
    ids = packed.input_ids
    nxt = torch.cat([ids[..., 1:], ids.new_full((*ids.shape[:-1], 1), ignore_index)], dim=-1)
    return torch.where(_continues(packed, ids.device), nxt, torch.full_like(nxt, ignore_index))


def next_token_weights(packed: Packed) -> torch.Tensor:
    """Logit-aligned weights ``[T]``: ``loss_weights[t+1]`` within a sample, 0 at each sample's last token."""
    _no_tree(packed, "next_token_weights")
    w = packed.loss_weights
    nxt = torch.cat([w[..., 1:], w.new_zeros((*w.shape[:-1], 1))], dim=-1)
    return torch.where(_continues(packed, w.device), nxt, torch.zeros_like(nxt))


def weighted_loss(token_losses: torch.Tensor, packed: Packed, *,
                  aligned: Literal["token", "logit"] = "token", per_sample: bool | None = None) -> torch.Tensor:
    """The scalar to backward for one micro-batch: ``Σ_t w[t] · token_losses[t]``.

    Args:
        token_losses: ``[T]`` (or ``[1, T]``) per-token losses ℓ, e.g. ``-A · logp`` or a PPO
            clipped surrogate; only positions with nonzero weight contribute (NaN/inf elsewhere
            is masked out of the value — keep them finite anyway, or their gradient is NaN).
        packed: the micro-batch's :class:`PackedMicro`.
        aligned: ``"token"`` (default) when ``token_losses[t]`` is the loss of token t (as from
            :func:`token_logprobs`); ``"logit"`` when it sits at the logit position t that
            predicts token t+1 (as from cross-entropy on :func:`next_token_labels`).

    Returns a 0-dim tensor in the promoted dtype of losses and weights. A placeholder gives an
    exact 0 that is still connected to the graph, so backward and the gradient all-reduce run.
    Do not rescale it: see the module note.

    A prefix-shared row takes its losses either per token ``[U]`` (a shared loss token carries
    the summed scales of its samples: exact when ℓ depends only on the token, e.g. a plain NLL) or
    in the per-sample layout ``[Σ L]`` of :meth:`PackedMicro.expand` / :func:`pack_values` (exact
    for every per-sample loss, e.g. PPO with per-sample advantages); ``per_sample`` says which
    (None: from the length — a row without any shared token has both of the same length, and
    then the two layouts must coincide, else pass it). A CP shard's losses are always per sample
    (``[S]``, the layout ``token_logprobs`` returns for it).
    """
    if aligned not in ("token", "logit"):
        raise PlanError(f"aligned={aligned!r} must be 'token' (loss of token t at t) or 'logit' (at t-1).")
    tree = getattr(packed, "tree", None)
    if tree is not None:
        if aligned == "logit":
            _no_tree(packed, "weighted_loss(aligned='logit')")
        y = token_losses[0] if token_losses.dim() == 2 and token_losses.shape[0] == 1 else token_losses
        S, U = tree.sample_weights.numel(), packed.num_tokens
        shard = getattr(packed, "cp", None) is not None  # a CP shard's losses are per sample (its expand layout)
        if shard and per_sample is False:
            raise PlanError("a CP shard's losses are per sample ([S], the layout token_logprobs returns for it): its "
                            "rows' logits score the tokens after them, so there is no loss per row; drop "
                            "per_sample=False.")
        if per_sample is None and y.dim() == 1 and y.shape[0] == S == U and not tree.in_row_order and not shard:
            raise PlanError("token_losses has as many entries as the row and as the per-sample layout, which order "
                            "tokens differently here: pass per_sample=True (losses in the layout of pack_values / "
                            "PackedMicro.expand) or per_sample=False (one loss per row token).")
        if per_sample or shard or (per_sample is None and y.dim() == 1 and y.shape[0] == S and S != U):
            if y.dim() != 1 or y.shape[0] != S:
                raise PlanError(f"per-sample token_losses must be [Σ L] = [{S}], got shape {tuple(y.shape)}.")
            if not (y.dtype.is_floating_point or y.dtype.is_complex):
                raise PlanError(f"token_losses must be floating point, got {y.dtype}.")
            w = tree.sample_weights.to(y.device)
            prod = y * w
            return torch.where(w != 0, prod, torch.zeros_like(prod)).sum()
    x = _tokens_first(token_losses, packed, "token_losses", extra_dims=0)
    if not (x.dtype.is_floating_point or x.dtype.is_complex):
        raise PlanError(f"token_losses must be floating point, got {x.dtype}.")
    w = packed.loss_weights if aligned == "token" else next_token_weights(packed)
    w = w.to(x.device)
    prod = x * w
    return torch.where(w != 0, prod, torch.zeros_like(prod)).sum()
