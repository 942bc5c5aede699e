"""Slot levels for padded layouts: a dynamic program over the sorted samples, every K at once.

Design note. A padded step's lockstep time is ``K·per_micro + Σ_s T_s``, T_s the costliest
micro-batch body of slot s (``assign.arrange`` attains it). Min-max runs (``padded.py``) give
every micro-batch the same budget, but a slot only needs its *own* dp micro-batches level: the
longest samples can sit alone in slot 0 while the short tail fills a much cheaper last slot.
This module plans *contiguous slots*: slot s takes a segment of the samples sorted by length
(``padded_rows._Sorted``), cut into exactly dp runs each costing at most a level T_s.

1. Jumps: for every level T of a candidate set and every start i, the longest run within T
   (``padded_rows._max_run``; 0 when the sample alone costs more) and, by doubling, R_T(i): the
   furthest end dp greedy runs reach (greedy longest runs are optimal: a run's cost never grows
   when it loses samples). A slot can end anywhere in [i + dp, R_T(i)].
2. DP, backwards: G_s(i) = min over T of T + G_{s-1}(j), the least Σ levels covering samples
   i.. with s slots of exactly dp runs, j = min(R_T(i), n − dp·(s−1)) the furthest end that
   leaves dp samples to every later slot (G is nearly non-increasing: a later start covers
   less; a range minimum over [i + dp, j] gave the same small-step plans at several times the cost). One
   pass over s = 1, 2, ... gives ``K·per_micro + G_K(0)`` for every K with dp·K ≤ n: K is
   searched over the whole range, not walked. The pass stops at the last K asked for, when
   K·per_micro plus the body bound (Σ lone-row costs / dp, or the costliest lone row) reaches
   the best time found, or ``PATIENCE`` slots (half the best K, if more) past the best.
3. Levels: every distinct run cost when there are at most ``EXACT_LEVELS`` (small steps), else
   ``GRID_LEVELS`` quantiles of them.

4. Volume cuts (``volume_cuts``): exactly dp·K runs minimising Σ (run cost)^p, a DP over
   (runs, end) vectorised over the ends, every power and K at once. Its slots need not be
   contiguous: p = 0.5 favours a few costly runs beside many cheap ones (mid-length pairs that
   join the longest singles in slot 0 while the short tail is cut fine), p = 1.5 evens the runs
   out. ``padded.py`` starts the deep search from both at its two best K when the DP's work
   (``volume_work``: (n + 1)·k_max·dp·K per power) is within ``padded.VOLUME_MAX_WORK``.

Guarantees: the runs returned number exactly dp·K, each within the caps (a sub-run of a greedy
run within the caps); the DP's time is achievable (its runs' predicted lockstep time is at
most it: ``assign.arrange`` does no worse than the DP's slots). Not exact: an optimal plan's
slots need not be contiguous in the sorted order (``padded_search.py``'s moves take it from
there). Cost: O(S·|T|·n) for S slots.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

from .padded_rows import _max_run
from .padded_search import run_cost_table

__all__ = ["LevelPlans", "level_plans", "split_to_count", "volume_cuts", "volume_work", "VOLUME_POWERS"]

VOLUME_POWERS = (0.5, 1.5)  # volume_cuts minimise Σ (run cost)^p: p < 1 favours a few costly runs
#                            beside many cheap ones, p > 1 evens the runs out (1: the padded volume)
EXACT_LEVELS = 200   # all distinct run costs are the level set when there are at most this many
GRID_LEVELS = 32     # else this many quantiles of them (64, or a refined grid: no better, 1.4-3x slower)
PATIENCE = 4         # slots tried past the best K before the pass stops (or half the best K, if more)


class LevelPlans(NamedTuple):
    """The DP's predicted time for every K it reached and a way to build the runs of one."""

    times: dict[int, float]   # K -> K·per_micro + Σ levels (inf when no contiguous-slot plan fits)
    runs: dict[int, list[int]]  # K -> run boundaries [0, ..., n] of the plans of the best K


def _levels(srt, bound: np.ndarray) -> np.ndarray:
    """Candidate slot levels: every run cost when few, else quantiles of them."""
    n = srt.n
    if int(bound.sum()) <= EXACT_LEVELS:
        a = np.repeat(np.arange(n), bound)
        k = np.concatenate([np.arange(1, b + 1) for b in bound])
        return np.unique(srt.run_cost(a, k))
    a = np.repeat(np.arange(n), bound)  # every run's cost, their quantiles as levels
    k = np.arange(a.size) - np.repeat(np.cumsum(bound) - bound, bound) + 1
    c = np.sort(srt.run_cost(a, k))
    return np.unique(c[np.linspace(0, c.size - 1, GRID_LEVELS).round().astype(np.int64)])


def _steps(srt, T: np.ndarray, bound: np.ndarray, caps: tuple) -> np.ndarray:
    """[len(T), n]: the longest run within T from every start (0 when the sample alone is over T)."""
    n = srt.n
    single = srt.run_cost(np.arange(n), np.ones(n, dtype=np.int64))
    out = np.empty((T.size, n), dtype=np.int64)
    for j, tau in enumerate(T):
        out[j] = _max_run(srt, float(tau), bound, caps[0])
    return np.where(single[None, :] <= T[:, None] * (1 + 1e-12), out, 0)


def _reach(step: np.ndarray, dp: int) -> np.ndarray:
    """[len(T), n + 1]: where dp greedy runs from every start end (stuck where a step is 0)."""
    nt, n = step.shape
    f = np.concatenate([np.arange(n)[None, :] + step, np.full((nt, 1), n)], axis=1)
    out = np.broadcast_to(np.arange(n + 1), (nt, n + 1)).copy()
    e = dp
    while e:
        if e & 1:
            out = np.take_along_axis(f, out, axis=1)
        e >>= 1
        if e:
            f = np.take_along_axis(f, f, axis=1)
    return out


class _Layer(NamedTuple):
    level: np.ndarray   # per start: index of the level chosen (-1: none)
    end: np.ndarray     # per start: where the slot ends


def _dp(reach: np.ndarray, T: np.ndarray, dp: int, stop) -> tuple[list[np.ndarray], list[_Layer]]:
    """Backward layers G_1, G_2, ... until ``stop(s, G_s[0])`` says so (module note, step 2).
    G_s has n + 2 entries: positions 0..n and an infinite sentinel that index -1 reaches."""
    n = reach.shape[1] - 1
    starts = np.arange(n)
    end0 = np.where(reach[:, :n] - starts >= dp, reach[:, :n], -1)  # -1: dp runs within T do not fit
    g = np.full(n + 2, np.inf)
    g[n] = 0.0
    gs, layers = [g], []
    s = 0
    while (s + 1) * dp <= n:
        s += 1
        lim = n - dp * (s - 1)     # leave dp samples to every later slot
        cols = lim - dp + 1        # the starts that leave this slot dp samples
        end = np.minimum(end0[:, :cols], lim)  # the furthest end (-1 stays -1)
        val = T[:, None] + g[end]
        best = np.argmin(val, axis=0)
        at = starts[:cols]
        g_new = np.full(n + 2, np.inf)
        g_new[:cols] = val[best, at]
        layers.append(_Layer(np.where(np.isfinite(g_new[:cols]), best, -1), end[best, at]))
        g = g_new
        gs.append(g)
        if stop(s, float(g[0])):
            break
    return gs, layers


def _runs_of(srt, T: np.ndarray, layers: list[_Layer], K: int, dp: int, bound: np.ndarray,
             caps: tuple) -> list[int]:
    """Run boundaries of the DP's plan with K slots: dp runs per slot, each within its level."""
    b, i = [0], 0
    for s in range(K, 0, -1):
        lay = layers[s - 1]
        t, e = int(lay.level[i]), int(lay.end[i])
        cut = _greedy_from(srt, float(T[t]), bound, caps, i, e)
        cut = split_to_count(srt, cut, dp)
        b.extend(cut[1:])
        i = e
    return b


def _greedy_from(srt, tau: float, bound: np.ndarray, caps: tuple, i: int, e: int) -> list[int]:
    """Greedy longest runs within τ from i, clipped at e: boundaries [i, ..., e]."""
    step = _max_run(srt, tau, bound, caps[0])
    b, x = [i], i
    while x < e:
        x = min(e, x + int(step[x]))
        b.append(x)
    return b


def split_to_count(srt, b: list[int], m: int) -> list[int]:
    """Split the costliest multi-sample runs of the boundaries b in two until there are m runs
    (splitting never breaks a cap)."""
    need = m - (len(b) - 1)
    if need <= 0:
        return list(b)
    starts, ends = np.array(b[:-1]), np.array(b[1:])
    k = ends - starts
    multi = k > 1
    cost = np.full(k.size, -1.0)
    cost[multi] = srt.run_cost(starts[multi], k[multi])
    heap = [(-c, a, e) for c, a, e in zip(cost.tolist(), starts.tolist(), ends.tolist()) if c >= 0.0]
    heapq.heapify(heap)  # costliest first; a tie goes to the earlier run, as an argmax over the runs in order
    cuts = []
    while need and heap:
        _, a, e = heapq.heappop(heap)
        mid = a + (e - a) // 2
        cuts.append(mid)
        need -= 1
        halves = [(a, mid), (mid, e)]
        live = [(x, y) for x, y in halves if y - x > 1]
        if live:
            lo = np.array([x for x, _ in live])
            c = srt.run_cost(lo, np.array([y for _, y in live]) - lo).tolist()
            for (x, y), cx in zip(live, c):
                heapq.heappush(heap, (-cx, x, y))
    return sorted(b + cuts)


def level_plans(srt, caps: tuple, bound: np.ndarray, *, dp: int, Ks: list[int], per_micro: float,
                keep: int = 3) -> LevelPlans:
    """Predicted lockstep time of the DP's contiguous-slot plan for every K in ``Ks`` it reaches
    (ascending, dp·K <= n), and the runs of the ``keep`` best (module note)."""
    n = srt.n
    Ks = [K for K in Ks if dp * K <= n]
    if not Ks:
        return LevelPlans({}, {})
    single = srt.run_cost(np.arange(n), np.ones(n, dtype=np.int64))
    body = max(float(single.sum()) / dp, float(single.max()))  # no plan's body is cheaper
    wanted = set(Ks)
    best = [np.inf, n]

    def stop(s: int, g0: float) -> bool:
        if s in wanted and np.isfinite(g0) and s * per_micro + g0 < best[0]:
            best[0], best[1] = s * per_micro + g0, s
        past = s - best[1] >= max(PATIENCE, best[1] // 2)  # well past the best K found
        return s >= Ks[-1] or (s >= Ks[0] and (s * per_micro + body >= best[0] or past))

    T = _levels(srt, bound)
    gs, layers = _dp(_reach(_steps(srt, T, bound, caps), dp), T, dp, stop)
    times = {K: K * per_micro + float(gs[K][0]) for K in Ks if K < len(gs)}
    finite = sorted((t, K) for K, t in times.items() if np.isfinite(t))
    return LevelPlans(times, {K: _runs_of(srt, T, layers, K, dp, bound, caps) for _, K in finite[:keep]})


def volume_work(n: int, bound: np.ndarray, m: int) -> int:
    """Table entries :func:`volume_cuts` updates for m runs of n samples: (n + 1)·k_max·m per power."""
    return (n + 1) * int(bound.max(initial=1)) * m * len(VOLUME_POWERS)


def volume_cuts(srt, ms: list[int], caps: tuple, bound: np.ndarray,
                powers: tuple[float, ...] = VOLUME_POWERS) -> dict[tuple[int, float], list[int] | None]:
    """For every m in ``ms`` and power p: exactly m runs of the sorted samples minimising
    Σ (run cost)^p within the caps, or None if no cut has m runs. Unlike the slot levels it does not
    make slots contiguous: a start for ``padded_search.py``.

    One DP over (runs, end) for every power and m at once, vectorised over the ends: layer j
    holds, for every end e, the least Σ cost^p of j runs covering [0, e), over the run lengths k
    (``padded_search.run_cost_table``); ties keep the smallest start. O((n + 1)·k_max·max(ms)·|powers|) work
    (:func:`volume_work`); the same cuts as the per-start loop it replaced (plan_hashes unchanged)."""
    n = srt.n
    ms = sorted({m for m in ms if 1 <= m <= n})
    if not ms:
        return {}
    table = run_cost_table(srt, caps, bound)
    top = table.shape[1]
    scale = float(srt.run_cost(np.array([0]), np.array([1]))[0]) or 1.0
    p = np.asarray(powers, dtype=np.float64)
    ks = np.arange(top, 0, -1)[None, :]        # k descending: argmin keeps the smallest start
    start = np.arange(n + 1)[:, None] - ks      # [end, k]: the run's start
    valid = start >= 0
    start = np.where(valid, start, 0)
    step = np.where(valid, table[start, ks - 1], np.inf)
    step = (step[None] / scale) ** p[:, None, None]  # [power, end, k]
    f = np.full((p.size, n + 1), np.inf)
    f[:, 0] = 0.0
    layers, args = [f], [None]
    for _ in range(ms[-1]):
        cand = f[:, start] + step
        pick = np.argmin(cand, axis=2)[..., None]
        f = np.take_along_axis(cand, pick, axis=2)[..., 0]
        layers.append(f)
        args.append(np.take_along_axis(np.broadcast_to(start, cand.shape), pick, axis=2)[..., 0])
    out: dict[tuple[int, float], list[int] | None] = {}
    for m in ms:
        for q, pw in enumerate(powers):
            if not np.isfinite(layers[m][q, n]):
                out[m, pw] = None
                continue
            b = [n]
            for j in range(m, 0, -1):
                b.append(int(args[j][q, b[-1]]))
            out[m, pw] = b[::-1]
    return out
