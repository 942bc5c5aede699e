"""A tree row's attention without gathering paths: shared keys attended once, merged by log-sum-exp.

Design note. In a prefix-tree row (``torch/tree.py``) segment j's queries attend to its path:
the rows of its ancestors (up to where it branches) and its own rows, causally. Gathering each
path's keys per segment copies a shared prompt's K/V once per response and pads sibling groups
into one masked call (``segment_groups.py``). Here each segment's attention is split in two:

1. **ancestor part** — every query of a segment sees every ancestor key, so segments with the
   same ancestor rows (a GRPO group's responses, a pair of agentic rollouts after their shared
   tool call) run as ONE non-causal call: their queries concatenated over those keys, read in
   place when contiguous (no copy, no mask, no padding);
2. **own part** — one causal call per segment over its own contiguous rows (square:
   ``is_causal`` skips the masked half);
3. **merge** — softmax over the union of two disjoint key sets is the two partial outputs
   weighted by ``exp(lse_part − lse)``, ``lse = logaddexp(lse_ancestor, lse_own)`` per query and
   head. The calls are torch's CPU flash kernels, which return the log-sum-exp.

Backward (a custom autograd function): for attention over a key set split in parts, the
gradient of part p is the flash backward of that part called with ``dO · w_p`` and the MERGED
output (its ``rowsum(dO ∘ O)`` term is the merged softmax's), where ``w_p = exp(lse_p − lse)`` —
so each part's backward is one kernel call, and nothing is recomputed.

Guarantees: exact — the same softmax over the same keys as the gathered per-segment call, up to
floating-point summation order (float64 ≤ 1e-12 relative, outputs and gradients,
``tests/test_tree_attention.py``); rows in no segment give 0. Scope: CPU-style kernels, no
dropout, keys in the row itself (not a context-parallel shard); ``split_plan`` returns None when
a table does not have this shape (a segment's last keys are not its own rows), and the caller
keeps the gathered path. Host cost: one pass over the key table per forward (cached across the
layers that share the table tensor: ``attention._SPLIT``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["HAS_SPLIT", "SplitPlan", "split_plan", "split_attention"]

#: torch's CPU flash kernels (internal ops returning the log-sum-exp); without them tree rows keep
#: the gathered path (``segment_groups.py``)
HAS_SPLIT = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu") and \
    hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")
_FWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


@dataclass(frozen=True)
class _Group:
    """Segments sharing one ancestor key set: their query rows (``qa:qb`` slice when contiguous,
    else ``q_index``), the ancestor rows (``ka:kb`` or ``k_index``), and each member's own range."""

    q_range: tuple[int, int] | None
    q_index: torch.Tensor | None
    k_range: tuple[int, int] | None
    k_index: torch.Tensor | None
    members: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class SplitPlan:
    """The calls of one tree table: ``roots`` (segments without ancestors: one causal call each),
    ``groups`` (:class:`_Group`: one non-causal call over shared ancestor rows, then one causal
    call per member), ``num_tokens`` rows, and ``covers_all`` (every row is some segment's query:
    the output needs no zero fill)."""

    roots: tuple[tuple[int, int], ...]
    groups: tuple[_Group, ...]
    num_tokens: int
    covers_all: bool


def _rows(runs: list[tuple[int, int]]) -> tuple[tuple[int, int] | None, np.ndarray]:
    """A list of row ranges as one range when they are contiguous, and as the row array."""
    idx = np.concatenate([np.arange(a, b) for a, b in runs]) if runs else np.zeros(0, dtype=np.int64)
    if idx.size and np.array_equal(idx, np.arange(idx[0], idx[0] + idx.size)):
        return (int(idx[0]), int(idx[0] + idx.size)), idx
    return None, idx


def split_plan(q_starts: tuple[int, ...], q_ends: tuple[int, ...], k_starts: tuple[int, ...],
               k_ends: tuple[int, ...], key_index: np.ndarray, num_tokens: int) -> SplitPlan | None:
    """The split calls of a tree table (module note), or None when a segment's last ``Lq`` keys
    are not its own query rows in order (then only the gathered path is exact).

    ``key_index`` maps the gathered key positions ``k_starts[j]:k_ends[j]`` to rows. O(Σ path).
    """
    if key_index.size and (int(key_index.min()) < 0 or int(key_index.max()) >= num_tokens):
        return None
    if q_ends and max(q_ends) > num_tokens:
        return None
    roots: list[tuple[int, int]] = []
    by_anc: dict[bytes, list[Any]] = {}
    for qa, qb, ka, kb in zip(q_starts, q_ends, k_starts, k_ends):
        lq = qb - qa
        if kb - ka < lq or kb > key_index.size:
            return None
        own = key_index[kb - lq:kb]
        if own[0] != qa or own[-1] != qb - 1 or not np.array_equal(own, np.arange(qa, qb)):
            return None
        if kb - lq == ka:
            roots.append((qa, qb))
            continue
        anc = key_index[ka:kb - lq]
        entry = by_anc.setdefault(anc.tobytes(), [anc, []])
        entry[1].append((qa, qb))
    groups = []
    covered = np.zeros(num_tokens, dtype=bool)
    for a, b in roots:
        covered[a:b] = True
    for anc, members in by_anc.values():
        q_range, q_idx = _rows(members)
        covered[q_idx] = True
        k_range = (int(anc[0]), int(anc[-1]) + 1) if int(anc[-1]) - int(anc[0]) + 1 == anc.size and \
            np.array_equal(anc, np.arange(anc[0], anc[-1] + 1)) else None
        groups.append(_Group(q_range, None if q_range else torch.from_numpy(q_idx), k_range,
                             None if k_range else torch.from_numpy(np.ascontiguousarray(anc, dtype=np.int64)),
                             tuple(members)))
    return SplitPlan(tuple(roots), tuple(groups), num_tokens, bool(covered.all()))


def _take(x: torch.Tensor, rng: tuple[int, int] | None, idx: torch.Tensor | None) -> torch.Tensor:
    """Rows of ``x [N, H, D]`` as ``[1, H, n, D]`` (a view for a contiguous range)."""
    part = x[rng[0]:rng[1]] if rng is not None else x.index_select(0, idx.to(x.device))  # type: ignore[union-attr]
    return part.transpose(0, 1)[None]


def _flat(o: torch.Tensor) -> torch.Tensor:
    """``[1, H, n, D]`` → ``[n, H, D]``."""
    return o[0].transpose(0, 1)


class _SplitAttention(torch.autograd.Function):
    """Forward and backward of :func:`split_attention` (module note)."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: SplitPlan,
                scale: float | None) -> torch.Tensor:
        shape = (plan.num_tokens, query.shape[1], value.shape[-1])
        out = query.new_empty(shape) if plan.covers_all else query.new_zeros(shape)
        lses: list[Any] = []
        for a, b in plan.roots:
            o, lse = _FWD(_take(query, (a, b), None), _take(key, (a, b), None), _take(value, (a, b), None),
                          0.0, True, scale=scale)
            out[a:b] = _flat(o)
            lses.append(lse)
        for g in plan.groups:
            oa, lse_a = _FWD(_take(query, g.q_range, g.q_index), _take(key, g.k_range, g.k_index),
                             _take(value, g.k_range, g.k_index), 0.0, False, scale=scale)
            at, was, own = 0, [], []
            for a, b in g.members:  # merge each member's own causal part into its rows of ``out``
                os_, lse_s = _FWD(_take(query, (a, b), None), _take(key, (a, b), None), _take(value, (a, b), None),
                                  0.0, True, scale=scale)
                la = lse_a[:, :, at:at + b - a]
                lse = torch.logaddexp(la, lse_s)
                wa, ws = torch.exp(la - lse), torch.exp(lse_s - lse)
                dst = _take(out, (a, b), None)
                torch.mul(oa[:, :, at:at + b - a], wa[..., None].to(oa.dtype), out=dst)
                dst.addcmul_(os_, ws[..., None].to(oa.dtype))
                was.append(wa)
                own.append((lse_s, ws))
                at += b - a
            lses.append((lse_a, torch.cat(was, dim=2) if len(was) > 1 else was[0], own))
        ctx.save_for_backward(query, key, value, out)
        ctx.plan, ctx.scale, ctx.lses = plan, scale, lses
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, out = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        grad = grad.contiguous()

        def part(q_rng, q_idx, k_rng, k_idx, lse, w, causal):
            """One call's backward: grads of its queries and keys, accumulated in place."""
            g = _take(grad, q_rng, q_idx)
            if w is not None:
                g = g * w[..., None].to(g.dtype)
            gq, gk, gv = _BWD(g, _take(query, q_rng, q_idx), _take(key, k_rng, k_idx), _take(value, k_rng, k_idx),
                              _take(out, q_rng, q_idx), lse, 0.0, causal, scale=scale)
            for acc, d, rng, idx in ((dq, gq, q_rng, q_idx), (dk, gk, k_rng, k_idx), (dv, gv, k_rng, k_idx)):
                if rng is not None:
                    acc[rng[0]:rng[1]] += _flat(d)
                else:
                    acc.index_add_(0, idx.to(acc.device), _flat(d))

        lses = iter(ctx.lses)
        for a, b in plan.roots:
            part((a, b), None, (a, b), None, next(lses), None, True)
        for g in plan.groups:
            lse_a, wa, own = next(lses)
            part(g.q_range, g.q_index, g.k_range, g.k_index, lse_a, wa, False)
            for (a, b), (lse_s, ws) in zip(g.members, own):
                part((a, b), None, (a, b), None, lse_s, ws, True)
        return dq, dk, dv, None, None


def split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: SplitPlan, *,
                    scale: float | None = None) -> torch.Tensor:
    """Tree-row attention by :class:`SplitPlan`: ``query [N, Hq, D]``, ``key/value [N, Hkv, D]``
    (the row's own keys, not gathered) → ``[N, Hq, Dv]`` (0 for rows in no segment)."""
    return _SplitAttention.apply(query, key, value, plan, scale)
