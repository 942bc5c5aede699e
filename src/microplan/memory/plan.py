"""Planning against bytes: ``PlanConfig(memory=M, max_bytes_per_micro=B)``.

Design note. The planner's stages pack under a token cap; bytes are a function of what a
micro-batch holds (``memory/check.py``), monotone in its tokens but not additive over its samples
(Σ L², T² terms). So the byte budget is met by choosing the token cap, per plan, and checking
every micro-batch's bytes:

1. Every sample alone must fit: its predicted bytes in a micro-batch of its own (over the widest
   CP group the config allows), margin included, ≤ B; else a PlanError naming the sample, its
   bytes, the budget and the fixes (context parallel, chunked log-probs, checkpointing).
2. Bracket the cap: ``hi`` = the most tokens one GPU may hold before its linear terms alone exceed
   B (and ≤ ``max_tokens_per_micro`` when given: both caps hold); ``lo`` = the least cap at which
   every sample fits a micro-batch (``footprint.check_fits``).
3. Plan at ``hi``; if every micro-batch's bytes fit, done. Else binary-search the largest cap in
   [lo, hi) whose plan fits (each candidate planned in full and checked with the same function
   validate uses). The plan returned is always one that was checked; if even ``lo`` does not fit
   (a dense-mask model: two short samples at the longest sample's length hold more than it alone),
   a PlanError names the micro-batch and the fix.

Samples alone as the fallback. A second priced resource (vision patches, ``per_vision_token``)
can put a micro-batch over the budget at every token cap that holds each sample (short samples
with many patches packed together); where the layout lets a sample run alone (plain varlen rows,
no padding multiples, sharing or CP) the search then runs again as under a dense mask below, in
which cap 1 (every sample alone) always fits. Configs whose first search finds a cap plan as
before.

Dense masks. Under a model with a packed-row term (``per_row_sq``: transformers' sdpa/eager over
a packed row) a lone sample pays no mask, so a sample of L tokens may fit alone while a pack of
two shorter ones at the same L does not: no token cap is safe there. For a varlen layout without
padding multiples, sharing or CP, the cap searched is then the PACK cap C, and every sample
longer than C runs in a micro-batch of its own (``lone_context``: the packers see it as C tokens,
so nothing else fits beside it). Every cap is feasible (C = 1 runs every sample alone, and each
fits alone by step 1); the plan's config carries max(C, the longest sample) as its token cap, so
``Plan.validate`` checks both caps.

The plan's config carries the cap chosen (``max_tokens_per_micro``) beside the memory model, so
``Plan.validate`` checks both and planning again from ``plan.config`` gives the same plan (its
cap is tried first; not guaranteed when long samples ran alone, whose cap is the longest
sample). Cost: one plan per bisection step, ⌈log2(hi − lo)⌉ + 2 plans at most (twice that
when the fallback runs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from ..errors import PlanError
from ..footprint import Footprint, check_fits, footprint_of
from .check import FIXES, plan_micro_bytes, sample_bytes

if TYPE_CHECKING:  # pragma: no cover
    from ..batch import Batch
    from ..config import PlanConfig
    from ..plan import Plan
    from ..stages.context import PlanContext

__all__ = ["plan_with_memory", "byte_token_bound", "lone_context", "pack_token_bound"]


def _widest_cp(cfg: PlanConfig) -> int:
    cp = cfg.context_parallel
    if cp is None:
        return 1
    return int(cp.max_size if cp.dynamic else cp.size)  # type: ignore[arg-type]


def byte_token_bound(cfg: PlanConfig) -> int:
    """The most tokens one GPU may hold before ``per_micro + per_token·tokens`` alone, margin
    included, exceeds the budget (every other term only adds bytes); at least 1."""
    m, b = cfg.memory, cfg.max_bytes_per_micro
    assert m is not None and b is not None
    rooms = [(b / (1.0 + m.margin) - p.per_micro) / p.per_token for p in m.phases() if p.per_token > 0]
    return max(1, min(2 ** 50, int(min(rooms))))


def pack_token_bound(cfg: PlanConfig) -> int:
    """The most tokens a packed row of two or more samples may hold under a dense model:
    ``per_micro + per_token·T + per_row_sq·T²``, margin included, within the budget (at least 1)."""
    m, b = cfg.memory, cfg.max_bytes_per_micro
    assert m is not None and b is not None
    best = float(2 ** 50)
    for p in m.phases():  # each phase's bytes must fit
        room = b / (1.0 + m.margin) - p.per_micro
        if room <= 0:
            return 1
        a, q = p.per_token, p.per_row_sq
        best = min(best, (-a + (a * a + 4.0 * q * room) ** 0.5) / (2.0 * q) if q > 0 else room / a)
    return max(1, int(best))


def _lone_layout(cfg: PlanConfig) -> bool:
    """Plain varlen rows, no sharing, no CP: a sample may run alone in a micro-batch of its own."""
    return (cfg.layout == "varlen" and cfg.pad_to_multiple_of == 1 and cfg.pad_row_to_multiple_of == 1
            and not cfg.share_prefixes and cfg.context_parallel is None)


def _lone_mode(cfg: PlanConfig) -> bool:
    """Dense model in a lone layout: long samples run alone from the start."""
    return cfg.memory is not None and cfg.memory.dense and _lone_layout(cfg)


def lone_context(ctx: PlanContext, cap: int) -> PlanContext:
    """``ctx`` whose packers see every sample longer than ``cap`` as ``cap`` tokens (so it runs
    alone in a micro-batch: nothing else fits beside it). Micro-batches keep the real footprint
    (``ctx.mfp``) and costs; ``Plan.validate`` re-derives both from the batch."""
    fp = ctx.fp
    clipped = Footprint(fp.padding, fp.seq_lens, prompt_lens=fp.prompt_lens, vision_tokens=fp.vision_tokens,
                        vision_costs=fp.vision_costs)
    st = np.minimum(fp.sample_tokens, cap)
    st.setflags(write=False)
    clipped.sample_tokens = st
    return ctx._replace(fp=clipped)


def _check_alone(batch: Batch, cfg: PlanConfig) -> None:
    m, budget = cfg.memory, cfg.max_bytes_per_micro
    assert m is not None and budget is not None
    width = _widest_cp(cfg)
    from ..prefix import forest_of
    forest = forest_of(batch) if cfg.share_prefixes else None  # a lone sample still runs as a tree row
    alone = m.with_margin(sample_bytes(footprint_of(batch, cfg), m, width, forest=forest))
    if alone.size and int(alone.max()) > budget:
        j = int(np.argmax(alone))
        cp = f" over a CP group of {width} GPUs" if width > 1 else ""
        raise PlanError(f"sample {j} ({int(batch.seq_lens[j]):,} tokens) alone{cp} is predicted to add "
                        f"{int(alone[j]):,} bytes (margin {m.margin:.1%} included), more than "
                        f"max_bytes_per_micro={budget:,}. Fix: {FIXES}.")


def _least_cap(batch: Batch, cfg: PlanConfig, hi: int) -> int:
    """The least token cap at which every sample fits a micro-batch (check_fits is monotone in it)."""
    fp = footprint_of(batch, cfg)
    try:
        check_fits(fp, replace(cfg, max_tokens_per_micro=hi))
    except PlanError as exc:
        raise PlanError(f"with the token cap {hi:,} that max_bytes_per_micro={cfg.max_bytes_per_micro:,} allows "
                        f"(or max_tokens_per_micro, when given): {exc}") from None
    lo, top = 0, hi  # check fails at lo (or lo = 0), passes at top
    while top - lo > 1:
        mid = (lo + top) // 2
        try:
            check_fits(fp, replace(cfg, max_tokens_per_micro=mid))
            top = mid
        except PlanError:
            lo = mid
    return top


def plan_with_memory(batch: Batch, config: PlanConfig, build: Callable[..., Plan]) -> Plan:
    """Plan ``batch`` so every micro-batch's predicted bytes fit ``config.max_bytes_per_micro``
    (see the module note); ``build(batch, cfg, lone_above)`` plans under a token cap."""
    _check_alone(batch, config)
    fp = footprint_of(batch, config)
    lone = _lone_mode(config)
    try:
        return _search(batch, config, build, fp, lone)
    except _NoCap as exc:
        if lone or not _lone_layout(config):
            raise PlanError(str(exc)) from None
        try:  # a second priced resource (vision patches) beside the tokens: long samples alone
            return _search(batch, config, build, fp, True)
        except _NoCap:
            raise PlanError(str(exc)) from None


class _NoCap(Exception):
    """No token cap of the search kept every micro-batch under the budget (its message)."""


def _search(batch: Batch, config: PlanConfig, build: Callable[..., Plan], fp: Footprint, lone: bool) -> Plan:
    """The largest token cap, by bisection, whose plan fits the budget (``lone``: samples longer
    than the cap run alone); _NoCap when even the least cap does not fit."""
    hi = pack_token_bound(config) if lone else byte_token_bound(config)
    longest = int(fp.sample_tokens.max())
    if config.max_tokens_per_micro is not None:
        hi = min(hi, config.max_tokens_per_micro)
        if lone:
            check_fits(fp, config)  # every sample within the user's cap
    lo = 1 if lone else _least_cap(batch, config, hi)

    def attempt(cap: int) -> tuple[Plan, tuple[int, int, int, int] | None]:
        cfg = replace(config, max_tokens_per_micro=cap)
        p = build(batch, cfg, cap) if lone else build(batch, cfg)
        if lone and longest > cap:  # the lone samples' tokens: the plan's cap is their length
            cfg = replace(config, max_tokens_per_micro=longest)
            p = type(p)(batch=batch, config=cfg, steps=p.steps, dropped=p.dropped, drop_reasons=p.drop_reasons)
        for s, grid in enumerate(plan_micro_bytes(batch, cfg, p.steps, fp)):
            over = np.argwhere(config.memory.with_margin(grid) > config.max_bytes_per_micro)  # type: ignore[union-attr]
            if over.size:
                r, m = (int(x) for x in over[0])
                return p, (s, r, m, int(grid[r, m]))
        return p, None

    best, bad = attempt(hi)
    if bad is None:
        return best
    first_bad = bad
    if lo < hi:
        p, bad = attempt(lo)
        if bad is None:
            best, good = p, lo
            top = hi
            while top - good > 1:
                mid = (good + top) // 2
                p, bad = attempt(mid)
                if bad is None:
                    best, good = p, mid
                else:
                    top = mid
            return best
    s, r, m, nbytes = bad if bad is not None else first_bad
    raise _NoCap(f"no token cap keeps every micro-batch under max_bytes_per_micro={config.max_bytes_per_micro:,}: "
                 f"at the least cap that holds every sample ({lo:,} tokens), step {s}, rank {r}, micro {m} is "
                 f"predicted to add {nbytes:,} bytes (margin {config.memory.margin:.1%} on top). The memory "  # type: ignore[union-attr]
                 "model charges a packed row more than its samples alone (a dense mask, or vision patches "
                 "packed beside the tokens); use a per-sample attention "
                 "kernel (flash-attn varlen, microplan.torch.register_attention()), plain varlen rows without "
                 f"padding multiples, sharing or CP (then long samples run alone), or {FIXES}.")
