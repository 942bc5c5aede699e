"""Measure a model's micro-batch cost: ``profile_cost(run_micro, *, max_tokens_per_micro) -> CalibrationResult``.

Design note. The cost model is linear in four features of a micro-batch, ``[Σ L, Σ L², T², 1]``
with the dense-kernel regime pricing packs by T² and lone samples by L² (``microplan.cost.models``). Timing micro-batches the planner would make (all near the cap, all
alike) cannot separate them; the profiler therefore times a *designed* set of compositions:

1. Design (:func:`profile_design`). For the cap C: single samples of C, C/2, C/4, C/8 (Σ L² = T²:
   linear vs attention), packs of 2 × C/2, 8 × C/8 and many short samples at T = C (same T,
   different Σ L²: per-sample vs packed-row attention), a mixed pack, packs at T = C/2 and C/4
   (different totals) and a tiny sample and pack (``per_micro``). Held out: random packs of
   random lengths at random totals (seeded), never fitted, only predicted.
2. Identifiability. Before any timing, the design's features (column-normalised, each row
   scaled to unit norm as the relative fit weighs it) must have a smallest/largest singular value
   ratio above ``1e-3``; otherwise a ``PlanError`` names the confounded terms and what to time
   instead (user-given compositions, a cap too small).
3. Time. Warm up (the largest single, the many-sample pack, the tiny one), then passes over every
   composition in a seeded random order (drift spreads over all of them); each composition's time
   is the median over passes. CUDA: events + synchronize (:func:`microplan.torch.time_call`);
   CPU: ``perf_counter``. ``time_budget_s`` stops adding passes once the next would overrun it.
4. Fit with :func:`microplan.calibrate` (relative least squares, nonnegative), then predict the
   held-out compositions and classify the attention regime from the fit: the regime calibrate
   chose (``"packed"``: a dense kernel, T² over packs and a cheaper unmasked causal path for a
   lone sample; ``"varlen"``: Σ L² everywhere), or ``"linear"`` when attention is under 3 % of a
   cap-full micro-batch's time.

5. CP (``cp_sizes``). For each CP degree c, :func:`cp_compositions` (samples of c·C, c·C/2 and C,
   packs at c·C and a short row) run through ``run_cp_micro(packed, c)`` in the same passes; the
   CP term (:class:`microplan.CPCost`) is fitted on them against the base fit
   (``cost/cpfit.py``: falls back to perfect scaling when they cannot identify it, named in
   ``CalibrationResult.cp_note``).

Guarantees: every fitted coefficient is >= 0; the result carries R², the held-out median/max
relative error, the regime and every timed row (``rows``: lengths, per-pass seconds, median,
held-out flag). Trade-off: each extra pass costs a full pass of time and buys robustness to
jitter (the median of 3 ignores one disturbed run). A pass at cap 4,096 holds ~11 cap-fulls of
tokens; the time budget stops the passes early on a slow or loaded machine.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._checks import int_field
from ..cost.calibrate import CalibrationResult, calibrate, calibration_row
from ..cost.cp import cp_micro_costs
from ..cost.cpfit import fit_cp
from ..cost.models import FEATURES, CostModel, micro_features
from ..errors import PlanError
from ..types import Micro
from .packing import PackedMicro, pack_micro
from .timing import time_call

__all__ = ["MIN_CAP", "ProfileDesign", "profile_design", "profile_cost", "attention_regime", "check_identifiable",
           "cp_compositions"]

#: Smallest cap the default design accepts.
MIN_CAP = 64
_COND = 1e-3          # smallest/largest singular value of the normalised design
_LINEAR_SHARE = 0.03  # attention below this share of a cap-long sample's time: regime "linear"
_TERM = dict(zip(FEATURES, ("linear", "quadratic", "packed_quadratic", "per_micro")))
_ADVICE = {
    "linear": "samples of several lengths (C/8 .. C)",
    "quadratic": "single long samples AND packs of several samples at the same total (e.g. [C] and 8 × [C/8])",
    "packed_quadratic": "packs of several samples at the same total as a single sample (e.g. [C] and 8 × [C/8])",
    "per_micro": "micro-batches of very different totals (a tiny one of a few tokens and one near the cap)",
}


@dataclass(frozen=True, kw_only=True)
class ProfileDesign:
    """The compositions to time: each a tuple of sample lengths packed into one micro-batch.

    Attributes:
        fit: compositions the coefficients are fitted on.
        heldout: compositions only predicted (the held-out error), disjoint from ``fit``.
    """

    fit: tuple[tuple[int, ...], ...]
    heldout: tuple[tuple[int, ...], ...]


def _fit_compositions(cap: int) -> list[tuple[int, ...]]:
    C = cap
    tiny = max(1, min(16, C // 64))
    n_many = max(2, min(64, C // max(tiny, 16)))
    out = [(C,), (C // 2,), (C // 4,), (C // 8,), (tiny,),
           (C // 2,) * 2, (C // 8,) * 8, (C // n_many,) * n_many,
           (C // 2, C // 4, C // 8, C // 16, C - C // 2 - C // 4 - C // 8 - C // 16),
           (C // 8,) * 4, (C // 32,) * 8, (tiny,) * 4]
    seen, uniq = set(), []
    for comp in out:
        comp = tuple(int(x) for x in comp if x >= 1)
        if comp and sum(comp) <= C and tuple(sorted(comp)) not in seen:
            seen.add(tuple(sorted(comp)))
            uniq.append(comp)
    return uniq


def _heldout_compositions(cap: int, count: int, rng: np.random.Generator,
                          exclude: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    tiny = max(1, min(16, cap // 64))
    out: list[tuple[int, ...]] = []
    for _ in range(50 * max(count, 1)):
        if len(out) >= count:
            break
        total = int(rng.integers(max(1, cap // 4), cap + 1))
        lens, left = [], total
        while left >= tiny:
            L = int(np.exp(rng.uniform(np.log(tiny), np.log(max(tiny, total)))))
            L = max(tiny, min(L, left))
            lens.append(L)
            left -= L
        comp = tuple(lens)
        if comp and tuple(sorted(comp)) not in exclude:
            exclude.add(tuple(sorted(comp)))
            out.append(comp)
    return out


def profile_design(max_tokens_per_micro: int, *, heldout: int = 6, seed: int = 0) -> ProfileDesign:
    """The default compositions for a cap (see the module note); ``heldout`` random packs held out."""
    cap = int_field("max_tokens_per_micro", max_tokens_per_micro, minimum=1)
    count = int_field("profile_design(heldout)", heldout, minimum=0)
    if cap < MIN_CAP:
        raise PlanError(f"max_tokens_per_micro={cap} is too small to profile: below {MIN_CAP} tokens the sample "
                        "lengths cannot vary enough to separate the attention terms from the linear one (and "
                        f"attention is far below timing noise). Profile at a cap of at least {MIN_CAP} tokens — "
                        "the fitted coefficients hold at any cap — or pass your own compositions=.")
    fit = _fit_compositions(cap)
    held = _heldout_compositions(cap, count, np.random.default_rng(seed), {tuple(sorted(c)) for c in fit})
    return ProfileDesign(fit=tuple(fit), heldout=tuple(held))


def check_identifiable(compositions: Sequence[Sequence[int]], *, packed: bool | None = None,
                       what: str = "profile_cost compositions") -> None:
    """Raise ``PlanError`` unless timing these compositions can separate every coefficient fitted.

    ``packed=False`` checks the three varlen terms (no packed-row T² term); otherwise all four.
    """
    comps = [list(c) for c in compositions]
    cols = [0, 1, 3] if packed is False else [0, 1, 2, 3]
    if len(comps) < len(cols):
        raise PlanError(f"{what}: {len(comps)} composition(s) for {len(cols)} coefficients; time at least "
                        f"{len(cols)} (the default design times ~12): " + "; ".join(_ADVICE[_TERM[FEATURES[j]]]
                                                                                for j in cols) + ".")
    X = np.array([micro_features(c, dense=packed is not False) for c in comps])[:, cols]
    norms = np.linalg.norm(X, axis=0)
    A = X / np.where(norms > 0, norms, 1.0)
    A = A / np.linalg.norm(A, axis=1, keepdims=True)
    _, sv, vt = np.linalg.svd(A, full_matrices=False)
    if sv[-1] >= _COND * sv[0] and np.all(norms > 0):
        return
    v = np.abs(vt[-1])
    bad = [_TERM[FEATURES[cols[j]]] for j in np.flatnonzero(v > 0.3)] or [_TERM[FEATURES[cols[int(np.argmax(v))]]]]
    raise PlanError(f"{what} cannot separate {' from '.join(bad)} (the timings would not identify them; "
                    f"design condition {sv[-1] / sv[0]:.1e} < {_COND:g}). Time also "
                    + "; ".join(_ADVICE[b] for b in bad)
                    + (". With the default design, raise max_tokens_per_micro (it is too small to vary the "
                       "lengths)" if what.startswith("profile_design") else "")
                    + (". Or pass packed=False if the backend is known to be per-sample (varlen)"
                       if "packed_quadratic" in bad and packed is None else "") + ".")


def attention_regime(cost: CostModel, max_tokens_per_micro: int) -> str:
    """``"linear"``, ``"varlen"`` or ``"packed"``: the kernel regime of the fit, and whether its
    attention is worth a term at the cap (>= 3 % of a cap-full micro-batch's time)."""
    C = float(max_tokens_per_micro)
    if getattr(cost, "packed_quadratic", 0.0) > 0:
        half = int(C) // 2
        share = float(cost.packed_quadratic) * C * C / float(cost.micro_cost([half, int(C) - half]))
        return "packed" if share >= _LINEAR_SHARE else "linear"
    share = float(getattr(cost, "quadratic", 0.0)) * C * C / float(cost.micro_cost([int(C)]))
    return "varlen" if share >= _LINEAR_SHARE else "linear"


def cp_compositions(max_tokens_per_micro: int, cp_size: int) -> list[tuple[int, ...]]:
    """Micro-batches timed over a CP group of ``cp_size`` GPUs: single samples of c·C, c·C/2 and C
    (communication grows with T, attention with L²), packs of 4 × c·C/4 and 8 × c·C/8 (same T,
    less attention) and a short row of C/2 (the fixed split overhead)."""
    C, c = int(max_tokens_per_micro), int(cp_size)
    return [(c * C,), (c * C // 2,), (C,), (c * C // 4,) * 4, (c * C // 8,) * 8, (C // 2,)]


def _pack(lens: Sequence[int], gen: torch.Generator, vocab: int, device: Any) -> PackedMicro:
    n = len(lens)
    toks = [torch.randint(0, vocab, (int(L),), generator=gen) for L in lens]
    micro = Micro(np.arange(n), np.asarray(lens), np.asarray(lens) - 1, np.ones(n))
    p = pack_micro(micro, toks)
    return p if torch.device(device).type == "cpu" else p.to(device)


def _comps(given: Sequence[Sequence[int]] | None, default: tuple, cap: int, what: str) -> list[tuple[int, ...]]:
    if given is None:
        return [tuple(c) for c in default]
    out = []
    for i, c in enumerate(given):
        try:
            comp = tuple(int(x) for x in c)
        except (TypeError, ValueError):
            raise PlanError(f"{what}[{i}] must be a list of sample lengths (ints), got {c!r}.") from None
        if not comp or min(comp) < 1 or any(int(x) != x for x in c) or sum(comp) > cap:
            raise PlanError(f"{what}[{i}]={list(c)!r} must be >= 1 lengths summing to <= max_tokens_per_micro={cap}.")
        out.append(comp)
    return out


def profile_cost(run_micro: Callable[[PackedMicro], Any], *, max_tokens_per_micro: int,
                 compositions: Sequence[Sequence[int]] | None = None,
                 heldout: Sequence[Sequence[int]] | None = None, repeats: int = 3, warmup: int = 1,
                 time_budget_s: float | None = 120.0, seed: int = 0, vocab_size: int = 128,
                 device: torch.device | str | None = None, packed: bool | None = None,
                 clock: Callable[[], float] | None = None, cp_sizes: Sequence[int] = (),
                 run_cp_micro: Callable[[PackedMicro, int], Any] | None = None) -> CalibrationResult:
    """Time designed micro-batches with the user's model and fit the cost model (binding name and first two args).

    Args:
        run_micro: ``run_micro(packed)`` runs one forward+backward (or forward-only) of your model
            on one ``PackedMicro`` (random token ids), e.g.
            ``lambda p: model(**p.model_inputs(), use_cache=False).logits.float().mean().backward()``.
        max_tokens_per_micro: the planner's cap; the design spans 1 .. cap tokens per micro-batch.
        compositions / heldout: your own micro-batches to fit on / to hold out (lists of sample
            lengths); default :func:`profile_design`. Compositions that cannot separate the
            coefficients are refused before anything runs.
        repeats: passes over every composition (median per composition); at least 1.
        warmup: untimed runs of the largest single, the many-sample pack and the tiny one.
        time_budget_s: stop adding passes when the next would end after this many seconds from the
            start (warm-up included); the first pass always runs. None: all ``repeats`` passes.
        seed: the held-out compositions, the token ids and the pass order.
        vocab_size: token ids are drawn from ``[0, vocab_size)`` (keep it <= your vocabulary; the
            ids do not change the timing).
        device: where ``run_micro`` computes; the packed tensors are moved there before timing.
            CUDA → CUDA events + synchronize; else ``perf_counter``. Default: CUDA when available.
        packed: fit the packed-row T² term (True), leave it out (False: a backend known to be
            varlen), or let the timings decide (None, default).
        clock: replaces ``perf_counter`` (tests and simulations; forces the host-clock path).
        cp_sizes: CP degrees (> 1) to time :func:`cp_compositions` at, through ``run_cp_micro``, and
            fit the CP term on (``CalibrationResult.cost.cp``; ``cp_note`` says how).
        run_cp_micro: ``run_cp_micro(packed, cp_size)`` runs one micro-batch split over a CP group
            of ``cp_size`` GPUs: on each member, ``packed.cp_shard(rank_in_group)`` under
            ``microplan.torch.context_parallel(group)`` (every rank of the group calls
            ``profile_cost`` with the same arguments: the design and its order are seeded).

    Returns:
        :class:`microplan.CalibrationResult`: ``cost`` in seconds, ``r2``, ``heldout_median_error``
        and ``heldout_max_error`` (|predicted/measured - 1| over the held-out compositions),
        ``regime`` (``"varlen"``, ``"packed"`` or ``"linear"``) and ``rows`` (every timing).

    Raises:
        PlanError: a design that cannot separate the coefficients (naming what to time instead),
            bad options, or a fit in which time does not grow with tokens.
    """
    if not callable(run_micro):
        raise PlanError(f"profile_cost(run_micro={run_micro!r}) must be a function of one PackedMicro.")
    widths = [int_field("profile_cost(cp_sizes)", c, minimum=2) for c in cp_sizes]
    if widths and not callable(run_cp_micro):
        raise PlanError(f"profile_cost(cp_sizes={list(cp_sizes)!r}) needs run_cp_micro(packed, cp_size), the function "
                        "that runs one micro-batch over a CP group; pass it, or leave cp_sizes empty.")
    cap = int_field("max_tokens_per_micro", max_tokens_per_micro, minimum=1)
    reps = int_field("profile_cost(repeats)", repeats, minimum=1)
    warm = int_field("profile_cost(warmup)", warmup, minimum=0)
    vocab = int_field("profile_cost(vocab_size)", vocab_size, minimum=1)
    if packed is not None and not isinstance(packed, bool):
        raise PlanError(f"profile_cost(packed={packed!r}) must be True, False or None.")
    if time_budget_s is not None and not (isinstance(time_budget_s, (int, float)) and time_budget_s > 0):
        raise PlanError(f"profile_cost(time_budget_s={time_budget_s!r}) must be a positive number of seconds or None.")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device is None else device
    design = profile_design(cap, seed=seed) if compositions is None or heldout is None else None
    fit_c = _comps(compositions, design.fit if design else (), cap, "compositions")
    held_c = _comps(heldout, design.heldout if design else (), cap, "heldout")
    check_identifiable(fit_c, packed=packed,
                       what="profile_design" if compositions is None else "profile_cost compositions")

    gen = torch.Generator().manual_seed(int(seed))
    cp_c = [(comp, c) for c in widths for comp in cp_compositions(cap, c)]
    comps = fit_c + held_c + [comp for comp, _ in cp_c]
    width = [1] * (len(fit_c) + len(held_c)) + [c for _, c in cp_c]
    packs = [_pack(c, gen, vocab, device) for c in comps]
    wall = clock or time.perf_counter
    t_start = wall()
    def one(i: int) -> float:
        fn = (lambda: run_micro(packs[i])) if width[i] == 1 else (lambda: run_cp_micro(packs[i], width[i]))  # type: ignore[misc]
        return time_call(fn, device=device, clock=clock)
    for i in _warm_indices(fit_c) * warm:
        one(i)
    rng = np.random.default_rng(seed)
    times: list[list[float]] = [[] for _ in comps]
    for _ in range(reps):
        t_pass = wall()
        for i in rng.permutation(len(comps)):
            times[i].append(one(int(i)))
        now = wall()
        if time_budget_s is not None and (now - t_start) + (now - t_pass) > time_budget_s:
            break
    seconds = [statistics.median(t) for t in times]
    n = len(fit_c) + len(held_c)
    res = _result(fit_c, held_c, seconds[:n], times[:n], cap, packed)
    return _with_cp(res, cp_c, seconds[n:], times[n:]) if cp_c else res


def _with_cp(res: CalibrationResult, cp_c: list[tuple[tuple[int, ...], int]], seconds: list[float],
             times: list[list[float]]) -> CalibrationResult:
    """The base fit with the CP term fitted on the timed CP compositions (``cost/cpfit.py``)."""
    base = res.cost
    mc = np.array([base.micro_cost(list(c)) for c, _ in cp_c])
    tokens = np.array([float(sum(c)) for c, _ in cp_c])
    width = np.array([w for _, w in cp_c], dtype=np.int64)
    got = fit_cp(mc, tokens, width, np.array(seconds), base.per_micro, None)
    cost = dataclasses.replace(base, cp=got.cp)
    rows = [{**calibration_row(list(c), s), "seq_lens": list(c), "times": list(t), "heldout": False, "cp_size": w}
            for (c, w), s, t in zip(cp_c, seconds, times)]
    errs = [abs(float(cp_micro_costs(cost, cost.micro_cost(list(c)), sum(c), w)) / s - 1.0) for (c, w), s in zip(cp_c, seconds)]
    return dataclasses.replace(res, cost=cost, rows=res.rows + tuple(rows),
                               cp_note=f"{got.note}; worst CP composition error {max(errs):.1%}")


def _warm_indices(fit: list[tuple[int, ...]]) -> list[int]:
    big = max(range(len(fit)), key=lambda i: (len(fit[i]) == 1, sum(fit[i])))
    many = max(range(len(fit)), key=lambda i: len(fit[i]))
    tiny = min(range(len(fit)), key=lambda i: sum(fit[i]))
    return sorted({big, many, tiny})


def _result(fit_c: list[tuple[int, ...]], held_c: list[tuple[int, ...]], seconds: list[float],
            times: list[list[float]], cap: int, packed: bool | None) -> CalibrationResult:
    for c, s in zip(fit_c + held_c, seconds):
        if not s > 0:
            raise PlanError(f"profile_cost: the composition {list(c)} timed {s!r} s; run_micro must do the work "
                            "synchronously enough to be timed (on CUDA, pass device='cuda').")
    rows = [{**calibration_row(list(c), s), "seq_lens": list(c), "times": list(t), "heldout": i >= len(fit_c)}
            for i, (c, s, t) in enumerate(zip(fit_c + held_c, seconds, times))]
    res = calibrate(rows[:len(fit_c)], packed=packed)
    errs = [abs(res.cost.micro_cost(r["seq_lens"]) / r["seconds"] - 1.0) for r in rows[len(fit_c):]]
    return dataclasses.replace(res, heldout_median_error=float(np.median(errs)) if errs else None,
                               heldout_max_error=float(np.max(errs)) if errs else None,
                               regime=attention_regime(res.cost, cap), rows=tuple(rows))
