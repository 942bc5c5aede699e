"""Pack a prefix-shared micro-batch: every shared token once, with what attention and the loss need.

Design note. A micro-batch planned with ``share_prefixes=True`` carries its trie
(``Micro.tree``, :class:`microplan.prefix.PrefixTree`): segments ``[start, end)`` — runs that
start only where paths branch — each continuing the path of a parent segment (at its end or
inside it). :func:`tree_layout` lays the segments out in one row (parents first) and derives, on
the host:

1. ``input_ids`` from the members' token ids, which must agree wherever their declared prefixes
   meet (else PlanError naming the sample and its prefix parent); ``position_ids`` = each
   token's position in its own samples (RoPE sees the true positions);
2. ``prev_index``: the row of each token's predecessor on its path (-1 at position 0). The
   first token of a branch is predicted by the last token of its parent segment, not by the
   previous row entry; :func:`microplan.torch.token_logprobs` gathers through it;
3. the attention table: segment j's queries are its own rows, its keys the rows of its whole
   path (``key_index``, concatenated segment by segment, ``cu_seqlens_k``), causal with
   bottom-right alignment — flash-attn varlen's ``cu_seqlens_q != cu_seqlens_k`` convention;
   :func:`microplan.torch.register_attention` runs it (per-segment sdpa on CPU);
4. ``sample_rows``: the rows of each member's whole sequence, so a node-level tensor ``[U]``
   expands to the per-sample layout ``[Σ L]`` (:meth:`PackedMicro.expand`) where per-sample
   values (advantages, old log-probs) live; loss weights are kept both ways: ``loss_weights``
   ``[U]`` (a node's weight = Σ of the scales of the samples whose loss covers it: exact when the
   per-token loss depends only on the token's log-prob) and ``sample_weights`` ``[Σ L]`` (exact
   for every per-sample loss, e.g. PPO with per-sample advantages).

Guarantees: Σ over the per-sample layout of ``sample_weights · ℓ`` equals the unshared
micro-batch's ``Σ loss_weights · ℓ`` term by term; ``loss_weights`` is its exact node-level
reduction; validation re-derives every table. Cost: O(U + Σ L) host work per micro-batch.
Trade-off: ``key_index`` lists each path per segment (Σ path lengths entries); segments are
long in the trees microplan builds (a prompt, a turn), so this stays a small multiple of U. On
CPU the attention reads shared keys in place from it (``tree_attention.py``); the GPU and CP
paths gather each path's K/V.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ..errors import PlanError
from ..prefix import PrefixTree
from ..types import Micro

__all__ = ["TreeLayout", "tree_layout", "check_tree"]


@dataclass(frozen=True, eq=False)
class TreeLayout:
    """What a tree-packed row needs beyond a flat one (tensors on the host until ``to``).

    Attributes:
        prev_index: ``[U]`` int64 row of each token's predecessor on its path (-1 at position 0).
        key_index: ``[Σ path]`` int64 rows of each segment's keys (its path), segment by segment.
        cu_seqlens_k: ``[segments+1]`` int32 boundaries of ``key_index`` per segment.
        max_seqlen_k: the longest path (host int).
        sample_rows: per member (in ``sample_indices`` order), ``[L_i]`` int64 rows of its tokens.
        sample_weights: ``[Σ L]`` float weights in the per-sample layout (label aligned).
    """

    prev_index: torch.Tensor
    key_index: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_k: int
    sample_rows: tuple[torch.Tensor, ...]
    sample_weights: torch.Tensor
    flat_rows: torch.Tensor   # ``[Σ L]`` the rows of every member's tokens, member after member
    in_row_order: bool        # host flag: flat_rows is 0..U-1 (the per-sample layout is the row itself)

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> TreeLayout:
        mv = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, prev_index=mv(self.prev_index), key_index=mv(self.key_index),
                       cu_seqlens_k=mv(self.cu_seqlens_k), sample_rows=tuple(mv(r) for r in self.sample_rows),
                       sample_weights=mv(self.sample_weights), flat_rows=mv(self.flat_rows))


def tree_layout(micro: Micro, masks: list[torch.Tensor], tokens: list[torch.Tensor],
                weight_dtype: torch.dtype, *, mult: int = 1, row: int = 1, pad_token_id: int = 0) -> dict[str, Any]:
    """The fields of a tree-packed :class:`~microplan.torch.PackedMicro` (see the module note).

    ``tokens``/``masks``: each member's token ids and loss mask, in ``micro.indices`` order.
    ``mult`` / ``row``: the plan's ``pad_to_multiple_of`` / ``pad_row_to_multiple_of``: each
    segment is padded at its end to a multiple of ``mult`` (pads continue its positions, attend
    to its path and themselves, carry no loss, and are never a key of another segment), and the
    row gets one trailing pad segment up to a multiple of ``row``.
    """
    tree: PrefixTree = micro.tree  # type: ignore[assignment]
    real_len = (tree.end - tree.start).astype(np.int64)
    seg_len = -(-real_len // mult) * mult
    body = int(seg_len.sum())
    row_pad = -(-body // row) * row - body
    if row_pad:
        seg_len = np.concatenate([seg_len, [row_pad]])
    offsets = np.concatenate([[0], np.cumsum(seg_len)])
    U = int(offsets[-1])
    pos_of_member = {int(g): k for k, g in enumerate(tree.members.tolist())}
    ids = torch.full((U,), -1, dtype=torch.int64)
    weights = torch.zeros(U, dtype=torch.float64)
    mask = torch.zeros(U, dtype=torch.bool)
    rows, flat_w = [], []
    for i, toks, m, scale in zip(micro.indices.tolist(), tokens, masks, micro.loss_scale.tolist()):
        k = int(tree.anchor[pos_of_member[i]])
        r = torch.from_numpy(tree.path_rows(offsets, k, toks.numel() - 1))
        if r.numel() != toks.numel():  # pragma: no cover - the plan's tree and the sample disagree
            raise PlanError(f"sample {i}: the micro-batch's prefix tree holds {r.numel()} of its {toks.numel()} tokens.")
        seen = ids[r]
        clash = (seen >= 0) & (seen != toks)
        if bool(clash.any()):
            t = int(torch.nonzero(clash)[0])
            raise PlanError(f"sample {i}: token {t} is {int(toks[t])}, but another sample of this micro-batch shares "
                            f"that position through the declared prefixes and has {int(seen[t])} there; the token ids "
                            "disagree with Batch(prefix_parent=..., shared_prefix_lens=...): rebuild them with "
                            "microplan.find_shared_prefixes(token_ids), or fix the sample's shared length.")
        ids[r] = toks
        w = m.to(torch.float64) * scale
        weights.index_add_(0, r, w)
        mask[r] |= m
        rows.append(r)
        flat_w.append(w)
    ids[ids < 0] = int(pad_token_id)  # segment and row padding
    prev = np.full(U, -1, dtype=np.int64)
    keys, cu_k = [], [0]
    n_seg = real_len.size
    for k in range(seg_len.size):
        a, b = int(offsets[k]), int(offsets[k + 1])
        prev[a + 1:b] = np.arange(a, b - 1)
        if k == n_seg:  # the row's trailing pad segment: a sequence of its own
            path = np.arange(a, b, dtype=np.int64)
        else:
            s = int(tree.start[k])
            if s > 0:  # the branch's first token follows the last shared token of its parent path
                q = int(tree.parent[k])
                prev[a] = int(offsets[q]) + (s - 1 - int(tree.start[q]))
            path = tree.path_rows(offsets, k, int(tree.end[k]) - 1)
            if seg_len[k] > real_len[k]:  # this segment's own pads (after its real tokens)
                path = np.concatenate([path, np.arange(a + int(real_len[k]), b, dtype=np.int64)])
        keys.append(path)
        cu_k.append(cu_k[-1] + path.size)
    starts = np.concatenate([tree.start, [0]]) if row_pad else tree.start
    position = np.concatenate([np.arange(s, s + n) for s, n in zip(starts.tolist(), seg_len.tolist())])
    flat = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    layout = TreeLayout(
        prev_index=torch.from_numpy(prev), key_index=torch.from_numpy(np.concatenate(keys)),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32), max_seqlen_k=int(max(np.diff(cu_k))),
        sample_rows=tuple(rows), sample_weights=torch.cat(flat_w).to(weight_dtype), flat_rows=flat,
        in_row_order=bool(flat.numel() == U and torch.equal(flat, torch.arange(U))))
    return dict(input_ids=ids, position_ids=torch.from_numpy(position.astype(np.int64)),
                cu_seqlens=torch.from_numpy(offsets.astype(np.int32)), max_seqlen=int(seg_len.max()),
                loss_weights=weights.to(weight_dtype), loss_mask=mask,
                sample_indices=torch.from_numpy(micro.indices.astype(np.int64)),
                seq_lens=tuple(int(x) for x in seg_len), sample_lens=tuple(t.numel() for t in tokens),
                row_pad=row_pad, pad_to_multiple_of=mult, pad_row_to_multiple_of=row, tree=layout)


def check_tree(packed: Any) -> None:
    """Re-derive what a tree-packed row promises; PlanError naming the first violation."""
    t: TreeLayout = packed.tree
    U = packed.num_tokens
    prev = t.prev_index.cpu()
    pos = packed.position_ids.cpu()
    if tuple(prev.shape) != (U,) or bool(((prev < -1) | (prev >= U)).any()):
        raise PlanError(f"prev_index must hold U={U} rows in -1..U-1.")
    has = prev >= 0
    shard = getattr(packed, "cp", None) is not None  # a CP shard: a predecessor may live on a peer (cp_shard.py)
    if bool((has & (pos == 0)).any()) if shard else not torch.equal(has, pos > 0):
        raise PlanError("prev_index must be -1 exactly at position 0 (a token with no predecessor).")
    if bool((pos[prev[has]] != pos[has] - 1).any()):
        raise PlanError("each token's predecessor must sit one position before it on its path.")
    w, m = packed.loss_weights.cpu(), packed.loss_mask.cpu()
    if not bool(torch.isfinite(w).all()) or bool((w[~m] != 0).any()) or (not shard and bool(m[~has].any())):
        raise PlanError("loss_weights must be finite, 0 outside loss_mask, and no token at position 0 may carry loss.")
    cu = t.cu_seqlens_k.cpu().to(torch.int64)
    if cu.numel() != len(packed.seq_lens) + 1 or int(cu[-1]) != t.key_index.numel():
        raise PlanError("cu_seqlens_k must have one boundary per segment and end at the gathered key count.")
    total = sum(r.numel() for r in t.sample_rows)
    if t.sample_weights.numel() != total or len(t.sample_rows) != packed.sample_indices.numel():
        raise PlanError("sample_rows/sample_weights must cover every member's tokens.")
    flat = torch.cat([r.cpu() for r in t.sample_rows]) if t.sample_rows else torch.zeros(0, dtype=torch.int64)
    if not torch.equal(t.flat_rows.cpu(), flat) or t.in_row_order != bool(flat.numel() == U and
                                                                           torch.equal(flat, torch.arange(U))):
        raise PlanError("flat_rows must be the members' rows in order, and in_row_order must say whether it is 0..U-1.")
    rows = t.flat_rows.cpu()
    summed = torch.zeros(U, dtype=torch.float64).index_add_(0, rows, t.sample_weights.cpu().to(torch.float64))
    # both sides are rounded to the weight dtype: a sum of k rounded terms is within k+1 of its ulps
    terms = torch.zeros(U, dtype=torch.float64).index_add_(0, rows, torch.ones(rows.numel(), dtype=torch.float64))
    eps = 1e-12 if w.dtype == torch.float64 else float(torch.finfo(w.dtype).eps)
    if bool(((summed - w.to(torch.float64)).abs() > (terms + 1) * eps * summed.abs()).any()):
        raise PlanError("loss_weights must be the per-sample weights summed onto the shared tokens.")
