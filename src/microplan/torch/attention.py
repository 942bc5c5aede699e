"""Per-sample (varlen) attention for Hugging Face models: ``register_attention() -> str``.

Design note. ``register_attention()`` adds microplan's attention function to transformers'
``AttentionInterface`` (and a mask function to ``AttentionMaskInterface``, so transformers builds
no T×T mask for it) and returns its name. A model built or loaded with
``attn_implementation=<that name>`` then runs a ``PackedMicro`` from ``**packed.model_inputs()``
with each sample attending causally to itself only — the work of flash-attn's varlen kernels,
Σ L² per micro-batch, where transformers' own sdpa/eager paths over the packed row compute
every T² pair of a block-diagonal mask.

Steps, per attention call:

1. A *segment table* (:class:`Segments`) says which queries attend to which keys. Query range
   ``[q_start, q_end)`` of the flattened ``B·T`` tokens attends to key range
   ``[k_start, k_end)``, causally with bottom-right alignment (the flash-attn convention when a
   segment has more keys than queries: the last query sees every key). Flat packing has
   ``q == k`` ranges; a prefix-tree micro-batch will give a node's new tokens as queries and its
   path as keys (``cu_seqlens_q != cu_seqlens_k``), which is why the table carries both.
2. The table comes from, in order: explicit ``cu_seq_lens_q``/``cu_seq_lens_k`` keyword
   arguments (transformers' flash-attn convention, forwarded from ``model(...)``), else the
   ``position_ids`` the decoder layers pass down (a segment starts wherever a position does not
   follow its predecessor by one — they restart at 0 in a ``PackedMicro``), else one segment per
   row. A 2-D padding mask removes its padded tokens from every segment (their output is 0).
   The table is computed once per forward (cached on the ``position_ids`` or ``cu_seq_lens`` tensors), not per layer.
3. Each segment runs ``torch.nn.functional.scaled_dot_product_attention`` on its own slice
   (``is_causal`` when it is square, an explicit lower-right mask otherwise; GQA through
   ``enable_gqa``); the outputs are concatenated back into the row. A tree row on CPU runs
   split — shared ancestor keys attended once, in place, merged by log-sum-exp with each
   segment's own causal call (``tree_attention.py``); elsewhere (a CP shard, dropout) its keys
   are gathered per path and segments of like shape run batched, one padded masked call per
   group (``segment_groups.py``).

Anything that is not a training-style forward over a packed row — a KV cache (keys longer than
queries without an explicit table), a 4-D mask — is handed to transformers' own sdpa function,
so generation still works with the same ``attn_implementation``.

Guarantees: on a float64 model the logits of a packed row equal each sample run alone to float64
rounding (``tests/test_attention.py``); attention work is Σ L² (score elements counted at the
sdpa calls). Trade-off: one sdpa call per sample and layer, so a many-sample micro-batch pays a
per-sample overhead the four-feature cost model folds into ``linear``, while a dense sdpa over
the same packed row pays all T² pairs whatever the mix.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import PlanError
from .segment_groups import grouped_attention, one_segment
from .tree_attention import HAS_SPLIT, split_attention, split_plan

__all__ = ["ATTENTION_NAME", "Segments", "register_attention", "segments_from_cu_seqlens",
           "segments_from_position_ids", "varlen_attention", "segment_attention"]

#: The name ``register_attention`` registers (pass it as ``attn_implementation``).
ATTENTION_NAME = "microplan"


@dataclass(frozen=True)
class Segments:
    """Which keys each block of queries attends to, over the flattened ``B·T`` tokens (host ints).

    Attributes:
        q_starts, q_ends: query range of each segment (``[q_start, q_end)``).
        k_starts, k_ends: key range of each segment; equal to the query ranges for flat packing.
        num_tokens: ``B·T``, the flattened length (tokens in no segment get output 0).
        causal: causal attention with bottom-right alignment (query j of a segment with Lq
            queries and Lk keys sees keys ``0 .. j + Lk - Lq``); False: every key.
    """

    q_starts: tuple[int, ...]
    q_ends: tuple[int, ...]
    k_starts: tuple[int, ...]
    k_ends: tuple[int, ...]
    num_tokens: int
    causal: bool = True

    def __post_init__(self) -> None:
        n = len(self.q_starts)
        if not (len(self.q_ends) == len(self.k_starts) == len(self.k_ends) == n):
            raise PlanError("Segments needs one q_start, q_end, k_start and k_end per segment.")
        for i in range(n):
            qa, qb, ka, kb = self.q_starts[i], self.q_ends[i], self.k_starts[i], self.k_ends[i]
            if not (0 <= qa < qb <= self.num_tokens and 0 <= ka < kb <= self.num_tokens):
                raise PlanError(f"segment {i}: queries [{qa}, {qb}) and keys [{ka}, {kb}) must be non-empty ranges "
                                f"inside the {self.num_tokens} tokens.")
            if self.causal and kb - ka < qb - qa:
                raise PlanError(f"segment {i} has {qb - qa} queries but {kb - ka} keys; causal attention with "
                                "bottom-right alignment needs at least as many keys as queries.")

    @property
    def flat(self) -> bool:
        """True when every segment's queries are its keys (flat packing, no tree)."""
        return self.q_starts == self.k_starts and self.q_ends == self.k_ends

    @property
    def covers_all(self) -> bool:
        """True when the query ranges tile ``[0, num_tokens)`` in order (no padding tokens)."""
        return (len(self.q_starts) > 0 and self.q_starts[0] == 0 and self.q_ends[-1] == self.num_tokens
                and all(a == b for a, b in zip(self.q_starts[1:], self.q_ends[:-1])))

    def attention_pairs(self) -> int:
        """(query, key) pairs the segments compute (causal: the allowed ones): Σ L(L+1)/2 when flat."""
        total = 0
        for qa, qb, ka, kb in zip(self.q_starts, self.q_ends, self.k_starts, self.k_ends):
            lq, lk = qb - qa, kb - ka
            total += lq * lk - (lq * (lq - 1)) // 2 if self.causal else lq * lk
        return total


def segments_from_cu_seqlens(cu_seqlens_q: Any, cu_seqlens_k: Any = None, *, causal: bool = True) -> Segments:
    """The table of varlen kernels: segment i has queries ``cu_q[i]:cu_q[i+1]`` and keys ``cu_k[i]:cu_k[i+1]``."""
    q = [int(x) for x in torch.as_tensor(cu_seqlens_q).reshape(-1).tolist()]
    k = q if cu_seqlens_k is None else [int(x) for x in torch.as_tensor(cu_seqlens_k).reshape(-1).tolist()]
    if len(q) < 2 or len(k) != len(q) or q[0] != 0 or k[0] != 0:
        raise PlanError(f"cu_seqlens_q={q} / cu_seqlens_k={k} must start at 0 and have the same n+1 entries.")
    return Segments(tuple(q[:-1]), tuple(q[1:]), tuple(k[:-1]), tuple(k[1:]),
                    num_tokens=max(q[-1], k[-1]), causal=causal)


def segments_from_position_ids(position_ids: torch.Tensor, valid: torch.Tensor | None = None, *,
                               causal: bool = True) -> Segments:
    """Segments of a ``[B, T]`` row batch: a new one where a position is not its predecessor + 1.

    ``valid`` (``[B, T]`` bool, e.g. a 2-D attention mask) drops padded tokens: they belong to no
    segment and break the segment they interrupt.
    """
    pos = position_ids.detach().to("cpu", torch.int64)
    if pos.dim() == 1:
        pos = pos[None]
    T = pos.shape[1]
    B = max(pos.shape[0], 1 if valid is None else valid.shape[0])  # transformers passes [1, T] positions for a batch
    pos = pos.expand(B, T)
    ok = torch.ones(B, T, dtype=torch.bool) if valid is None else valid.detach().to("cpu", torch.bool).expand(B, T)
    start = torch.ones(B, T, dtype=torch.bool)
    start[:, 1:] = (pos[:, 1:] != pos[:, :-1] + 1) | ~ok[:, :-1]
    start &= ok
    end = torch.ones(B, T, dtype=torch.bool)
    end[:, :-1] = start[:, 1:] | ~ok[:, 1:]
    end &= ok
    flat_start = torch.nonzero(start.reshape(-1)).reshape(-1).tolist()
    flat_end = (torch.nonzero(end.reshape(-1)).reshape(-1) + 1).tolist()
    s, e = tuple(int(x) for x in flat_start), tuple(int(x) for x in flat_end)
    return Segments(s, e, s, e, num_tokens=B * T, causal=causal)


def segment_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: Segments, *,
                      scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Attention of flattened tokens by segment: ``query [N, Hq, D]``, ``key/value [N, Hkv, D]`` → ``[N, Hq, Dv]``.

    Each segment is one ``scaled_dot_product_attention`` call; tokens in no segment give 0. A
    tree row's table (queries apart from keys) batches segments of like shape into one call each
    (``segment_groups.grouped_attention``).
    """
    if not segments.flat and len(segments.q_starts) > 1:
        return grouped_attention(query, key, value, segments, scale=scale, dropout_p=dropout_p)
    gqa = query.shape[1] != key.shape[1]
    outs = []
    for qa, qb, ka, kb in zip(segments.q_starts, segments.q_ends, segments.k_starts, segments.k_ends):
        outs.append(one_segment(query, key, value, qa, qb, ka, kb, segments.causal, scale, dropout_p, gqa))
    if segments.covers_all:
        return torch.cat(outs) if len(outs) > 1 else outs[0]
    out = query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])
    if not outs:
        return out
    idx = torch.cat([torch.arange(a, b, device=query.device) for a, b in zip(segments.q_starts, segments.q_ends)])
    return out.index_copy(0, idx, torch.cat(outs))


class _SegmentCache:
    """One entry: what was built from the last anchor tensor seen (``position_ids`` or
    ``cu_seq_lens_q/k``: the segment table; a tree row's ``key_index``: its split plan): every
    layer of a forward receives the same tensors, so the host round trip and the table's checks
    happen once per forward, not once per layer."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._ref: weakref.ref | None = None
        self._segments: Any = None

    def get(self, anchor: torch.Tensor, other: torch.Tensor | None, causal: bool, build: Callable[[], Any]) -> Any:
        key = (anchor._version, tuple(anchor.shape), id(other), None if other is None else other._version, causal)
        if self._ref is not None and self._ref() is anchor and self._key == key:
            return self._segments  # type: ignore[return-value]
        seg = build()
        self._ref, self._key, self._segments = weakref.ref(anchor), key, seg
        return seg


_CACHE = _SegmentCache()
_SPLIT = _SegmentCache()  # a tree row's split plan (tree_attention.split_plan), keyed on its key index


def _table(query: torch.Tensor, attention_mask: torch.Tensor | None, causal: bool, kwargs: dict) -> Segments:
    B, _, T, _ = query.shape
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if B != 1:
            raise PlanError(f"cu_seq_lens_q/k describe ONE packed row, but the batch has {B} rows; pack into [1, T].")
        anchor = cu_q if cu_q is not None else cu_k
        return _CACHE.get(anchor, cu_k, causal, lambda: segments_from_cu_seqlens(anchor, cu_k, causal=causal))
    pos = kwargs.get("position_ids")
    if pos is None:
        pos = torch.arange(T).expand(B, T)
    elif pos.shape[-1] != T:
        raise PlanError(f"position_ids cover {pos.shape[-1]} tokens but attention runs over {T}.")
    return _CACHE.get(pos, attention_mask, causal,
                      lambda: segments_from_position_ids(pos, attention_mask, causal=causal))


def _cache_mask(query: torch.Tensor, key: torch.Tensor, padding: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """The ``[B, 1, T, S]`` boolean mask of T new queries over S cached + new keys (generation with a
    KV cache): causal aligned bottom-right (query t sees keys up to S − T + t), keys masked by the
    2-D padding mask ``[B, ≥S]`` (1 = token). A query that may see no key (a left-pad position)
    sees all of them instead: its output is discarded, and an empty row would be NaN."""
    B, T, S = query.shape[0], query.shape[2], key.shape[2]
    allowed = torch.ones(B, 1, T, S, dtype=torch.bool, device=query.device)
    if causal:
        q = torch.arange(T, device=query.device)[:, None] + (S - T)
        allowed = allowed & (torch.arange(S, device=query.device)[None, :] <= q)
    if padding is not None:
        if padding.shape[-1] < S:
            raise PlanError(f"the attention mask covers {padding.shape[-1]} keys but the KV cache holds {S}.")
        allowed = allowed & padding[:, None, None, :S].to(device=query.device, dtype=torch.bool)
    return allowed | ~allowed.any(dim=-1, keepdim=True)


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function (``query [B, Hq, T, D]``, ``key/value [B, Hkv, S, D]``): per-segment sdpa.

    Returns ``(attn_output [B, T, Hq, Dv], None)`` as transformers' attention functions do.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    explicit = kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None
    four_d = attention_mask is not None and attention_mask.dim() != 2
    if four_d or (key.shape[2] != query.shape[2] and not explicit):  # KV cache / custom mask: not a packed row
        if not four_d:  # this backend's mask is 2-D padding (or None): sdpa needs the 4-D one
            causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
            attention_mask = _cache_mask(query, key, attention_mask, causal)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    for unsupported in ("sliding_window", "softcap"):
        if kwargs.get(unsupported) is not None:
            raise PlanError(f"microplan's attention does not implement {unsupported}; use attn_implementation="
                            "'flash_attention_2' (which reads cu_seq_lens) or 'sdpa' for this model.")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    key_index = kwargs.get("microplan_key_index")
    if key_index is not None:  # a prefix-shared row (torch/tree.py): each segment's keys are its path
        if query.shape[0] != 1:
            raise PlanError(f"a prefix-shared micro-batch is ONE packed row, but the batch has {query.shape[0]} rows.")
        if kwargs.get("microplan_cp") is not None:  # a CP shard: its keys are the group's gathered slots
            from .cp_attention import gather_keys_values
            key, value = gather_keys_values(key, value, kwargs["microplan_cp"])
        elif not dropout and query.device.type == "cpu" and HAS_SPLIT:
            split = _split_tree(query, key, value, key_index, attention_mask, causal, scaling, kwargs)
            if split is not None:
                return split, None
        idx = key_index.to(key.device)
        key, value = key.index_select(2, idx), value.index_select(2, idx)
        if query.is_cuda and _flash_varlen() is not None:
            return _flash_tree(query, key, value, kwargs, scaling, dropout, causal), None
    seg = _table(query, attention_mask, causal, kwargs)
    B, Hq, T, _ = query.shape
    flat = lambda x: x.transpose(1, 2).reshape(B * x.shape[2], x.shape[1], x.shape[3])  # noqa: E731
    out = segment_attention(flat(query), flat(key), flat(value), seg, scale=scaling, dropout_p=dropout)
    return out.reshape(B, T, Hq, value.shape[-1]), None


def _split_tree(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_index: torch.Tensor,
                attention_mask: torch.Tensor | None, causal: bool, scaling: float | None, kwargs: dict) -> Any:
    """A tree row's attention with shared keys attended once (``tree_attention.py``), as
    ``[1, T, Hq, Dv]``; None when the table is not a plain tree row (the gathered path runs)."""
    if not causal or kwargs.get("cu_seq_lens_q") is None:
        return None
    seg = _table(query, attention_mask, causal, kwargs)
    T = query.shape[2]
    plan = _SPLIT.get(key_index, kwargs["cu_seq_lens_q"], causal, lambda: split_plan(
        seg.q_starts, seg.q_ends, seg.k_starts, seg.k_ends, key_index.detach().to("cpu", torch.int64).numpy(), T))
    if plan is None:
        return None
    flat = lambda x: x[0].transpose(0, 1)  # noqa: E731  [1, H, T, D] -> [T, H, D]
    out = split_attention(flat(query), flat(key), flat(value), plan, scale=scaling)
    return out[None]


def _flash_varlen() -> Any:
    """flash-attn's varlen function when installed (GPU only), else None."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _flash_tree(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kwargs: dict, scaling: float | None,
                dropout: float, causal: bool) -> torch.Tensor:
    """A prefix-shared row on GPU: flash-attn varlen with ``cu_seqlens_q != cu_seqlens_k`` over the
    gathered path keys, causal aligned bottom-right (flash-attn >= 2.1). Not exercised by the
    CPU test suite: the per-segment sdpa path is the tested reference."""
    fn = _flash_varlen()
    q = query[0].transpose(0, 1)            # [T, Hq, D]
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    cu_q = kwargs["cu_seq_lens_q"].to(query.device, torch.int32)
    cu_k = kwargs["cu_seq_lens_k"].to(query.device, torch.int32)
    out = fn(q, k, v, cu_q, cu_k, int(kwargs["max_length_q"]), int(kwargs["max_length_k"]), dropout_p=dropout,
             softmax_scale=scaling, causal=causal)
    return out[None]                         # [1, T, Hq, Dv]


def register_attention() -> str:
    """Register microplan's per-sample attention with transformers and return its name (binding API).

    Build or load the model with ``attn_implementation=register_attention()`` (or call
    ``model.set_attn_implementation(name)``), then run ``model(**packed.model_inputs(),
    use_cache=False)``: each sample of the packed row attends causally to itself only, at a cost
    in Σ L² (see the module note). A prefix-shared micro-batch (``PlanConfig(share_prefixes=True)``)
    runs the same way: each token attends to its ancestors on its path (``model_inputs`` passes
    the path table; per-segment sdpa over the gathered path keys on CPU, flash-attn varlen with
    ``cu_seqlens_q != cu_seqlens_k`` on GPU when installed). Idempotent; needs ``transformers`` >= 5.

    Raises:
        PlanError: transformers is missing or has no attention interface.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as exc:  # pragma: no cover - exercised only without transformers 5
        raise PlanError("register_attention needs transformers >= 5 (AttentionInterface, AttentionMaskInterface): "
                        f"pip install -U transformers ({exc}).") from None
    AttentionInterface.register(ATTENTION_NAME, varlen_attention)
    # No T×T mask for this backend: None, or the 2-D padding mask when there is padding.
    AttentionMaskInterface.register(ATTENTION_NAME, flash_attention_mask)
    return ATTENTION_NAME
