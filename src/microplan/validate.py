"""The invariant checker: re-derives every guarantee of a plan from its batch and config.

Checks, in order (the first violation raises PlanError naming step, rank and micro-batch):
shape (dp_size rows, equal K per rank, K a multiple of align), then coverage of every step at
once (a sample missing, or in two places, is named with where it is — before the loss scales or
the cap trip over its symptom: ``_check_coverage``), micro-batch contents (arrays
aligned and matching the batch, placeholders empty; under placement="local" every sample on its
``rank_of``), the token cap counting padding (the footprint of the config's layout, re-derived
here, not read from the Micro) and the vision cap / micro_batch_size, CP
groups (consistent members, power-of-two sizes, no GPU over the cap), coverage (every sample in
exactly one micro-batch or in ``dropped`` with a reason), step atomicity of rollouts and prompt
groups, and the loss scales (recomputed from the loss contract; all 0 in a forward plan), and
K >= pipeline_stages; with a memory model, every micro-batch's predicted bytes (margin included)
within ``max_bytes_per_micro`` (``memory/check.py``). Cost: O(total samples + dp·K).

Vectorised: a step's micro-batches are read once into flat arrays (their samples concatenated,
each tagged with its micro-batch), every per-micro-batch check runs as one numpy expression, and
only the first flagged micro-batch is re-checked one by one (``_check_micro``) for the exact
message. Prefix trees and dynamic CP groups are checked per micro-batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain, repeat
from operator import attrgetter, ne

import numpy as np

from .batch import Batch
from .config import PlanConfig
from .errors import PlanError
from .footprint import Footprint, footprint_of, gpu_tokens, micro_footprint
from .memory.check import check_byte_cap
from .prefix import forest_of, micro_tree
from .stages.weigh import loss_coefficients, loss_scales
from .types import Micro, Step, _same_rules

__all__ = ["validate_plan"]


def _fail(msg: str) -> None:
    raise PlanError(f"invalid plan: {msg}")


def _check_micro(b: Batch, cfg: PlanConfig, s: int, r: int, m: int, micro: Micro, fp: Footprint) -> None:
    where = f"step {s}, rank {r}, micro {m}"
    k = micro.indices.size
    if not (micro.seq_lens.size == micro.loss_tokens.size == micro.loss_scale.size == k):
        _fail(f"{where}: indices, seq_lens, loss_tokens and loss_scale are not aligned")
    if k and (micro.indices.min() < 0 or micro.indices.max() >= b.num_samples):
        _fail(f"{where}: sample index out of range 0..{b.num_samples - 1}")
    if not np.array_equal(micro.seq_lens, b.seq_lens[micro.indices]) or \
            not np.array_equal(micro.loss_tokens, b.loss_tokens[micro.indices]):
        _fail(f"{where}: seq_lens/loss_tokens differ from the batch")
    if not np.isfinite(micro.loss_scale).all():
        _fail(f"{where}: non-finite loss_scale")
    if cfg.share_prefixes and k:
        parent, shared = forest_of(b)
        if micro.tree is None or micro.tree != micro_tree(parent, shared, b.seq_lens, micro.indices,
                                                         rules=fp.row_rules()):
            _fail(f"{where}: the prefix tree does not match the batch's shared prefixes for these samples")
        if micro.tree.num_tokens > int(micro.seq_lens.sum()):  # type: ignore[union-attr]
            _fail(f"{where}: the prefix tree holds more tokens than its samples unshared")
    elif micro.tree is not None and not cfg.share_prefixes:
        _fail(f"{where}: a prefix tree in a plan made without share_prefixes")
    cp = cfg.context_parallel
    if cp is not None and cp.dynamic:
        if micro.cp_size & (micro.cp_size - 1) or micro.cp_size > cp.max_size:  # type: ignore[operator]
            _fail(f"{where}: dynamic CP size {micro.cp_size} is not a power of two <= max_size={cp.max_size}")
    elif micro.cp_size != cfg.static_cp_size or micro.cp_rank != 0 or micro.cp_group != (r,):
        _fail(f"{where}: CP fields (size {micro.cp_size}, rank {micro.cp_rank}, group {micro.cp_group}) do not "
              f"match the config (size {cfg.static_cp_size})")
    if not _same_rules(micro.footprint, micro_footprint(fp)):
        _fail(f"{where}: the micro-batch's layout/padding rules differ from the config's ({fp.padding})")
    if cfg.max_tokens_per_micro is not None:
        # what the GPU holds: the (validated) prefix trie, or the footprint re-derived from the batch
        held = 0 if not k else fp.tree_tokens(micro.tree) if cfg.share_prefixes else fp.tokens(micro.indices)  # type: ignore[arg-type]
        gpu = gpu_tokens(held, micro.cp_size)  # the fullest GPU of its CP group: ⌈held / cp_size⌉
        if gpu > cfg.max_tokens_per_micro:
            pad = "" if held == int(micro.seq_lens.sum()) else f" (padding included, layout={cfg.layout!r})"
            _fail(f"{where}: {held} tokens{pad} over cp_size {micro.cp_size} exceed the per-GPU cap "
                  f"max_tokens_per_micro={cfg.max_tokens_per_micro}")
        vcap = cfg.max_vision_tokens_per_micro
        if vcap is not None and k and fp.vision(micro.indices) > vcap:
            _fail(f"{where}: {fp.vision(micro.indices)} vision tokens exceed max_vision_tokens_per_micro={vcap}")
    elif k > cfg.micro_batch_size:  # type: ignore[operator]
        _fail(f"{where}: {k} samples exceed micro_batch_size={cfg.micro_batch_size}")


def _check_pinned(rank_of: np.ndarray, s: int, r: int, m: int, micro: Micro) -> None:
    away = rank_of[micro.indices] != r
    if away.any():
        i = int(micro.indices[away][0])
        _fail(f"step {s}, rank {r}, micro {m}: sample {i} is pinned to rank {int(rank_of[i])} (placement='local') "
              f"but runs on rank {r}")


def _check_cp_groups(step: Step, s: int) -> None:
    for r, row in enumerate(step.micros):
        for m, micro in enumerate(row):
            g = micro.cp_group
            if len(g) != micro.cp_size or not 0 <= micro.cp_rank < micro.cp_size or g[micro.cp_rank] != r:
                _fail(f"step {s}, rank {r}, micro {m}: CP group {g} does not hold rank {r} at cp_rank {micro.cp_rank}")
            for q, other in enumerate(g):
                peer = step.micros[other][m]
                if peer.cp_group != g or peer.cp_rank != q or not np.array_equal(peer.indices, micro.indices):
                    _fail(f"step {s}, micro {m}: ranks {r} and {other} disagree on their CP group")


def validate_plan(b: Batch, cfg: PlanConfig, steps: Sequence[Step], dropped: np.ndarray,
                  drop_reasons: Mapping[int, str], *, forward: bool = False) -> None:
    """Raise PlanError naming the first violated invariant of the plan given by its parts
    (``forward``: a forward plan, whose loss scales are all exactly 0)."""
    owner = np.full(b.num_samples, -1, dtype=np.int64)  # step of each sample
    try:
        fp = footprint_of(b, cfg)
    except PlanError as exc:
        raise PlanError(f"invalid plan: {exc}") from None
    if cfg.placement == "local" and b.rank_of is None:
        _fail("placement='local' but the batch has no rank_of (the rank that holds each sample)")
    for s, step in enumerate(steps):
        if step.index != s:
            _fail(f"step {s} carries index {step.index}")
        if len(step.micros) != cfg.dp_size:
            _fail(f"step {s} has {len(step.micros)} ranks, expected dp_size={cfg.dp_size}")
        K = step.micro_count
        for r, row in enumerate(step.micros):
            if len(row) != K:
                _fail(f"step {s}: rank {r} has {len(row)} micro-batches, rank 0 has {K}; counts must be equal")
        if K == 0 or K % cfg.align:
            _fail(f"step {s}: {K} micro-batches per rank is not a positive multiple of align={cfg.align}")
        if K < cfg.pipeline_stages:
            _fail(f"step {s}: {K} micro-batches per rank is fewer than pipeline_stages={cfg.pipeline_stages}")
    _check_coverage(b, steps, dropped)
    for s, step in enumerate(steps):
        K = step.micro_count
        flat = _Flat(step, K)
        _screen_micros(b, cfg, s, flat, fp)
        _check_placeholders(cfg, s, flat, forward)
        if cfg.context_parallel is not None and cfg.context_parallel.dynamic:
            _check_cp_groups(step, s)
        idx = flat.idx[flat.cp_rank[flat.micro_of] == 0]
        if np.unique(idx).size != idx.size:
            _fail(f"step {s}: a sample appears in two micro-batches")
        if (owner[idx] >= 0).any():
            _fail(f"step {s}: sample {int(idx[owner[idx] >= 0][0])} already trains in an earlier step")
        owner[idx] = s
        if not np.array_equal(np.sort(idx), step.samples):
            _fail(f"step {s}: Step.samples differs from the samples in its micro-batches")
        if not idx.size:
            _fail(f"step {s} trains no sample")
        if forward:
            _check_zero_scales(flat, s)
        else:
            _check_scales(b, cfg, step, flat, s)
    if dropped.size and (dropped.min() < 0 or dropped.max() >= b.num_samples):
        bad = int(dropped[(dropped < 0) | (dropped >= b.num_samples)][0])
        _fail(f"dropped sample {bad} is out of range 0..{b.num_samples - 1}")
    if np.unique(dropped).size != dropped.size:
        _fail("a sample is listed twice in dropped")
    if (owner[dropped] >= 0).any():
        _fail(f"sample {int(dropped[owner[dropped] >= 0][0])} is both dropped and planned")
    if set(drop_reasons) != set(dropped.tolist()):
        _fail("drop_reasons does not give a reason for exactly the dropped samples")
    owner[dropped] = len(steps)
    check_byte_cap(b, cfg, steps, fp)  # the byte budget (memory/check.py): a no-op without a memory model
    lost = np.flatnonzero(owner < 0)
    if lost.size:
        _fail(f"sample {int(lost[0])} is neither planned nor dropped ({lost.size} such samples)")
    for name, codes in (("rollout", b.rollout_codes), ("prompt group", b.prompt_codes)):
        planned = owner < len(steps)
        if planned.any():
            c, st = codes[planned], owner[planned]
            lo = np.full(int(codes.max()) + 1, np.iinfo(np.int64).max)
            hi = np.full(int(codes.max()) + 1, -1)
            np.minimum.at(lo, c, st)
            np.maximum.at(hi, c, st)
            bad = np.flatnonzero((hi >= 0) & (lo != hi))
            if bad.size:
                _fail(f"{name} {int(bad[0])} spans steps {int(lo[bad[0]])} and {int(hi[bad[0]])}")


def _check_coverage(b: Batch, steps: Sequence[Step], dropped: np.ndarray) -> None:
    """Name a sample that is missing (in no micro-batch and not dropped) or in two places, and
    where, before the later checks trip over its symptom (a loss scale off by the missing sample's
    tokens, a cap overflowed by the doubled one). A CP group's members hold the same samples: only
    its cp_rank-0 member counts. Indices out of range are left to the micro-batch checks."""
    n = b.num_samples
    micros = [m for step in steps for row in step.micros for m in row]
    lead = [m.indices for m in micros if m.cp_rank == 0]
    idx = np.concatenate([*lead, np.asarray(dropped, dtype=np.int64)]).astype(np.int64, copy=False)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        return
    count = np.bincount(idx, minlength=n)
    twice = np.flatnonzero(count > 1)
    if twice.size:
        i = int(twice[0])
        places = _places_of(steps, i)
        drops = int(np.count_nonzero(dropped == i))
        if drops > 1:
            _fail(f"sample {i} is listed twice in dropped")
        if drops:
            _fail(f"sample {i} is both dropped and planned (in {places[0]}); a sample trains once or is dropped")
        if len(places) == 1:
            _fail(f"sample {i} appears {int(count[i])} times in {places[0]}; every sample trains once")
        _fail(f"sample {i} appears in {'two' if len(places) == 2 else len(places)} micro-batches: "
              f"{' and '.join(places)}; every sample trains in exactly one micro-batch")
    missing = np.flatnonzero(count == 0)
    if missing.size:
        seen = np.zeros(n, dtype=bool)  # held by a CP member whose fields the CP checks will name
        for m in micros:
            ix = m.indices
            seen[ix[(ix >= 0) & (ix < n)]] = True  # out of range: left to the micro-batch checks
        missing = missing[~seen[missing]]
    if missing.size:
        i = int(missing[0])
        peers = np.flatnonzero((b.prompt_codes == b.prompt_codes[i]) & (count > 0) & ~np.isin(np.arange(n), dropped))
        near = f"; its prompt group's sample {int(peers[0])} trains in {_places_of(steps, int(peers[0]))[0]}" \
            if peers.size else ""
        _fail(f"sample {i} is neither planned nor dropped: it is in no micro-batch and not in dropped "
              f"({missing.size} such sample{'s' if missing.size > 1 else ''}){near}")


def _places_of(steps: Sequence[Step], i: int) -> list[str]:
    """Where sample ``i`` trains: ``"step s, rank r, micro m"`` per cp_rank-0 micro-batch holding it."""
    return [f"step {s}, rank {r}, micro {k}" for s, step in enumerate(steps) for r, row in enumerate(step.micros)
            for k, m in enumerate(row) if m.cp_rank == 0 and (m.indices == i).any()]


def _check_placeholders(cfg: PlanConfig, s: int, flat: _Flat, forward: bool) -> None:
    """The ``short_step`` rule (placeholders under ``"pad"`` only; a forward plan's own geometry
    is a ``"pad"`` plan) and their order: without a pipeline order every rank runs its real
    micro-batches first, placeholders after (``assign.arrange`` and ``stages/cp.py`` lay them out
    so; under ``pipeline_stages > 1`` the pipeline order may run a cheap placeholder early)."""
    ph = (flat.size == 0).reshape(-1, flat.K)
    if not ph.any():
        return
    if cfg.short_step != "pad" and not forward:
        r, m = (int(x[0]) for x in np.nonzero(ph))
        _fail(f"step {s}, rank {r}, micro {m}: a placeholder micro-batch under short_step={cfg.short_step!r}, "
              "which never pads (it drops trailing rollouts or raises); only short_step='pad' plans placeholders")
    if cfg.pipeline_stages == 1:
        late = ph[:, :-1] & ~ph[:, 1:]
        if late.any():
            r, m = (int(x[0]) for x in np.nonzero(late))
            _fail(f"step {s}, rank {r}: placeholder micro {m} runs before the real micro-batch {m + 1}; a rank runs "
                  "its placeholders after its real micro-batches (pipeline_stages=1)")


def _check_zero_scales(flat: _Flat, s: int) -> None:
    bad = flat.scale != 0
    if bad.any():
        r, m = flat.where(int(flat.micro_of[np.argmax(bad)]))
        _fail(f"step {s}, rank {r}, micro {m}: a forward plan carries loss_scale 0 for every sample")


def _check_scales(b: Batch, cfg: PlanConfig, step: Step, flat: _Flat, s: int) -> None:
    idx = step.samples
    assert cfg.loss is not None
    coef = loss_coefficients(cfg.loss, b.loss_tokens[idx], b.prompt_codes[idx], b.rollout_codes[idx])
    want = loss_scales(cfg.loss, coef, grad_world=cfg.grad_world, micro_count=step.micro_count)
    scale_of = np.zeros(b.num_samples)
    scale_of[idx] = want
    expect = scale_of[flat.idx]
    bad = ~(np.abs(flat.scale - expect) <= 1e-12 * np.abs(expect))  # np.allclose(rtol=1e-12, atol=0), NaN fails
    if bad.any():
        r, m = flat.where(int(flat.micro_of[np.argmax(bad)]))
        _fail(f"step {s}, rank {r}, micro {m}: loss_scale differs from the loss contract "
              f"({cfg.loss.mode}, W={cfg.grad_world})")


class _Flat:
    """One step's micro-batches read once: per micro-batch (flat id r·K + m) its fields, and the
    concatenation of their sample arrays, each entry tagged with its micro-batch (``micro_of``).

    ``limit``: micro-batches before the first whose four arrays differ in length (all when none);
    only those are concatenated, so every entry lines up with its micro-batch.
    """

    def __init__(self, step: Step, K: int) -> None:
        self.K = K
        self.micros = list(chain.from_iterable(step.micros))
        F = len(self.micros)
        arrays = [list(map(attrgetter(f), self.micros)) for f in ("indices", "seq_lens", "loss_tokens", "loss_scale")]
        sizes = [np.fromiter(map(len, a), dtype=np.int64, count=F) for a in arrays]
        off = np.flatnonzero((sizes[1] != sizes[0]) | (sizes[2] != sizes[0]) | (sizes[3] != sizes[0]))
        self.limit = int(off[0]) if off.size else F
        self.size = sizes[0]
        full = np.flatnonzero(self.size[:self.limit]).tolist()  # placeholders hold nothing: skip them
        cat = [np.concatenate([a[f] for f in full]) if full else np.zeros(0) for a in arrays]
        self.idx, self.seq_lens, self.loss_tokens = (c.astype(np.int64, copy=False) for c in cat[:3])
        self.scale = cat[3].astype(np.float64, copy=False)
        self.micro_of = np.repeat(np.arange(self.limit, dtype=np.int64), self.size[:self.limit])
        self.cp_size = np.fromiter(map(attrgetter("cp_size"), self.micros), dtype=np.int64, count=F)
        self.cp_rank = np.fromiter(map(attrgetter("cp_rank"), self.micros), dtype=np.int64, count=F)

    def where(self, f: int) -> tuple[int, int]:
        """(rank, slot) of flat micro-batch ``f``."""
        return divmod(f, self.K)


def _screen_micros(b: Batch, cfg: PlanConfig, s: int, flat: _Flat, fp: Footprint) -> None:
    """Every check of ``_check_micro`` (and ``_check_pinned`` under local placement) on all of a
    step's micro-batches at once; the first flagged one is re-checked alone for its message."""
    bad = np.zeros(flat.limit, dtype=bool)
    n, idx, at = b.num_samples, flat.idx, flat.micro_of
    oob = (idx < 0) | (idx >= n)
    bad[at[oob]] = True
    safe = np.where(oob, 0, idx)
    wrong = (flat.seq_lens != b.seq_lens[safe]) | (flat.loss_tokens != b.loss_tokens[safe]) | ~np.isfinite(flat.scale)
    bad[at[wrong]] = True
    micros = flat.micros[:flat.limit]
    if cfg.share_prefixes:  # trees: re-derived one micro-batch at a time
        bad |= np.fromiter((m.indices.size > 0 for m in micros), dtype=bool, count=flat.limit)
    else:
        trees = list(map(attrgetter("tree"), micros))
        if trees.count(None) != len(trees):
            bad |= np.array([t is not None for t in trees], dtype=bool)
    size, rank = flat.cp_size[:flat.limit], flat.cp_rank[:flat.limit]
    cp = cfg.context_parallel
    if cp is not None and cp.dynamic:
        bad |= ((size & (size - 1)) != 0) | (size > cp.max_size)  # type: ignore[operator]
    else:
        own = chain.from_iterable(repeat((r,), flat.K) for r in range(len(flat.micros) // max(flat.K, 1)))
        bad |= (size != cfg.static_cp_size) | (rank != 0)
        bad |= np.fromiter(map(ne, map(attrgetter("cp_group"), micros), own), dtype=bool, count=flat.limit)
    bad |= _other_rules(micros, micro_footprint(fp))
    count = flat.size[:flat.limit]
    if cfg.max_tokens_per_micro is not None:
        if not cfg.share_prefixes:
            bad |= fp.bin_tokens(safe, at, flat.limit) > size * cfg.max_tokens_per_micro
        vcap = cfg.max_vision_tokens_per_micro
        if vcap is not None and fp.vision_tokens is not None:
            bad |= np.bincount(at, weights=fp.vision_tokens[safe], minlength=flat.limit) > vcap
    else:
        bad |= count > cfg.micro_batch_size  # type: ignore[operator]
    if cfg.placement == "local":
        away = b.rank_of[safe] != at // flat.K  # type: ignore[index]
        bad[at[away]] = True
    first = np.flatnonzero(bad)
    f = int(first[0]) if first.size else flat.limit
    if f == len(flat.micros):
        return
    r, m = flat.where(f)
    _check_micro(b, cfg, s, r, m, flat.micros[f], fp)
    if cfg.placement == "local":
        _check_pinned(b.rank_of, s, r, m, flat.micros[f])  # type: ignore[arg-type]
    if cfg.share_prefixes:  # trees pass: carry on past this micro-batch, one at a time
        for g in range(f + 1, len(flat.micros)):
            if bad[g] if g < flat.limit else True:
                r, m = flat.where(g)
                _check_micro(b, cfg, s, r, m, flat.micros[g], fp)
                if cfg.placement == "local":
                    _check_pinned(b.rank_of, s, r, m, flat.micros[g])  # type: ignore[arg-type]
        return
    _fail(f"step {s}, rank {r}, micro {m}: the micro-batch fails a check that its own re-check passes "
          "(a validate bug: please report it)")


def _other_rules(micros: list[Micro], want: Footprint | None) -> np.ndarray:
    """Micro-batches whose footprint rules differ from the config's (each distinct footprint once)."""
    fps = list(map(attrgetter("footprint"), micros))
    ids = list(map(id, fps))
    odd = {i for i, f in dict(zip(ids, fps)).items() if not _same_rules(f, want)}
    if not odd:
        return np.zeros(len(micros), dtype=bool)
    return np.fromiter(map(odd.__contains__, ids), dtype=bool, count=len(micros))
