"""Predicted times and bounds of a plan under its cost model (see PlanStats for definitions).

A micro-batch costs its cost model's ``micro_cost`` of the shape its layout gives it
(``footprint.py``: padded sample lengths and the row pad, or n rows of the padded width; plus
vision work), with the packed-row term in its total T, and ``per_micro``; over a CP group of c
GPUs each GPU pays the CP price of ``cost/cp.py`` (``cp_micro_costs``: (micro_cost − per_micro) / c +
per_micro without a CP term; K/V communication, split efficiency and overhead with one). A
placeholder runs one dummy token (so it never costs more than a real micro-batch).
``max_micro_tokens`` is the footprint per GPU: ⌈tokens held, padding included / cp_size⌉. The lower bound of a step is
min over K >= K_lb of LB(K) (``stages/kchoice.py``): with an additive cost that is
max(Σ sample costs / GPUs + K_lb · per_micro, max sample cost / c_max + per_micro). Padded
layouts run every row as its own sequence, so their bound is additive even under a dense kernel:
each sample at the cheaper of its lone and masked row cost (no packed-row Jensen term, which
would not bound a padded plan: its rows are not one packed row).
With pipeline parallelism the step's wall time under the 1F1B (or interleaved) schedule is
``pipeline_time`` (``stages/pipeline.py``); the other times stay whole-model sums.

This module reads a plan's parts (batch, config, steps), never the ``Plan`` class, so
``plan.py`` can import it without a cycle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from .batch import Batch
from .config import PlanConfig
from .cost.cp import cp_work_floor
from .cost.gpu import gpu_costs
from .cost.models import CostModel, bin_costs, is_additive, row_costs
from .footprint import Footprint, bin_footprint, footprint_of, packing_cap
from .prefix import PrefixTree, forest_of, micro_tree
from .stages.assign import grid_time
from .stages.kchoice import best_lower_bound, time_lower_bounds
from .stages.pipeline import BACKWARD_RATIO, step_pipeline_time
from .types import PlanStats, Step, StepStats

__all__ = ["compute_stats", "micro_cost_grid", "step_cost_grid", "step_lower_bound", "k_lower_bound",
           "split_lower_bound", "unshared_step_bound"]


def step_cost_grid(batch: Batch, config: PlanConfig, step: Step, fp: Footprint | None = None) -> np.ndarray:
    """``cost[r, m]`` of every micro-batch of one step, on the GPU(s) of rank r."""
    return _step_grids(batch, config, step, fp)[0]


def _step_grids(batch: Batch, config: PlanConfig, step: Step, fp: Footprint | None = None,
                ) -> tuple[np.ndarray, np.ndarray]:
    """(``cost[r, m]``, ``tokens[r, m]``) of every micro-batch of one step: its cost on the GPU(s) of
    rank r and the tokens it holds (``Micro.num_tokens`` of a valid plan: with shared prefixes each
    bin's row as ``trie.row_tries`` counts it, which equals its trie's padded footprint, so no
    Micro's trie is read)."""
    cost = config.cost
    assert cost is not None
    fp = footprint_of(batch, config) if fp is None else fp
    D, K = step.dp_size, step.micro_count
    flat = [m for row in step.micros for m in row]
    sizes = np.array([m.indices.size for m in flat], dtype=np.int64)
    idx = np.concatenate([m.indices for m in flat]) if flat else np.zeros(0, dtype=np.int64)
    owner = np.repeat(np.arange(len(flat)), sizes)
    # the one footprint function the planner priced the bins with: prefix tries (padded segments,
    # row pad) with share_prefixes, the layout's rows otherwise
    forest = forest_of(batch) if config.share_prefixes else None
    tokens, mc = bin_footprint(fp, cost, idx, owner, len(flat), forest=forest)
    width = np.array([m.cp_size for m in flat], dtype=np.float64)
    grid = gpu_costs(cost, mc, tokens, width, empty=sizes == 0).reshape(D, K)  # placeholders: one dummy token
    return grid, tokens.reshape(D, K)


def micro_cost_grid(plan: object, step_index: int) -> np.ndarray:
    """``cost[r, m]`` of step ``step_index`` of ``plan`` (anything with batch, config, steps)."""
    return step_cost_grid(plan.batch, plan.config, plan.steps[step_index])  # type: ignore[attr-defined]


def k_lower_bound(cfg: PlanConfig, n: int, tokens: int, vision: int = 0) -> int:
    """⌈tokens / (dp · cap)⌉, tokens as the samples occupy them at least (padded alone, or the
    step's unique tokens), the cap less the row multiple; the same for vision tokens under their
    cap; and at least the pipeline stages. Static batching: ⌈n / (dp · micro_batch_size)⌉."""
    if cfg.micro_batch_size is not None:
        return max(1, -(-n // (cfg.dp_size * cfg.micro_batch_size)), cfg.pipeline_stages)
    cap = packing_cap(cfg)
    assert cap is not None
    if cfg.context_parallel is not None and cfg.context_parallel.dynamic:
        cap = cfg.max_tokens_per_micro  # a group of w GPUs rounds its row to the multiple within w × cap
    k = max(1, -(-tokens // (cfg.dp_size * cap)))
    if vision and cfg.max_vision_tokens_per_micro is not None:
        k = max(k, -(-vision // (cfg.dp_size * cfg.max_vision_tokens_per_micro)))
    return max(k, cfg.pipeline_stages)


def _max_cp(cfg: PlanConfig) -> int:
    cp = cfg.context_parallel
    if cp is None:
        return 1
    return cp.size if cp.size is not None else int(cp.max_size)  # type: ignore[arg-type]


def _take(a: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``a[idx]``, or ``a`` itself (not to be written) when ``idx`` is 0 .. a.size − 1 in order (a
    step of the whole batch): the same values in the same order, without a copy."""
    n = a.size
    if idx.size == n and n and int(idx[0]) == 0 and int(idx[-1]) == n - 1 and bool((idx[1:] > idx[:-1]).all()):
        return a
    return a[idx]


def step_lower_bound(batch: Batch, cfg: PlanConfig, idx: np.ndarray, k_lb: int, fp: Footprint | None = None, *,
                     slot: bool = True, costs: np.ndarray | None = None) -> float:
    """min over K >= K_lb of LB(K); bins per K: one per DP group (static CP) or per GPU (dynamic CP).
    ``slot=False``: without the lockstep slot term (``kchoice.time_lower_bounds``; O(n log n)), a
    bound never above the full one. ``costs``: every sample's ``fp.sample_costs(cfg.cost)`` when
    the caller holds them (the planner's ``PlanContext.costs``), else computed.

    With shared prefixes the work any plan does at least once is the step's prefix trie: its
    segments stand in for the samples, and the costliest micro-batch is at least one sample alone.
    Otherwise each sample counts at the tokens it occupies alone (``fp``: padding to its multiple,
    its padded width) and its vision work, which every plan of the config must run.
    """
    cost = cfg.cost
    assert cost is not None
    if not idx.size:
        return 0.0
    if cfg.share_prefixes:
        lens = batch.seq_lens[idx]
        tree = step_tree(batch, idx)
        seg = (tree.end - tree.start).astype(np.float64)
        seg_cost = cost.tree_costs(seg, (tree.end ** 2 - tree.start ** 2).astype(np.float64))  # type: ignore[attr-defined]
        single = float(cost.sample_costs(lens).max())  # a sample alone
        # a CP group's GPUs share its work (a split at least at perfect scaling, whatever its CP price)
        return best_lower_bound(seg_cost, seg.astype(np.int64), k_lb, bins_per_k=cfg.dp_size,
                                gpus=cfg.dp_size * cfg.static_cp_size, max_width=_max_cp(cfg), cost=cost,
                                single=single)
    fp = footprint_of(batch, cfg) if fp is None else fp
    lens = _take(fp.sample_tokens, idx)
    costs, view = fp.sample_costs(cost, idx) if costs is None else _take(costs, idx), cost
    if fp.padded:
        costs, view = _padded_sample_costs(cost, fp, idx), _AdditiveView(float(cost.per_micro))
    elif cfg.context_parallel is not None and getattr(cost, "cp", None) is not None:
        costs = cp_work_floor(cost, costs, lens, _least_width(cfg, lens))  # a priced split costs GPU-time
    return best_lower_bound(costs, lens, k_lb, bins_per_k=cfg.dp_size,
                            gpus=cfg.dp_size * cfg.static_cp_size, max_width=_max_cp(cfg), cost=view,
                            cap=cfg.max_tokens_per_micro, lockstep=cfg.sync == "micro" and slot)


def unshared_step_bound(batch: Batch, cfg: PlanConfig, idx: np.ndarray, fp: Footprint, *,
                        slot: bool = True, costs: np.ndarray | None = None) -> tuple[float, int]:
    """(``time_lower_bound``, ``micro_count_lower_bound``) that the plan of ``cfg`` without
    ``share_prefixes`` reports for a step of samples ``idx`` (``fp``: the config's footprint, which
    sharing does not change): a lower bound of that plan's predicted time and micro-batch count per
    rank for the step when it keeps every sample. ``slot=False``: the time bound without its
    lockstep slot term (:func:`step_lower_bound`), never above it. ``costs``: as there."""
    flat = replace(cfg, share_prefixes=False)
    k_lb = k_lower_bound(flat, int(idx.size), int(_take(fp.sample_tokens, idx).sum()), fp.vision(idx))
    return step_lower_bound(batch, flat, idx, k_lb, fp, slot=slot, costs=costs), k_lb


def split_lower_bound(batch: Batch, cfg: PlanConfig, idx: np.ndarray, fp: Footprint | None = None, *,
                      step_bound: float | None = None) -> float:
    """A lower bound on the step time of any plan that keeps every sample on its ``batch.rank_of``
    (local placement: the split is given), under either sync mode:

        max( step_lower_bound,  min over K >= K_split of  max_r LB_r(K) )

    LB_r(K) is rank r's own bound (``kchoice.time_lower_bounds`` with one bin per K on its GPU(s):
    its work / GPUs + K · per_micro, the packed-row term at its Jensen minimum over its K rows, its
    costliest sample + per_micro); K_split is the fewest micro-batches the fullest rank needs under
    the cap (its tokens as they occupy micro-batches, vision tokens under their cap, static:
    ⌈n_r / micro_batch_size⌉), at least ``pipeline_stages``, rounded up to ``align`` — every rank
    runs the same K. It is a bound because each slot waits for its heaviest rank, so Σ_m max_r ≥
    max_r Σ_m, and a rank's Σ_m is at least LB_r(K). What it leaves out (hence "the split allows"):
    which slot a coarse rank's heavy micro-batch lands in — a rank holding three samples of 16k
    tokens among 16 cannot split them evenly over K = 4, and every other rank must match that
    slot (bench_planners, bimodal dp 32: 1.0206 of this bound before the lift of slot 0's target).
    ``step_bound``: the step's :func:`step_lower_bound`, when already computed.
    """
    cost = cfg.cost
    assert cost is not None
    if not idx.size:
        return 0.0
    fp = footprint_of(batch, cfg) if fp is None else fp
    owner = batch.rank_of[idx] if batch.rank_of is not None else np.zeros(idx.size, dtype=np.int64)
    items, k_need = [], max(1, cfg.pipeline_stages)
    for r in np.unique(owner).tolist():
        sub = idx[owner == r]
        costs, lens, view, single = _split_items(batch, cfg, sub, fp)
        items.append((costs, lens, view, single))
        k_need = max(k_need, _rank_k(cfg, int(sub.size), int(lens.sum()), fp.vision(sub)))  # trie tokens if shared
    K_lb = -(-k_need // cfg.align) * cfg.align
    # dense: up to the least aligned K with a micro-batch per sample of the fullest rank (past it LB only grows)
    most = -(-max(c.size for c, *_ in items) // cfg.align) * cfg.align
    top = K_lb if is_additive(cost) else max(K_lb, most)
    Ks = np.arange(K_lb, top + 1, cfg.align)
    cp = cfg.static_cp_size
    per = [time_lower_bounds(c, ln, Ks, bins_per_k=1, gpus=cp, max_width=_max_cp(cfg), cost=view, single=single)
           for c, ln, view, single in items]
    if step_bound is None:
        unique = step_tree(batch, idx).num_tokens if cfg.share_prefixes else int(fp.sample_tokens[idx].sum())
        step_bound = step_lower_bound(batch, cfg, idx, k_lower_bound(cfg, int(idx.size), unique, fp.vision(idx)), fp)
    return max(float(np.max(per, axis=0).min()), step_bound)


def _rank_k(cfg: PlanConfig, n: int, tokens: int, vision: int) -> int:
    """The fewest micro-batches one rank's n samples (``tokens`` as they occupy micro-batches,
    ``vision`` tokens) need: :func:`k_lower_bound` for a single rank, without pipeline stages."""
    if cfg.micro_batch_size is not None:
        return max(1, -(-n // cfg.micro_batch_size))
    cap = packing_cap(cfg)
    assert cap is not None
    k = max(1, -(-tokens // cap))
    if vision and cfg.max_vision_tokens_per_micro is not None:
        k = max(k, -(-vision // cfg.max_vision_tokens_per_micro))
    return k


def _split_items(batch: Batch, cfg: PlanConfig, idx: np.ndarray, fp: Footprint):
    """(costs, tokens, cost view, single) of the work one rank's samples ``idx`` must run, as in
    :func:`step_lower_bound`: prefix-trie segments with shared prefixes, padded rows at their
    cheapest, the samples as they occupy micro-batches otherwise."""
    cost = cfg.cost
    assert cost is not None
    if cfg.share_prefixes:
        tree = step_tree(batch, idx)
        seg = (tree.end - tree.start).astype(np.float64)
        seg_cost = cost.tree_costs(seg, (tree.end ** 2 - tree.start ** 2).astype(np.float64))  # type: ignore[attr-defined]
        return seg_cost, seg.astype(np.int64), cost, float(cost.sample_costs(batch.seq_lens[idx]).max())
    lens = fp.sample_tokens[idx]
    if fp.padded:
        return _padded_sample_costs(cost, fp, idx), lens, _AdditiveView(float(cost.per_micro)), None
    costs = fp.sample_costs(cost, idx)
    if cfg.context_parallel is not None and getattr(cost, "cp", None) is not None:
        costs = cp_work_floor(cost, costs, lens, _least_width(cfg, lens))
    return costs, lens, cost, None


def _least_width(cfg: PlanConfig, lens: np.ndarray) -> np.ndarray | int:
    """The narrowest CP group each sample may run in: the fixed degree, or (dynamic) the power of two
    its tokens need under the cap."""
    cp = cfg.context_parallel
    if cp is None or not cp.dynamic:
        return cfg.static_cp_size
    need = np.maximum(-(-lens // int(cfg.max_tokens_per_micro)), 1)  # type: ignore[arg-type]
    return np.left_shift(1, np.ceil(np.log2(need)).astype(np.int64))


class _AdditiveView(NamedTuple):
    """A cost without a packed-row term, for the bound of padded layouts (only ``per_micro`` is read)."""

    per_micro: float
    packed_quadratic: float = 0.0


def _padded_sample_costs(cost: CostModel, fp: Footprint, idx: np.ndarray) -> np.ndarray:
    """The least any padded micro-batch pays for each sample's row: the row is at least the sample's
    own width w, a lone row runs the plain causal path (``sample_costs(w)``) and a masked row of a
    dense kernel pays ``linear·w + packed_quadratic·w²`` (``row_costs``), so the cheaper of the two.
    Padded rows never form a packed row of T tokens: the packed term's Jensen bound over T (which
    put ``time_lower_bound`` above ``predicted_time``) does not apply to them."""
    w = fp.sample_tokens[idx].astype(np.float64)
    out = np.minimum(row_costs(cost, w, 1), row_costs(cost, w, 2))
    return out if fp.vision_costs is None else out + fp.vision_costs[idx]


def step_tree(batch: Batch, idx: np.ndarray) -> PrefixTree:
    """The prefix trie of a whole step: every token any plan of the step must compute once."""
    parent, shared = forest_of(batch)
    return micro_tree(parent, shared, batch.seq_lens, idx)


def compute_stats(batch: Batch, config: PlanConfig, steps: Sequence[Step], dropped: np.ndarray, *,
                  forward: bool = False) -> PlanStats:
    """The :class:`PlanStats` of a plan given by its parts (``forward``: a forward-only pass, whose
    pipeline runs no backward)."""
    cfg = config
    cost = cfg.cost
    assert cost is not None
    lens = batch.seq_lens
    fp = footprint_of(batch, cfg)
    per_step: list[StepStats] = []
    rank_total = np.zeros(cfg.dp_size)
    max_tokens = 0
    for step in steps:
        grid, held_grid = _step_grids(batch, cfg, step, fp)
        rank_total += grid.sum(axis=1)
        idx = step.samples
        tokens, n = int(lens[idx].sum()), int(idx.size)
        unique = step_tree(batch, idx).num_tokens if cfg.share_prefixes and n else int(fp.sample_tokens[idx].sum())
        held, step_max = _held(step, held_grid if cfg.share_prefixes else None)
        k_lb = k_lower_bound(cfg, n, unique, fp.vision(idx))
        lb = step_lower_bound(batch, cfg, idx, k_lb, fp)
        split = split_lower_bound(batch, cfg, idx, fp, step_bound=lb) if cfg.placement == "local" else 0.0
        max_tokens = max(max_tokens, step_max)
        lock_s, sync_s = grid_time(grid, "micro"), grid_time(grid, "step")
        pipe = step_pipeline_time(grid, cfg, backward_ratio=0.0 if forward else BACKWARD_RATIO) \
            if cfg.pipeline_stages > 1 else (lock_s if cfg.sync == "micro" else sync_s)
        per_step.append(StepStats(
            num_samples=n, num_tokens=tokens, micro_count=step.micro_count, micro_count_lower_bound=k_lb,
            num_placeholders=step.num_placeholders, max_micro_tokens=step_max,
            lockstep_time=lock_s, step_sync_time=sync_s,
            time_lower_bound=lb, rank_costs=tuple(float(x) for x in grid.sum(axis=1)), choice=step.choice,
            tokens_with_sharing=held, tokens_lower_bound=unique,
            pipeline_time=pipe, pipeline_bubble=_bubble(lock_s if cfg.sync == "micro" else sync_s, pipe, cfg),
            split_lower_bound=split))
    lock = sum(p.lockstep_time for p in per_step)
    sync = sum(p.step_sync_time for p in per_step)
    pipe_total = sum(p.pipeline_time for p in per_step)
    mean = float(rank_total.mean()) if rank_total.size else 0.0
    return PlanStats(
        num_steps=len(steps), num_samples=batch.num_samples, num_dropped=int(dropped.size),
        num_placeholders=sum(p.num_placeholders for p in per_step), max_micro_tokens=max_tokens,
        cap=cfg.max_tokens_per_micro, micro_count=sum(p.micro_count for p in per_step),
        micro_count_lower_bound=sum(p.micro_count_lower_bound for p in per_step),
        predicted_time=lock if cfg.sync == "micro" else sync, lockstep_time=lock, step_sync_time=sync,
        time_lower_bound=sum(p.time_lower_bound for p in per_step),
        rank_imbalance=float(rank_total.max()) / mean if mean > 0 else 1.0, steps=tuple(per_step),
        tokens_without_sharing=sum(p.num_tokens for p in per_step),
        tokens_with_sharing=sum(p.tokens_with_sharing for p in per_step),
        tokens_lower_bound=sum(p.tokens_lower_bound for p in per_step),
        pipeline_time=pipe_total, pipeline_bubble=_bubble(lock if cfg.sync == "micro" else sync, pipe_total, cfg),
        split_lower_bound=sum(p.split_lower_bound for p in per_step), max_micro_bytes=_max_bytes(batch, cfg, steps, fp))


def _held(step: Step, tokens: np.ndarray | None) -> tuple[int, int]:
    """(Σ tokens the step's micro-batches hold, one per CP group; the most one GPU holds):
    ``tokens[r, m]`` each micro-batch's ``num_tokens`` where the caller has it (with shared prefixes:
    the tries stay unread), else read from the Micros."""
    flat = [m for row in step.micros for m in row]
    if tokens is None:
        held = sum(m.num_tokens for m in flat if not m.is_placeholder and m.cp_rank == 0)
        return held, max((-(-m.num_tokens // m.cp_size) for m in flat), default=0)
    t = tokens.reshape(-1).tolist()
    held = sum(x for x, m in zip(t, flat) if m.cp_rank == 0 and m.indices.size)
    return held, max((-(-x // m.cp_size) for x, m in zip(t, flat)), default=0)


def _max_bytes(batch: Batch, cfg: PlanConfig, steps: Sequence[Step], fp: Footprint) -> int | None:
    """The largest predicted bytes of any micro-batch under the config's memory model (None without one)."""
    if cfg.memory is None:
        return None
    from .memory.check import plan_micro_bytes
    return max((int(g.max()) for g in plan_micro_bytes(batch, cfg, steps, fp) if g.size), default=0)


def _bubble(predicted: float, pipeline: float, cfg: PlanConfig) -> float:
    """Idle share of a pipeline stage: 1 − (predicted / p) / pipeline time."""
    if cfg.pipeline_stages <= 1 or pipeline <= 0:
        return 0.0
    return max(0.0, 1.0 - predicted / (cfg.pipeline_stages * pipeline))
