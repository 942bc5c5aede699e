"""microplan over ``torch.distributed``: gather the batch, agree on the plan, move the data.

Design note. The numpy core is collective-free: any process that knows every sample's length
computes the whole plan. This module supplies the few collectives an SPMD trainer needs around
it, each taking the process group explicitly (``group=None`` = the default group; the group's
ranks are the plan's ranks):

====================  ==========================================================  ============
name                  does                                                        collectives
====================  ==========================================================  ============
gather_batch          every rank's local Batch → the global Batch (rank order)    2 (3 w/ str ids)
local_view            same, plus this rank's offset / counts (:class:`LocalView`) 2 (3)
verify_agreement      all-gather the 32-byte fingerprint digest; same error       1
plan_distributed      gather → plan → verify; any failure fails every rank        3 (4)
exchange_samples      sample tensors → every rank that runs them (CP groups too)  3
exchange_outputs      per-sample outputs → their home ranks, local order          3
collective_guard      context manager: a local exception fails every rank         1
====================  ==========================================================  ============

The safety rule (see ``_comm``): a failure on one rank — bad input, a planner error, a wrong
tensor, different configs — is carried as a status word in the next collective, and every rank
raises the same :class:`PlanError` naming the failing ranks and their messages. No rank
proceeds to a collective its peers skip, so nothing hangs. What it cannot cover: a rank that
raises *outside* these calls never arrives; put such code in :func:`collective_guard` or pass
``plan_distributed`` a callable that builds the local batch.

Modules: ``gather`` (LocalView, gather_batch), ``agree`` (verify_agreement, plan_distributed),
``exchange`` (routes, exchange_samples/outputs), ``_comm`` (status plumbing).
"""

from __future__ import annotations

from ._comm import collective_guard
from .agree import plan_distributed, verify_agreement
from .exchange import Routes, exchange_outputs, exchange_samples, routes
from .gather import LocalView, gather_batch, local_view

__all__ = [
    "gather_batch", "local_view", "LocalView", "verify_agreement", "plan_distributed",
    "exchange_samples", "exchange_outputs", "routes", "Routes", "collective_guard",
]
