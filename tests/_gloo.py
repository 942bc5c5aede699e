"""Run a function on N gloo-connected CPU processes, with a hard timeout (a hang fails the test).

    results = run_gloo(fn, world_size=4, args=(...,), timeout_s=60)

``fn(rank, world_size, *args)`` runs inside an initialised ``torch.distributed`` gloo process
group and returns a picklable value; ``results[r]`` is rank r's value. If a rank raises, the
returned list holds a :class:`RankError` for it (type name, message, traceback) instead, so a
test can assert on how every rank ended. If the ranks do not all finish within ``timeout_s``,
every child is killed and :class:`GlooTimeout` is raised listing the ranks that never reported.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class RankError:
    """How a rank that raised ended: exception type name, message and formatted traceback."""

    type: str
    message: str
    traceback: str


class GlooTimeout(AssertionError):
    """Some ranks did not finish in time (a hang): they were killed."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, q: Any,
           pg_timeout_s: float) -> None:
    import datetime

    import torch.distributed as dist
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        try:
            out: Any = fn(rank, world, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        q.put((rank, True, out))
    except BaseException as exc:  # report every failure, including KeyboardInterrupt
        q.put((rank, False, RankError(type(exc).__name__, str(exc), traceback.format_exc())))


def run_gloo(fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout_s: float = 120.0,
             pg_timeout_s: float = 30.0, start_method: str = "fork") -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks; return each rank's value or RankError (see module doc)."""
    ctx = mp.get_context(start_method)
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world_size, port, args, q, pg_timeout_s), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                raise GlooTimeout(f"ranks {missing} did not finish within {timeout_s:.0f}s (hang)")
            try:
                r, ok, val = q.get(timeout=min(left, 0.5))
                results[r] = val
            except Exception:
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and i not in results]
                # a child that died without reporting (segfault, os._exit) counts as an error
                for i in dead:
                    time.sleep(0.2)
                    if i not in results and q.empty():
                        results[i] = RankError("ProcessDied", f"exit code {procs[i].exitcode}", "")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
    return [results[r] for r in range(world_size)]
