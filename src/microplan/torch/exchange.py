"""Move sample tensors to the ranks the plan assigns them, and outputs back to their home ranks.

Design note. For SPMD trainers whose data starts spread over ranks (each rank loaded or
generated its own shard: the *home* rank of a sample is the rank whose local batch held it).
The plan says which rank runs each sample; :func:`exchange_samples` delivers the tensors there
— to *every* member of the CP group under dynamic CP — and :func:`exchange_outputs` returns
per-sample results (log-probs, values, entropies) to the home ranks, in local order.

Three collectives per call, sizes first:

1. one all-gather of a fixed header ``[status, dtype, count, routing digest]`` — a bad tensor
   on one rank, or ranks holding different plans (their split sizes would disagree and the
   all-to-all could hang), fails every rank here with the same PlanError, before any data moves;
2. one all-gather of the numel of every tensor (int64, padded to the largest rank);
3. one ``all_to_all_single`` of raw bytes with per-peer split sizes. Gloo implements uneven
   ``all_to_all_single`` (checked on torch 2.13; NCCL and MPI do too), so no isend/irecv
   emulation is needed. Tensors travel as a ``uint8`` view: any dtype (bool, bfloat16, ...)
   arrives bitwise unchanged, and one buffer serves all peers.

Routing is a pure function of (plan, view), computed identically on every rank: rank s sends
rank d the samples of s's local range that d runs, in ascending global index; the output of a
sample comes from the rank running it at CP rank 0. Tensors must be 1-D (reshape scalars to
``[1]``); their lengths are free (tokens, response tokens, one value per sample).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import PlanError
from ..plan import Plan
from ._comm import all_gather_padded, all_gather_rows, comm_device, fail_together, group_info, ranks_phrase
from .gather import LocalView

__all__ = ["Routes", "routes", "exchange_samples", "exchange_outputs"]

_DTYPES = [getattr(torch, n) for n in (
    "bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
    "complex64", "complex128", "uint16", "uint32", "uint64") if hasattr(torch, n)]


@dataclass(frozen=True, eq=False)
class Routes:
    """Who runs which sample, from (plan, view); identical on every rank.

    Attributes:
        needs: ``needs[r]``: sorted global indices of every sample rank r runs (all steps; all
            members of a CP group run its samples).
        owner: ``owner[i]``: the rank that returns sample i's output (CP rank 0 of its micro),
            -1 for samples the plan dropped.
        offsets: ``offsets[r]:offsets[r+1]`` are rank r's home samples.
    """

    needs: tuple[np.ndarray, ...]
    owner: np.ndarray
    offsets: np.ndarray

    def send(self, src: int, dst: int) -> np.ndarray:
        """Global indices ``src`` sends ``dst`` in :func:`exchange_samples`, ascending."""
        need = self.needs[dst]
        lo, hi = np.searchsorted(need, self.offsets[src : src + 2])
        return need[lo:hi]

    def owned(self, r: int) -> np.ndarray:
        """Samples whose output rank r returns in :func:`exchange_outputs`, ascending."""
        return np.flatnonzero(self.owner == r)


def routes(plan: Plan, view: LocalView) -> Routes:
    """Derive the :class:`Routes` of ``plan`` for the ranks of ``view`` (no communication)."""
    if not isinstance(plan, Plan):
        raise PlanError(f"expected a microplan.Plan, got {type(plan).__name__}.")
    D, N = plan.config.dp_size, view.batch.num_samples
    if D != view.world_size:
        raise PlanError(f"the plan has dp_size={D} but the group has {view.world_size} ranks; plan ranks are group "
                        "ranks: pass the data-parallel group (dynamic CP: the whole DP×CP plane).")
    if plan.batch.num_samples != N:
        raise PlanError(f"the plan covers {plan.batch.num_samples} samples but the gathered batch has {N}; plan "
                        "the batch that local_view/gather_batch returned.")
    owner = np.full(N, -1, dtype=np.int64)
    needs = []
    for r in range(D):
        idx = [m.indices for step in plan.rank(r) for m in step]
        for m in (m for step in plan.rank(r) for m in step if m.cp_rank == 0):
            owner[m.indices] = r
        needs.append(np.unique(np.concatenate(idx)) if idx else np.zeros(0, np.int64))
    return Routes(tuple(needs), owner, view.offsets)


def exchange_samples(plan: Plan, view: LocalView, local_tensors: Sequence[torch.Tensor], *, group: Any = None,
                     device: torch.device | str | None = None) -> dict[int, torch.Tensor]:
    """Deliver every sample's tensor to the ranks that run it; return ``{global index: tensor}``.

    ``local_tensors[j]`` is the 1-D tensor of this rank's j-th local sample (global index
    ``view.offset + j``), one dtype for all. The result holds exactly the samples of
    ``plan.rank(rank)`` — under dynamic CP, of every CP group this rank belongs to — ready for
    ``pack_micro(micro, result)``. Bitwise copies; placed on ``device`` (default: the group's
    communication device). Collective: every rank of ``group`` calls it. Same PlanError on every
    rank if any rank's input is bad or the ranks' plans/views route differently.
    """
    rank, world = group_info(group)
    rt, tensors, err = None, [], None
    try:
        rt = routes(plan, view)
        tensors = _check_tensors(list(local_tensors), view.n_local, "local_tensors")
    except Exception as exc:
        err = exc
    meta = _gather_meta(rt, tensors, err, group, what="exchange_samples")
    assert rt is not None
    glens = np.concatenate(meta.lens)
    off = int(rt.offsets[rank])
    sends = [[tensors[i - off] for i in rt.send(rank, d)] for d in range(world)]
    recv = [rt.send(s, rank) for s in range(world)]
    got = _all_to_all(sends, [glens[idx] for idx in recv], meta.dtype, group, device)
    return {int(i): t for i, t in zip(np.concatenate(recv), got)}


def exchange_outputs(plan: Plan, view: LocalView, outputs: Mapping[int, torch.Tensor], *, group: Any = None,
                     device: torch.device | str | None = None) -> list[torch.Tensor | None]:
    """Return per-sample outputs to their home ranks; the inverse of :func:`exchange_samples`.

    ``outputs[i]`` is the 1-D output of global sample i, for (at least) every sample this rank
    runs at CP rank 0 (``routes(plan, view).owned(rank)``; extra keys, e.g. from other CP
    members, are ignored). Returns a list aligned with this rank's local samples: element j is
    the output of global sample ``view.offset + j``, None for samples the plan dropped.
    Collective; same PlanError on every rank if any rank is missing an output.
    """
    rank, world = group_info(group)
    rt, tensors, err = None, [], None
    try:
        rt = routes(plan, view)
        owned = rt.owned(rank)
        missing = [int(i) for i in owned if int(i) not in outputs]
        if missing:
            raise PlanError(f"outputs lacks {len(missing)} of the {owned.size} samples this rank runs at CP rank 0, "
                            f"e.g. sample {missing[0]}; key outputs by global sample index.")
        tensors = _check_tensors([outputs[int(i)] for i in owned], owned.size, "outputs")
    except Exception as exc:
        err = exc
    meta = _gather_meta(rt, tensors, err, group, what="exchange_outputs")
    assert rt is not None
    olens = np.zeros(rt.owner.size, np.int64)
    for r in range(world):
        olens[rt.owned(r)] = meta.lens[r]
    home = np.searchsorted(rt.offsets, rt.owned(rank), side="right") - 1
    sends = [[t for t, h in zip(tensors, home) if h == d] for d in range(world)]
    lo, hi = int(rt.offsets[rank]), int(rt.offsets[rank + 1])
    recv = [np.flatnonzero(rt.owner[lo:hi] == s) + lo for s in range(world)]
    got = _all_to_all(sends, [olens[idx] for idx in recv], meta.dtype, group, device)
    out: list[torch.Tensor | None] = [None] * (hi - lo)
    for i, t in zip(np.concatenate(recv), got):
        out[int(i) - lo] = t
    return out


def _check_tensors(ts: list[Any], n: int, name: str) -> list[torch.Tensor]:
    if len(ts) != n:
        raise PlanError(f"{name} holds {len(ts)} tensors but this rank has {n} samples to send; pass one per sample.")
    for j, t in enumerate(ts):
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            what = type(t).__name__ if not isinstance(t, torch.Tensor) else f"a {t.dim()}-D tensor"
            raise PlanError(f"{name}[{j}] is {what}; every sample's data must be a 1-D tensor "
                            "(reshape scalars to [1], flatten the rest).")
        if t.dtype != ts[0].dtype:
            raise PlanError(f"{name}[{j}] has dtype {t.dtype} but {name}[0] has {ts[0].dtype}; one dtype per call.")
        if t.dtype not in _DTYPES:
            raise PlanError(f"{name}[{j}] has dtype {t.dtype}, which exchange does not carry.")
    return ts


@dataclass(frozen=True)
class _Meta:
    dtype: torch.dtype
    lens: list[np.ndarray]  # per rank: numel of each tensor it sends (local order / owned order)


def _digest(rt: Routes) -> list[int]:
    """32 bytes of SHA-256 over the routing, as 4 int64: equal on ranks that route alike."""
    h = hashlib.sha256(rt.offsets.astype("<i8").tobytes())
    h.update(rt.owner.astype("<i8").tobytes())
    for need in rt.needs:
        h.update(np.int64(need.size).tobytes() + need.astype("<i8").tobytes())
    return np.frombuffer(h.digest(), dtype="<i8").tolist()


def _gather_meta(rt: Routes | None, ts: list[torch.Tensor], err: BaseException | None, group: Any,
                 *, what: str) -> _Meta:
    """Header ``[status, dtype, count, routing digest]``, then the numel of every tensor.

    The fixed-size header goes first so that nothing variable-sized is exchanged before every
    rank knows that all inputs are valid and that all ranks route alike (same plan and view):
    otherwise split sizes would disagree and the all-to-all could hang.
    """
    dev = comm_device(group)
    ok = err is None and rt is not None
    head = [0 if ok else 1, _DTYPES.index(ts[0].dtype) if ok and ts else -1, len(ts) if ok else 0]
    head += _digest(rt) if ok else [0, 0, 0, 0]  # type: ignore[arg-type]
    rows = all_gather_rows(torch.tensor(head, dtype=torch.int64, device=dev), group).cpu().numpy()
    fail_together(rows[:, 0].tolist(), err, what=what, group=group)
    digests = [tuple(r) for r in rows[:, 3:7].tolist()]
    if len(set(digests)) > 1:
        groups = {d: [r for r, x in enumerate(digests) if x == d] for d in dict.fromkeys(digests)}
        by = "; ".join(ranks_phrase(rs) for rs in groups.values())
        raise PlanError(f"{what}: ranks route samples differently (groups: {by}) — their plans or local views "
                        "differ; plan with plan_distributed (or call verify_agreement) before exchanging.")
    codes = rows[:, 1]
    kinds = sorted(set(codes[codes >= 0].tolist()))
    if len(kinds) > 1:
        by = "; ".join(f"{_DTYPES[k]} on {ranks_phrase(np.flatnonzero(codes == k).tolist())}" for k in kinds)
        raise PlanError(f"{what}: ranks pass different dtypes ({by}); exchange one dtype per call.")
    counts = rows[:, 2].tolist()
    lens = torch.tensor([t.numel() for t in ts], dtype=torch.int64, device=dev)
    got = all_gather_padded(lens, counts, group)
    return _Meta(_DTYPES[kinds[0]] if kinds else torch.uint8, [g.cpu().numpy() for g in got])


def _all_to_all(sends: list[list[torch.Tensor]], recv_lens: list[np.ndarray], dtype: torch.dtype, group: Any,
                device: torch.device | str | None) -> list[torch.Tensor]:
    """One uneven byte all-to-all: ``sends[d]`` go to rank d; returns the received tensors, source-major."""
    dev = comm_device(group)
    item = torch.empty(0, dtype=dtype).element_size()
    flat = [t.to(dev) for chunk in sends for t in chunk]
    buf = torch.cat(flat).view(torch.uint8) if flat else torch.zeros(0, dtype=torch.uint8, device=dev)
    in_splits = [sum(t.numel() for t in chunk) * item for chunk in sends]
    out_splits = [int(lens.sum()) * item for lens in recv_lens]
    out = torch.empty(sum(out_splits), dtype=torch.uint8, device=dev)
    dist.all_to_all_single(out, buf.contiguous(), out_splits, in_splits, group=group)
    vals = out.view(dtype)
    if device is not None:
        vals = vals.to(device)
    lens = np.concatenate(recv_lens).tolist() if recv_lens else []
    return list(torch.split(vals, lens)) if lens else []
