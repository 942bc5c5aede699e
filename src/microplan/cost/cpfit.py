"""Fit the context-parallel term (:class:`CPCost`) to timed CP micro-batches.

Design note. A timed micro-batch split over c > 1 GPUs gives its whole-micro-batch cost under
the base model (``mc``: the base fitted on unsplit micro-batches, per_micro included), its packed
tokens T, c and the measured seconds y; the CP price of ``cost/cp.py`` predicts y from the four
CP numbers. Steps:
1. Grid over efficiency (1 … 0.5 in 1/e steps of 0.025), overlap (0, ¼, ½, ¾, 1) and
   comm_per_token (0 and a geometric grid around the size the residuals imply, the prior's value
   included); split_overhead in closed form (weighted least squares, clipped at 0). Records weigh
   1/y (relative error, as ``calibrate``). A prior with a cross-node rate (``node_size``) keeps
   its ratio: records of groups wider than a node count their tokens at that ratio, and the
   fitted rate carries it (one rate fitted, however the records split between the tiers).
2. Among the grid points whose relative error is within ``_NEAR`` of the best (what the records
   cannot tell apart), keep the one nearest the prior: a term the records do not pin down stays
   at the prior, and is named in ``CPFit.prior_terms``.
3. Too few records (< ``MIN_CP_RECORDS`` split micro-batches, or fewer than two distinct
   shapes): the prior, said so in ``CPFit.note``.
Guarantees: the result is a valid :class:`CPCost` (every term in range); the fit never explains
the records worse than the prior does (the prior is a grid point). Cost: ~4,000 grid points ×
records, vectorised (only when the meter refits).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .cp import CPCost, DEFAULT_CP_OVERLAP

__all__ = ["CPFit", "fit_cp", "MIN_CP_RECORDS"]

MIN_CP_RECORDS = 4        # split micro-batches needed before the CP term is fitted
_NEAR = 0.05              # grid points within 5 % of the best relative error are "as good"
_INV_EFF = np.arange(1.0, 2.0 + 1e-9, 0.025)
_OVERLAP = np.array([0.0, 0.25, 0.5, 0.75, 1.0])
_COMM_STEPS = 2.0 ** np.arange(-8.0, 6.01, 0.25)
TERMS = ("comm_per_token", "overlap", "efficiency", "split_overhead")


class CPFit(NamedTuple):
    """The fitted CP term, the terms left at the prior, and one line for ``CostMeter.report``."""

    cp: CPCost | None
    prior_terms: tuple[str, ...]
    note: str


def _price(inv_e: float, o: float, k: np.ndarray, body_c: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``[len(k), n]`` per-GPU cost less per_micro and split_overhead (cost/cp.py's formula)."""
    compute = body_c * inv_e                    # body / (c·e)
    comm = k[:, None] * x[None, :]              # comm_per_token · T (c − 1) / c
    return compute + comm - o * np.minimum(compute, comm)


def fit_cp(mc: np.ndarray, tokens: np.ndarray, width: np.ndarray, seconds: np.ndarray, per_micro: float,
           prior: CPCost | None) -> CPFit:
    """Fit :class:`CPCost` to split micro-batches (module note); ``prior`` in the same units (None: perfect
    scaling, comm 0, efficiency 1)."""
    p = prior if prior is not None else CPCost(comm_per_token=0.0, overlap=DEFAULT_CP_OVERLAP, efficiency=1.0)
    n = int(seconds.size)
    shapes = len(set(zip(np.round(tokens).tolist(), width.tolist(), np.round(mc / np.max(mc), 6).tolist()))) if n else 0
    if n < MIN_CP_RECORDS or shapes < 2:
        held = TERMS if prior is not None else ()
        why = (f"{n} split micro-batch(es) timed" if n < MIN_CP_RECORDS else "every split micro-batch timed alike")
        return CPFit(prior, held, f"CP term from the prior ({why}; the fit needs >= {MIN_CP_RECORDS} of >= 2 shapes)")
    c = width.astype(np.float64)
    body_c = (mc - per_micro) / c
    ratio = p.comm_rates(c) / p.comm_per_token if p.comm_per_token > 0 else np.ones_like(c)
    x = tokens * (c - 1.0) / c * ratio  # a group wider than a node moves at the prior's cross-node ratio
    y = seconds - per_micro
    w2 = 1.0 / (seconds * seconds)              # relative least squares
    resid = y - body_c
    ref = float(np.median(np.maximum(resid, 0.0) / np.maximum(x, 1.0)))
    ref = ref if ref > 0 else (p.comm_per_token if p.comm_per_token > 0 else float(np.median(y / np.maximum(x, 1.0))))
    ks = np.unique(np.concatenate([[0.0, p.comm_per_token], ref * _COMM_STEPS]))
    inv_es = np.unique(np.concatenate([_INV_EFF, [1.0 / p.efficiency]]))
    overlaps = np.unique(np.concatenate([_OVERLAP, [p.overlap]]))
    pts, errs = [], []
    for inv_e in inv_es:
        for o in overlaps:
            f = _price(float(inv_e), float(o), ks, body_c, x)          # [k, n]
            h = np.maximum(((y - f) * w2).sum(axis=1) / w2.sum(), 0.0)  # closed-form overhead per k
            e = (((f + h[:, None] - y) ** 2) * w2).sum(axis=1)
            pts.append(np.column_stack([ks, np.full(ks.size, o), np.full(ks.size, 1.0 / inv_e), h]))
            errs.append(e)
    P, E = np.vstack(pts), np.concatenate(errs)
    near = E <= E.min() * (1.0 + _NEAR) + 1e-300
    scale_k = max(ref, p.comm_per_token, 1e-300)
    scale_h = max(float(np.median(y)), 1e-300)
    dist = (np.abs(np.log1p(P[:, 0] / scale_k) - np.log1p(p.comm_per_token / scale_k)) + np.abs(P[:, 1] - p.overlap)
            + np.abs(1.0 / P[:, 2] - 1.0 / p.efficiency) + np.abs(P[:, 3] - p.split_overhead) / scale_h)
    best = int(np.flatnonzero(near)[np.argmin(dist[near])])
    k, o, e, h = (float(v) for v in P[best])
    lo, hi = P[near].min(axis=0), P[near].max(axis=0)
    loose = (hi[0] > 2.0 * lo[0] and hi[0] > 0.05 * ref, hi[1] - lo[1] > 0.5, hi[2] - lo[2] > 0.1,
             hi[3] - lo[3] > 0.5 * max(h, 0.05 * scale_h))
    held = tuple(t for t, unknown in zip(TERMS, loose) if unknown)
    cross = None if p.node_size is None else k * (p.cross_node_comm_per_token / p.comm_per_token  # type: ignore[operator]
                                                  if p.comm_per_token > 0 else 1.0)
    cp = CPCost(comm_per_token=k, overlap=o, efficiency=min(e, 1.0), split_overhead=h, node_size=p.node_size,
                cross_node_comm_per_token=cross)
    rel = float(np.sqrt(E[best] / n))
    note = f"CP term fitted on {n} split micro-batches (rms error {rel:.1%})"
    if held:
        note += f"; not identified by them, kept near the prior: {', '.join(held)}"
    return CPFit(cp, held, note)
