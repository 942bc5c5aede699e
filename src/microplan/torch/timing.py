"""Time each micro-batch's compute inside a training step, for ``CostMeter`` and ``profile_cost``.

Design note. ``MicroTimer.time(micro)`` brackets one micro-batch's forward+backward. On CUDA it
records a pair of ``torch.cuda.Event(enable_timing=True)`` on the current stream and returns at
once — no host synchronisation inside the step, so timing does not serialise the host with the
GPU or stall the next micro-batch's launch. :meth:`MicroTimer.resolve` (or :meth:`feed`) is
called once at step end: it waits for the last event (the one sync of the step) and reads every
elapsed time. On CPU (or with an injected ``clock``) work is synchronous and ``perf_counter``
brackets it directly.

What to time (docs/cost.md, "Timing in the loop"): the rank's OWN compute for the micro-batch.
Under DDP with ``no_sync`` (``sync="step"``) no collective runs inside a micro-batch, so the
events around forward+backward measure exactly that; record every rank's micro-batches. Under
FSDP/ZeRO-3 lockstep (``sync="micro"``) the all-gathers and reduce-scatters run inside forward and
backward: a rank that is ahead waits there for the slowest rank, and its events include the wait
(every rank of a slot reads about the slot's maximum). Recording those times would charge the
slowest composition's time to every composition. :func:`lockstep_records` keeps, per slot, one
record: the slot's time attributed to the micro-batch the current model predicts slowest (the
rank that arrived last waited least, so its time is its own compute plus the communication).

Guarantees: ``resolve`` returns one timing per ``time`` call, in call order, then forgets them
(bounded memory per step); a ``time`` block that raised is dropped, not recorded half-timed.
Trade-off: events resolve at step end, so a step's timings feed the NEXT step's plan — the plan
of step s+1 uses records up to step s, which is what planning ahead needs anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import PlanError

__all__ = ["MicroTimer", "MicroTiming", "lockstep_records", "time_call"]


class MicroTiming(NamedTuple):
    """One timed micro-batch: what ran (a ``Micro``, ``PackedMicro`` or its lengths) and its seconds."""

    micro: Any
    seconds: float


def _device_type(device: torch.device | str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device).type


class MicroTimer:
    """Time micro-batches without a host sync inside the step; resolve once at step end.

    Args:
        device: where the compute runs; CUDA → CUDA events on the current stream, anything else
            → ``time.perf_counter`` (default: CUDA when available).
        clock: a zero-argument function returning seconds, replacing ``perf_counter`` on the host
            path (tests, simulated clocks); with a clock the host path is used on any device.

    Usage, once per step on each rank::

        timer = MicroTimer()
        for micro in plan.rank(r)[s]:
            with timer.time(micro):
                p = pack_micro(micro, token_ids).to("cuda")
                weighted_loss(per_token_loss(model, p), p).backward()
        timer.feed(meter)          # one sync; meter.record(micro, seconds) for each
    """

    def __init__(self, device: torch.device | str | None = None, *, clock: Callable[[], float] | None = None) -> None:
        self._cuda = clock is None and _device_type(device) == "cuda"
        self._clock = clock or time.perf_counter
        self._pending: list[tuple[Any, Any, Any]] = []

    @property
    def uses_events(self) -> bool:
        """True when timing with CUDA events (False: host clock)."""
        return self._cuda

    def __len__(self) -> int:
        return len(self._pending)

    @contextmanager
    def time(self, micro: Any) -> Iterator[None]:
        """Bracket one micro-batch's compute (forward + backward) — no sync inside."""
        if self._cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((micro, start, end))
        else:
            t0 = self._clock()
            yield
            self._pending.append((micro, t0, self._clock()))

    def resolve(self) -> list[MicroTiming]:
        """Every timing since the last resolve, in call order (one host sync on CUDA); then forget them."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        if self._cuda:
            pending[-1][2].synchronize()  # events on one stream complete in order
            return [MicroTiming(m, float(s.elapsed_time(e)) / 1e3) for m, s, e in pending]
        return [MicroTiming(m, float(b - a)) for m, a, b in pending]

    def feed(self, meter: Any) -> list[MicroTiming]:
        """Resolve and ``meter.record(micro, seconds)`` each timing (a ``CostMeter``); returns them."""
        out = self.resolve()
        for m, s in out:
            meter.record(m, max(s, 1e-9))  # time the plan's Micro: its lengths, trie and CP degree
        return out


def time_call(fn: Callable[[], Any], *, device: torch.device | str | None = None,
              clock: Callable[[], float] | None = None) -> float:
    """Seconds one call of ``fn`` takes, synchronised: CUDA events + synchronize, else the host clock."""
    timer = MicroTimer(device, clock=clock)
    if timer.uses_events:
        torch.cuda.synchronize()
    with timer.time(None):
        fn()
    return timer.resolve()[0].seconds


def lockstep_records(micros: Sequence[Sequence[Any]], seconds: Sequence[Sequence[float]],
                     cost: Any) -> list[MicroTiming]:
    """Under lockstep (FSDP, ``sync="micro"``): one record per slot, the slot's time on its slowest micro-batch.

    Args:
        micros: ``micros[r][m]``, every rank's micro-batches of the step (``plan.steps[s].micros``).
        seconds: ``seconds[r][m]``, each rank's measured time of its slot m (events around its
            forward+backward, which include its wait at the collectives).
        cost: the model the step was planned with (picks the slowest micro-batch of each slot).

    Returns:
        For each slot m: ``MicroTiming(micro of argmax_r cost.micro_cost, max_r seconds[r][m])`` —
        the rank that arrived last at each collective waited least, so the slot's time is its compute.
    """
    if len(micros) != len(seconds) or any(len(a) != len(b) for a, b in zip(micros, seconds)):
        raise PlanError("lockstep_records needs seconds[r][m] for every micros[r][m] (same ranks, same counts).")
    if not micros:
        return []
    k = len(micros[0])
    if any(len(row) != k for row in micros):
        raise PlanError("lockstep_records: every rank must have the same number of micro-batches (a lockstep step).")
    out = []
    for m in range(k):
        pred = [cost.micro_cost(row[m]) for row in micros]  # a Micro: its trie, if it holds one
        r = int(np.argmax(pred))
        out.append(MicroTiming(micros[r][m], float(max(row[m] for row in seconds))))
    return out
