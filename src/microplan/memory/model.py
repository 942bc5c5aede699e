"""The memory model: the peak bytes a GPU adds while it runs ONE micro-batch (binding: ``MemoryModel``).

Design note. Memory has the same regimes as time (``microplan.cost.models``), so a
:class:`MemoryModel` is linear in the same four features of a micro-batch holding samples of
lengths L_1..L_n packed into a row of T = Σ L tokens::

    per-sample kernel: bytes = per_token·T + per_sample_sq·Σ L² + per_micro
    dense mask:        bytes = per_token·T + per_row_sq·T²      + per_micro   (two or more samples)
                             = per_token·L + per_sample_sq·L²   + per_micro   (a lone sample: no mask)

and never below ``floor``. A pass has phases, and its peak is the largest of theirs:
``phase2`` (optional) is a second set of the same four terms — with full recomputation the
logits phase (linear) and a layer's recompute (its attention scores) peak at different times —
and the prediction is the larger of the two. ``per_token``: saved activations, logits and their gradients, every
buffer of one token's width. ``per_sample_sq``: attention scores materialised per sample (eager
attention, a math kernel). ``per_row_sq``: a dense ``[T, T]`` mask over the packed row and the
scores of a dense kernel (transformers' sdpa/eager fed restarting position ids): under it a
micro-batch of 8 × 512 tokens holds far more than one sample of 4,096. ``per_micro``: what every
micro-batch adds whatever its size (gradient temporaries of the weights). ``floor``: the least
peak any micro-batch was measured at (the peak is a maximum over phases of the pass, and for a
tiny micro-batch the gradient phase is the larger one).

What the bytes are: the peak the pass allocates ABOVE what the GPU held before it — parameters,
accumulated gradients and optimizer state are a separate, static term the budget is net of.
``max_bytes_per_micro`` is that budget: the GPU's memory less the static term.

Safety margin. ``margin`` (relative, stated, never silently guessed) is the prediction error the
planner allows for: it checks ``with_margin(bytes) = ⌈bytes·(1 + margin)⌉ ≤ budget``.
``microplan.torch.profile_memory`` sets it from the fit's worst held-out error;
:meth:`MemoryModel.from_hf_config` takes it as an argument (default 0.1, stated in the summary).

Other layouts and parallelism, read through the same coefficients (``memory/check.py``): a
padded ``[n, W]`` micro-batch is n rows of W; a prefix tree is priced by its unique tokens and
Σ depth (a token of depth d attends to its whole path); a CP group of c GPUs splits the row's
token terms c ways and each GPU also holds the gathered keys/values of the whole row
(``kv_per_token``); vision patches add ``per_vision_token``; a prefix tree holds path tables and
gathered path keys its unique tokens do not show (``tree_factor``). ``forward``: the model of the
no-grad pass (log-probs, reference, values: no saved activations), which ``plan_forward`` plans
with; None plans the forward pass with this model (safe, not tight).

Guarantees: every coefficient is finite and >= 0, ``per_token`` > 0; ``to_dict``/``from_dict``
round-trip exactly (plans serialise their memory model).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .._checks import float_field
from ..cost.models import FlopsCost, micro_features
from ..errors import PlanError

__all__ = ["MemoryModel", "memory_from_dict", "GiB"]

GiB = 2 ** 30
_COEFS = ("per_token", "per_sample_sq", "per_row_sq", "per_micro")
_EXTRA = ("floor", "kv_per_token", "per_vision_token", "margin")
_ONE = ("tree_factor",)  # fields whose neutral value is 1


@dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """Predicted peak bytes a GPU adds while it runs one micro-batch (binding; see the module note).

    Attributes:
        per_token: bytes per token of the packed row (> 0 unless a quadratic term is; the planner
            needs it > 0 in the first phase).
        per_sample_sq: bytes per squared sample length (scores materialised per sample; a lone
            sample under a dense-mask kernel).
        per_row_sq: bytes per squared packed-row length T² of a micro-batch of two or more
            samples (dense mask over the row); > 0 selects the dense regime.
        per_micro: bytes every micro-batch adds.
        floor: the least any micro-batch adds (the prediction is ``max(floor, terms)``).
        kv_per_token: under context parallel, bytes per token of the WHOLE row each GPU of the
            group holds for the gathered keys/values (0: not modelled).
        per_vision_token: bytes per vision-encoder patch.
        margin: relative safety margin for prediction error (0.1 = 10 %): the planner keeps
            ``⌈bytes·(1 + margin)⌉`` under ``max_bytes_per_micro``.
        forward: the model of the forward-only (no-grad) pass, or None (use this one).
        phase2: a second phase of the pass (its four terms; the prediction is the larger), or None.
        tree_factor: >= 1: a prefix-tree micro-batch (``share_prefixes``) adds this times what its
            unique tokens and Σ depth predict (path tables, gathered path keys);
            ``profile_memory(trees=True)`` measures it.
        note: where the coefficients come from (``from_hf_config``, ``profile_memory``, ...).
    """

    per_token: float
    per_sample_sq: float = 0.0
    per_row_sq: float = 0.0
    per_micro: float = 0.0
    floor: float = 0.0
    kv_per_token: float = 0.0
    per_vision_token: float = 0.0
    margin: float = 0.0
    forward: MemoryModel | None = None
    note: str = ""
    phase2: MemoryModel | None = None
    tree_factor: float = 1.0

    def __post_init__(self) -> None:
        for name in _COEFS + _EXTRA:
            v = float_field(f"MemoryModel.{name}", getattr(self, name), minimum=0.0)
            if v > 1e30:
                raise PlanError(f"MemoryModel.{name}={v:g} is beyond any GPU (bytes); pass the coefficient in bytes.")
            object.__setattr__(self, name, v)
        if self.per_token <= 0.0 and not (self.per_sample_sq or self.per_row_sq):
            raise PlanError(f"MemoryModel.per_token={self.per_token} must be > 0: every token of a micro-batch holds "
                            "activations; pass the bytes per token (MemoryModel.from_hf_config derives it).")
        tf = float_field("MemoryModel.tree_factor", self.tree_factor, minimum=1.0)
        if tf > 100.0:
            raise PlanError(f"MemoryModel.tree_factor={tf} must be a factor of at most 100 (1.2 = 20 % more bytes).")
        object.__setattr__(self, "tree_factor", tf)
        if self.margin >= 10.0:
            raise PlanError(f"MemoryModel.margin={self.margin} is a relative margin (0.1 = 10 %); pass one below 10.")
        fwd = self.forward
        if isinstance(fwd, Mapping):
            object.__setattr__(self, "forward", memory_from_dict(dict(fwd)))
        elif fwd is not None and not isinstance(fwd, MemoryModel):
            raise PlanError(f"MemoryModel.forward must be a MemoryModel or None, got {type(fwd).__name__}.")
        if self.forward is not None and self.forward.forward is not None:
            raise PlanError("MemoryModel.forward is the forward-only pass's model: it has no forward model of its own.")
        ph = self.phase2
        if isinstance(ph, Mapping):
            object.__setattr__(self, "phase2", memory_from_dict(dict(ph)))
        elif ph is not None and not isinstance(ph, MemoryModel):
            raise PlanError(f"MemoryModel.phase2 must be a MemoryModel or None, got {type(ph).__name__}.")
        if self.per_token <= 0.0 and self.phase2 is not None:
            raise PlanError("MemoryModel.per_token must be > 0 in the first phase (phase2 may have none).")
        if self.phase2 is not None and (self.phase2.phase2 is not None or self.phase2.forward is not None):
            raise PlanError("MemoryModel.phase2 is one more set of terms: it has no phase2 or forward of its own.")
        if not isinstance(self.note, str):
            raise PlanError(f"MemoryModel.note must be a str, got {type(self.note).__name__}.")

    # -- prediction -----------------------------------------------------------------------------
    @property
    def dense(self) -> bool:
        """True when a packed row of two or more samples pays ``per_row_sq·T²`` (a dense mask), in any phase."""
        return self.per_row_sq > 0.0 or (self.phase2 is not None and self.phase2.per_row_sq > 0.0)

    def phases(self) -> tuple[MemoryModel, ...]:
        """The phases whose largest prediction is the peak: this model's terms, then ``phase2``'s."""
        return (self,) if self.phase2 is None else (self, self.phase2)

    def coefficients(self) -> np.ndarray:
        """Over ``microplan.cost.models.FEATURES``: ``[per_token, per_sample_sq, per_row_sq, per_micro]``."""
        return np.array([self.per_token, self.per_sample_sq, self.per_row_sq, self.per_micro])

    def micro_bytes(self, seq_lens: Sequence[int] | np.ndarray) -> int:
        """Predicted peak bytes one packed micro-batch of these sample lengths adds (binding; no margin)."""
        raw = max(float(p.coefficients() @ micro_features(seq_lens, dense=p.per_row_sq > 0)) for p in self.phases())
        return int(math.ceil(max(self.floor, raw)))

    def with_margin(self, nbytes: Any) -> Any:
        """``⌈bytes·(1 + margin)⌉``: what the planner keeps under the budget (ints or arrays)."""
        out = np.ceil(np.asarray(nbytes, dtype=np.float64) * (1.0 + self.margin))
        return int(out) if out.ndim == 0 else out.astype(np.int64)

    def as_cost(self) -> FlopsCost:
        """The same terms as a :class:`FlopsCost` in bytes: the footprint stage prices any layout
        (padded rows, prefix trees, row pads) with it (``memory/check.py``); this phase's terms only,
        no floor, no CP."""
        return FlopsCost(linear=self.per_token, quadratic=self.per_sample_sq, per_micro=self.per_micro,
                         packed_quadratic=self.per_row_sq)

    def forward_model(self) -> MemoryModel:
        """The model ``plan_forward`` plans with: ``forward`` when given, else this one (with this margin)."""
        return self if self.forward is None else self.forward

    def max_tokens_alone(self, budget: int) -> int:
        """The longest lone sample whose predicted peak, margin included, fits ``budget`` bytes (0: none)."""
        lo, hi = 0, 1
        while self.with_margin(self.micro_bytes([hi])) <= budget and hi < 2 ** 50:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.with_margin(self.micro_bytes([mid])) <= budget else (lo, mid)
        return lo

    # -- reporting and serialisation -------------------------------------------------------------
    def describe(self) -> str:
        """One line: the coefficients in bytes, the margin and the source."""
        parts = [f"{self.per_token:,.0f} B/token"]
        if self.per_sample_sq:
            parts.append(f"{self.per_sample_sq:.4g} B/L² per sample")
        if self.per_row_sq:
            parts.append(f"{self.per_row_sq:.4g} B/T² per packed row")
        parts.append(f"{self.per_micro / 2 ** 20:,.1f} MiB/micro")
        if self.floor:
            parts.append(f"floor {self.floor / 2 ** 20:,.1f} MiB")
        if self.kv_per_token:
            parts.append(f"CP K/V {self.kv_per_token:,.0f} B/token")
        if self.tree_factor != 1.0:
            parts.append(f"trees ×{self.tree_factor:.3g}")
        if self.phase2 is not None:
            parts.append("or " + self.phase2.describe().removeprefix("MemoryModel: ").split("; margin")[0])
        src = f" ({self.note})" if self.note else ""
        return f"MemoryModel: {', '.join(parts)}; margin {self.margin:.1%}{src}"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "MemoryModel"}
        out.update({k: getattr(self, k) for k in _COEFS + _EXTRA if getattr(self, k) or k == "per_token"})
        if self.forward is not None:
            out["forward"] = self.forward.to_dict()
        if self.note:
            out["note"] = self.note
        if self.phase2 is not None:
            out["phase2"] = self.phase2.to_dict()
        if self.tree_factor != 1.0:
            out["tree_factor"] = self.tree_factor
        return out

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | object, *, dtype: Any = "bfloat16", attention: str,
                       gradient_checkpointing: bool = False, logits_dtype: Any = "float32",
                       tensor_parallel: int = 1, margin: float = 0.1,
                       gated_mlp: bool | None = None) -> MemoryModel:
        """Peak bytes per micro-batch from a Hugging Face config (formula: docs/memory.md, ``memory/hf.py``).

        Args:
            config: a config dict (``config.json``) or ``transformers.PretrainedConfig``.
            dtype: the activations' dtype (``"bfloat16"``, ``"float16"``, ``"float32"`` or a torch dtype).
            attention: the kernel: ``"fa2"``, ``"fa3"`` (no score matrix), ``"sdpa-packed"``
                (transformers' sdpa over a packed row: a dense ``[T, T]`` mask for two or more
                samples), ``"eager"`` (scores materialised per head, over the packed row).
            gradient_checkpointing: full activation recomputation per layer (only each layer's
                input is saved; one layer's activations live again during its backward).
            logits_dtype: the dtype log-probs are computed in (``"float32"``: the usual upcast).
            tensor_parallel: TP degree t: per-layer activations and the vocabulary divide by t
                (sequence parallel assumed, Korthikanti et al. 2022).
            margin: the stated safety margin (relative): the formula is an estimate (within 25 %
                median on the small models of benchmarks/bench_memory.py); profile for a tighter one.
            gated_mlp: whether the MLP is gated (SwiGLU/GeGLU); None infers it from ``model_type`` /
                ``hidden_act``, as ``FlopsCost.from_hf_config`` does.

        Returns a model whose ``forward`` is the no-grad pass's model (same config).
        """
        from .hf import memory_from_hf_config
        return memory_from_hf_config(cls, config, dtype=dtype, attention=attention,
                                     gradient_checkpointing=gradient_checkpointing, logits_dtype=logits_dtype,
                                     tensor_parallel=tensor_parallel, margin=margin, gated_mlp=gated_mlp)

    def replace(self, **changes: Any) -> MemoryModel:
        """A copy with ``changes`` (e.g. ``margin=0.05``)."""
        return replace(self, **changes)


def memory_from_dict(d: Mapping[str, Any]) -> MemoryModel:
    """Inverse of :meth:`MemoryModel.to_dict`."""
    if d.get("type") != "MemoryModel":
        raise PlanError(f"unknown memory model type {d.get('type')!r}; expected 'MemoryModel'.")
    fields = {k: v for k, v in d.items() if k != "type"}
    for key in ("forward", "phase2"):
        if fields.get(key) is not None:
            fields[key] = memory_from_dict(fields[key])
    return MemoryModel(**fields)
