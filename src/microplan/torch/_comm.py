"""Collective plumbing for the distributed helpers: group facts, padded gathers, fail-together.

Design note. One rule holds for every collective helper in ``microplan.torch``: *no rank ever
leaves the sequence of collectives alone*. Local work that can fail (building the local Batch,
checking tensors, planning) runs in ``try``; its outcome rides as a status word in the first
collective that follows. If any rank failed, every rank takes the same error path — one
``all_gather_object`` of the short messages, then the same :class:`PlanError`, whose text is
built from gathered data only, so it is identical on every rank. The happy path pays nothing
for this: the status is one element of a header the helper all-gathers anyway.

A rank that raises *outside* any microplan call never reaches the collective; its peers block
until the backend notices (gloo: the peer's sockets close; NCCL: the watchdog timeout). Run such
code inside :func:`collective_guard` or hand it to ``plan_distributed`` as a callable.

Device: NCCL groups communicate CUDA tensors (``torch.cuda.current_device()``), every other
backend CPU tensors. Ranks named in messages are ranks of ``group`` (= plan ranks).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from ..errors import PlanError

__all__ = ["group_info", "comm_device", "all_gather_rows", "all_gather_padded", "fail_together",
           "collective_guard", "describe", "rank_list", "ranks_phrase"]

_MSG_LIMIT = 1500  # characters of each rank's message carried in a fail-together error


def group_info(group: Any = None) -> tuple[int, int]:
    """(rank in ``group``, size of ``group``); PlanError when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise PlanError("torch.distributed is not initialised: call torch.distributed.init_process_group() "
                        "first, or plan in one process with microplan.plan(batch, config).")
    rank = dist.get_rank(group)
    if rank < 0:
        raise PlanError("this process is not a member of the process group passed as group=; call microplan's "
                        "collectives only on the ranks of that group (e.g. each rank with its own DP group).")
    return rank, dist.get_world_size(group)


def comm_device(group: Any = None) -> torch.device:
    """The device collectives on ``group`` use: CUDA for NCCL, CPU for gloo and the rest."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_rows(row: torch.Tensor, group: Any = None) -> torch.Tensor:
    """All-gather one fixed-size 1-D tensor per rank; return them stacked ``[world, k]``."""
    _, world = group_info(group)
    out = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(out, row, group=group)
    return torch.stack(out)


def all_gather_padded(t: torch.Tensor, sizes: Sequence[int], group: Any = None) -> list[torch.Tensor]:
    """All-gather 1-D tensors of per-rank ``sizes`` (known to every rank): pad, gather, trim.

    ``sizes[r]`` is rank r's element count; every rank must pass the same ``sizes``. Gloo and
    NCCL all-gather only equal shapes, hence the padding to ``max(sizes)``. When every size is
    0 no collective runs (all ranks know it, so all skip it together).
    """
    width = max(sizes, default=0)
    if width == 0:
        return [t.new_empty(0) for _ in sizes]
    pad = t.new_zeros(width)
    pad[: t.numel()] = t
    out = [torch.empty_like(pad) for _ in sizes]
    dist.all_gather(out, pad, group=group)
    return [o[:n] for o, n in zip(out, sizes)]


def describe(exc: BaseException) -> str:
    """``Type: message``, trimmed: what a peer needs to know about a local failure."""
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= _MSG_LIMIT else text[: _MSG_LIMIT - 3] + "..."


def rank_list(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` written compactly as ``0-2, 5`` (readable at 1,024 ranks)."""
    ranks = sorted(ranks)
    parts: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return "[" + ", ".join(parts) + "]"


def ranks_phrase(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks [0-2, 5]``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_list(ranks)}"


def fail_together(status: Sequence[int], local_error: BaseException | None, *, what: str,
                  group: Any = None) -> None:
    """If any rank's gathered ``status`` is non-zero, raise the same PlanError on every rank.

    Every rank must call this with the same ``status`` (it comes from an all-gather). On
    failure the ranks all-gather their messages (one extra collective, error path only) and
    raise ``PlanError`` naming each failing rank and its message, grouped by message. The
    failing rank chains its own exception as ``__cause__`` for the local traceback.
    """
    failed = [r for r, s in enumerate(status) if int(s)]
    if not failed:
        return
    _, world = group_info(group)
    msgs: list[Any] = [None] * world
    dist.all_gather_object(msgs, None if local_error is None else describe(local_error), group=group)
    by_msg: dict[str, list[int]] = {}
    for r in failed:
        by_msg.setdefault(str(msgs[r]), []).append(r)
    lines = "; ".join(f"{ranks_phrase(rs)}: {m}" for m, rs in by_msg.items())
    err = PlanError(f"{what} failed on {len(failed)} of {world} ranks — {lines}. Every rank stopped here "
                    "before the next collective; fix the input on the named ranks.")
    raise err from local_error


def agree_status(local_error: BaseException | None, *, what: str, group: Any = None) -> None:
    """One all-gather of a status word; raise the same PlanError everywhere if any rank failed."""
    flag = torch.tensor([0 if local_error is None else 1], dtype=torch.int64, device=comm_device(group))
    fail_together(all_gather_rows(flag, group)[:, 0].tolist(), local_error, what=what, group=group)


@contextmanager
def collective_guard(what: str, *, group: Any = None) -> Iterator[None]:
    """Run local code that may raise so that a failure on one rank fails every rank, no hang.

    ::

        with collective_guard("loading the rollout batch", group=g):
            local = Batch(lengths_from_my_shard())     # may raise on one rank only
        plan = plan_distributed(local, config, group=g)

    Costs one all-gather of one int64. An exception in the body becomes, on every rank of
    ``group``, the same :class:`PlanError` naming the ranks that failed and their messages.
    """
    try:
        yield
    except Exception as exc:
        agree_status(exc, what=what, group=group)
        raise  # unreachable: agree_status raised
    agree_status(None, what=what, group=group)
