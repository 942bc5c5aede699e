"""Gather every rank's local batch into the global Batch, identical on every rank.

Design note. Three tensor all-gathers, sizes first:

1. a fixed header per rank ``[status, n, has_prompt_lens, prompt_kind, rollout_kind,
   json_bytes, num_prompts, num_rollouts, has_vision]`` (int64) — status carries a local failure
   (a bad Batch, NaN lengths) so every rank fails together before any variable-size collective;
2. the numeric columns (seq_lens, loss_tokens, [prompt_lens], [int ids], [vision_tokens,
   num_images]) as one int64 tensor padded to the largest rank (a text-only rank of a batch with
   vision sends zero patches);
3. only when some rank has string (or > int64) ids: their JSON, as uint8 padded bytes.

Why tensors and not ``all_gather_object``: all_gather_object pickles every rank's object,
runs its own size + payload gathers, and unpickles world payloads on every rank (unpickling
peers' bytes is also a code-execution hazard); under NCCL it stages the pickles through the
GPU. Here integer columns travel as raw int64 memory and string ids as JSON (no pickle).

Id rule. ``local_ids=False`` (default): ids are global — the same prompt/rollout id on two
ranks means the same group (e.g. a GRPO group whose samples landed on different ranks); ids
are kept as given. ``local_ids=True``: each rank numbers its own groups (e.g. every rank
uses prompt ids 0..P-1); rank r's k-th distinct id becomes ``base_r + k`` with ``base_r`` the
groups of ranks < r, so groups never merge across ranks. The returned ids are then those ints.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import torch

from ..batch import Batch
from ..errors import PlanError
from ._comm import all_gather_padded, all_gather_rows, comm_device, fail_together, group_info, ranks_phrase

__all__ = ["LocalView", "local_view", "gather_batch", "LocalBatchLike"]

LocalBatchLike = Union[Batch, Mapping[str, Any], Callable[[], Batch]]
_NONE, _INT, _JSON = 0, 1, 2  # id kinds in the header
_I64 = (-(2**63), 2**63 - 1)


@dataclass(frozen=True, eq=False)
class LocalView:
    """This rank's place in the gathered global batch.

    Attributes:
        batch: the global :class:`Batch` (rank order, then local order), identical on all ranks.
        rank: this rank in the group (= its plan rank).
        counts: local samples of every rank; rank r's samples are global indices
            ``offsets[r] .. offsets[r+1]-1``.
    """

    batch: Batch
    rank: int
    counts: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.counts)

    @property
    def offsets(self) -> np.ndarray:
        """int64 ``[world+1]``: rank r's local samples are ``offsets[r]:offsets[r+1]``."""
        return np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)]).astype(np.int64)

    @property
    def offset(self) -> int:
        return int(self.offsets[self.rank])

    @property
    def n_local(self) -> int:
        return self.counts[self.rank]

    @property
    def indices(self) -> np.ndarray:
        """Global indices of this rank's local samples, in local order."""
        return np.arange(self.offset, self.offset + self.n_local, dtype=np.int64)

    def home(self, i: int | np.ndarray) -> Any:
        """The rank whose local batch holds global sample(s) ``i``."""
        return np.searchsorted(self.offsets, i, side="right") - 1

    @property
    def owners(self) -> np.ndarray:
        """int64 rank holding each global sample (rank order): ``Batch.rank_of`` for local placement."""
        return np.repeat(np.arange(self.world_size, dtype=np.int64), self.counts)

    def pinned(self) -> Batch:
        """The global batch with every sample's owner rank set (``PlanConfig(placement="local")``)."""
        return self.batch.with_rank_of(self.owners)


def gather_batch(local_batch: LocalBatchLike, *, group: Any = None, local_ids: bool = False,
                 owners: bool = False) -> Batch:
    """All-gather every rank's local batch into the global batch (binding API).

    ``local_batch`` is a :class:`Batch`, a dict of Batch keyword arguments (validated inside
    the guard, so a NaN length on one rank fails every rank), or a zero-argument callable
    returning a Batch. Result: rank order, then local order; identical on every rank. See the
    module doc for ``local_ids``. ``owners=True`` fills ``Batch.rank_of`` with the rank each
    sample came from (for ``PlanConfig(placement="local")``); a local batch's own ``rank_of``
    is not gathered. Raises the same PlanError on every rank on any failure.
    """
    view = local_view(local_batch, group=group, local_ids=local_ids)
    return view.pinned() if owners else view.batch


def local_view(local_batch: LocalBatchLike, *, group: Any = None, local_ids: bool = False) -> LocalView:
    """Like :func:`gather_batch`, plus where this rank's samples sit: a :class:`LocalView`."""
    rank, world = group_info(group)
    dev = comm_device(group)
    enc: _Local | None = None
    err: BaseException | None = None
    try:
        enc = _Local(_as_batch(local_batch), local_ids)
    except Exception as exc:
        err = exc
    header = enc.header() if enc is not None else [1, 0, 0, 0, 0, 0, 0, 0, 0]
    heads = all_gather_rows(torch.tensor(header, dtype=torch.int64, device=dev), group).cpu().numpy()
    fail_together(heads[:, 0].tolist(), err, what="gather_batch (local batch)", group=group)
    assert enc is not None
    lay = _GlobalColumns(heads, local_ids)
    counts = [int(n) for n in heads[:, 1]]
    cols = all_gather_padded(torch.from_numpy(enc.columns(lay)).to(dev), [n * lay.ncols for n in counts], group)
    blobs = [b""] * world
    if lay.any_json:
        raw = torch.from_numpy(np.frombuffer(enc.json_bytes, dtype=np.uint8).copy())
        got = all_gather_padded(raw.to(dev), [int(x) for x in heads[:, 5]], group)
        blobs = [g.cpu().numpy().tobytes() for g in got]
    tables = [c.cpu().numpy().reshape(n, lay.ncols) for c, n in zip(cols, counts)]
    return LocalView(_assemble(lay, tables, blobs), rank, tuple(counts))


def _as_batch(local: LocalBatchLike) -> Batch:
    if isinstance(local, Batch):
        return local
    if isinstance(local, Mapping):
        return Batch(**local)
    if callable(local):
        out = local()
        if not isinstance(out, Batch):
            raise PlanError(f"the local-batch callable returned {type(out).__name__}, not a microplan.Batch.")
        return out
    raise PlanError(f"local batch must be a microplan.Batch, a dict of Batch arguments or a callable returning "
                    f"a Batch; got {type(local).__name__}.")


def _id_kind(ids: list[Any] | None) -> int:
    if ids is None:
        return _NONE
    ok = all(isinstance(v, int) and _I64[0] <= v <= _I64[1] for v in ids)
    return _INT if ok else _JSON


class _Local:
    """One rank's batch, encoded for the gathers."""

    def __init__(self, b: Batch, local_ids: bool) -> None:
        self.b = b
        self.local_ids = local_ids
        self.pkind = _INT if local_ids and b.prompt_ids is not None else _id_kind(b.prompt_ids)
        self.rkind = _INT if local_ids and b.rollout_ids is not None else _id_kind(b.rollout_ids)
        blob = {}
        if not local_ids:
            blob = {k: ids for k, ids, kind in (("p", b.prompt_ids, self.pkind), ("r", b.rollout_ids, self.rkind))
                    if kind == _JSON}
        self.json_bytes = json.dumps(blob, separators=(",", ":")).encode() if blob else b""

    def header(self) -> list[int]:
        b = self.b
        return [0, b.num_samples, int(b.prompt_lens is not None), self.pkind, self.rkind, len(self.json_bytes),
                b.num_prompts, b.num_rollouts, int(b.vision_tokens is not None)]

    def columns(self, lay: _GlobalColumns) -> np.ndarray:
        b, n = self.b, self.b.num_samples
        cols = [b.seq_lens, b.loss_tokens]
        if lay.plens:
            cols.append(b.prompt_lens if b.prompt_lens is not None else np.zeros(n, np.int64))
        for present, kind, ids, codes in ((lay.p_int, self.pkind, self.b.prompt_ids, b.prompt_codes),
                                          (lay.r_int, self.rkind, self.b.rollout_ids, b.rollout_codes)):
            if present:
                if self.local_ids:
                    cols.append(codes)
                else:
                    cols.append(np.asarray(ids, np.int64) if kind == _INT else np.zeros(n, np.int64))
        if lay.vision:
            for a in (b.vision_tokens, b.num_images):
                cols.append(a if a is not None else np.zeros(n, np.int64))
        return np.stack(cols, axis=1).reshape(-1).astype(np.int64) if n else np.zeros(0, np.int64)


class _GlobalColumns:
    """Global column layout, decided identically on every rank from the gathered headers."""

    def __init__(self, heads: np.ndarray, local_ids: bool) -> None:
        n = heads[:, 1]
        busy = n > 0
        self.plens = bool(busy.any() and heads[busy, 2].all())  # kept only if every non-empty rank has it
        self.vision = bool(busy.any() and heads[busy, 8].any())  # text-only ranks send zero patches
        self.local_ids = local_ids
        self.num_prompts = heads[:, 6]
        self.num_rollouts = heads[:, 7]
        self.kinds = (heads[:, 3], heads[:, 4])
        if local_ids:
            self.p_int = bool((heads[:, 3] != _NONE).any())
            self.r_int = bool((heads[:, 4] != _NONE).any())
            self.any_json = False
        else:
            for name, col in (("prompt_ids", 3), ("rollout_ids", 4)):
                _check_same_presence(name, heads[busy, col], np.flatnonzero(busy))
            self.p_int = bool((heads[:, 3] == _INT).any())
            self.r_int = bool((heads[:, 4] == _INT).any())
            self.any_json = bool((heads[:, 5] > 0).any())
        self.ncols = 2 + int(self.plens) + int(self.p_int) + int(self.r_int) + 2 * int(self.vision)


def _check_same_presence(name: str, kinds: np.ndarray, ranks: np.ndarray) -> None:
    given = ranks[kinds != _NONE]
    if given.size and given.size != ranks.size:
        missing = ranks[kinds == _NONE]
        raise PlanError(f"{name} given on {ranks_phrase(given.tolist())} but not on "
                        f"{ranks_phrase(missing.tolist())}: with global ids every non-empty rank must pass {name} "
                        "(or none may); or pass local_ids=True to number groups per rank.")


def _assemble(lay: _GlobalColumns, tables: list[np.ndarray], blobs: list[bytes]) -> Batch:
    """The global Batch from every rank's columns (raises the same PlanError on every rank)."""
    allc = np.concatenate(tables) if tables else np.zeros((0, lay.ncols), np.int64)
    c = 2 + int(lay.plens)
    plens = allc[:, 2] if lay.plens else None
    pids = _ids(lay, tables, blobs, 0, c) if lay.p_int or lay.any_json else None
    rids = _ids(lay, tables, blobs, 1, c + int(lay.p_int)) if lay.r_int or lay.any_json else None
    v = c + int(lay.p_int) + int(lay.r_int)
    vis, imgs = (allc[:, v], allc[:, v + 1]) if lay.vision else (None, None)
    try:
        return Batch(allc[:, 0], loss_tokens=allc[:, 1], prompt_lens=plens, prompt_ids=pids, rollout_ids=rids,
                     vision_tokens=vis, num_images=imgs)
    except PlanError as exc:
        raise PlanError(f"the gathered global batch is invalid: {exc} (with global ids, ranks that reuse the "
                        "same ids share groups; pass local_ids=True if each rank numbers its own).") from None


def _ids(lay: _GlobalColumns, tables: list[np.ndarray], blobs: list[bytes], which: int, col: int) -> list[Any] | None:
    """Prompt (which=0) or rollout (which=1) ids of the global batch, or None when nobody gave any."""
    present = lay.p_int if which == 0 else lay.r_int
    if lay.local_ids:
        if not present:
            return None
        base = np.concatenate([[0], np.cumsum(lay.num_prompts if which == 0 else lay.num_rollouts)])
        return np.concatenate([t[:, col] + base[r] for r, t in enumerate(tables)]).tolist()
    out: list[Any] = []
    for r, t in enumerate(tables):
        kind = int(lay.kinds[which][r])
        if kind == _INT:
            out.extend(t[:, col].tolist())
        elif kind == _JSON:
            out.extend(json.loads(blobs[r].decode())["pr"[which]])
    return out if any(int(k) != _NONE for k in lay.kinds[which]) else None
