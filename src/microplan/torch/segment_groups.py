"""Tree rows' gathered-path attention in few calls: segments of like shape batched into one padded sdpa call.

Design note. The path a tree row takes where the split attention (``tree_attention.py``) does
not apply: a context-parallel shard, dropout, a device without the CPU flash kernels. A
prefix-tree row (``torch/tree.py``) gives each trie segment its own queries and
its path as keys, so attention is one ``scaled_dot_product_attention`` call per segment and
layer — many small calls for a GRPO group's responses or an agent's branches, whose per-call
overhead the linear layers do not pay. Segments of one depth of a tree have nearly the same
shape (a group's responses over the same prompt), so branch segments (fewer queries than path
keys) are grouped: sorted by (keys, queries), a group grows while its padded work
G·max(Lq)·max(Lk) stays within ``SLACK`` × its real work Σ Lq·Lk, and each group of two or
more runs as ONE batched call ``[G, H, max Lq, D]`` over ``[G, H, max Lk, D]`` with a boolean
mask: causal with bottom-right alignment inside each segment, no key beyond a segment's own,
and a padded query row seeing every key (its output is never read: an all-masked row would be
NaN). A lone segment keeps the plain call, and so does every square segment (a root:
``is_causal`` skips the masked half, which a mask cannot). The gather indices and masks of a
table are built once and cached (every layer of a forward passes the same table).

Guarantees: exact — a masked key gets probability exactly 0, so every real query's output is
the per-segment call's up to floating-point summation order (float64 ≤ 1e-12 relative,
``tests/test_attention.py``); gradients flow through the gathers (index_select / index_copy).
Trade-off: at most ``SLACK`` − 1 extra score work per group, for one call instead of G.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["SLACK", "segment_groups", "grouped_attention", "one_segment"]

#: largest padded / real score work of one batched group
SLACK = 1.25


def segment_groups(lq: tuple[int, ...], lk: tuple[int, ...], slack: float = SLACK) -> list[list[int]]:
    """Segment indices grouped for one call each (module note): a square causal segment (a root:
    its queries are its keys) alone, its causal kernel skipping the masked half; the others sorted
    by (keys, queries), a group growing while G·max(Lq)·max(Lk) <= ``slack`` · Σ Lq·Lk."""
    out: list[list[int]] = [[j] for j in range(len(lq)) if lq[j] == lk[j]]
    order = sorted((j for j in range(len(lq)) if lq[j] != lk[j]), key=lambda j: (lk[j], lq[j], j))
    cur: list[int] = []
    mq = mk = real = 0
    for j in order:
        nq, nk, nreal = max(mq, lq[j]), max(mk, lk[j]), real + lq[j] * lk[j]
        if cur and (len(cur) + 1) * nq * nk > slack * nreal:
            out.append(cur)
            cur, nq, nk, nreal = [], lq[j], lk[j], lq[j] * lk[j]
        cur.append(j)
        mq, mk, real = nq, nk, nreal
    if cur:
        out.append(cur)
    return out


@lru_cache(maxsize=8)
def _plan(q_starts: tuple[int, ...], q_ends: tuple[int, ...], k_starts: tuple[int, ...], k_ends: tuple[int, ...],
          causal: bool, device: Any) -> list[tuple[Any, ...]]:
    """Per group: ("one", segment) or ("batch", query rows [G, mq], key rows [G, mk], mask
    [G, 1, mq, mk], rows kept [Σ Lq] flat positions into [G·mq], their query rows)."""
    lq = tuple(b - a for a, b in zip(q_starts, q_ends))
    lk = tuple(b - a for a, b in zip(k_starts, k_ends))
    out: list[tuple[Any, ...]] = []
    for g in segment_groups(lq, lk):
        if len(g) == 1:
            out.append(("one", g[0]))
            continue
        mq, mk = max(lq[j] for j in g), max(lk[j] for j in g)
        Lq = torch.tensor([lq[j] for j in g], device=device)[:, None]
        Lk = torch.tensor([lk[j] for j in g], device=device)[:, None]
        tq, tk = torch.arange(mq, device=device)[None, :], torch.arange(mk, device=device)[None, :]
        qa = torch.tensor([q_starts[j] for j in g], device=device)[:, None]
        ka = torch.tensor([k_starts[j] for j in g], device=device)[:, None]
        qrows = qa + torch.minimum(tq, Lq - 1)                    # padded rows repeat the last query
        krows = ka + torch.minimum(tk, Lk - 1)
        mask = (tk[:, None, :] < Lk[:, :, None]).expand(len(g), mq, mk)
        if causal:
            mask = mask & (tk[:, None, :] <= tq[:, :, None] + (Lk - Lq)[:, :, None])
        mask = mask | ~mask.any(-1, keepdim=True)                 # a padded query row: every key
        keep = (tq < Lq).reshape(-1)
        out.append(("batch", qrows.reshape(-1), krows.reshape(-1), mask[:, None], torch.nonzero(keep)[:, 0],
                    qrows.reshape(-1)[keep], len(g), mq, mk))
    return out


def one_segment(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, qa: int, qb: int, ka: int, kb: int,
                causal: bool, scale: float | None, dropout_p: float, gqa: bool) -> torch.Tensor:
    """One segment's attention: queries ``qa:qb`` over keys ``ka:kb`` (causal bottom-right aligned)."""
    q = query[qa:qb].transpose(0, 1)[None]
    k = key[ka:kb].transpose(0, 1)[None]
    v = value[ka:kb].transpose(0, 1)[None]
    lq, lk = qb - qa, kb - ka
    mask = None
    if causal and lq != lk:  # bottom-right alignment: query j sees keys 0 .. j + lk - lq
        mask = torch.ones(lq, lk, dtype=torch.bool, device=query.device).tril(diagonal=lk - lq)
        causal = False
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal, scale=scale,
                                       enable_gqa=gqa)
    return o[0].transpose(0, 1)


def grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: Any, *,
                      scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """``segment_attention`` of a table (``attention.Segments``) with like segments batched:
    ``query [N, Hq, D]``, ``key/value [M, Hkv, D]`` → ``[N, Hq, Dv]`` (0 for rows in no segment)."""
    s = segments
    gqa = query.shape[1] != key.shape[1]
    H, Hk, Dv = query.shape[1], key.shape[1], value.shape[-1]
    rows, outs = [], []
    for part in _plan(s.q_starts, s.q_ends, s.k_starts, s.k_ends, s.causal, query.device):
        if part[0] == "one":
            j = part[1]
            qa, qb = s.q_starts[j], s.q_ends[j]
            outs.append(one_segment(query, key, value, qa, qb, s.k_starts[j], s.k_ends[j], s.causal, scale, dropout_p,
                                    gqa))
            rows.append(torch.arange(qa, qb, device=query.device))
            continue
        _, qrows, krows, mask, keep, kept_rows, G, mq, mk = part
        q = query.index_select(0, qrows).reshape(G, mq, H, -1).transpose(1, 2)
        k = key.index_select(0, krows).reshape(G, mk, Hk, -1).transpose(1, 2)
        v = value.index_select(0, krows).reshape(G, mk, Hk, Dv).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(1, 2).reshape(G * mq, H, Dv).index_select(0, keep))
        rows.append(kept_rows)
    out = query.new_zeros(query.shape[0], H, Dv)
    return out.index_copy(0, torch.cat(rows), torch.cat(outs))
