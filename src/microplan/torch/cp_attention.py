"""All-gather-KV context parallel: ``with microplan.torch.context_parallel(group):``.

Design note. Each member of a CP group runs the model on its shard of a packed row
(:meth:`PackedMicro.cp_shard`); under ``context_parallel(group)`` the attention of
:func:`microplan.torch.register_attention` does, in every layer:

1. project its rows (its owned rows: ``cp_shard`` computes no other) to Q, K, V as usual;
2. all-gather the K and V of its owned rows over ``group`` — one collective per layer, K and
   V flattened side by side and padded to the largest member's count, so the buffer has
   ``c × width`` slots (member m's i-th owned row at slot m·width + i);
3. attend each local piece to its keys: the slots of its path up to itself
   (``microplan_key_index``), causally aligned bottom-right — sdpa per piece on CPU,
   flash-attn's varlen kernel with ``cu_seqlens_q != cu_seqlens_k`` on CUDA where installed —
   exactly the tree-row attention of ``attention.py`` over gathered keys.

The gather is autograd-aware: its backward reduce-scatters the buffer's gradient (every member's
contributions to each slot summed, each member keeping its own block: ``reduce_scatter_single``,
which gloo and NCCL implement; a backend without it all-reduces and slices), so ∂loss/∂K,V of a
member's rows includes every peer's queries. Because any key set works, this handles what ring
attention cannot: a prefix tree's paths, the Llama 3 reason for all-gather CP.

Guarantees: the shard's outputs equal the unsharded row's on its rows, and the members'
gradients add up to the unsharded row's (float64 gloo test: within 1e-12 relative for J and
∇J, every loss mode, c = 2 and 4, flat and tree rows, tests/test_cp_attention.py).
Trade-off: all-gather CP holds the whole row's K/V per layer (2·U·H_kv·d values, plus a tree's
path index) where ring attention holds two chunks, in exchange for any mask; with GQA the K/V
are a small fraction of the activations (benchmarks/bench_tree_cp.py times a tree row against
its unshared tokens).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PlanError
from .cp_shard import CPLayout

__all__ = ["context_parallel", "current_group", "gather_keys_values"]

_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("microplan_cp_group", default=None)


@contextmanager
def context_parallel(group: Any) -> Iterator[Any]:
    """Run a CP shard's model call with its attention gathering keys and values over ``group``.

    ``group`` is the micro-batch's CP process group (``torch.distributed`` group; the member at
    ``cp_rank`` of the shard must be rank ``cp_rank`` of ``group``). Rows that are not shards
    (``cp_size`` 1) run as usual inside it. The backward needs no context: the gather's backward
    keeps its group. Nests; restores the outer group on exit.
    """
    if group is None or not (dist.is_available() and dist.is_initialized()):
        raise PlanError("context_parallel(group) needs an initialised torch.distributed process group: the "
                        "micro-batch's CP group (dist.new_group(ranks of micro.cp_group)); got "
                        f"{'None' if group is None else 'a group before init_process_group'}.")
    token = _GROUP.set(group)
    try:
        yield group
    finally:
        _GROUP.reset(token)


def current_group() -> Any:
    """The group of the innermost ``context_parallel`` (None outside one)."""
    return _GROUP.get()


def _gather_single(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


class _AllGatherRows(torch.autograd.Function):
    """``[w, F]`` per member → ``[c·w, F]`` member-major; backward: sum over members, keep own block."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int, rank: int) -> torch.Tensor:
        ctx.group, ctx.size, ctx.rank = group, size, rank
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))
        _gather_single(out, x.contiguous(), group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        g = grad.contiguous()
        w = g.shape[0] // ctx.size
        rs = getattr(dist, "reduce_scatter_single", None)
        if rs is not None:
            out = g.new_empty((w, *g.shape[1:]))
            rs(out, g, group=ctx.group)
            return out, None, None, None
        g = g.clone()  # pragma: no cover - torch without reduce_scatter_single
        dist.all_reduce(g, group=ctx.group)
        return g[ctx.rank * w:(ctx.rank + 1) * w], None, None, None


def gather_keys_values(key: torch.Tensor, value: torch.Tensor, cp: CPLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """The CP group's keys and values of a shard: ``[1, H, T_local, D]`` → ``[1, H, c·width, D]`` slots."""
    group = _GROUP.get()
    if group is None:
        raise PlanError("this micro-batch is a CP shard (PackedMicro.cp_shard), whose attention gathers keys and "
                        "values over its CP group: call the model inside `with microplan.torch."
                        "context_parallel(group):`, group = the micro-batch's CP process group.")
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != cp.cp_size or rank != cp.cp_rank:
        raise PlanError(f"context_parallel group has {size} ranks and this process is its rank {rank}, but the shard "
                        f"is member {cp.cp_rank} of a CP group of {cp.cp_size}: pass the micro-batch's CP group "
                        "(ranks ordered by cp_rank) and shard with cp_shard(this process's rank in it).")
    if key.shape[0] != 1:
        raise PlanError(f"a CP shard is ONE packed row, but the batch has {key.shape[0]} rows.")
    H, T, dk, dv = key.shape[1], key.shape[2], key.shape[3], value.shape[3]
    flat = torch.cat([key[0].transpose(0, 1).reshape(T, H * dk), value[0].transpose(0, 1).reshape(T, H * dv)], 1)
    own = flat.index_select(0, cp.own_index.to(flat.device))
    if own.shape[0] < cp.width:  # pad to the widest member: gloo and NCCL gather equal shapes
        own = torch.cat([own, own.new_zeros(cp.width - own.shape[0], own.shape[1])])
    buf = _AllGatherRows.apply(own, group, size, rank)          # [c·width, H·(dk+dv)]
    n = buf.shape[0]
    k = buf[:, :H * dk].reshape(n, H, dk).transpose(0, 1)[None]
    v = buf[:, H * dk:].reshape(n, H, dv).transpose(0, 1)[None]
    return k, v
