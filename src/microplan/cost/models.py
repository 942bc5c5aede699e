"""Cost models: the predicted time of ONE micro-batch, used for balancing, K and predicted times.

Design note. Every built-in model is linear in four *features* of a micro-batch holding samples
of lengths L_1..L_n packed into a row of T = Σ L tokens (``micro_features``)::

    varlen kernel:   micro_cost = linear·Σ L + quadratic·Σ L² + per_micro
    dense kernel:    micro_cost = linear·T + packed_quadratic·T² + per_micro   (two or more samples)
                                = linear·L + quadratic·L² + per_micro           (a lone sample)

- ``linear``: weights (dense, MoE, LM head) — every token costs the same.
- ``quadratic``: attention of *varlen* kernels (flash-attn varlen, cuDNN, per-sample sdpa):
  each sample attends to itself only, so the work adds up sample by sample.
- ``packed_quadratic``: attention of *dense* kernels over the packed row with a block-diagonal
  mask (transformers' sdpa/eager fed restarting position ids, any masked dense kernel): the
  kernel computes all T² pairs, so the cost is NOT a sum over samples. Under such a backend two
  half-full micro-batches are cheaper than one full one, and the planner chooses the
  micro-batch count by predicted time (``stages/kchoice.py``). A model with this term is a
  *dense* model: a micro-batch of two or more samples pays ``packed_quadratic·T²`` and no
  per-sample attention, while a lone sample needs no mask and runs the kernel's plain causal
  path, priced by ``quadratic·L²``.
- ``per_micro``: fixed cost per micro-batch a rank runs (launches, FSDP gathers, sync).

The planner reads a model through :func:`bin_costs` / :func:`row_costs` (from
:meth:`sample_costs`, the additive part per sample, and — for a dense model — ``linear``,
:meth:`packed_costs` and ``packed_quadratic``), ``per_micro``, and ``tree_costs`` for prefix
tries; :meth:`micro_cost` (binding) is the same price for one micro-batch. Units are whatever the coefficients are in: FLOPs for
:meth:`FlopsCost.from_hf_config`, seconds after calibration, profiling or metering.

Guarantees: coefficients are finite and >= 0 (validated with messages naming the field), and
small enough that a micro-batch of up to 2**64 tokens costs at most 1e300 (``check_coefficient``:
sums of ~1e8 such costs stay finite);
``to_dict``/:func:`cost_from_dict` round-trip exactly, so plans serialise their cost model.
Trade-off: a four-feature linear model cannot express everything a GPU does (kernel tile
quantisation, communication overlap), but it can be fitted from a few dozen timed micro-batches
(``cost/calibrate.py``) and stays O(n) to evaluate for a whole step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .._checks import float_field
from ..errors import PlanError
from ._bounds import MAX_MICRO_COST, MAX_PRICED_TOKENS, check_coefficient  # noqa: F401 (the bounds, read here too)
from .cp import DEFAULT_GPU_FLOPS, CPCost, cp_from_dict
from .hf import forward_flops
from .presets import DEFAULT_ATTENTION, DEFAULT_PER_MICRO_TOKENS, attention_kernel

__all__ = ["CostModel", "TokenCost", "FlopsCost", "cost_from_dict", "micro_features", "bin_costs", "row_costs",
           "FEATURES", "is_additive", "placeholder_cost"]

#: The features every built-in model is linear in, in coefficient order.
FEATURES: tuple[str, ...] = ("tokens", "sum_sq_len", "packed_sq", "num_micros")


@runtime_checkable
class CostModel(Protocol):
    """What the planner needs from a cost model (binding: ``micro_cost``)."""

    per_micro: float

    def sample_costs(self, seq_lens: np.ndarray) -> np.ndarray:
        """float64 additive cost of each sample (same shape as ``seq_lens``): no per_micro, no T term."""
        ...

    def micro_cost(self, seq_lens: Sequence[int] | np.ndarray) -> float:
        """Predicted cost of ONE micro-batch holding samples of these lengths, per_micro included."""
        ...

    def to_dict(self) -> dict[str, Any]:
        ...


def _lens(seq_lens: Any) -> np.ndarray:
    arr = np.asarray(getattr(seq_lens, "seq_lens", seq_lens), dtype=np.float64).reshape(-1)
    if arr.size and (not np.isfinite(arr).all() or arr.min() < 0):
        raise PlanError("micro_cost needs finite sample lengths >= 0; pass the micro-batch's seq_lens.")
    return arr


def micro_features(seq_lens: Sequence[int] | np.ndarray, *, dense: bool = False) -> np.ndarray:
    """The regressors of one micro-batch (a ``Micro`` is accepted), aligned with :data:`FEATURES`.

    Varlen kernels (``dense=False``): ``[Σ L, Σ L², 0, 1]``. A dense masked kernel
    (``dense=True``, a model with ``packed_quadratic > 0``): a micro-batch of two or more samples
    pays the packed row, ``[T, 0, T², 1]``; a lone sample needs no mask and runs the plain causal
    path, ``[L, L², 0, 1]``. A prefix-shared micro-batch (a ``Micro`` with a ``tree``) holds U
    unique tokens whose attention work is Σ over tokens of (2·position + 1) (= L² for one
    sample): U and that sum stand for Σ L and Σ L².
    """
    tree = getattr(seq_lens, "tree", None)
    if tree is not None and not hasattr(tree, "depth_sq"):  # a PackedMicro's TreeLayout: segments, not samples
        raise PlanError("micro_features/micro_cost got a packed prefix-tree row (PackedMicro): its seq_lens are "
                        "trie segments, not samples; pass the plan's Micro instead.")
    if tree is not None:
        T, sq, n = float(tree.num_tokens), float(tree.depth_sq), int(tree.members.size)
    else:
        L = _lens(seq_lens)
        T, sq, n = float(L.sum()), float((L * L).sum()), int(L.size)
    if dense and n >= 2:
        return np.array([T, 0.0, T * T, 1.0])
    return np.array([T, sq, 0.0, 1.0])


def is_additive(cost: CostModel) -> bool:
    """True when the model has no term in the packed total T (the micro cost is a sum over
    samples): a packed-row term is ``packed_quadratic > 0`` (a model without the field has none)."""
    return float(getattr(cost, "packed_quadratic", 0.0)) == 0.0


def bin_costs(cost: CostModel, additive: np.ndarray, tokens: np.ndarray, counts: np.ndarray | int) -> np.ndarray:
    """Cost of micro-batches from Σ sample_costs, packed tokens T and sample count of each
    (per_micro included). Under a dense kernel (a packed term) a micro-batch of two or more
    samples costs ``linear·T + packed_costs(T)`` (the per-sample attention is replaced by the
    packed row's); a lone sample costs its sample cost (the kernel's unmasked causal path)."""
    out = np.asarray(additive, dtype=np.float64) + float(cost.per_micro)
    if is_additive(cost):
        return out
    T = np.asarray(tokens, dtype=np.float64)
    multi = np.asarray(counts) >= 2
    row = float(getattr(cost, "linear", 0.0)) * T + cost.packed_costs(T) + float(cost.per_micro)  # type: ignore[attr-defined]
    return np.where(multi, row, out)


def placeholder_cost(cost: CostModel) -> float:
    """What a placeholder micro-batch costs: it runs one dummy token (``pack_micro``), per_micro
    included — never more than a real micro-batch. The one price stats, the planner's candidate
    times and dynamic CP give a placeholder."""
    one = np.ones(1, dtype=np.float64)
    return float(bin_costs(cost, cost.sample_costs(one), one, 1)[0])


def row_costs(cost: CostModel, w: np.ndarray, k: np.ndarray | int) -> np.ndarray:
    """Cost of one padded row of width W in a micro-batch of k rows: each row is its own sequence.
    A dense masked kernel (``packed_quadratic > 0``) computes all W² pairs of a row that carries a
    padding mask (k >= 2), a lone row runs its plain causal path (the sample cost)."""
    base = cost.sample_costs(w)
    pq = float(getattr(cost, "packed_quadratic", 0.0))
    if pq <= 0:
        return base
    masked = float(getattr(cost, "linear", 0.0)) * w + pq * w * w
    return np.where(np.asarray(k) >= 2, masked, base)


@dataclass(frozen=True, kw_only=True)
class TokenCost:
    """Cost = tokens (+ ``per_micro`` per micro-batch). Right when linear layers dominate.

    Attributes:
        per_micro: fixed cost charged per micro-batch, in tokens-equivalent (default 0).
        cp: the context-parallel term (:class:`microplan.CPCost`, in tokens-equivalent), or None:
            a split micro-batch scales perfectly (``microplan.cost.cp``).
    """

    per_micro: float = 0.0
    cp: CPCost | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_micro", float_field("TokenCost.per_micro", self.per_micro, minimum=0.0))
        check_coefficient("TokenCost.per_micro", self.per_micro, 0)
        object.__setattr__(self, "cp", cp_from_dict(self.cp))

    @property
    def linear(self) -> float:
        return 1.0

    @property
    def quadratic(self) -> float:
        return 0.0

    @property
    def packed_quadratic(self) -> float:
        return 0.0

    def sample_costs(self, seq_lens: np.ndarray) -> np.ndarray:
        return np.asarray(seq_lens, dtype=np.float64)

    def packed_costs(self, total_tokens: np.ndarray) -> np.ndarray:
        return np.zeros_like(np.asarray(total_tokens, dtype=np.float64))

    def tree_costs(self, unique_tokens: np.ndarray, depth_sq: np.ndarray) -> np.ndarray:
        """Additive cost of prefix trees of ``unique_tokens`` tokens (the tokens themselves)."""
        return np.asarray(unique_tokens, dtype=np.float64)

    def micro_cost(self, seq_lens: Sequence[int] | np.ndarray) -> float:
        return float(self.coefficients() @ micro_features(seq_lens))

    def coefficients(self) -> np.ndarray:
        """Coefficients over :data:`FEATURES`."""
        return np.array([1.0, 0.0, 0.0, self.per_micro])

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "TokenCost", "per_micro": self.per_micro}
        return out if self.cp is None else {**out, "cp": self.cp.to_dict()}


@dataclass(frozen=True, kw_only=True)
class FlopsCost:
    """``linear·Σ L + quadratic·Σ L² + packed_quadratic·T² + per_micro`` per micro-batch.

    Attributes:
        linear: cost per token (forward+backward FLOPs of the dense/MoE/LM-head weights).
        quadratic: cost per squared token of ONE sample (varlen causal attention, per sample).
        per_micro: fixed cost per micro-batch a rank runs (launch, all-gather, sync overhead).
        packed_quadratic: > 0 selects a dense masked kernel: a micro-batch of two or more samples
            costs ``linear·T + packed_quadratic·T² + per_micro`` (all T² pairs of the packed row, no
            per-sample term), a lone sample ``linear·L + quadratic·L² + per_micro`` (no mask: the
            plain causal path). Default 0: a varlen kernel, ``quadratic·Σ L²`` for every
            micro-batch.
        cp: the context-parallel term (:class:`microplan.CPCost`: K/V communication, its overlap,
            a split micro-batch's efficiency and overhead, in the same units), or None: a
            micro-batch split over c GPUs costs each ``(cost − per_micro)/c + per_micro``
            (``microplan.cost.cp.cp_micro_costs``).
        attention_rel_sd: how well the attention terms (``quadratic``, ``packed_quadratic``) are
            known, as a relative standard deviation (0 <= sd < 1). Default 0: trust them. When
            > 0 the planner hedges: under ``sync="micro"`` its last balancing pass lowers the sum
            of the lockstep times at attention × (1 − sd), × 1 and × (1 + sd)
            (``microplan.stages.hedge``), so a plan stays balanced whichever the machine turns
            out to be. :class:`microplan.CostMeter` sets it from its fit's posterior; predicted
            costs (``micro_cost``) use the point estimate.

    All four are finite and >= 0 and at least one of the token terms is positive. Build one
    from a model's dimensions with :meth:`from_hf_config`, fit one to timings with
    :func:`microplan.calibrate`, ``microplan.torch.profile_cost`` or :class:`microplan.CostMeter`.
    """

    linear: float
    quadratic: float = 0.0
    per_micro: float = 0.0
    packed_quadratic: float = 0.0
    cp: CPCost | None = None
    attention_rel_sd: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "cp", cp_from_dict(self.cp))
        sd = float_field("FlopsCost.attention_rel_sd", self.attention_rel_sd, minimum=0.0)
        if sd >= 1.0:
            raise PlanError(f"FlopsCost.attention_rel_sd={sd!r} must be below 1 (a relative standard deviation of "
                            "the attention terms); pass e.g. 0.1 for ±10 %, or 0 to trust them.")
        object.__setattr__(self, "attention_rel_sd", sd)
        for name, power in (("linear", 1), ("quadratic", 2), ("per_micro", 0), ("packed_quadratic", 2)):
            object.__setattr__(self, name, float_field(f"FlopsCost.{name}", getattr(self, name), minimum=0.0))
            check_coefficient(f"FlopsCost.{name}", getattr(self, name), power)
        if self.linear == 0.0 and self.quadratic == 0.0 and self.packed_quadratic == 0.0:
            raise PlanError("FlopsCost.linear, quadratic and packed_quadratic are all 0: every sample would cost "
                            "nothing and balancing is meaningless; give at least one a positive value.")

    def sample_costs(self, seq_lens: np.ndarray) -> np.ndarray:
        L = np.asarray(seq_lens, dtype=np.float64)
        return self.linear * L + self.quadratic * (L * L)

    def packed_costs(self, total_tokens: np.ndarray) -> np.ndarray:
        T = np.asarray(total_tokens, dtype=np.float64)
        return self.packed_quadratic * (T * T)

    def tree_costs(self, unique_tokens: np.ndarray, depth_sq: np.ndarray) -> np.ndarray:
        """Additive cost of prefix trees: linear per unique token, quadratic per unit of
        ``depth_sq`` = Σ over tokens of (2·position + 1) (a token attends to its whole path)."""
        return self.linear * np.asarray(unique_tokens, dtype=np.float64) + \
            self.quadratic * np.asarray(depth_sq, dtype=np.float64)

    def micro_cost(self, seq_lens: Sequence[int] | np.ndarray) -> float:
        return float(self.coefficients() @ micro_features(seq_lens, dense=self.dense))

    @property
    def dense(self) -> bool:
        """True for a dense masked kernel (``packed_quadratic > 0``): packs pay T², lone samples L²."""
        return self.packed_quadratic > 0.0

    def coefficients(self) -> np.ndarray:
        """Coefficients over :data:`FEATURES` (``[linear, quadratic, packed_quadratic, per_micro]``)."""
        return np.array([self.linear, self.quadratic, self.packed_quadratic, self.per_micro])

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "FlopsCost", "linear": self.linear, "quadratic": self.quadratic,
                               "per_micro": self.per_micro, "packed_quadratic": self.packed_quadratic}
        if self.attention_rel_sd:
            out["attention_rel_sd"] = self.attention_rel_sd
        return out if self.cp is None else {**out, "cp": self.cp.to_dict()}

    @property
    def crossover_len(self) -> float:
        """The L at which one sample's attention cost equals its linear cost.

        ``linear / quadratic``: a lone sample runs per-sample attention, also under a dense kernel
        (no mask: its causal path); a dense model without that term prices it as a row of T = L
        (``linear / packed_quadratic``). ``inf`` without attention terms. Below it a sample's cost
        grows ~linearly with L, above it ~quadratically.
        """
        q = self.quadratic if self.quadratic > 0 else self.packed_quadratic
        return float("inf") if q == 0.0 else self.linear / q

    def describe(self) -> str:
        """One line: the coefficients and the crossover length, e.g. for logs.

        >>> FlopsCost(linear=6.0, quadratic=0.001, per_micro=100.0).describe()
        'FlopsCost: linear=6/token, quadratic=0.001/token², per_micro=100/micro; attention = linear at L=6,000'
        """
        cross = self.crossover_len
        where = "never (no attention term)" if cross == float("inf") else f"L={cross:,.0f}"
        packed = f", packed_quadratic={self.packed_quadratic:.4g}/T²" if self.packed_quadratic else ""
        cp = "" if self.cp is None else f"; {self.cp.describe()}"
        sd = f" (±{self.attention_rel_sd:.1%})" if self.attention_rel_sd else ""
        return (f"FlopsCost: linear={self.linear:.4g}/token, quadratic={self.quadratic:.4g}/token²{sd}{packed}, "
                f"per_micro={self.per_micro:.4g}/micro; attention = linear at {where}{cp}")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | object, *, attention: str = DEFAULT_ATTENTION,
                       per_micro: float | None = None, backward_factor: float = 2.0, causal: bool = True,
                       gated_mlp: bool | None = None, cp_bandwidth: float | None = None,
                       gpu_flops: float = DEFAULT_GPU_FLOPS, cp_node_size: int | None = None,
                       cp_cross_node_bandwidth: float | None = None) -> FlopsCost:
        """Predicted forward(+backward) cost of a micro-batch, in GEMM-FLOP-equivalents, from a config.

        Args:
            config: a Hugging Face-style config: a dict (``config.json``) or an object with
                attributes (``transformers.PretrainedConfig``). Keys and aliases: see
                :func:`microplan.cost.forward_flops` and ``docs/cost.md``.
            attention: the attention kernel, which sets how much slower than the weight GEMMs an
                attention FLOP runs and whether attention is per sample or over the packed row:
                one of :data:`microplan.cost.ATTENTION_KERNELS` — ``"hedged"`` (default: the
                choice that loses least when the kernel is unknown, see docs/cost.md), ``"fa3"``,
                ``"fa2"``, ``"sdpa-packed"`` (dense masked kernel: T² of the packed row) or
                ``"flops"`` (pure FLOPs).
            per_micro: fixed cost per micro-batch in FLOPs-equivalent. Default (None): the
                estimate of ``DEFAULT_PER_MICRO_TOKENS`` tokens of linear compute (FSDP gathers
                and launches of one micro-batch; see docs/cost.md). Pass 0.0 for none.
            backward_factor: backward FLOPs as a multiple of forward FLOPs; the total is
                ``(1 + backward_factor)·forward``. 2.0 (default) is the usual "6N" training
                rule; 0.0 models a forward-only pass (log-prob recomputation, reference model);
                3.0 adds one recomputed forward (full activation checkpointing).
            causal: causal attention computes L²/2 query/key pairs (True, default); False
                counts all L² (bidirectional).
            gated_mlp: force a gated (SwiGLU/GeGLU: 3 matrices) or plain (2 matrices) MLP;
                None infers it from ``model_type``/``hidden_act``.
            cp_bandwidth: bytes per second a GPU receives in the context-parallel all-gather of
                keys/values (e.g. ~3e11 NVLink, ~4e10 InfiniBand). Given: the result carries a
                :class:`microplan.CPCost` (``CPCost.from_hf_config``: K/V moved once per pass —
                forward, plus backward unless ``backward_factor`` is 0 — default overlap and
                efficiency); None (default): no CP term (perfect CP scaling).
            gpu_flops: FLOP/s that turn the communication seconds into this model's FLOP units
                (default ``DEFAULT_GPU_FLOPS`` = 400 TFLOP/s); only read with ``cp_bandwidth``.
            cp_node_size, cp_cross_node_bandwidth: GPUs per node and the bytes per second a GPU
                receives when its CP group crosses nodes (~4e10 InfiniBand): a group wider than a
                node pays that rate (``CPCost.node_size``); both or neither, with ``cp_bandwidth``.

        Returns:
            A plain :class:`FlopsCost` (serialises through ``to_dict``).

        Raises:
            PlanError: a required key is missing (naming the key and its accepted aliases), a
                value is not a positive whole number, an unknown ``attention`` name.
        """
        bf = float_field("FlopsCost.from_hf_config(backward_factor)", backward_factor, minimum=0.0)
        kernel = attention_kernel(attention)
        f = forward_flops(config, causal=causal, gated_mlp=gated_mlp)
        scale = 1.0 + bf
        linear = scale * f.linear
        attn = scale * f.quadratic * kernel.slowdown
        if kernel.packed:  # a dense masked kernel computes every pair of a packed row; a lone sample runs causal
            quad, packed = attn, attn * (2.0 if causal else 1.0)
        else:
            quad, packed = attn, 0.0
        pm = DEFAULT_PER_MICRO_TOKENS * linear if per_micro is None else \
            float_field("FlopsCost.from_hf_config(per_micro)", per_micro, minimum=0.0)
        if cp_bandwidth is None and (cp_node_size is not None or cp_cross_node_bandwidth is not None):
            raise PlanError("FlopsCost.from_hf_config: cp_node_size / cp_cross_node_bandwidth describe the CP "
                            "interconnect across nodes and need cp_bandwidth (the rate inside a node) too; pass "
                            "cp_bandwidth=..., or drop them for no CP term.")
        cp = None if cp_bandwidth is None else CPCost.from_hf_config(
            config, bandwidth=cp_bandwidth, units_per_second=gpu_flops, passes=1.0 if bf == 0 else 2.0,
            node_size=cp_node_size, cross_node_bandwidth=cp_cross_node_bandwidth)
        return cls(linear=linear, quadratic=quad, per_micro=pm, packed_quadratic=packed, cp=cp)


def cost_from_dict(d: dict[str, Any]) -> TokenCost | FlopsCost:
    """Inverse of ``to_dict`` for the built-in cost models."""
    kind = d.get("type")
    fields = {k: v for k, v in d.items() if k != "type"}
    if kind == "TokenCost":
        return TokenCost(**fields)
    if kind == "FlopsCost":
        return FlopsCost(**fields)
    raise PlanError(f"unknown cost model type {kind!r}; expected 'TokenCost' or 'FlopsCost'.")
