"""The readable summary of a plan: one text, printed by the CLI and returned by ``Plan.summary()``.

Design note. ``format_summary(plan)`` builds the text from ``plan.stats`` (never recomputing a
figure) in four parts: what was planned (config and batch), the figures against their lower
bounds, why K for the most telling step, a per-step table — then a legend that explains every
term the text uses, one line each. Rules every line follows:

- units are named once, in the ``units`` line: seconds only for a cost in seconds (calibrated,
  profiled or metered: a per-token coefficient below 1e-2 can only be a time, a FLOP count per
  token is ~1e9), otherwise what the cost counts ("tokens of compute" for TokenCost, FLOPs for a
  cost derived from a model config, the coefficients' own units for a hand-set FlopsCost);
- every cost figure has 4 significant figures (``sig``: 1.100M, never 1.1M beside 1.098M), every
  ratio 3 decimals;
- the why-K line is a sentence in plain words; K that could not be packed are said so, never
  printed as ``inf``;
- padding (tokens a GPU holds that belong to no sample) and placeholders (empty micro-batches
  that keep K equal) are reported apart;
- a plan whose placeholders outnumber its real micro-batches more than ``PLACEHOLDER_WARN_RATIO``
  times (more ranks than the batch can use: ``dp_size`` 1,000,000 on 2,048 samples) gets a
  ``warning`` line (:func:`placeholder_warning`; the CLI also prints it to stderr). Legal, so
  never an error, but never silent either.

Trade-off: the summary is ~20 lines + a 7-line legend for a one-screen plan; the legend costs
7 lines on every print, which a newcomer needs and an expert skips (``Plan.__repr__`` is the
one-line form).
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np

if TYPE_CHECKING:
    from .batch import Batch
    from .types import KChoice, Step

__all__ = ["format_summary", "describe_batch", "cost_unit", "CostUnit", "sig", "count", "short_repr", "LEGEND",
           "placeholder_warning", "PLACEHOLDER_WARN_RATIO"]

#: Placeholders per real micro-batch above which the summary warns (most GPUs would idle).
PLACEHOLDER_WARN_RATIO = 4



class PlanView(Protocol):
    """What the summary reads of a plan (``plan.Plan`` has it; this module never imports plan.py,
    which imports it)."""

    batch: Batch
    config: Any
    steps: Sequence[Step]
    dropped: np.ndarray
    drop_reasons: Mapping[int, str]
    kind: str

    @property
    def stats(self) -> Any: ...

    def fingerprint(self) -> str: ...


_MAX_TABLE_ROWS = 12
_LABEL = 23  # width of the left column

#: One line per term the summary uses (printed under "terms").
LEGEND = (
    ("K", "micro-batches each rank runs in a step (the same on every rank)"),
    ("K_lb", "the fewest K the cap allows: ⌈step tokens / (dp × cap)⌉ (at least the pipeline stages)"),
    ("LB", "lower bound of the predicted time: no plan of this config can be faster"),
    ("lockstep", "ranks meet at every micro-batch (sync='micro': FSDP/ZeRO-3, pipelines): a step "
                 "takes Σ over micro-batch slots of the slowest rank"),
    ("step-sync", "ranks meet once per step (sync='step': DDP no_sync): a step takes the slowest rank's total"),
    ("placeholder", "an empty micro-batch (one dummy token, no loss) that keeps K equal on every rank"),
    ("padding", "tokens a GPU holds that belong to no sample (padded layouts, pad-to-multiple rules)"),
)


class CostUnit(NamedTuple):
    """The unit of a plan's cost figures: ``short`` after a number, ``long`` in the units line."""

    short: str
    long: str
    seconds: bool


def cost_unit(config: Any) -> CostUnit:
    """What a config's predicted costs are measured in (see the module note for the rule)."""
    cost = config.cost
    if type(cost).__name__ == "TokenCost":
        return CostUnit("tokens", "predicted cost, in tokens of compute (TokenCost: 1 per token, not seconds; "
                        "calibrate, profile_cost or CostMeter give seconds)", False)
    linear = float(getattr(cost, "linear", 1.0))
    if 0.0 < linear < 1e-2 or (linear == 0.0 and float(getattr(cost, "quadratic", 1.0)) < 1e-2):
        return CostUnit("s", "predicted time, in seconds (a calibrated, profiled or metered cost)", True)
    if linear >= 1e3:
        return CostUnit("FLOPs", "predicted cost, in GEMM-equivalent FLOPs (a cost derived from the model's "
                        "config, not seconds)", False)
    return CostUnit("cost units", "predicted cost, in the units of the cost model's coefficients (not seconds)",
                    False)


def sig(x: float, digits: int = 4) -> str:
    """``x`` with exactly ``digits`` significant figures and a k/M/G/T/P/E suffix: 1100000 → '1.100M'."""
    if x != x or x in (float("inf"), float("-inf")):
        return "n/a"
    if x == 0:
        return "0"
    a = abs(x)
    for scale, suffix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= scale * (1 - 0.5 * 10 ** -digits):
            return _fixed(x / scale, digits) + suffix
    return _fixed(x, digits)


def count(n: int) -> str:
    """A whole count (tokens, samples): exact below 10,000, else 4 significant figures."""
    return f"{int(n):,}" if abs(n) < 10_000 else sig(n)


def _fixed(v: float, digits: int) -> str:
    """``v`` to ``digits`` significant figures, trailing zeros kept (no exponent for 1e-4 <= |v| < 1e4)."""
    text = f"{v:#.{digits}g}"
    return text.rstrip(".") if "e" not in text else text


def _amount(x: float, unit: CostUnit, digits: int = 4) -> str:
    """A cost figure with its unit: seconds as s/ms, others with ``digits`` significant figures."""
    if unit.seconds:
        return f"{sig(x * 1e3, digits)} ms" if 0 < abs(x) < 1 else f"{sig(x, digits)} s"
    return f"{sig(x, digits)} {unit.short}"


def describe_batch(batch: Batch) -> str:
    """One line on a batch: sizes, total tokens, and the length distribution."""
    s = batch.seq_lens
    if s.size == 0:
        return "empty"
    p50, p90 = (int(np.quantile(s, q)) for q in (0.5, 0.9))
    at_max = int((s == s.max()).sum())
    return (f"{batch.num_samples:,} samples, {batch.num_prompts:,} prompts, {batch.num_rollouts:,} rollouts, "
            f"{count(batch.total_tokens)} tokens; seq_len median {p50:,} · p90 {p90:,} · max {int(s.max()):,} "
            f"({at_max:,} at the max)")


def _config_line(cfg: Any) -> str:
    cap = (f"cap {cfg.max_tokens_per_micro:,} tokens/GPU" if cfg.max_tokens_per_micro
           else f"micro_batch_size {cfg.micro_batch_size}")
    cp = cfg.context_parallel
    parts = [f"dp={cfg.dp_size}", cap]
    parts += [] if cp is None else [f"CP {cp.size}" if cp.size else f"dynamic CP ≤ {cp.max_size}"]
    parts += [f"align {cfg.align}"] if cfg.align > 1 else []
    parts += [f"layout {cfg.layout}"] if cfg.layout != "varlen" else []
    parts += [f"pad to {cfg.pad_to_multiple_of}"] if cfg.pad_to_multiple_of > 1 else []
    parts += [f"row to {cfg.pad_row_to_multiple_of}"] if cfg.pad_row_to_multiple_of > 1 else []
    if cfg.pipeline_stages > 1:
        parts.append(f"PP {cfg.pipeline_stages}" + (f"×{cfg.virtual_stages} virtual" if cfg.virtual_stages > 1 else ""))
    parts += [f"sync={cfg.sync}", f"short_step={cfg.short_step}", f"cost {type(cfg.cost).__name__}",
              f"loss {cfg.loss.mode}"]
    parts += ["shared prefixes"] if cfg.share_prefixes else []
    return " · ".join(parts)


def _row(label: str, text: str, width: int = 110) -> str:
    """``  label : text``, long text wrapped under itself at ``width`` columns."""
    indent = " " * (_LABEL + 4)
    return textwrap.fill(text, width, initial_indent=f"  {label:<{_LABEL}}: ", subsequent_indent=indent,
                         break_on_hyphens=False)


def _padding(plan: PlanView) -> tuple[int, int] | None:
    """(padding tokens, tokens held) over the plan, or None when the config cannot pad."""
    cfg, st = plan.config, plan.stats
    if cfg.share_prefixes or (cfg.layout == "varlen" and cfg.pad_to_multiple_of == 1 and cfg.pad_row_to_multiple_of == 1):
        return None
    return st.tokens_with_sharing - st.tokens_without_sharing, st.tokens_with_sharing


def _choice_step(plan: PlanView) -> Any:
    """The most telling step for the why-K line: the first whose K is not simply K_lb."""
    steps = [s for s in plan.steps if s.choice is not None]
    if not steps:
        return None
    return next((s for s in steps if s.choice.micro_count != s.choice.lower_bound or len(s.choice.candidates) > 1),
                steps[0])


def why_k(choice: KChoice, cfg: Any, unit: CostUnit, k_lb: int | None = None) -> str:
    """Why a step runs K micro-batches per rank, in plain words (no ``inf``); ``k_lb``: the step's
    K_lb as the stats report it (the choice's bound is K_lb rounded up to ``align``)."""
    K, K0 = choice.micro_count, choice.lower_bound
    low = f"K_lb = {K0}" if k_lb in (None, K0) else f"K_lb {k_lb} rounded up to align {cfg.align} = {K0}"
    finite = [(k, t) for k, t in choice.candidates if np.isfinite(t)]
    unpacked = sorted(k for k, t in choice.candidates if not np.isfinite(t))
    cap = f"the {cfg.max_tokens_per_micro:,}-token cap" if cfg.max_tokens_per_micro else "the cap"
    no_fit = ""
    if unpacked:
        ks = ", ".join(map(str, unpacked))
        no_fit = f"with K = {ks} no packing of the step's whole samples under {cap} was found"
    if getattr(cfg, "micro_batch_size", None) is not None:
        return (f"K = {K}: static batching fixes it (the fewest micro-batches per rank that hold the samples "
                f"micro_batch_size={cfg.micro_batch_size} at a time, align={cfg.align}).")
    if K == K0 and len(finite) <= 1:
        return f"K = {K}, {low}: the fewest micro-batches per rank the cap allows, and the samples pack into them."
    if len(finite) <= 1:
        return (f"K = {K}, {K - K0} more than {low}: {no_fit} (K_lb counts tokens only; whole samples "
                f"leave gaps in the micro-batches).")
    digits = next((d for d in range(4, 8) if len({sig(t, d) for _, t in finite}) == len({t for _, t in finite})), 8)
    tried = ", ".join(f"K = {k}: {_amount(t, unit, digits)}" for k, t in finite)
    why = (" A dense masked kernel pays for the whole packed row squared (packed-row attention), so smaller "
           "micro-batches can be faster." if getattr(cfg.cost, "dense", False) else
           " In a padded layout, more micro-batches pad less." if cfg.layout != "varlen" else "")
    rest = f"; {no_fit}" if no_fit else ""
    return f"K = {K} ({low}) has the lowest predicted step time of the K tried ({tried}){rest}.{why}"


def _dropped_lines(plan: PlanView) -> list[str]:
    by_reason: dict[str, list[int]] = {}
    for i, why in plan.drop_reasons.items():
        by_reason.setdefault(why, []).append(i)
    lines = []
    for why, idx in by_reason.items():
        head = ", ".join(map(str, idx[:6])) + (", ..." if len(idx) > 6 else "")
        lines.append(f"  {len(idx):,} sample{'s' if len(idx) != 1 else ''} [{head}]: {why}")
    return lines


def _step_table(plan: PlanView, padded: bool) -> list[str]:
    ss = plan.stats.steps
    head = "   step   samples    tokens     K  K_lb  max tok/GPU  lockstep/LB  step-sync/LB  placeholders"
    rows = [head + ("   padding" if padded else "")]
    shown = ss if len(ss) <= _MAX_TABLE_ROWS else ss[: _MAX_TABLE_ROWS - 2]
    for i, s in enumerate(shown):
        lb = s.time_lower_bound or 1.0
        row = (f"  {i:5d} {s.num_samples:9,} {count(s.num_tokens):>9} {s.micro_count:5d} {s.micro_count_lower_bound:5d} "
               f"{s.max_micro_tokens:12,} {s.lockstep_time / lb:12.3f} {s.step_sync_time / lb:13.3f} "
               f"{s.num_placeholders:13d}")
        rows.append(row + (f" {s.tokens_with_sharing - s.num_tokens:9,}" if padded else ""))
    if len(shown) < len(ss):
        rows.append(f"  ... {len(ss) - len(shown)} more steps")
    return rows


def _time_lines(plan: PlanView, unit: CostUnit) -> list[str]:
    st, cfg = plan.stats, plan.config
    lb = st.time_lower_bound
    ratio = (lambda t: f"{t / lb:.3f}× LB") if lb > 0 else (lambda t: "LB n/a")
    used, other = ((st.lockstep_time, "lockstep"), (st.step_sync_time, "step-sync"))[:: 1 if cfg.sync == "micro" else -1]
    lines = [_row("predicted time", f"{_amount(used[0], unit)} ({used[1]}, sync={cfg.sync}) = {ratio(used[0])}; "
                  f"LB = {_amount(lb, unit)}"),
             f"  {'':<{_LABEL}}  under {other[1]} it would be {_amount(other[0], unit)} = {ratio(other[0])}"]
    if cfg.placement == "local" and st.split_lower_bound > 0:
        lines.append(f"  {'':<{_LABEL}}  the split's bound (every sample on its rank) is {_amount(st.split_lower_bound, unit)}"
                     f": {used[0] / st.split_lower_bound:.3f}× of it")
    if cfg.pipeline_stages > 1:
        sched = (f"interleaved 1F1B, {cfg.virtual_stages} chunks/stage, groups of {cfg.align}"
                 if cfg.virtual_stages > 1 else "1F1B")
        sched = ("forward-only " if plan.kind == "forward" else "") + sched
        lines.append(_row("pipeline", f"{cfg.pipeline_stages} stages, {sched}: step time "
                          f"{_amount(st.pipeline_time, unit)}, bubble {100 * st.pipeline_bubble:.1f} % of a stage's time"))
    return lines


def _cp_text(plan: PlanView) -> str:
    """CP groups by width, the samples that fit one GPU but run split, and how a split is priced."""
    from .footprint import footprint_of
    cfg = plan.config
    heads = [m for s in plan.steps for row in s.micros for m in row if m.cp_rank == 0]
    widths: dict[int, int] = {}
    for m in heads:
        widths[m.cp_size] = widths.get(m.cp_size, 0) + 1
    fits = footprint_of(plan.batch, cfg).sample_tokens <= cfg.max_tokens_per_micro  # type: ignore[operator]
    split = sum(int(fits[m.indices].sum()) for m in heads if m.cp_size > 1)
    groups = ", ".join(f"{n:,} of width {w}" for w, n in sorted(widths.items()))
    cp = getattr(cfg.cost, "cp", None)
    price = (f"split micro-batches priced with {cp.describe()}" if cp is not None else
             "no CP term in the cost: a split micro-batch costs (cost − per_micro)/c + per_micro (perfect scaling)")
    return (f"micro-batch groups: {groups}; {split:,} of {int(fits.sum()):,} samples that fit one GPU run split; "
            f"{price}")


def placeholder_warning(plan: PlanView) -> str | None:
    """One sentence when the plan's placeholders outnumber its real micro-batches more than
    ``PLACEHOLDER_WARN_RATIO`` times (more ranks than the batch can keep busy), else None."""
    st = plan.stats
    slots = sum(s.micro_count for s in st.steps) * plan.config.dp_size
    empty = st.num_placeholders
    real = slots - empty
    if empty <= PLACEHOLDER_WARN_RATIO * max(real, 1):
        return None
    planned = st.num_samples - st.num_dropped
    return (f"{empty:,} placeholders for {real:,} real micro-batches ({empty / max(real, 1):,.0f}×): most GPUs run "
            f"only empty micro-batches. dp_size={plan.config.dp_size:,} is more ranks than {planned:,} planned samples "
            "can use; plan them on fewer ranks, or put more samples in each step.")


def format_summary(plan: PlanView) -> str:
    """The readable multi-line summary of a plan (what ``Plan.summary()`` returns and the CLI prints)."""
    st, cfg = plan.stats, plan.config
    unit = cost_unit(cfg)
    cap = cfg.max_tokens_per_micro
    mx = (f"{st.max_micro_tokens:,} of the {cap:,} cap ({100 * st.max_micro_tokens / cap:.1f} %)" if cap else
          f"{st.max_micro_tokens:,} (static micro_batch_size {cfg.micro_batch_size})")
    per_step = " ".join(str(s.micro_count) for s in st.steps[:16]) + (" ..." if len(st.steps) > 16 else "")
    kind = "forward plan (loss scale 0)" if plan.kind == "forward" else "plan"
    pad = _padding(plan)
    lines = [
        f"{kind}: {st.num_steps} step{'s' if st.num_steps != 1 else ''} · {_config_line(cfg)}",
        _row("batch", describe_batch(plan.batch)),
        _row("units", unit.long),
        _row("micro-batches per rank", f"{st.micro_count} over all steps (K per step: {per_step}) vs "
             f"K_lb {st.micro_count_lower_bound}" if st.steps else "none"),
        _row("max tokens per GPU", mx),
        *_memory_lines(plan),
        *_time_lines(plan, unit),
        _row("rank imbalance", f"{st.rank_imbalance:.3f} (max / mean of the ranks' total predicted cost; 1 = even)"),
    ]
    if pad is not None:
        share = 100 * pad[0] / pad[1] if pad[1] else 0.0
        lines.append(_row("padding", f"{pad[0]:,} tokens ({share:.1f} % of the {pad[1]:,} tokens the GPUs hold)"))
    if cfg.share_prefixes:
        lines.append(_row("shared prefixes", f"{st.tokens_with_sharing:,} tokens held for {st.tokens_without_sharing:,} "
                          f"sample tokens (lower bound {st.tokens_lower_bound:,})"))
    lines.append(_row("placeholders", f"{st.num_placeholders:,} empty micro-batch{'es' if st.num_placeholders != 1 else ''}"))
    warn = placeholder_warning(plan)
    if warn is not None:
        lines.append(_row("warning", warn))
    if cfg.context_parallel is not None and st.steps:
        lines.append(_row("context parallel", _cp_text(plan)))
    pick = _choice_step(plan)
    if pick is not None:
        k_lb = st.steps[pick.index].micro_count_lower_bound
        lines.append(_row(f"why K (step {pick.index})", why_k(pick.choice, cfg, unit, k_lb)))
    lines.append(_row("dropped", f"{st.num_dropped:,} of {st.num_samples:,} samples"))
    lines += _dropped_lines(plan)
    if st.steps:
        lines += _step_table(plan, pad is not None)
    lines.append(_row("fingerprint", plan.fingerprint()[:16]))
    width = max(len(t) for t, _ in LEGEND)
    lines.append("  terms:")
    lines += [textwrap.fill(d, 110, initial_indent=f"    {t:<{width}}  ", subsequent_indent=" " * (width + 6))
              for t, d in LEGEND]
    return "\n".join(lines)


def _memory_lines(plan: PlanView) -> list[str]:
    """With a memory model: the largest predicted peak against the byte budget, the margin, the source."""
    cfg, st = plan.config, plan.stats
    if cfg.memory is None or st.max_micro_bytes is None:
        return []
    m, b = cfg.memory, cfg.max_bytes_per_micro
    gib = 2 ** 30
    return [_row("max bytes per GPU", f"{st.max_micro_bytes / gib:,.3f} GiB predicted peak (+{m.margin:.1%} margin = "
                 f"{m.with_margin(st.max_micro_bytes) / gib:,.3f} GiB) of the {b / gib:,.3f} GiB max_bytes_per_micro "
                 f"({100 * m.with_margin(st.max_micro_bytes) / b:.1f} %) under the token cap "
                 f"{cfg.max_tokens_per_micro:,}; "
                 f"{m.describe()}")]


def short_repr(plan: PlanView) -> str:
    """One line that fits a screen: sizes, K vs its bound, predicted time vs its bound."""
    st, cfg = plan.stats, plan.config
    unit = cost_unit(cfg)
    kind = ", kind='forward'" if plan.kind == "forward" else ""
    lb = st.time_lower_bound
    ratio = f" = {st.predicted_time / lb:.3f}× lower bound" if lb > 0 else ""
    steps = f"{st.num_steps} step{'s' if st.num_steps != 1 else ''}"
    return (f"<Plan{kind}: {steps} × dp {cfg.dp_size}, {st.num_samples:,} samples "
            f"({st.num_dropped:,} dropped), {st.micro_count} micro-batches per rank (K_lb {st.micro_count_lower_bound}), "
            f"predicted {_amount(st.predicted_time, unit)}{ratio}; print(plan.summary()) for more>")
