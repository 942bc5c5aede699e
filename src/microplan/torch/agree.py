"""Prove that every rank holds the same plan, and plan safely in SPMD trainers.

Design note. :func:`verify_agreement` is one all-gather of a fixed 33-byte row per rank: a
status byte and the 32-byte SHA-256 digest of ``plan.fingerprint()``. Equal digests: done.
Different digests: every rank knows it at once (same gathered rows), so all of them take the
error path together — one ``all_gather_object`` of small diagnostics (config, batch and version
hashes) to say *why* they differ — and raise the same PlanError. The status byte lets
:func:`plan_distributed` fold "planning failed here" into the same collective: gather →
plan → verify costs the gather's collectives plus exactly one more on the happy path.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import __version__
from ..config import PlanConfig
from ..errors import PlanError
from ..plan import Plan
from ..planner import build_plan
from ._comm import all_gather_rows, comm_device, fail_together, group_info, ranks_phrase
from .gather import LocalBatchLike, LocalView, local_view

__all__ = ["verify_agreement", "plan_distributed"]


def verify_agreement(plan: Plan, *, group: Any = None) -> str:
    """Check that every rank of ``group`` holds the same plan (binding API); return its fingerprint.

    One all-gather of a fixed 33-byte tensor. If any rank's fingerprint differs (or a rank
    cannot compute it), every rank raises the same :class:`PlanError` naming the ranks grouped
    by fingerprint and the likely cause (different configs, batches, or library versions).
    Call it before the first collective that depends on the plan.
    """
    digest, err = None, None
    try:
        if not isinstance(plan, Plan):
            raise PlanError(f"verify_agreement takes a microplan.Plan, got {type(plan).__name__}.")
        digest = bytes.fromhex(plan.fingerprint())
    except Exception as exc:
        err = exc
    return _agree(plan, digest, err, what="verify_agreement", group=group)


def plan_distributed(local_batch: LocalBatchLike | LocalView, config: PlanConfig, *, group: Any = None,
                     local_ids: bool = False, min_micro_count: int | None = None) -> Plan:
    """Gather, plan and verify in one call that fails on every rank or on none — never hangs.

    ``local_batch``: this rank's :class:`Batch`, a dict of Batch arguments or a callable
    returning one (so a bad length or a loader error on one rank becomes everyone's PlanError),
    or a :class:`LocalView` already gathered with :func:`local_view`. The group's ranks are the
    plan ranks: ``config.dp_size`` must equal the group size (static CP: pass the DP group;
    dynamic CP: the whole DP×CP plane). Planning errors on any rank — or plans that differ —
    raise the same PlanError on every rank, naming the ranks and their messages. With
    ``config.placement == "local"`` every sample is pinned to the rank that passed it (the
    gathered batch's ``rank_of``), so the plan needs no :func:`exchange_samples`;
    ``min_micro_count`` is then its minimum K per rank (see ``microplan.planner.build_plan``).
    """
    view = local_batch if isinstance(local_batch, LocalView) else local_view(local_batch, group=group,
                                                                              local_ids=local_ids)
    out, digest, err = None, None, None
    try:
        if not isinstance(config, PlanConfig):
            raise PlanError(f"plan_distributed takes a microplan.PlanConfig, got {type(config).__name__}.")
        if config.dp_size != view.world_size:
            raise PlanError(f"config.dp_size={config.dp_size} but the process group has {view.world_size} ranks; "
                            "plan ranks are group ranks: pass the data-parallel group (static CP: the DP group; "
                            "dynamic CP: the whole DP×CP plane) or fix dp_size.")
        batch = view.pinned() if config.placement == "local" else view.batch
        out = build_plan(batch, config, min_micro_count=min_micro_count)
        digest = bytes.fromhex(out.fingerprint())
    except Exception as exc:
        err = exc
    _agree(out, digest, err, what="plan_distributed (planning)", group=group, config=config)
    assert out is not None
    return out


def _agree(plan: Any, digest: bytes | None, err: BaseException | None, *, what: str, group: Any,
           config: Any = None) -> str:
    """All-gather [status, digest]; fail together; on differing digests, diagnose and raise."""
    _, world = group_info(group)
    row = np.zeros(33, np.uint8)
    if err is None and digest is not None:
        row[1:] = np.frombuffer(digest, np.uint8)
    else:
        row[0] = 1
    rows = all_gather_rows(torch.from_numpy(row).to(comm_device(group)), group).cpu().numpy()
    if rows[:, 0].any():
        _fail_with_config_hint(rows[:, 0].tolist(), err, what, group, config)
    hexes = [bytes(r[1:]).hex() for r in rows]
    if len(set(hexes)) == 1:
        return hexes[0]
    diag: list[Any] = [None] * world
    dist.all_gather_object(diag, _diagnosis(plan), group=group)
    by_fp: dict[str, list[int]] = {}
    for r, h in enumerate(hexes):
        by_fp.setdefault(h, []).append(r)
    groups = "; ".join(f"fingerprint {h[:12]} on {ranks_phrase(rs)}" for h, rs in by_fp.items())
    raise PlanError(f"{what}: the ranks hold different plans — {groups}. {_cause(diag)} No micro-batch may run: "
                    "ranks would block in mismatched collectives.")


def _fail_with_config_hint(status: list[int], err: BaseException | None, what: str, group: Any,
                           config: Any) -> None:
    """fail_together, adding 'the configs differ' when they do (one extra collective, error path)."""
    try:
        fail_together(status, err, what=what, group=group)
    except PlanError as exc:
        if config is None:
            raise
        _, world = group_info(group)
        hashes: list[Any] = [None] * world
        dist.all_gather_object(hashes, _hash_json(config), group=group)
        note = _split_note("PlanConfig", hashes)
        raise PlanError(f"{exc}{' ' + note if note else ''}") from exc.__cause__


def _hash_json(obj: Any) -> str:
    try:
        text = json.dumps(obj.to_dict(), sort_keys=True, default=str)
    except Exception:
        text = repr(obj)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _diagnosis(plan: Any) -> dict[str, str]:
    if not isinstance(plan, Plan):
        return {"config": "?", "batch": "?", "version": __version__}
    return {"config": _hash_json(plan.config), "batch": _hash_json(plan.batch),
            "version": f"microplan {__version__}, numpy {np.__version__}"}


def _split_note(name: str, values: list[Any]) -> str:
    """'The PlanConfig differs across ranks: ranks [0-2] vs rank 3.' when values differ, else ''."""
    by: dict[Any, list[int]] = {}
    for r, v in enumerate(values):
        by.setdefault(v, []).append(r)
    if len(by) < 2:
        return ""
    return f"The {name} differs across ranks: " + " vs ".join(ranks_phrase(rs) for rs in by.values()) + "."


def _cause(diag: list[dict[str, str]]) -> str:
    for key, name, fix in (("config", "PlanConfig", "pass the same PlanConfig on every rank."),
                           ("batch", "batch", "plan the gathered batch (gather_batch / plan_distributed), "
                                              "not each rank's local lengths."),
                           ("version", "library version", "install the same microplan and numpy everywhere.")):
        note = _split_note(name, [d.get(key) for d in diag])
        if note:
            return f"{note} Fix: {fix}"
    return "Same config, batch and versions gave different plans: planner nondeterminism — please report it."
