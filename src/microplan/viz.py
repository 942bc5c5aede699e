"""One picture of a plan: a ranks × micro-batches heat map of predicted cost, plus rank totals.

Design note. Left panel: cell (r, m) is micro-batch m of rank r, coloured by its predicted cost
under the plan's cost model (``microplan.stats.micro_cost_grid``) on a scale that starts at 0,
so a 1 % difference looks like 1 % (a scale from the smallest cost to the largest made a
balanced plan look dramatic); placeholders are grey and hatched; a cell's padding (tokens the
GPU holds for no sample: padded layouts, padding multiples) is a white dotted band across its
top whose height is the padding's share of the cell. With ``step=None`` all steps sit side by
side, separated by white lines, a tick under every slot. Small grids (≤ 16 ranks, ≤ 256 cells)
print each cell's tokens per GPU; large ones (dp=128) stay a clean heat map with thinned labels.
Right panel: each rank's total cost (bars, same rows), with the mean and the time lower bound
marked; the costliest rank is red only when the ranks differ (max/mean ≥ 1.0005: the
imbalance, printed to 3 decimals, is above 1.000), never at perfect balance. The title carries
dp, K vs its lower bound, max tokens vs the cap, lockstep and step-sync time vs the lower bound,
imbalance and placeholder count; the caption under the colour bar says how to read it: what
good looks like (one colour down every column, equal bars at the lower bound).

Legibility rules (checked by looking at the PNG at its default size): every colour and line is in
a legend or the colour-bar label; when the mean and the lower bound lie within ~1 px of each other
(a balanced plan: the usual case) the lower bound is drawn wide and pale under the dashed mean
and the legend says they coincide, so neither hides the other; a zoomed bar axis starts at a tick,
so the "axis starts at" note and the first tick label are the same number.

matplotlib is imported lazily and used through ``matplotlib.figure.Figure`` (the Agg canvas
behind ``savefig``), never pyplot: no global backend switch, safe inside notebooks and servers.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import PlanError
from .stats import micro_cost_grid
from .summary import sig

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["plot_plan", "human", "cost_units"]

_TEXT_MAX_RANKS = 16
_TEXT_MAX_CELLS = 256
_BAR, _WORST, _LB = "#4c72b0", "#d62728", "#2ca02c"  # rank bars, the costliest rank, the lower bound


def human(x: float, digits: int = 3) -> str:
    """Compact number with ``digits`` significant digits: 14942 → '14.9k', 1098765 → '1.1M'."""
    a = abs(x)
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= scale:
            v = x / scale
            return f"{v:.{digits}g}{suffix}" if abs(v) < 10 ** digits else f"{v:.0f}{suffix}"
    return f"{x:.0f}" if float(x).is_integer() or a >= 10 ** (digits - 1) else f"{x:.{digits}g}"


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlanError("plotting needs matplotlib: pip install -e '.[plot]' in the microplan clone.") from None
    return Figure


def _cp_groups(plan: Plan, steps: list[int]) -> list[tuple[int, int, int, int]]:
    """``(column, first rank, last rank, cp_size)`` of every multi-rank (dynamic) CP group."""
    out, offset = [], 0
    for s in steps:
        for row in plan.steps[s].micros:
            for m, micro in enumerate(row):
                if len(micro.cp_group) > 1 and micro.cp_rank == 0:
                    out.append((offset + m, min(micro.cp_group), max(micro.cp_group), micro.cp_size))
        offset += plan.steps[s].micro_count
    return out


def _grids(plan: Plan, steps: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Cost, per-GPU tokens, placeholder mask and padding share (padding / tokens held; 0 with
    shared prefixes, whose trees hold fewer tokens than their samples), steps side by side;
    plus each step's K."""
    costs, tokens, holes, pads = [], [], [], []
    shared = plan.config.share_prefixes
    for s in steps:
        micros = plan.steps[s].micros
        costs.append(micro_cost_grid(plan, s))
        held = np.array([[m.num_tokens for m in row] for row in micros], dtype=np.int64)
        cp = np.array([[m.cp_size for m in row] for row in micros], dtype=np.int64)
        tokens.append(-(-held // cp))
        holes.append(np.array([[m.is_placeholder for m in row] for row in micros], dtype=bool))
        real = np.array([[m.real_tokens for m in row] for row in micros], dtype=np.int64)
        pad = np.zeros(held.shape) if shared else np.where(held > 0, (held - real) / np.maximum(held, 1), 0.0)
        pads.append(np.clip(pad, 0.0, 1.0))
    return (np.hstack(costs), np.hstack(tokens), np.hstack(holes), np.hstack(pads),
            [plan.steps[s].micro_count for s in steps])


def _title(plan: Plan, steps: list[int]) -> str:
    st, cfg = plan.stats, plan.config
    if len(steps) == 1:
        ss = st.steps[steps[0]]
        head = f"step {steps[0]} of {st.num_steps}"
        k, k_lb, mx, ph = ss.micro_count, ss.micro_count_lower_bound, ss.max_micro_tokens, ss.num_placeholders
        lock, sync, lb, rc = ss.lockstep_time, ss.step_sync_time, ss.time_lower_bound, np.array(ss.rank_costs)
        imb = float(rc.max() / rc.mean()) if rc.size and rc.mean() > 0 else 1.0
        kdesc = f"K={k} micro-batches/rank (lower bound {k_lb})"
    else:
        head = f"all {st.num_steps} steps"
        mx, ph, lock, sync, lb, imb = (st.max_micro_tokens, st.num_placeholders, st.lockstep_time,
                                       st.step_sync_time, st.time_lower_bound, st.rank_imbalance)
        kdesc = f"ΣK={st.micro_count} micro-batches/rank (lower bound {st.micro_count_lower_bound})"
    cap = f"cap {cfg.max_tokens_per_micro:,}" if cfg.max_tokens_per_micro else f"micro_batch_size {cfg.micro_batch_size}"
    cp = plan.config.context_parallel
    cpdesc = "" if cp is None else (f" · CP={cp.size}" if cp.size else f" · dynamic CP ≤{cp.max_size}")
    ratio = (lambda t: f"{t / lb:.3f}× LB") if lb > 0 else (lambda t: "n/a")
    held = real = 0
    if not cfg.share_prefixes:     # a prefix tree holds fewer tokens than its samples: no padding to show
        for s in steps:
            for row in plan.steps[s].micros:
                held += sum(m.num_tokens for m in row)
                real += sum(m.real_tokens for m in row)
    paddesc = f" · padding {100 * (held - real) / held:.1f} % of held tokens" if held > real else ""
    return (f"microplan · {head} · dp={cfg.dp_size}{cpdesc} · {kdesc} · {ph} placeholder{'s' if ph != 1 else ''}"
            f"{paddesc}\nmax {mx:,} tokens/GPU vs {cap} · predicted time: lockstep {ratio(lock)}, "
            f"step-sync {ratio(sync)} · rank imbalance {imb:.3f}")


def plot_plan(plan: Plan, path: str | os.PathLike[str], *, step: int | None = 0, dpi: int = 120) -> Path:
    """Write a PNG picture of ``plan`` to ``path`` and return the path.

    Args:
        plan: a :class:`microplan.Plan` with at least one step.
        path: output file (PNG).
        step: the step to draw (default 0), or None for all steps side by side.
        dpi: resolution of the PNG.

    Raises:
        PlanError: matplotlib missing (with the install hint), an empty plan, a step out of range,
            or an unwritable path.
    """
    Figure = _figure_class()
    n = len(plan.steps)
    if n == 0:
        raise PlanError("the plan has no steps to plot (empty batch, or every sample dropped).")
    if step is not None and not (isinstance(step, int) and 0 <= step < n):
        raise PlanError(f"step={step!r} is outside 0..{n - 1}; pick a step of the plan or None for all.")
    steps = list(range(n)) if step is None else [step]
    cost, tokens, holes, pads, ks = _grids(plan, steps)
    dp, cols = cost.shape
    size = (max(11.0, min(18.0, 6.0 + 0.28 * cols)), max(4.5, min(10.0, 3.4 + 0.42 * dp)))
    fig = Figure(figsize=size, layout="constrained")
    ax, axb = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [4, 1]})
    _heatmap(fig, ax, plan, cost, tokens, holes, pads, ks, step)
    _rank_bars(axb, plan, cost, steps)
    fig.suptitle(_title(plan, steps), fontsize=10)
    out = Path(path)
    try:
        fig.savefig(out, dpi=dpi)
    except OSError as exc:
        raise PlanError(f"{out}: cannot write the PNG: {exc.strerror or exc}.") from None
    return out


def cost_units(config: Any) -> str:
    """The unit of a config's cost figures (``microplan.summary.cost_unit``): tokens, FLOPs, s, cost units."""
    from .summary import cost_unit
    unit = cost_unit(config)
    return "seconds" if unit.seconds else unit.short


def _heatmap(fig: Any, ax: Any, plan: Plan, cost: np.ndarray, tokens: np.ndarray, holes: np.ndarray,
             pads: np.ndarray, ks: list[int], step: int | None) -> None:
    import matplotlib as mpl
    from matplotlib.patches import Rectangle

    dp, cols = cost.shape
    cmap = mpl.colormaps["viridis"].with_extremes(bad="#d0d0d0")
    shown = np.ma.masked_array(cost, mask=holes)
    real = cost[~holes]
    vmin, vmax = 0.0, (float(real.max()) if real.size else 1.0)   # from 0: differences at their true size
    im = ax.imshow(shown, aspect="auto", cmap=cmap, vmin=vmin, vmax=max(vmax, vmin + 1e-9),
                   interpolation="nearest")
    for r, m in zip(*np.nonzero(holes)):
        ax.add_patch(Rectangle((m - 0.5, r - 0.5), 1, 1, fill=False, hatch="///", edgecolor="#808080", lw=0))
    padded = _padding_bands(ax, pads)
    groups = _cp_groups(plan, list(range(len(plan.steps))) if step is None else [step])
    for m, r0, r1, _c in groups:
        ax.add_patch(Rectangle((m - 0.5, r0 - 0.5), 1, r1 - r0 + 1, fill=False, edgecolor="white",
                               lw=1.5 if cols <= 64 else 0.8))
    if dp <= _TEXT_MAX_RANKS and dp * cols <= _TEXT_MAX_CELLS:
        mid = (vmin + vmax) / 2
        for r in range(dp):
            for m in range(cols):
                txt, colour = ("empty", "#404040") if holes[r, m] else (human(tokens[r, m]), "black" if cost[r, m] > mid else "white")
                ax.text(m, r, txt, ha="center", va="center", fontsize=7 if cols > 16 else 8, color=colour)
    bounds = np.cumsum(ks)[:-1]
    for b in bounds:
        ax.axvline(b - 0.5, color="white", lw=2.5)
    if step is None:
        centers = np.cumsum(ks) - np.asarray(ks) / 2 - 0.5
        every = max(1, len(ks) // 24)
        ax.set_xticks(centers[::every], [f"step {s}" for s in range(len(ks))][::every],
                      fontsize=8, rotation=0 if len(ks) <= 10 else 45)
        ax.set_xticks(np.arange(cols) if cols <= 400 else _ticks(cols), minor=True)   # a tick under every slot
        ax.xaxis.remove_overlapping_locs = False   # a slot under a step label keeps its tick too
        ax.tick_params(axis="x", which="major", length=0, pad=6)
        ax.set_xlabel("micro-batch slots (one tick each), step by step")
    else:
        ax.set_xticks(_ticks(cols))
        ax.set_xlabel(f"micro-batch m (step {step})")
    ax.set_yticks(_ticks(dp))
    ax.set_ylabel("DP rank")
    ax.tick_params(length=2)
    cbar = fig.colorbar(im, ax=ax, location="bottom", fraction=0.06, pad=0.02, aspect=50)
    note = "; cell text: tokens per GPU" if dp <= _TEXT_MAX_RANKS and dp * cols <= _TEXT_MAX_CELLS else ""
    note += "; white boxes: context-parallel groups" if groups else ""
    note += "; white lines separate steps" if step is None and len(ks) > 1 else ""
    note += "; white dotted band: the cell's padding share (tokens held for no sample)" if padded else ""
    label = (f"predicted micro-batch cost ({cost_units(plan.config)}, scale from 0); grey hatched 'empty' = "
             f"placeholder (an empty micro-batch that keeps K equal){note}")
    width = int(fig.get_size_inches()[0] * 0.8 * 14)   # characters of 8 pt text across the heat map
    cbar.set_label("\n".join([textwrap.fill(label, width), textwrap.fill(CAPTION, width)]), fontsize=8)


#: How to read the picture, printed under the colour bar.
CAPTION = ("How to read it: each column is one micro-batch slot, which every rank runs at the same time; "
           "good = one colour down each column (no rank waits for a slower one) and equal rank totals at the "
           "green lower bound.")


def _padding_bands(ax: Any, pads: np.ndarray) -> bool:
    """A white dotted band across the top of every cell with padding, its height the padding's
    share of the cell (one PatchCollection: cheap at dp=128). True when any cell has padding."""
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Rectangle

    rows, cols = np.nonzero(pads > 0)
    if not rows.size:
        return False
    bands = [Rectangle((m - 0.5, r - 0.5), 1, float(pads[r, m])) for r, m in zip(rows, cols)]
    ax.add_collection(PatchCollection(bands, facecolor=(1, 1, 1, 0.35), edgecolor="white", hatch="...", lw=0))
    return True


def _ticks(n: int) -> np.ndarray:
    """At most ~16 integer ticks over 0..n-1."""
    stride = max(1, int(np.ceil(n / 16)))
    return np.arange(0, n, stride)


def _rank_bars(ax: Any, plan: Plan, cost: np.ndarray, steps: list[int]) -> None:
    """Each rank's total cost: blue bars, the costliest rank red when the ranks differ (not at a
    printed imbalance of 1.000); mean (black dashes) and lower bound (green) as vertical lines;
    when they (nearly) coincide the lines are drawn side by side in styles that stay visible, and
    the legend says they coincide. Every colour is in the legend."""
    from matplotlib.patches import Patch

    totals = cost.sum(axis=1)
    dp = totals.size
    lb = sum(plan.stats.steps[s].time_lower_bound for s in steps)
    mean = float(totals.mean())
    worst = int(np.argmax(totals))
    uneven = mean > 0 and round(float(totals.max()) / mean, 3) > 1.0   # what the title prints as imbalance
    colours = np.where((np.arange(dp) == worst) & uneven, _WORST, _BAR)
    ax.barh(np.arange(dp), totals, height=0.8 if dp <= 64 else 1.0, color=colours)
    hi, lo = max(float(totals.max()), lb), min(float(totals.min()), lb)
    span = max(hi - lo, 0.02 * hi)               # zoom, but never magnify < 2 % differences
    left = lo - 0.6 * span
    left = left if left > 0.25 * hi else 0.0      # a short zoom only confuses: start at 0
    ax.set_xlim(left, hi + 0.25 * span)
    units = cost_units(plan.config)
    close = abs(mean - lb) < 0.004 * (hi + 0.25 * span - left)  # under ~1 px apart at the usual width
    ax.axvline(lb, color=_LB, lw=3.0 if close else 1.5, alpha=0.6 if close else 1.0, zorder=2)
    ax.axvline(mean, color="black", ls=(0, (3, 2)), lw=1.2, zorder=3)
    flag = (Patch(color=_WORST, label=f"costliest rank ({worst})") if uneven else
            Patch(color="none", label="ranks balanced: none costlier (max/mean 1.000)"))
    handles = [Patch(color=_BAR, label="rank total"), flag,
               _line("black", (0, (3, 2)), f"mean {sig(mean)}"),
               _line(_LB, "-", f"lower bound {sig(lb)}" + (" (= mean: lines coincide)" if close else ""))]
    tick_left = _tick_labels(ax, hi)
    zoom = f"\n(axis starts at {tick_left}, not 0)" if left > 0 else ""
    ax.set_xlabel(f"rank total ({units}){zoom}")
    ax.set_title(f"max/mean {totals.max() / mean:.3f}" if mean > 0 else "", fontsize=9)
    from matplotlib.transforms import offset_copy
    below = offset_copy(ax.transAxes, fig=ax.figure, y=-50, units="points")   # under the x label
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), bbox_transform=below, fontsize=7,
              frameon=False)
    ax.tick_params(labelleft=False, length=2)


def _line(colour: str, style: Any, label: str) -> Any:
    from matplotlib.lines import Line2D
    return Line2D([], [], color=colour, ls=style, lw=1.5, label=label)


def _tick_labels(ax: Any, hi: float) -> str:
    """About 4 x ticks, labelled in k/M with just enough decimals to tell them apart; returns the
    axis's left end written with the same scale and decimals (for the "axis starts at" note)."""
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(4))
    lo_lim, hi_lim = ax.get_xlim()
    below = [t for t in ax.get_xticks() if t <= lo_lim]
    if lo_lim > 0 and below and max(below) > 0:  # start a zoomed axis at a tick: the note and the ticks agree
        lo_lim = float(max(below))
        ax.set_xlim(lo_lim, hi_lim)
    ticks = [t for t in ax.get_xticks() if lo_lim <= t <= hi_lim]
    scale, suffix = next(((v, s) for v, s in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")) if hi >= v), (1.0, ""))
    vals = [t / scale for t in ticks]
    dec = next((d for d in range(4) if all(abs(round(v, d) - v) < 1e-9 * max(1.0, abs(v)) for v in vals)), 3)
    ax.set_xticks(ticks, [f"{v:.{dec}f}{suffix}" if v else "0" for v in vals])
    return f"{lo_lim / scale:.{dec}f}{suffix}"
