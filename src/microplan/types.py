"""The plan's value types: Micro, Step, PlanStats (Plan lives in plan.py).

A :class:`Micro` carries everything a rank needs to pack and weigh one micro-batch: global
sample indices in execution order, their lengths and loss-token counts, and per-sample loss
scales. Arrays are int64/float64, read-only, and aligned with ``indices``. The planner builds
dp·K of them per step (``_micro_row``) while a rank reads its own K: ``seq_lens``,
``loss_tokens`` and ``loss_scale`` are then views sliced from the step's shared columns on first
read (``_Column``); pickling or copying one carries its own arrays only. A tree row's ``tree``
is likewise taken on first read from its step's lazy tries (``_Tree``; the step's tries are
computed together then). Trade-off: building a step's Micros is cheaper, reading an array or
the first trie of a step dearer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from .footprint import Footprint
    from .prefix import PrefixTree

__all__ = ["Micro", "Step", "StepStats", "PlanStats", "KChoice"]


_new, _set = object.__new__, object.__setattr__


def _ro(a: Any, dtype: Any) -> np.ndarray:
    arr = np.array(a, dtype=dtype, copy=True).reshape(-1)
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class Micro:
    """One micro-batch on one rank (binding API).

    Attributes:
        indices: int64 global sample indices in execution order; empty only for a placeholder.
        seq_lens: int64 packed length of each sample (aligned with ``indices``).
        loss_tokens: int64 loss-carrying tokens of each sample.
        loss_scale: float64 per-sample loss scale (see docs/loss.md); multiply each sample's
            per-token loss sum by it, sum over the micro-batch, and call backward.
        cp_size: GPUs that process this micro-batch together (1 without context parallel).
        cp_rank: this rank's position in its CP group (0 .. cp_size-1; 0 without dynamic CP).
        cp_group: the plan ranks that share this micro-batch under dynamic CP, in CP-rank order;
            ``(rank,)`` otherwise.
        footprint: the plan's :class:`~microplan.footprint.Footprint` (layout and padding rules
            over the batch), or None for a plain varlen row (the footprint is Σ seq_lens).
        tree: with ``PlanConfig(share_prefixes=True)``, the prefix trie of the samples (each
            shared token once; see :class:`microplan.prefix.PrefixTree`); None otherwise.
    """

    indices: np.ndarray
    seq_lens: np.ndarray
    loss_tokens: np.ndarray
    loss_scale: np.ndarray
    cp_size: int = 1
    cp_rank: int = 0
    cp_group: tuple[int, ...] = field(default=())
    footprint: Footprint | None = field(default=None, repr=False)
    tree: PrefixTree | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "indices", _ro(self.indices, np.int64))
        object.__setattr__(self, "seq_lens", _ro(self.seq_lens, np.int64))
        object.__setattr__(self, "loss_tokens", _ro(self.loss_tokens, np.int64))
        object.__setattr__(self, "loss_scale", _ro(self.loss_scale, np.float64))
        object.__setattr__(self, "cp_group", tuple(int(r) for r in self.cp_group))

    @classmethod
    def _trusted(cls, indices: np.ndarray, seq_lens: np.ndarray, loss_tokens: np.ndarray,
                 loss_scale: np.ndarray, cp_size: int, cp_rank: int, cp_group: tuple[int, ...],
                 tree: PrefixTree | None = None, footprint: Footprint | None = None) -> Micro:
        """Internal fast path: arrays are already read-only int64/float64 views; no copies."""
        self = _new(cls)
        _set(self, "__dict__", {"indices": indices, "seq_lens": seq_lens, "loss_tokens": loss_tokens,
                                "loss_scale": loss_scale, "cp_size": cp_size, "cp_rank": cp_rank, "cp_group": cp_group,
                                "footprint": footprint, "tree": tree})  # frozen: bypass __setattr__ (one dict, ~1 µs)
        return self

    def __getstate__(self) -> dict[str, Any]:
        """Pickle and copy with the Micro's own arrays, never its step's shared columns (see _Column)."""
        if "_cols" not in self.__dict__:
            return self.__dict__
        return {name: getattr(self, name) for name in _FIELDS}

    @property
    def is_placeholder(self) -> bool:
        """True for an explicit filler micro-batch: no sample, no loss (pack it as 1 dummy token)."""
        return self.indices.size == 0

    @property
    def num_tokens(self) -> int:
        """Tokens the GPU(s) hold for this micro-batch: its samples as the plan's layout places them,
        padding included (pad-to-multiple, the row multiple, the ``[n, W]`` padding of padded
        layouts), all CP ranks together — per GPU it is ⌈num_tokens / cp_size⌉. This is what the
        cap counts. 0 for a placeholder (which packs to one dummy row). With shared prefixes: the
        unique tokens of its prefix trie. Without a footprint: Σ seq_lens (a plain varlen row)."""
        if self.tree is not None:
            return self.tree.num_tokens if self.footprint is None else self.footprint.tree_tokens(self.tree)
        if self.footprint is None or not self.indices.size:
            return int(self.seq_lens.sum())
        return self.footprint.tokens(self.indices)

    @property
    def real_tokens(self) -> int:
        """The samples' own tokens, Σ seq_lens (num_tokens − real_tokens is padding)."""
        return int(self.seq_lens.sum())

    @property
    def vision_tokens(self) -> int:
        """Vision-encoder patches of the micro-batch (0 without ``Batch.vision_tokens``)."""
        return 0 if self.footprint is None else self.footprint.vision(self.indices)

    @property
    def num_samples(self) -> int:
        return int(self.indices.size)

    @classmethod
    def placeholder(cls, *, cp_group: tuple[int, ...] = ()) -> Micro:
        e = np.zeros(0)
        return cls(e, e, e, e, cp_group=cp_group)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Micro):
            return NotImplemented
        return (np.array_equal(self.indices, other.indices) and np.array_equal(self.seq_lens, other.seq_lens)
                and np.array_equal(self.loss_tokens, other.loss_tokens)
                and np.array_equal(self.loss_scale, other.loss_scale)
                and (self.cp_size, self.cp_rank, self.cp_group) == (other.cp_size, other.cp_rank, other.cp_group)
                and _same_rules(self.footprint, other.footprint) and self.tree == other.tree)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        if self.is_placeholder:
            return "Micro(placeholder)"
        cp = f", cp_size={self.cp_size}, cp_rank={self.cp_rank}" if self.cp_size > 1 else ""
        shared = f" of {int(self.seq_lens.sum())} unshared" if self.tree is not None else ""
        return f"Micro(samples={self.num_samples}, tokens={self.num_tokens}{shared}{cp})"

    def to_dict(self) -> dict[str, Any]:
        return {"indices": self.indices.tolist(), "loss_scale": self.loss_scale.tolist(),
                "cp_size": self.cp_size, "cp_rank": self.cp_rank, "cp_group": list(self.cp_group)}


_FIELDS = ("indices", "seq_lens", "loss_tokens", "loss_scale", "cp_size", "cp_rank", "cp_group", "footprint", "tree")


class _Column:
    """``seq_lens``, ``loss_tokens`` and ``loss_scale`` of a planner-built Micro (:func:`_micro_row`):
    sliced from the step's shared read-only column on first read, then kept in the instance dict
    (which shadows this non-data descriptor). A rank reads its own K micro-batches, not dp·K:
    3 of 4 slices per Micro are never paid for the others (16k samples, dp 128: ~1.5 ms per plan)."""

    __slots__ = ("name", "col")

    def __init__(self, name: str, col: int) -> None:
        self.name, self.col = name, col

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        d = obj.__dict__
        cols = d.get("_cols")
        if cols is None:
            raise AttributeError(f"'Micro' object has no attribute {self.name!r}")
        lo = d["_lo"]
        value = d[self.name] = cols[self.col][lo:lo + d["indices"].size]
        return value


for _col, _name in enumerate(("seq_lens", "loss_tokens", "loss_scale"), start=1):
    setattr(Micro, _name, _Column(_name, _col))  # after @dataclass: the fields stay required, without defaults


class _Tree:
    """``tree`` of a planner-built Micro of tree rows (:func:`_micro_tree_grid`): taken on first
    read from the step's lazy tries (``_tries[_g]``, every bin's trie computed in one pass the
    first time any of them is read; ``stages.build.StepTries``), then kept in the instance dict
    (which shadows this non-data descriptor). A Micro without a source has the field's default,
    None. Equality, pickling and copying read the field, so they see the trie."""

    __slots__ = ()

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return None  # the dataclass field's default, as the class attribute was
        d = obj.__dict__
        src = d.get("_tries")
        if src is None:
            return None
        value = d["tree"] = src[d["_g"]]
        return value


Micro.tree = _Tree()  # type: ignore[assignment]  # after @dataclass: the field keeps its default None


def _extra(cp_size: int, footprint: Footprint | None) -> dict[str, Any]:
    """The fields a planner-built Micro sets beyond its span when not at their class default."""
    extra: dict[str, Any] = {} if cp_size == 1 else {"cp_size": cp_size}
    if footprint is not None:
        extra["footprint"] = footprint
    return extra


def _make(ds: list[dict[str, Any]], extra: dict[str, Any], tries: Any, bins: list[int] | None) -> list[Micro]:
    """Micros from their instance dicts (frozen: ``__setattr__`` bypassed), with ``extra`` and, for
    tree rows, each one's lazy trie source (``tries[bins[k]]``, :class:`_Tree`)."""
    if extra:
        for d in ds:
            d.update(extra)
    if tries is not None:
        for d, g in zip(ds, bins):  # type: ignore[arg-type]
            d["_tries"], d["_g"] = tries, g
    made = list(map(_new, repeat(Micro, len(ds))))
    list(map(_set, made, repeat("__dict__"), ds))
    return made


def _micro_row(cols: list[np.ndarray], los: list[int], his: list[int], group: tuple[int, ...], cp_size: int,
               footprint: Footprint | None, tries: Any = None, bins: list[int] | None = None) -> list[Micro]:
    """One rank's Micros, the m-th holding ``cols[c][los[m]:his[m]]`` (internal fast path for the
    planner's dp·K micro-batches: one dict per Micro holding ``indices``, the step's columns and the
    offset its other arrays are sliced from on first read (:class:`_Column`; no span tuple: a third
    fewer objects for the garbage collector per Micro); fields at their class default are left
    out of it — attribute lookup falls back to the class — so a Micro costs ~0.5 µs; a rank's
    empty spans share one placeholder). ``cols``: indices, seq_lens, loss_tokens, loss_scale, read-only.
    ``tries``/``bins``: tree rows, the m-th taking its trie ``tries[bins[m]]`` on first read (:class:`_Tree`)."""
    i = cols[0]
    extra = _extra(cp_size, footprint)
    full = [k for k, lo, hi in zip(range(len(los)), los, his) if hi > lo]
    row: list[Micro] = []
    if len(full) < len(los):  # placeholders: one shared by the rank, built once (a rank of dp=1,024 may hold none)
        ph = _new(Micro)
        _set(ph, "__dict__", {"indices": i[:0], "_cols": cols, "_lo": 0, "cp_group": group, **extra})
        row = [ph] * len(los)
        if not full:
            return row
        los, his = [los[k] for k in full], [his[k] for k in full]
        bins = None if bins is None else [bins[k] for k in full]
    made = _make([{"indices": i[lo:hi], "_cols": cols, "_lo": lo, "cp_group": group} for lo, hi in zip(los, his)],
                 extra, tries, bins)
    if not row:
        return made
    for k, m in zip(full, made):
        row[k] = m
    return row


def _micro_grid(cols: list[np.ndarray], los: list[int], his: list[int], K: int, cp_size: int,
                footprint: Footprint | None, tries: Any = None, bins: list[int] | None = None) -> list[list[Micro]]:
    """Every rank's Micros in one pass when no span is empty (no placeholder): rank r's m-th holds
    ``cols[c][los[r·K + m]:his[r·K + m]]``. The same Micros as :func:`_micro_row` per rank, built
    by one comprehension over the flat grid and cut into rows (16k samples, dp 128: ~0.3 ms less
    than 128 row calls). ``K`` >= 1; ``tries``/``bins`` as in :func:`_micro_row`."""
    i = cols[0]
    groups = chain.from_iterable(repeat((r,), K) for r in range(len(los) // K))  # one tuple per rank
    extra = _extra(cp_size, footprint)
    if tries is None:
        made = _make([{"indices": i[lo:hi], "_cols": cols, "_lo": lo, "cp_group": g}
                      for lo, hi, g in zip(los, his, groups)], extra, None, None)
    elif extra:  # the dicts _make fills, keys in its order, each in one literal
        made = _make([{"indices": i[lo:hi], "_cols": cols, "_lo": lo, "cp_group": g, **extra, "_tries": tries, "_g": b}
                      for lo, hi, g, b in zip(los, his, groups, bins)], {}, None, None)  # type: ignore[arg-type]
    else:
        made = _make([{"indices": i[lo:hi], "_cols": cols, "_lo": lo, "cp_group": g, "_tries": tries, "_g": b}
                      for lo, hi, g, b in zip(los, his, groups, bins)], {}, None, None)  # type: ignore[arg-type]
    return [made[k:k + K] for k in range(0, len(made), K)]


def _micro_tree_grid(cols: list[np.ndarray], lo: np.ndarray, hi: np.ndarray, bins: np.ndarray, tries: Any,
                     cp_size: int, footprint: Footprint | None) -> list[list[Micro]]:
    """Every rank's Micros of tree rows (``lo``, ``hi``, ``bins``: ranks × slots int arrays): rank
    r's m-th holds ``cols[c][lo[r, m]:hi[r, m]]`` and the trie ``tries[bins[r, m]]`` (read on first
    access of ``tree``: :class:`_Tree`), built as flat rows are (:func:`_micro_grid`, or
    :func:`_micro_row` per rank when a span is empty: a rank's placeholders share one Micro,
    without a trie). At least one slot per rank."""
    K = bins.shape[1]
    los, his, bl = lo.ravel().tolist(), hi.ravel().tolist(), bins.ravel().tolist()
    if bins.size and bool((hi > lo).all()):
        return _micro_grid(cols, los, his, K, cp_size, footprint, tries, bl)
    return [_micro_row(cols, los[k:k + K], his[k:k + K], (k // K,), cp_size, footprint, tries, bl[k:k + K])
            for k in range(0, len(los), K)]


def _same_rules(a: Footprint | None, b: Footprint | None) -> bool:
    if a is None:
        return b is None or b.same_rules(None)
    return a.same_rules(b)


@dataclass(frozen=True)
class KChoice:
    """Why a step runs K micro-batches per rank (see ``stages/kchoice.py``).

    Attributes:
        micro_count: the K chosen.
        lower_bound: K_lb, the fewest micro-batches per rank the cap allows (aligned).
        candidates: ``(K, predicted step time)`` for every K packed, in the order tried; ``inf``
            when no packing under the cap was found at that K.
        reason: one sentence for humans.
    """

    micro_count: int
    lower_bound: int
    candidates: tuple[tuple[int, float], ...]
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"micro_count": self.micro_count, "lower_bound": self.lower_bound,
                "candidates": [[k, (t if t != float("inf") else None)] for k, t in self.candidates],
                "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KChoice:
        return cls(int(d["micro_count"]), int(d["lower_bound"]),
                   tuple((int(k), float("inf") if t is None else float(t)) for k, t in d["candidates"]),
                   str(d["reason"]))


@dataclass(frozen=True, eq=False)
class Step:
    """One optimizer step (mini-batch) of the plan (binding API).

    Attributes:
        index: position of the step in the plan (0-based).
        micros: ``micros[rank][m]`` is the m-th micro-batch rank ``rank`` runs in this step.
        samples: int64 global indices of every sample that trains in this step (sorted).
        choice: why the step runs K micro-batches per rank (the K tried and their predicted
            times). The planner sets it on every step (static batching: the K its count fixes);
            None only in plans read from JSON written without it.
    """

    index: int
    micros: tuple[tuple[Micro, ...], ...]
    samples: np.ndarray
    choice: KChoice | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "micros", tuple(tuple(r) for r in self.micros))
        object.__setattr__(self, "samples", _ro(self.samples, np.int64))

    @property
    def micro_count(self) -> int:
        """K: micro-batches each rank runs in this step (identical on every rank)."""
        return len(self.micros[0]) if self.micros else 0

    @property
    def dp_size(self) -> int:
        return len(self.micros)

    @property
    def num_placeholders(self) -> int:
        return sum(m.is_placeholder for r in self.micros for m in r)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Step):
            return NotImplemented
        return (self.index == other.index and np.array_equal(self.samples, other.samples)
                and self.micros == other.micros and self.choice == other.choice)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (f"Step(index={self.index}, samples={self.samples.size}, micro_count={self.micro_count}, "
                f"placeholders={self.num_placeholders})")


@dataclass(frozen=True, kw_only=True)
class StepStats:
    """Predicted cost figures of one step (cost units of the plan's cost model)."""

    num_samples: int
    num_tokens: int
    micro_count: int
    micro_count_lower_bound: int
    num_placeholders: int
    max_micro_tokens: int
    lockstep_time: float
    step_sync_time: float
    time_lower_bound: float
    rank_costs: tuple[float, ...]
    choice: KChoice | None = None
    tokens_with_sharing: int = 0
    tokens_lower_bound: int = 0
    pipeline_time: float = 0.0
    pipeline_bubble: float = 0.0
    split_lower_bound: float = 0.0


@dataclass(frozen=True, kw_only=True)
class PlanStats:
    """Summary figures of a plan (binding names: see DESIGN.md).

    Attributes:
        max_micro_tokens: most tokens one GPU holds in any micro-batch (per CP rank), padding
            included: ⌈Micro.num_tokens / cp_size⌉ under the plan's layout (docs/layouts.md).
        cap: ``max_tokens_per_micro`` (None for static batching).
        micro_count / micro_count_lower_bound: Σ over steps of K, and of its lower bound
            ceil(tokens / (dp · cap)), tokens as the samples occupy them alone (padding to the
            multiples, padded widths) and the cap less the row multiple (static:
            ceil(samples / (dp · micro_batch_size))).
        predicted_time: Σ over steps of the step time under the config's ``sync`` mode.
        lockstep_time: Σ_steps Σ_m max_r cost(r, m)  (every micro-batch a sync point).
        step_sync_time: Σ_steps max_r Σ_m cost(r, m)  (ranks meet once per step).
        time_lower_bound: Σ_steps of each step's bound min_K LB(K) over the K the config allows
            (``stages/kchoice.py``: work / GPUs + K · per_micro with the packed-row term at its
            Jensen minimum, the longest sample, and under lockstep the slot bound).
        rank_imbalance: max / mean of the ranks' total cost over the plan (1.0 = perfect).
        steps: per-step :class:`StepStats`.
        tokens_without_sharing: Σ seq_lens of the planned samples (each sample packed alone).
        tokens_with_sharing: tokens the micro-batches hold (unique tokens of their prefix tries
            under ``share_prefixes``; equal to the above otherwise).
        tokens_lower_bound: the fewest tokens any plan computes: each step's whole prefix trie
            once (Σ seq_lens without ``share_prefixes``).
        pipeline_time: Σ over steps of the predicted wall time under the pipeline schedule
            (1F1B, or interleaved 1F1B with ``virtual_stages`` > 1; forward-only for a forward
            plan): each of the p stages runs 1/p of every micro-batch's cost. Equals
            ``predicted_time`` when ``pipeline_stages`` = 1.
        pipeline_bubble: the idle share of that time on a stage,
            1 − predicted_time / (p · pipeline_time) (0 without pipeline parallelism).
        split_lower_bound: with ``placement="local"``, Σ_steps of the best any plan keeping every
            sample on its ``rank_of`` can do (``stats.split_lower_bound``: the busiest rank's own
            bound at the fewest micro-batches the fullest rank needs, and ``time_lower_bound``);
            0 under global placement.
        max_micro_bytes: with a memory model (``PlanConfig.memory``), the largest predicted peak
            bytes one GPU adds in any micro-batch (before the model's margin); None without one.
    """

    num_steps: int
    num_samples: int
    num_dropped: int
    num_placeholders: int
    max_micro_tokens: int
    cap: int | None
    micro_count: int
    micro_count_lower_bound: int
    predicted_time: float
    lockstep_time: float
    step_sync_time: float
    time_lower_bound: float
    rank_imbalance: float
    steps: tuple[StepStats, ...] = ()
    tokens_without_sharing: int = 0
    tokens_with_sharing: int = 0
    tokens_lower_bound: int = 0
    pipeline_time: float = 0.0
    pipeline_bubble: float = 0.0
    split_lower_bound: float = 0.0
    max_micro_bytes: int | None = None

    @property
    def time_ratio(self) -> float:
        """predicted_time / time_lower_bound (1.0 = provably optimal)."""
        return self.predicted_time / self.time_lower_bound if self.time_lower_bound > 0 else 1.0
