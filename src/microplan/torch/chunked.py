"""Log-probs of a packed row computed in slices of tokens, so the logits never exist whole.

Design note. ``token_logprobs(model(...).logits, p)`` materialises the [T, V] logits and, inside
``logsumexp``, one more [T, V] temporary: 2·T·V·4 bytes in float32 — at T = 205k tokens and a
76k-entry vocab shard that is 116 GiB (slime #1951 hit 58 GiB for the logits alone).
:func:`chunked_token_logprobs` takes the last hidden states [T, H] and the LM head weight [V, H]
instead and computes ``chunk_tokens`` rows of logits at a time (matmul in the weight's dtype,
then upcast, as HF does), so the logits take 2·chunk·V·4 bytes whatever T. Under autograd each
slice is recomputed in backward (``torch.utils.checkpoint``), so training keeps the bound too.
benchmarks/bench_logits.py measures the peak (docs/passes.md).
The result equals ``token_logprobs`` of the full logits up to float rounding (a matmul over a
slice of rows may block differently); for bit-identical log-probs between two passes, use the
same recipe (and the same micro-batches: ``plan_forward(like=...)``) in both.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..errors import PlanError
from .loss import _tokens_first, prediction_table
from .packing import PackedMicro
from .padded import PaddedMicro

__all__ = ["chunked_token_logprobs"]


def _slice_logprobs(h: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    labels: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """Log-probs of ``labels`` predicted by hidden rows ``rows`` (gathered here, so a checkpointed
    slice stores indices, not a copy of the hidden states)."""
    logits = torch.nn.functional.linear(h.index_select(0, rows), weight, bias).to(dtype)
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, labels[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, packed: PackedMicro, *,
                           chunk_tokens: int = 4096, bias: torch.Tensor | None = None, temperature: float = 1.0,
                           dtype: torch.dtype | None = None) -> torch.Tensor:
    """Label-aligned log-probs ``[T]`` (as :func:`token_logprobs`) from hidden states, by slices.

    Args:
        hidden: the last hidden states ``[T, H]`` or ``[1, T, H]`` (after the final norm: what the
            LM head sees), e.g. ``model.get_decoder()(**p.model_inputs(), use_cache=False)
            .last_hidden_state``.
        weight: the LM head weight ``[V, H]`` (``model.get_output_embeddings().weight``); V may be a
            vocab-parallel shard only if you combine the shards' logsumexp yourself.
        packed: the micro-batch's :class:`PackedMicro` (labels and sample starts).
        chunk_tokens: rows of logits computed at once; peak logits memory is about
            2 · chunk_tokens · V · 4 bytes (see :func:`microplan.logits_token_cap`).
        bias: the LM head bias, if any. Models that post-process logits (soft-capping, scaling)
            need their own recipe.
        temperature: divides the logits.
        dtype: dtype of logits and log-probs; default: the hidden dtype promoted to at least float32.

    Entry t is 0 where t starts a sample. Token t is predicted by the hidden state of its
    predecessor (:func:`~microplan.torch.row.predecessor_index`: t − 1, or the parent segment's
    last token in a prefix-shared row), as in :func:`token_logprobs`; a CP shard gives its
    per-sample layout ``[S]`` as :func:`token_logprobs` does. Differentiable (slices recomputed
    in backward).
    """
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise PlanError(f"chunk_tokens={chunk_tokens!r} must be an int >= 1 (rows of logits computed at once).")
    if isinstance(packed, PaddedMicro):
        raise PlanError("chunked_token_logprobs takes a packed row (PackedMicro); for a padded [n, W] micro-batch "
                        "use token_logprobs on the model's logits.")
    h = _tokens_first(hidden, packed, "hidden", extra_dims=1)
    if weight.dim() != 2 or weight.shape[1] != h.shape[1]:
        raise PlanError(f"weight has shape {tuple(weight.shape)}; the LM head weight must be [V, H] with "
                        f"H={h.shape[1]} (the hidden size).")
    out_dtype = dtype or torch.promote_types(h.dtype, torch.float32)
    src, ids, ok = prediction_table(packed, h.device)
    T = src.shape[0]
    parts = []
    track = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    for lo in range(0, max(T, 1), chunk_tokens):  # an empty table (a shard scoring nothing): one empty slice
        hi = min(lo + chunk_tokens, T)
        args = (h, src[lo:hi], weight, bias, ids[lo:hi], out_dtype, temperature)
        parts.append(checkpoint(_slice_logprobs, *args, use_reentrant=False) if track else _slice_logprobs(*args))
    lp = torch.cat(parts)
    return torch.where(ok, lp, torch.zeros_like(lp))
