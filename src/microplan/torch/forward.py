"""A forward-only pass end to end: pack, run, restore to sample order — one call.

Design note. A forward pass (old log-probs, reference log-probs, values) over a forward plan
(:func:`microplan.plan_forward`) is: pack every micro-batch of the rank (placeholders included,
so the rank runs as many forwards as its peers), run the model without autograd, and put the
per-token outputs back in sample order, dropping the placeholders' outputs.
:func:`run_forward` does that for any ``run(packed)``; :func:`forward_logprobs` is the Hugging
Face causal-LM case (the same recipe as the training forward: ``model(**p.model_inputs(),
use_cache=False).logits`` then :func:`token_logprobs`, or :func:`chunked_token_logprobs` with
``chunk_tokens``). The result is a :class:`Restored` keyed by global sample index, so the old
log-probs go straight into the training micro-batches: ``pack_values(packed,
old.as_dict())``. With ``plan_forward(batch, cfg, like=train_plan)`` every sample is on the
rank that trains it (no exchange) and its log-probs are bit-identical to the training
forward's (tests/test_forward_torch.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch

from ..errors import PlanError
from ..types import Micro
from .chunked import chunked_token_logprobs
from .loss import token_logprobs
from .packing import PackedMicro, pack_micro
from .restore import Restored, restore_order

__all__ = ["run_forward", "forward_logprobs"]


def _flat(micros: Sequence[Any]) -> list[Micro]:
    """A rank's micro-batches: a flat list, or ``plan.rank(r)`` (one tuple per step) flattened."""
    out: list[Micro] = []
    for i, m in enumerate(micros):
        if isinstance(m, Micro):
            out.append(m)
        elif isinstance(m, (list, tuple)) and all(isinstance(x, Micro) for x in m):
            out.extend(m)
        else:
            raise PlanError(f"micros[{i}] is a {type(m).__name__}; pass the rank's Micro objects: plan.rank(r) "
                            "or [m for step in plan.rank(r) for m in step].")
    return out


def run_forward(micros: Sequence[Any], token_ids: Sequence[Any] | Mapping[int, Any],
                run: Callable[[PackedMicro], Any], *, order: Sequence[int] | np.ndarray | None = None,
                kind: Literal["token", "sample"] = "token", pad_token_id: int = 0,
                device: torch.device | str | None = None) -> Restored:
    """Pack, run and restore one rank's forward pass (no autograd).

    Args:
        micros: the rank's micro-batches in execution order: ``plan.rank(r)`` or a flat list.
        token_ids: ``token_ids[i]``: the token tensor of GLOBAL sample i (as :func:`pack_micro`).
        run: ``run(packed) -> output`` for one :class:`PackedMicro` (placeholders included): a
            packed ``[T, ...]`` tensor, or with ``kind="sample"`` a ``[n, ...]`` one.
        order, kind: as :func:`restore_order`.
        pad_token_id: the placeholder's dummy token.
        device: move each packed micro-batch there before ``run``.

    Returns the :class:`Restored` outputs of the real samples, ascending global index by default.
    """
    flat = _flat(micros)
    packs, outputs = [], []
    with torch.no_grad():
        for micro in flat:
            packed = pack_micro(micro, token_ids, pad_token_id=pad_token_id)
            if device is not None:
                packed = packed.to(device)
            packs.append(packed)
            outputs.append(run(packed))
    return restore_order(packs, outputs, order=order, kind=kind)


def forward_logprobs(model: torch.nn.Module, micros: Sequence[Any], token_ids: Sequence[Any] | Mapping[int, Any],
                     *, temperature: float = 1.0, chunk_tokens: int | None = None,
                     dtype: torch.dtype | None = None, order: Sequence[int] | np.ndarray | None = None,
                     pad_token_id: int = 0, device: torch.device | str | None = None) -> Restored:
    """Per-token log-probs of every real sample of the rank, in sample order (one ``[L_i]`` tensor
    per sample, label aligned: entry 0 is 0).

    ``model`` is a Hugging Face causal LM (in eval mode); each micro-batch runs
    ``model(**packed.model_inputs(), use_cache=False)``. ``chunk_tokens``: compute the logits in
    slices of that many tokens from the decoder's hidden states and the LM head
    (:func:`chunked_token_logprobs`) instead of materialising them. ``dtype``: upcast the logits
    first (e.g. ``torch.float32`` for a bf16 model). Use the same recipe as the training forward
    if the two must agree bit for bit.
    """
    if chunk_tokens is None:
        def run(p: PackedMicro) -> torch.Tensor:
            logits = model(**p.model_inputs(), use_cache=False).logits
            return token_logprobs(logits if dtype is None else logits.to(dtype), p, temperature=temperature)
    else:
        head = model.get_output_embeddings()
        decoder = model.get_decoder()

        def run(p: PackedMicro) -> torch.Tensor:
            hidden = decoder(**p.model_inputs(), use_cache=False).last_hidden_state
            return chunked_token_logprobs(hidden, head.weight, p, chunk_tokens=chunk_tokens,
                                          bias=getattr(head, "bias", None), temperature=temperature, dtype=dtype)
    return run_forward(micros, token_ids, run, order=order, pad_token_id=pad_token_id, device=device)
