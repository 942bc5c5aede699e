"""Pack samples into exactly ``m`` non-empty bins under a hard token cap, balanced by cost.

Design note. The packer is a capacity-aware longest-processing-time (LPT) greedy: samples in
descending cost order, each to the least-loaded bin that still has room for its tokens. It is
vectorised in *safe chunks*: with bin loads sorted ascending and the next samples sorted
descending, the first c samples can go to the c least-loaded bins at once as long as the c-th
bin's load is at most the lightest load plus the c-th sample — exactly what one-at-a-time
LPT would do up to ties. A sample whose paired bin lacks room falls back to a masked argmin over
the bins that fit, one sample at a time; without a second resource, blocks of such samples
search only the bins they can choose (``_place_rest_batched``: the same bins, loads and tokens).
An optional second resource (``extra``: vision tokens with their own cap) is checked the same way.
Guarantees: every bin non-empty when n >= m; no bin over ``cap`` tokens (returns None instead);
deterministic (stable sorts, ties by bin and sample index).
Cost: O(n log n + rounds · m log m). The descending order is one sort of the int lengths when
the costs rise with them (``_sort.stable_argsort_via``), and the samples are permuted into it
once, so a round's chunk is a slice; a chunk that fits takes its bins' new loads from the loads
it compared and tests fits with ``count_nonzero``.
"""

from __future__ import annotations

from bisect import insort

import numpy as np

from .._sort import stable_argsort_via

__all__ = ["lpt_pack", "lpt_pack_wide", "round_robin_pack", "bins_lower_bound"]


Extra = tuple[np.ndarray, int]  # a second additive resource per sample and its cap per bin
REST_BLOCK = 64  # samples per block of the batched fallback placement (_place_rest_batched)


def bins_lower_bound(seq_lens: np.ndarray, cap: int, extra: Extra | None = None) -> int:
    """A lower bound on the bins any packing under ``cap`` needs: max(⌈Σ L / cap⌉, #{L > cap/2}, 1),
    and the same for the ``extra`` resource under its cap."""
    if seq_lens.size == 0:
        return 0
    out = 1
    for x, c in ((seq_lens, cap),) + ((extra,) if extra is not None else ()):
        out = max(out, -(-int(x.sum()) // c), int(np.count_nonzero(2 * x > c)))
    return out


def lpt_pack(seq_lens: np.ndarray, costs: np.ndarray, num_bins: int, cap: int | None,
             extra: Extra | None = None) -> np.ndarray | None:
    """Bin id (0..num_bins-1) of each sample, or None when some sample fits in no bin.

    Requires ``1 <= num_bins <= len(seq_lens)`` and every length <= cap; then every bin ends up
    non-empty. ``cap=None`` means no token cap (for a per-bin sample count cap, as in static
    batching, use :func:`round_robin_pack`).
    """
    width = np.ones(num_bins, dtype=np.int64)
    return lpt_pack_wide(seq_lens, costs, width, cap, extra=extra)


def lpt_pack_wide(seq_lens: np.ndarray, costs: np.ndarray, width: np.ndarray, cap: int | None, *,
                  load: np.ndarray | None = None, tokens: np.ndarray | None = None,
                  extra: Extra | None = None, extra_load: np.ndarray | None = None,
                  room: np.ndarray | None = None,
                  increments: tuple[np.ndarray, np.ndarray] | None = None,
                  order: np.ndarray | None = None) -> np.ndarray | None:
    """LPT into bins of GPU ``width`` (capacity width·cap, per-GPU load Σ cost / width).

    ``load``/``tokens`` give each bin's starting per-GPU load and tokens (e.g. a long sample
    already placed on a context-parallel group); they are updated in place. Empty bins are
    filled first, so every bin with zero starting tokens ends non-empty when there are at least
    as many samples as such bins. ``extra``: a second resource per sample with a per-bin cap
    (not scaled by width), ``extra_load`` its starting load per bin; ``room``: each bin's token
    capacity when it is not width·cap (a row multiple); ``increments``: (per cost, per token), the
    per-GPU load a sample adds to each bin (a priced CP group, ``stages/cp.py``) instead of
    cost / width; ``order``: the
    placement order when the caller has it, ``stable_argsort_via(costs, seq_lens, descending=True)``.
    Returns the bin of each sample, or None if one fits nowhere.
    """
    n, B = seq_lens.size, width.size
    if order is None:
        order = stable_argsort_via(costs, seq_lens, descending=True)  # costs usually rise with length
    load_c = np.zeros(B, dtype=np.float64) if load is None else load
    load_t = np.zeros(B, dtype=np.int64) if tokens is None else tokens
    room_t = None if cap is None else width * cap if room is None else room
    ex, ex_cap = extra if extra is not None else (None, 0)
    load_x = np.zeros(B, dtype=np.int64) if extra_load is None else extra_load.astype(np.int64)
    inv_w = 1.0 / width if increments is None else increments[0]
    tok_w = None if increments is None else increments[1]
    unit = increments is None and bool((width == 1).all())  # x · 1.0 + 0.0 == x: the scaling is skipped
    cs, ts = costs[order], seq_lens[order]  # in placement order: a round's chunk is a slice, not a gather
    lim = cap if room is None and cap is not None and bool((width == 1).all()) else None  # one room for every bin
    bin_of = np.empty(n, dtype=np.int64)
    pos = 0
    while pos < n:
        srt = load_c.argsort(kind="stable")
        size = min(B, n - pos)
        top = srt[:size]
        ls = load_c[top]
        cc = cs[pos:pos + size]
        if unit:
            ok_prefix = ls <= ls[0] + cc
        else:
            ok_prefix = ls <= ls[0] + cc * inv_w[top] + (0.0 if tok_w is None else ts[pos:pos + size] * tok_w[top])
        k = int(ok_prefix.argmin())  # the first bin a one-at-a-time LPT might not reach
        c = size if ok_prefix[k] else max(k, 1)
        chunk, bins, cc, tc = order[pos:pos + c], top[:c], cc[:c], ts[pos:pos + c]
        held = load_t[bins] + tc
        fits = None if room_t is None else held <= (lim if lim is not None else room_t[bins])
        if ex is not None:
            xc = ex[chunk]
            fits = (load_x[bins] + xc <= ex_cap) if fits is None else fits & (load_x[bins] + xc <= ex_cap)
        if fits is not None and np.count_nonzero(fits) < c:  # (cheaper than fits.all()'s reduction)
            chunk, bins, cc, tc, rest = chunk[fits], bins[fits], cc[fits], tc[fits], chunk[~fits]
            xc = None if ex is None else xc[fits]
            bin_of[chunk] = bins
            load_c[bins] += cc if unit else cc * inv_w[bins] + (0.0 if tok_w is None else tc * tok_w[bins])
            load_t[bins] += tc
        else:  # the whole chunk fits: the loads gathered above are the bins' loads
            rest = chunk[:0]
            bin_of[chunk] = bins
            load_c[bins] = ls[:c] + cc if unit else ls[:c] + (cc * inv_w[bins] + (0.0 if tok_w is None
                                                                                  else tc * tok_w[bins]))
            load_t[bins] = held
        if ex is not None:
            load_x[bins] += xc
        if rest.size and not _place_rest(rest, bin_of, seq_lens, costs, load_c, load_t, room_t, inv_w, tok_w,
                                         ex, load_x, ex_cap):
            return None
        pos += c
    return bin_of


def _place_rest(rest: np.ndarray, bin_of: np.ndarray, seq_lens: np.ndarray, costs: np.ndarray,
                load_c: np.ndarray, load_t: np.ndarray, room_t: np.ndarray | None, inv_w: np.ndarray,
                tok_w: np.ndarray | None, ex: np.ndarray | None, load_x: np.ndarray, ex_cap: int) -> bool:
    """Samples ``rest`` (in placement order) each to the least-loaded bin with room, ties to the
    lower bin; loads updated in place. False when one fits no bin. Batched when the state allows
    it (:func:`_place_rest_batched`), else one at a time (:func:`_place_rest_one_by_one`)."""
    if (ex is None and room_t is not None and all(a.dtype.kind in "iu" for a in (seq_lens, load_t, room_t))
            and all(a.dtype == np.float64 for a in (load_c, inv_w) + (() if tok_w is None else (tok_w,)))
            and bool(np.isfinite(load_c).all())):
        return _place_rest_batched(rest, bin_of, seq_lens, costs, load_c, load_t, room_t, inv_w, tok_w)
    return _place_rest_one_by_one(rest, bin_of, seq_lens, costs, load_c, load_t, room_t, inv_w, tok_w,
                                  ex, load_x, ex_cap)


def _place_rest_one_by_one(rest: np.ndarray, bin_of: np.ndarray, seq_lens: np.ndarray, costs: np.ndarray,
                           load_c: np.ndarray, load_t: np.ndarray, room_t: np.ndarray | None, inv_w: np.ndarray,
                           tok_w: np.ndarray | None, ex: np.ndarray | None, load_x: np.ndarray,
                           ex_cap: int) -> bool:
    """The reference: per sample, a masked argmin over the bins with room."""
    B = load_c.size
    for s in rest:
        room_s = np.ones(B, dtype=bool) if room_t is None else load_t + seq_lens[s] <= room_t
        if ex is not None:
            room_s &= load_x + ex[s] <= ex_cap
        if not room_s.any():
            return False
        b = int(np.argmin(np.where(room_s, load_c, np.inf)))
        bin_of[s] = b
        load_c[b] += costs[s] * inv_w[b] + (0.0 if tok_w is None else seq_lens[s] * tok_w[b])
        load_t[b] += seq_lens[s]
        if ex is not None:
            load_x[b] += ex[s]
    return True


def _place_rest_batched(rest: np.ndarray, bin_of: np.ndarray, seq_lens: np.ndarray, costs: np.ndarray,
                        load_c: np.ndarray, load_t: np.ndarray, room_t: np.ndarray, inv_w: np.ndarray,
                        tok_w: np.ndarray | None) -> bool:
    """What :func:`_place_rest_one_by_one` does (finite float64 loads, integer tokens, no extra resource),
    each block of ``REST_BLOCK`` samples searching only the bins it can choose. Take the r = block
    size lightest bins with room for the block's longest sample: before each sample of the block at
    most r − 1 of them were taken, so an untaken one (load and room as before) is open to it.
    Placing only adds load (finite increments >= 0, checked; otherwise the reference runs) and
    removes room, so a bin heavier than the r-th, or without room for the block's shortest sample, is never
    chosen. Among the others, kept sorted by (load, bin) as the argmin breaks ties, each sample
    takes the first with room (Python floats: the same float64 additions)."""
    cr = costs[rest]
    if not (np.isfinite(cr).all() and (cr >= 0).all() and (inv_w >= 0).all() and (seq_lens[rest] >= 0).all()
            and (tok_w is None or (tok_w >= 0).all())):  # NaN fails too
        return _place_rest_one_by_one(rest, bin_of, seq_lens, costs, load_c, load_t, room_t, inv_w, tok_w,
                                      None, load_t, 0)
    for at in range(0, rest.size, REST_BLOCK):
        block = rest[at:at + REST_BLOCK]
        lens = seq_lens[block]
        free_all = room_t - load_t
        open_loads = load_c[free_all >= int(lens.max())]
        usable = free_all >= int(lens.min())  # a bin without room for the shortest takes none of the block
        if open_loads.size >= block.size:  # ... nor one heavier than the block.size-th lightest open bin
            usable &= load_c <= np.partition(open_loads, block.size - 1)[block.size - 1]
        bins = np.flatnonzero(usable)
        if not bins.size:  # not even the block's shortest sample fits anywhere
            return False
        free = (room_t[bins] - load_t[bins]).tolist()
        iw = inv_w[bins].tolist()
        tw = None if tok_w is None else tok_w[bins].tolist()
        keyed = sorted(zip(load_c[bins].tolist(), bins.tolist(), range(bins.size)))  # (load, bin): argmin's order
        placed: dict[int, float] = {}  # bin -> its new load
        for s, L, c in zip(block.tolist(), lens.tolist(), costs[block].tolist()):
            for k, e in enumerate(keyed):  # the lightest with room
                if free[e[2]] >= L:
                    break
            else:
                return False
            load, b, p = keyed.pop(k)
            bin_of[s] = b
            free[p] -= L
            placed[b] = load = load + (c * iw[p] + (0.0 if tw is None else L * tw[p]))
            insort(keyed, (load, b, p))
        load_c[list(placed)] = list(placed.values())
        load_t[bins] = room_t[bins] - np.array(free, dtype=load_t.dtype)
    return True


def round_robin_pack(costs: np.ndarray, num_bins: int) -> np.ndarray:
    """Static batching: bins whose sample counts differ by at most one, balanced by cost.

    Samples in descending cost order are dealt in rounds of ``num_bins``; each round gives its
    heaviest sample to the currently lightest bin. Cost: O(n log n + (n/m) · m log m).
    """
    n = costs.size
    order = np.argsort(-costs, kind="stable")
    load = np.zeros(num_bins, dtype=np.float64)
    bin_of = np.empty(n, dtype=np.int64)
    for pos in range(0, n, num_bins):
        chunk = order[pos:pos + num_bins]
        bins = np.argsort(load, kind="stable")[: chunk.size]
        bin_of[chunk] = bins
        load[bins] += costs[chunk]
    return bin_of
