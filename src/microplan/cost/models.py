"""Cost models: the predicted time of ONE micro-batch, used for balancing, K and predicted times.

Design note. Every built-in model is linear in four *features* of a micro-batch holding samples
of lengths L_1..L_n packed into a row of T = Σ L tokens::

    micro_cost = linear·Σ L  +  quadratic·Σ L²  +  packed_quadratic·T²  +  per_micro

- ``linear``: weights (dense, MoE, LM head) — every token costs the same.
- ``quadratic``: attention of *varlen* kernels (flash-attn varlen, cuDNN, per-sample sdpa):
  each sample attends to itself only, so the work adds up sample by sample.
- ``packed_quadratic``: attention of *dense* kernels over the packed row with a block-diagonal
  mask (transformers' sdpa/eager fed restarting position ids, any masked dense kernel): the
  kernel computes all T² pairs, so the cost is NOT a sum over samples. Under such a backend two
  half-full micro-batches are cheaper than one full one, and the planner chooses the
  micro-batch count by predicted time (``stages/kchoice.py``).
- ``per_micro``: fixed cost per micro-batch a rank runs (launches, FSDP gathers, sync).

The planner reads a model through :meth:`sample_costs` (the additive part per sample),
:meth:`packed_costs` (the part in T) and ``per_micro``; :meth:`micro_cost` (binding) is their
sum for one micro-batch. Units are whatever the coefficients are in: FLOPs for
:meth:`FlopsCost.from_hf_config`, seconds after calibration, profiling or metering.

Guarantees: coefficients are finite and >= 0 (validated with messages naming the field);
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
from .hf import forward_flops
from .presets import DEFAULT_ATTENTION, DEFAULT_PER_MICRO_TOKENS, attention_kernel

__all__ = ["CostModel", "TokenCost", "FlopsCost", "cost_from_dict", "micro_features", "bin_costs",
           "FEATURES", "is_additive"]

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


def micro_features(seq_lens: Sequence[int] | np.ndarray) -> np.ndarray:
    """``[Σ L, Σ L², T², 1]`` of one micro-batch (a ``Micro`` is accepted): the model's regressors.

    A prefix-shared micro-batch (a ``Micro`` with a ``tree``) holds U unique tokens whose
    attention work is Σ over tokens of (2·position + 1) (= L² for a lone sample): its features
    are ``[U, depth_sq, U², 1]``.
    """
    tree = getattr(seq_lens, "tree", None)
    if tree is not None:
        U = float(tree.num_tokens)
        return np.array([U, float(tree.depth_sq), U * U, 1.0])
    L = _lens(seq_lens)
    T = float(L.sum())
    return np.array([T, float((L * L).sum()), T * T, 1.0])


def is_additive(cost: CostModel) -> bool:
    """True when the model has no term in the packed total T (the micro cost is a sum over samples)."""
    pq = getattr(cost, "packed_quadratic", None)
    if pq is not None:
        return float(pq) == 0.0
    return not hasattr(cost, "packed_costs")


def bin_costs(cost: CostModel, additive: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Cost of micro-batches from Σ sample_costs and packed tokens T of each (per_micro included)."""
    out = np.asarray(additive, dtype=np.float64) + float(cost.per_micro)
    packed = getattr(cost, "packed_costs", None)
    if packed is not None:
        out = out + packed(np.asarray(tokens, dtype=np.float64))
    return out


@dataclass(frozen=True, kw_only=True)
class TokenCost:
    """Cost = tokens (+ ``per_micro`` per micro-batch). Right when linear layers dominate.

    Attributes:
        per_micro: fixed cost charged per micro-batch, in tokens-equivalent (default 0).
    """

    per_micro: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_micro", float_field("TokenCost.per_micro", self.per_micro, minimum=0.0))

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
        return {"type": "TokenCost", "per_micro": self.per_micro}


@dataclass(frozen=True, kw_only=True)
class FlopsCost:
    """``linear·Σ L + quadratic·Σ L² + packed_quadratic·T² + per_micro`` per micro-batch.

    Attributes:
        linear: cost per token (forward+backward FLOPs of the dense/MoE/LM-head weights).
        quadratic: cost per squared token of ONE sample (varlen causal attention, per sample).
        per_micro: fixed cost per micro-batch a rank runs (launch, all-gather, sync overhead).
        packed_quadratic: cost per squared token of the micro-batch's packed total T (a dense
            kernel over the packed row with a block-diagonal mask computes all T² pairs).
            Default 0 (varlen kernels).

    All four are finite and >= 0 and at least one of the token terms is positive. Build one
    from a model's dimensions with :meth:`from_hf_config`, fit one to timings with
    :func:`microplan.calibrate`, ``microplan.torch.profile_cost`` or :class:`microplan.CostMeter`.
    """

    linear: float
    quadratic: float = 0.0
    per_micro: float = 0.0
    packed_quadratic: float = 0.0

    def __post_init__(self) -> None:
        for name in ("linear", "quadratic", "per_micro", "packed_quadratic"):
            object.__setattr__(self, name, float_field(f"FlopsCost.{name}", getattr(self, name), minimum=0.0))
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
        return float(self.coefficients() @ micro_features(seq_lens))

    def coefficients(self) -> np.ndarray:
        """Coefficients over :data:`FEATURES` (``[linear, quadratic, packed_quadratic, per_micro]``)."""
        return np.array([self.linear, self.quadratic, self.packed_quadratic, self.per_micro])

    def to_dict(self) -> dict[str, Any]:
        return {"type": "FlopsCost", "linear": self.linear, "quadratic": self.quadratic,
                "per_micro": self.per_micro, "packed_quadratic": self.packed_quadratic}

    @property
    def crossover_len(self) -> float:
        """The L at which one sample's attention cost equals its linear cost.

        ``linear / (quadratic + packed_quadratic)`` (a lone sample has T = L); ``inf`` without
        attention terms. Below it a sample's cost grows ~linearly with L, above it ~quadratically.
        """
        q = self.quadratic + self.packed_quadratic
        return float("inf") if q == 0.0 else self.linear / q

    def describe(self) -> str:
        """One line: the coefficients and the crossover length, e.g. for logs.

        >>> FlopsCost(linear=6.0, quadratic=0.001, per_micro=100.0).describe()
        'FlopsCost: linear=6/token, quadratic=0.001/token², per_micro=100/micro; attention = linear at L=6,000'
        """
        cross = self.crossover_len
        where = "never (no attention term)" if cross == float("inf") else f"L={cross:,.0f}"
        packed = f", packed_quadratic={self.packed_quadratic:.4g}/T²" if self.packed_quadratic else ""
        return (f"FlopsCost: linear={self.linear:.4g}/token, quadratic={self.quadratic:.4g}/token²{packed}, "
                f"per_micro={self.per_micro:.4g}/micro; attention = linear at {where}")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | object, *, attention: str = DEFAULT_ATTENTION,
                       per_micro: float | None = None, backward_factor: float = 2.0, causal: bool = True,
                       gated_mlp: bool | None = None) -> FlopsCost:
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
        if kernel.packed:  # a dense masked kernel computes every pair of the packed row
            attn_packed = attn * (2.0 if causal else 1.0)
            quad, packed = 0.0, attn_packed
        else:
            quad, packed = attn, 0.0
        pm = DEFAULT_PER_MICRO_TOKENS * linear if per_micro is None else \
            float_field("FlopsCost.from_hf_config(per_micro)", per_micro, minimum=0.0)
        return cls(linear=linear, quadratic=quad, per_micro=pm, packed_quadratic=packed)


def cost_from_dict(d: dict[str, Any]) -> TokenCost | FlopsCost:
    """Inverse of ``to_dict`` for the built-in cost models."""
    kind = d.get("type")
    fields = {k: v for k, v in d.items() if k != "type"}
    if kind == "TokenCost":
        return TokenCost(**fields)
    if kind == "FlopsCost":
        return FlopsCost(**fields)
    raise PlanError(f"unknown cost model type {kind!r}; expected 'TokenCost' or 'FlopsCost'.")
