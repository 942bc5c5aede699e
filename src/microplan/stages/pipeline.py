"""Pipeline parallelism: a 1F1B / interleaved-1F1B schedule model and the micro-batch order.

Design note. With p pipeline stages each DP rank is a pipeline; stage s runs 1/p of the layers,
so micro-batch m costs f_m = c_m/((1+β)·p) forward and b_m = β·f_m backward on every stage
(c_m: the cost model's micro cost, β = ``BACKWARD_RATIO`` = 2 for training, 0 for a forward
pass). :func:`makespan` replays Megatron's schedules op by op — each stage runs its fixed op
sequence (warm-up forwards, then one-forward-one-backward, then cool-down backwards; under
interleaving v model chunks per stage in groups of ``align`` micro-batches, Megatron's
``get_schedule_table``) and an op starts when its stage is free and its input (the previous
stage's forward, the next stage's backward) is done. Point-to-point transfers cost 0 and never
block. The result is exact for this model: O(p·K·v) per evaluation.

Order. Lockstep ranks (``sync="micro"``) run slot m together, so the pipeline sees per-slot
costs max_r c(r, m); the slot grid of ``assign.py`` is therefore reordered by one permutation of
its columns, which keeps every slot's members (lockstep balance, rank totals and CP groups are
unchanged) and only moves slots in time. :func:`pipeline_order` evaluates constructions —
as given, descending, ascending, verl's light-ends/heavy-middle, and the "skewed pyramids"
(ascending to the heaviest, then descending over a tail of every length) — and improves the
three best by local search (moves and swaps of one micro-batch; bounded work), keeping the
order of least predicted makespan: never predicted slower than any construction, and optimal
on every exhaustively checked case (K = 7, 8). What it finds: the lightest micro-batch last
(the last backward drains through every stage at twice a forward's cost), a light one first.
The search (numpy, bounded work; benchmarks/bench_pipeline.py compares it with verl's order) runs
only when ``pipeline_stages`` > 1. Long orders: the pyramids are dealt by a vectorised
merge and, beyond ``ALL_TAILS_MAX_K`` micro-batches, only the extreme and evenly spaced tails are
built; a local-search round is skipped *before* building a neighbourhood the budget refuses.

K. With ``pipeline_stages`` the planner chooses K by the predicted pipeline time of this module
(``kchoice.choose_k_pipeline``: candidates timed in their best constructed order, the best ones
re-timed in the searched order, :func:`slot_order`, which the planner then runs): more, smaller
micro-batches shrink the bubble; the K chosen is never predicted slower than the K of least
lockstep time (it is one of the candidates).
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ..config import PlanConfig
from ..errors import PlanError
from ..types import Step

__all__ = ["BACKWARD_RATIO", "PipelineTime", "makespan", "makespans", "pipeline_time", "pipeline_order",
           "order_step", "slot_order", "stage_ops", "verl_order", "skewed_pyramid", "split_costs"]

BACKWARD_RATIO = 2.0  # backward FLOPs per forward FLOP of a training micro-batch (the usual "6N = 2N + 4N")


class PipelineTime(NamedTuple):
    """Predicted pipeline time of one step (cost units).

    Attributes:
        time: the makespan — first forward start to last backward end on any stage.
        busy: the work of one stage, Σ_m (f_m + b_m) (stages are identical).
        bubble: idle share of the step on a stage, 1 − busy / time (0 for one stage).
    """

    time: float
    busy: float
    bubble: float


def _table(K: int, v: int, group: int) -> list[tuple[int, int]]:
    """Megatron's virtual schedule table: (micro-batch, model chunk) of each virtual micro id."""
    out: list[tuple[int, int]] = []
    for lo in range(0, K, group):
        hi = K if lo + group >= K else lo + group
        out.extend((m, c) for c in range(v) for m in range(lo, hi))
    return out


def stage_ops(K: int, p: int, s: int, *, v: int = 1, group: int | None = None,
              forward_only: bool = False) -> list[tuple[bool, int, int]]:
    """Stage s's op sequence: (is_forward, micro-batch, model chunk), Megatron's order."""
    g = p if group is None else group
    table = _table(K, v, g) if v > 1 else [(m, 0) for m in range(K)]
    total = len(table)
    fwd = [(True, m, c) for m, c in table]
    if forward_only:
        return fwd
    bwd = [(False, m, v - 1 - c) for m, c in table]
    warm = (p - s - 1) * 2 + (v - 1) * g if v > 1 else p - s - 1
    warm = min(warm, total)
    ops = fwd[:warm]
    for i in range(total - warm):
        ops.append(fwd[warm + i])
        ops.append(bwd[i])
    ops.extend(bwd[total - warm:])
    return ops


def _check_interleaving(K: int, p: int, v: int, group: int | None) -> None:
    """Megatron's rules for the interleaved schedule: p <= group <= K, last group 0 or >= p."""
    if v == 1:
        return
    g = p if group is None else group
    if not p <= g <= K or 0 < K % g < p:
        raise PlanError(f"the interleaved schedule cannot run K={K} micro-batches in groups of {g} over p={p} "
                        f"stages: Megatron needs p <= group <= K and K % group either 0 or >= p; plan with "
                        f"align={g} (K is then a multiple of it) and at least {max(g, p)} micro-batches.")


@lru_cache(maxsize=256)
def _dag(K: int, p: int, v: int, group: int | None, forward_only: bool) -> tuple[np.ndarray, ...]:
    """The schedule's ops in a topological order: (stage, input op or -1, micro-batch, is_forward).

    The dependency graph does not depend on the durations, so one order serves every evaluation.
    """
    seqs = [stage_ops(K, p, s, v=v, group=group, forward_only=forward_only) for s in range(p)]
    where: dict[tuple[bool, int, int, int], int] = {}  # (is_forward, micro, chunk, stage) -> op id
    stage, dep, micro, fwd = [], [], [], []
    pos = [0] * p
    left = sum(len(q) for q in seqs)
    while left:
        before = left
        for s in range(p):
            q = seqs[s]
            while pos[s] < len(q):
                is_f, m, c = q[pos[s]]
                if is_f:
                    key = (True, m, c, s - 1) if s > 0 else ((True, m, c - 1, p - 1) if c > 0 else None)
                else:
                    key = ((False, m, c, s + 1) if s < p - 1 else
                           ((False, m, c + 1, 0) if c < v - 1 else (True, m, c, s)))
                if key is not None and key not in where:
                    break
                where[(is_f, m, c, s)] = len(stage)
                stage.append(s)
                dep.append(-1 if key is None else where[key])
                micro.append(m)
                fwd.append(is_f)
                pos[s] += 1
                left -= 1
        if left == before:  # pragma: no cover - Megatron's orders never deadlock
            raise RuntimeError("pipeline schedule deadlocked")
    return tuple(np.array(a, dtype=np.int64) for a in (stage, dep, micro, fwd))


def makespans(fwd: np.ndarray, bwd: np.ndarray, p: int, *, v: int = 1, group: int | None = None) -> np.ndarray:
    """Makespan of each row of ``fwd``/``bwd`` ([n, K] per-stage forward/backward times, in run order).

    With v > 1 each stage holds v model chunks, each taking 1/v of the stage's time. A backward
    time of 0 everywhere is a forward-only pass (no backward ops are scheduled). Rows are
    evaluated together (one pass over the ops, numpy across rows).
    """
    fwd = np.atleast_2d(np.asarray(fwd, dtype=np.float64)) / v
    bwd = np.atleast_2d(np.asarray(bwd, dtype=np.float64)) / v
    n, K = fwd.shape
    if K == 0:
        return np.zeros(n)
    _check_interleaving(K, p, v, group)
    stage, dep, micro, is_f = _dag(K, p, v, group, not bwd.any())
    dur = np.where(is_f[None, :], fwd[:, micro], bwd[:, micro]).T.copy()  # [ops, n]
    done = np.empty_like(dur)
    free = np.zeros((p, n))
    for j, (s, d) in enumerate(zip(stage.tolist(), dep.tolist())):
        start = free[s] if d < 0 else np.maximum(free[s], done[d])
        done[j] = free[s] = start + dur[j]
    return free.max(axis=0)


def makespan(fwd: np.ndarray, bwd: np.ndarray, p: int, *, v: int = 1, group: int | None = None) -> float:
    """Makespan of one order (see :func:`makespans`)."""
    return float(makespans(fwd, bwd, p, v=v, group=group)[0])


def split_costs(costs: np.ndarray, p: int, backward_ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-stage forward and backward times of micro-batches of (whole-model) cost ``costs``."""
    c = np.asarray(costs, dtype=np.float64) / p
    f = c / (1.0 + backward_ratio)
    return f, c - f


def pipeline_time(costs: np.ndarray, p: int, *, v: int = 1, group: int | None = None,
                  backward_ratio: float = BACKWARD_RATIO) -> PipelineTime:
    """:class:`PipelineTime` of micro-batches of (whole-model) cost ``costs`` run in this order."""
    f, b = split_costs(costs, p, backward_ratio)
    busy = float(f.sum() + b.sum())
    t = makespan(f, b, p, v=v, group=group) if p > 1 else busy
    return PipelineTime(t, busy, 1.0 - busy / t if t > 0 else 0.0)


def verl_order(costs: np.ndarray) -> np.ndarray:
    """verl's order: sort descending, then the even positions reversed, then the odd ones."""
    desc = np.argsort(-np.asarray(costs), kind="stable")
    return np.concatenate([desc[0::2][::-1], desc[1::2]])


def skewed_pyramid(costs: np.ndarray, tail: int) -> np.ndarray:
    """The heaviest micro-batch at position K−1−``tail``: ascending before it, descending after.

    The other micro-batches are dealt heaviest first to whichever slope is further behind its
    length (K−1−tail before, ``tail`` after; a tie goes before), so both slopes get a fair share
    of the weight. ``tail`` = K−1 is the descending order, 0 the ascending one. The dealing is
    a merge of the two slopes' progress keys (h·tail, b·(K−1−tail)): O(K log K) numpy.
    """
    desc = np.argsort(-np.asarray(costs), kind="stable")
    K = desc.size
    head_len = K - 1 - tail
    keys = np.concatenate([np.arange(head_len, dtype=np.int64) * tail, np.arange(tail, dtype=np.int64) * head_len])
    kind = np.concatenate([np.zeros(head_len, dtype=np.int64), np.ones(tail, dtype=np.int64)])
    to_head = kind[np.lexsort((kind, keys))] == 0  # the k-th dealt micro-batch goes before the peak
    rest = desc[1:]
    return np.concatenate([rest[to_head][::-1], desc[:1], rest[~to_head]]).astype(np.int64)


def _tails(K: int, quick: bool = False) -> np.ndarray:
    """Tail lengths of the skewed pyramids tried: all up to ``ALL_TAILS_MAX_K`` micro-batches, else
    the shortest and longest few and an even grid between (O(1) constructions for long orders);
    ``quick`` (timing a candidate K): a quarter of each."""
    all_max, ends, grid = (ALL_TAILS_MAX_K, TAIL_ENDS, TAIL_GRID) if not quick else \
        (ALL_TAILS_MAX_K // 4, TAIL_ENDS // 4, TAIL_GRID // 4)
    if K <= all_max:
        return np.arange(K)
    e = np.arange(ends)
    return np.unique(np.concatenate([e, K - 1 - e, np.linspace(0, K - 1, grid).round().astype(np.int64)]))


def _neighbour_count(K: int, full: bool) -> int:
    """How many orders :func:`_neighbours` returns (checked against the budget before building them)."""
    return K * (K - 1) + K * (K - 1) // 2 if full else max(5 * K - 7, 0)


def _neighbours(order: np.ndarray, full: bool) -> np.ndarray:
    """Orders one step away: every move of one micro-batch to another place and every swap of
    two (full), else adjacent swaps and moves to and from both ends (O(K), for long orders)."""
    K = order.size
    base = order.tolist()
    rows = []
    if full:
        for i in range(K):
            for j in range(K):
                if i == j:
                    continue
                o = base[:]
                o.insert(j, o.pop(i))
                rows.append(o)
                if i < j:
                    o = base[:]
                    o[i], o[j] = o[j], o[i]
                    rows.append(o)
    else:
        for i, j in ([(i, i + 1) for i in range(K - 1)] + [(i, 0) for i in range(1, K)]
                     + [(i, K - 1) for i in range(K - 1)] + [(0, j) for j in range(1, K - 1)]
                     + [(K - 1, j) for j in range(1, K - 1)]):
            o = base[:]
            o.insert(j, o.pop(i))
            rows.append(o)
    return np.array(rows, dtype=np.int64).reshape(-1, K)


FULL_SEARCH_MAX_K = 24  # up to this many micro-batches the local search tries every move and swap
STARTS = 3              # local searches, from the best constructions
MAX_SWEEPS = 32         # rounds per local search (each: evaluate the neighbourhood, keep the best)
MAX_WORK = 3_000_000    # orders × schedule ops the local searches may evaluate (about 0.2 s of numpy at most)
ALL_TAILS_MAX_K = 256   # up to this many micro-batches every skewed pyramid is a construction
TAIL_ENDS, TAIL_GRID = 8, 48  # beyond: the 8 shortest and longest tails and 48 evenly spaced ones


def pipeline_order(costs: np.ndarray, p: int, *, v: int = 1, group: int | None = None,
                   backward_ratio: float = BACKWARD_RATIO, search: bool = True) -> np.ndarray:
    """The order (a permutation of ``range(K)``) of least predicted makespan found (module note).

    Candidates: as given, descending, ascending, verl's, and the skewed pyramids of every tail
    length; then best-improvement local search (moves and swaps) from the ``STARTS`` best of
    them, each until no neighbour is faster (at most ``MAX_SWEEPS`` rounds, ``MAX_WORK``
    order-ops evaluated in all; the first search goes deepest). A forward-only
    single-chunk pipeline (``backward_ratio`` 0, v = 1) is a proportionate flow shop whose
    makespan Σf + (p−1)·max f does not depend on the order: kept as given. ``search=False``: the
    best construction only (no local search; K by pipeline time times candidates this way). The
    last ``_CACHE_SIZE`` searched orders are remembered (K is chosen by timing the order the
    planner then asks for again).
    """
    key = (np.asarray(costs, dtype=np.float64).tobytes(), p, v, group, backward_ratio)
    if search and key in _CACHE:
        return _CACHE[key].copy()
    order = _order(costs, p, v=v, group=group, backward_ratio=backward_ratio, search=search)
    if search:
        _CACHE[key] = order.copy()
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
    return order


_CACHE: dict[tuple, np.ndarray] = {}
_CACHE_SIZE = 8


def _order(costs: np.ndarray, p: int, *, v: int, group: int | None, backward_ratio: float,
           search: bool) -> np.ndarray:
    """:func:`pipeline_order` without the cache."""
    c = np.asarray(costs, dtype=np.float64)
    K = c.size
    ident = np.arange(K, dtype=np.int64)
    if p <= 1 or K <= 1 or (backward_ratio == 0 and v == 1):
        return ident
    f, b = split_costs(c, p, backward_ratio)

    def times(orders: np.ndarray) -> np.ndarray:
        return makespans(f[orders], b[orders], p, v=v, group=group)

    desc = np.argsort(-c, kind="stable")
    cands = np.array([ident, desc, desc[::-1], verl_order(c)] + [skewed_pyramid(c, t) for t in _tails(K, not search).tolist()])
    ts = times(cands)
    best, best_t = cands[int(np.argmin(ts))], float(ts.min())
    budget = MAX_WORK // (2 * p * K * v) if search else 0  # orders the local searches may evaluate
    for k in np.argsort(ts, kind="stable")[:STARTS].tolist():
        order, t = cands[k], float(ts[k])
        for _ in range(MAX_SWEEPS):
            if _neighbour_count(K, K <= FULL_SEARCH_MAX_K) > budget:
                break
            nb = _neighbours(order, K <= FULL_SEARCH_MAX_K)
            budget -= nb.shape[0]
            nt = times(nb)
            j = int(np.argmin(nt))
            if not nt[j] < t * (1 - 1e-12):
                break
            order, t = nb[j], float(nt[j])
        if t < best_t:
            best, best_t = order, t
    return best


def order_step(step: Step, grid: np.ndarray, cfg: PlanConfig, *, backward_ratio: float = BACKWARD_RATIO) -> Step:
    """``step`` with its slots (columns of ``grid[r, m]``, the micro-batch costs) in pipeline order.

    One permutation for every rank, chosen on the slot maxima (lockstep ranks run a slot
    together; under ``sync="step"`` the slot maxima are the proxy): slot contents, rank totals
    and CP groups are unchanged. A no-op without pipeline parallelism.
    """
    if cfg.pipeline_stages <= 1:
        return step
    order = slot_order(grid, cfg, backward_ratio=backward_ratio).tolist()
    micros = tuple(tuple(row[j] for j in order) for row in step.micros)
    return Step(step.index, micros, step.samples, choice=step.choice)


def slot_order(grid: np.ndarray, cfg: PlanConfig, *, backward_ratio: float = BACKWARD_RATIO,
               search: bool = True) -> np.ndarray:
    """The run order of the slots (columns of ``grid[r, m]``): :func:`pipeline_order` of the slot
    maxima, taken heaviest first (stable), so the order depends only on the slots, not on how they
    arrive — K by pipeline time (``fit.py``) times exactly the order the planner then runs."""
    slot = grid.max(axis=0)
    if cfg.pipeline_stages <= 1 or (backward_ratio == 0 and cfg.virtual_stages == 1):
        return np.arange(slot.size, dtype=np.int64)  # order-free (pipeline_order keeps the order as given)
    canon = np.argsort(-slot, kind="stable")
    return canon[pipeline_order(slot[canon], cfg.pipeline_stages, v=cfg.virtual_stages, group=cfg.align,
                                backward_ratio=backward_ratio, search=search)]


def step_pipeline_time(grid: np.ndarray, cfg: PlanConfig, *, backward_ratio: float = BACKWARD_RATIO) -> float:
    """Predicted wall time of a step whose micro-batch costs are ``grid[r, m]`` (in run order).

    ``sync="micro"``: the ranks run each slot together, so the pipeline sees the slot maxima;
    ``sync="step"``: every rank's pipeline runs on its own and the slowest one ends the step.
    """
    p = cfg.pipeline_stages
    rows = grid.max(axis=0, keepdims=True) if cfg.sync == "micro" else grid
    if p <= 1 or rows.shape[1] == 0:
        return float(rows.sum(axis=1).max()) if rows.size else 0.0
    f, b = split_costs(rows, p, backward_ratio)
    return float(makespans(f, b, p, v=cfg.virtual_stages, group=cfg.align).max())
