"""The price of context parallelism: what one GPU of a CP group pays for a split micro-batch.

Design note. A micro-batch of T tokens whose whole-micro-batch cost is ``body + per_micro``
(``body``: its token work, ``cost.micro_cost`` less ``per_micro``) runs over a CP group of c GPUs
as microplan.torch runs it (``context_parallel(group)``): each GPU holds T/c tokens, all-gathers
the keys/values of the other (c−1)/c of the row before its attention (and reduce-scatters their
gradients in backward). Per GPU, :func:`cp_micro_costs` prices it as::

    compute = body / (c · efficiency)
    comm    = comm_per_token · T · (c − 1) / c
    cost    = compute + comm − overlap · min(compute, comm) + split_overhead + per_micro    (c > 1)
    cost    = body + per_micro                                                           (c = 1)

- ``comm_per_token``: moving ONE token's keys and values (every layer, every pass) over the CP
  interconnect, in the cost's own units: bytes per token = 2 · kv_heads · head_dim · dtype_bytes ·
  layers · passes (forward all-gather + backward reduce-scatter), ÷ bandwidth (bytes/s) gives
  seconds, × ``units_per_second`` (1 for a cost in seconds; the GEMM rate in FLOP/s for a cost in
  FLOPs) gives cost units (:meth:`CPCost.from_hf_config`). With ``node_size`` (GPUs of one fast
  domain, e.g. 8 on NVLink) a group wider than a node pays ``cross_node_comm_per_token`` instead:
  its ring crosses the slower inter-node links, which set its pace. Exact for the planner's
  groups (contiguous, width-aligned rank ranges of power-of-two widths, plane ranks numbered
  node-major) when ``node_size`` is a multiple of every width at most it.
- ``overlap`` ∈ [0, 1]: the share of the shorter of compute and communication hidden under the
  longer: 0 = serial (microplan.torch gathers before attending), 1 = max(compute, comm).
- ``efficiency`` ∈ (0, 1]: per-GPU compute efficiency of a split micro-batch (shorter GEMMs and
  attention tiles, the zigzag's residual imbalance); ``split_overhead`` >= 0: fixed cost per GPU
  of a split micro-batch (the collective's launch and latency, the shard bookkeeping).
Without a CP term (``cost.cp is None``) a split micro-batch costs ``body / c + per_micro``:
perfect scaling.

Guarantees: this is the ONE formula every caller prices a CP micro-batch with (K choice,
fixed and dynamic CP, stats, summary); every term is >= 0 and ``cost >= body / c + per_micro``,
so the lower bounds that assume perfect scaling stay lower bounds. Trade-off: the meter fits one
communication rate (``cost/cpfit.py``); a cross-node rate keeps the prior's ratio to it, so the
model stays four fitted numbers that a few dozen timed CP micro-batches pin down.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._checks import float_field, int_field
from ..errors import PlanError
from ._bounds import check_coefficient

__all__ = ["CPCost", "cp_micro_costs", "cp_work_floor", "DEFAULT_CP_EFFICIENCY", "DEFAULT_CP_OVERLAP", "DEFAULT_GPU_FLOPS"]

#: Prior per-GPU efficiency of a split micro-batch (not measured here: fit it with CostMeter).
DEFAULT_CP_EFFICIENCY = 0.95
#: Prior overlap: microplan.torch's ``context_parallel`` gathers K/V before the attention (serial).
DEFAULT_CP_OVERLAP = 0.0
#: FLOPs per second that turn communication seconds into the GEMM-FLOP units of
#: ``FlopsCost.from_hf_config`` (400 TFLOP/s: an H100 at ~40 % of its dense bf16 peak, the figure
#: docs/cost.md uses for the per-micro default).
DEFAULT_GPU_FLOPS = 4e14


@dataclass(frozen=True, kw_only=True)
class CPCost:
    """The context-parallel term of a cost model (see the module note for the formula).

    Attributes:
        comm_per_token: cost units (the cost model's own: FLOPs-equivalent or seconds) to move one
            token's keys/values over the CP interconnect, all layers and passes; a c-wide group
            moves (c − 1)/c of the micro-batch's T tokens to each GPU. >= 0.
        overlap: share (0..1) of the shorter of compute and communication hidden under the longer.
        efficiency: per-GPU compute efficiency (0 < e <= 1) of a split micro-batch.
        split_overhead: fixed cost units per GPU of a split micro-batch. >= 0.
        node_size: GPUs of one fast interconnect domain (a node); a CP group wider than this
            crosses nodes. None (default): one rate for every width.
        cross_node_comm_per_token: ``comm_per_token`` for a group wider than ``node_size`` (the
            inter-node links, e.g. InfiniBand, set a crossing ring's pace); >= comm_per_token.
            Given with ``node_size``, never without.
    """

    comm_per_token: float
    overlap: float = DEFAULT_CP_OVERLAP
    efficiency: float = DEFAULT_CP_EFFICIENCY
    split_overhead: float = 0.0
    node_size: int | None = None
    cross_node_comm_per_token: float | None = None

    def __post_init__(self) -> None:
        for name in ("comm_per_token", "overlap", "efficiency", "split_overhead"):
            object.__setattr__(self, name, float_field(f"CPCost.{name}", getattr(self, name), minimum=0.0))
        check_coefficient("CPCost.comm_per_token", self.comm_per_token, 1)
        check_coefficient("CPCost.split_overhead", self.split_overhead, 0)
        if (self.node_size is None) != (self.cross_node_comm_per_token is None):
            raise PlanError("CPCost.node_size and CPCost.cross_node_comm_per_token go together: pass both (GPUs per "
                            "node and the cost units per token of a group that crosses nodes) or neither (one rate "
                            f"for every width); got node_size={self.node_size!r}, "
                            f"cross_node_comm_per_token={self.cross_node_comm_per_token!r}.")
        if self.node_size is not None:
            object.__setattr__(self, "node_size", int_field("CPCost.node_size", self.node_size, minimum=1))
            x = float_field("CPCost.cross_node_comm_per_token", self.cross_node_comm_per_token, minimum=0.0)
            check_coefficient("CPCost.cross_node_comm_per_token", x, 1)
            if x < self.comm_per_token:
                raise PlanError(f"CPCost.cross_node_comm_per_token={x!r} is below comm_per_token="
                                f"{self.comm_per_token!r}: a group that crosses nodes moves keys/values no faster "
                                "than one inside a node; pass the inter-node cost (>= comm_per_token).")
            object.__setattr__(self, "cross_node_comm_per_token", x)
        if self.overlap > 1.0:
            raise PlanError(f"CPCost.overlap={self.overlap!r} must be within [0, 1] (the share of communication "
                            "hidden under compute); pass 0 for a gather before the attention, 1 for full overlap.")
        if not 0.0 < self.efficiency <= 1.0:
            raise PlanError(f"CPCost.efficiency={self.efficiency!r} must be within (0, 1] (a split micro-batch's "
                            "per-GPU compute efficiency); pass e.g. 0.95, or 1.0 for perfect scaling.")

    def to_dict(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {"comm_per_token": self.comm_per_token, "overlap": self.overlap,
                                       "efficiency": self.efficiency, "split_overhead": self.split_overhead}
        if self.node_size is not None:
            out.update(node_size=self.node_size, cross_node_comm_per_token=self.cross_node_comm_per_token)  # type: ignore[arg-type]
        return out

    def comm_rates(self, width: np.ndarray | int) -> np.ndarray:
        """Cost units per token moved for groups of ``width`` GPUs: ``comm_per_token``, or
        ``cross_node_comm_per_token`` where a group is wider than ``node_size``."""
        w = np.asarray(width)
        if self.node_size is None:
            return np.full(w.shape, self.comm_per_token)
        return np.where(w > self.node_size, self.cross_node_comm_per_token, self.comm_per_token)  # type: ignore[arg-type]

    def describe(self) -> str:
        """One line, e.g. ``CP: comm 1.2e+08/token, overlap 0, efficiency 0.95, split_overhead 0``."""
        cross = "" if self.node_size is None else \
            f" ({self.cross_node_comm_per_token:.4g}/token for groups wider than {self.node_size} GPUs)"
        return (f"CP: comm {self.comm_per_token:.4g}/token{cross}, overlap {self.overlap:.3g}, efficiency "
                f"{self.efficiency:.3g}, split_overhead {self.split_overhead:.4g}/micro")

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | object, *, bandwidth: float, units_per_second: float,
                       dtype_bytes: float = 2.0, passes: float = 2.0, overlap: float = DEFAULT_CP_OVERLAP,
                       efficiency: float = DEFAULT_CP_EFFICIENCY, split_overhead: float = 0.0,
                       node_size: int | None = None, cross_node_bandwidth: float | None = None) -> CPCost:
        """The CP term of a model on an interconnect.

        Args:
            config: a Hugging Face-style config (keys as :func:`microplan.cost.forward_flops`):
                layers, kv heads and head dim (DeepSeek MLA: heads × (qk + v head dims)).
            bandwidth: bytes per second one GPU receives in the CP all-gather (NVLink ~ 3e11,
                InfiniBand ~ 4e10 per GPU).
            units_per_second: cost units per second: ``DEFAULT_GPU_FLOPS`` (or your measured FLOP/s)
                for a cost in FLOPs, 1.0 for a cost in seconds.
            dtype_bytes: bytes per key/value element (2 for bf16).
            passes: K/V volumes moved per training step of a token: 2 (forward all-gather, backward
                reduce-scatter of the gradients), 1 for a forward-only pass, 3 with recomputation.
            overlap, efficiency, split_overhead, node_size: as the attributes.
            cross_node_bandwidth: bytes per second one GPU receives when its group crosses nodes
                (InfiniBand ~ 4e10 per GPU); given with ``node_size``, never without.
        """
        from .hf import kv_values_per_token
        bw = float_field("CPCost.from_hf_config(bandwidth)", bandwidth, positive=True)
        ups = float_field("CPCost.from_hf_config(units_per_second)", units_per_second, positive=True)
        db = float_field("CPCost.from_hf_config(dtype_bytes)", dtype_bytes, positive=True)
        ps = float_field("CPCost.from_hf_config(passes)", passes, minimum=0.0)
        moved = kv_values_per_token(config) * db * ps  # bytes per token
        cross = None if cross_node_bandwidth is None else \
            moved / float_field("CPCost.from_hf_config(cross_node_bandwidth)", cross_node_bandwidth, positive=True) * ups
        return cls(comm_per_token=moved / bw * ups, overlap=overlap, efficiency=efficiency,
                   split_overhead=split_overhead, node_size=node_size, cross_node_comm_per_token=cross)


def cp_micro_costs(cost: Any, micro_costs: np.ndarray | float, tokens: np.ndarray | float,
                   width: np.ndarray | int) -> np.ndarray:
    """Per-GPU cost of micro-batches run over CP groups of ``width`` GPUs (the one CP price).

    ``micro_costs``: each micro-batch's whole cost (``per_micro`` included, as ``bin_costs`` /
    ``micro_cost`` give it); ``tokens``: its packed tokens T (what the group gathers keys/values
    of); ``width``: its CP degree (scalar or per micro-batch). Width 1 returns the cost unchanged.
    """
    mc = np.asarray(micro_costs, dtype=np.float64)
    w = np.asarray(width, dtype=np.float64)
    if not np.any(w > 1):
        return np.broadcast_to(mc, np.broadcast(mc, w).shape).astype(np.float64)
    pm = float(cost.per_micro)
    body = mc - pm
    cp = getattr(cost, "cp", None)
    if cp is None:
        split = body / w + pm
    else:
        compute = body / (w * cp.efficiency)
        comm = cp.comm_rates(w) * np.asarray(tokens, dtype=np.float64) * (w - 1.0) / w
        split = compute + comm - cp.overlap * np.minimum(compute, comm) + cp.split_overhead + pm
    return np.where(w > 1, split, mc)


def cp_work_floor(cost: Any, costs: np.ndarray, lens: np.ndarray, width: np.ndarray | int) -> np.ndarray:
    """GPU-time (width × per-GPU cost, per_micro and split_overhead excluded) a sample of additive
    cost ``costs`` and ``lens`` tokens costs at least in a group of ``width``: ``costs`` unsplit,
    ``costs / efficiency + (1 − overlap) · comm_per_token · L · (width − 1)`` split. The price of a
    micro-batch is at least the sum of these over its samples / width (compute and communication
    add up over samples, and min(compute, comm) <= comm), so the plan's lower bounds stay bounds."""
    c = np.asarray(costs, dtype=np.float64)
    cp = getattr(cost, "cp", None)
    if cp is None:
        return c
    w = np.asarray(width, dtype=np.float64)
    split = c / cp.efficiency + (1.0 - cp.overlap) * cp.comm_rates(w) * np.asarray(lens, dtype=np.float64) * (w - 1.0)
    return np.where(w > 1, split, c)


def cp_from_dict(d: Mapping[str, Any] | None) -> CPCost | None:
    """Inverse of :meth:`CPCost.to_dict` (None stays None)."""
    if d is None or isinstance(d, CPCost):
        return d  # type: ignore[return-value]
    if not isinstance(d, Mapping):
        raise PlanError(f"a cost model's 'cp' must be a CPCost, its to_dict() or None; got {d!r}.")
    return CPCost(**d)
