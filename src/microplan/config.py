"""Configuration: how a batch is cut into optimizer steps, packed, spread over ranks and weighed.

All configs are frozen, keyword-only dataclasses validated in ``__post_init__``; every refusal
is a :class:`PlanError` naming the field, the constraint and the fix. Units are in the names:
``max_tokens_per_micro`` is tokens per GPU per micro-batch, ``micro_batch_size`` is samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from ._checks import float_field
from .config_fields import _INT_FIX, MAX_COUNT, MAX_SLOTS, int_field
from .cost.models import CostModel, FlopsCost, TokenCost, cost_from_dict
from .cost.vision import VisionCost
from .errors import PlanError
from .memory.config import check_memory, memory_dict, memory_from_config_dict
from .memory.model import MemoryModel

__all__ = ["Steps", "Loss", "PlanConfig", "LOSS_MODES", "ContextParallel"]

#: The layouts a micro-batch may take (``footprint.py`` computes what each occupies).
LAYOUTS: tuple[str, ...] = ("varlen", "padded", "padded-2d")
Layout = Literal["varlen", "padded", "padded-2d"]

LOSS_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
              "seq-mean-token-sum-norm", "prompt-mean", "rollout-mean")
LossMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                   "seq-mean-token-sum-norm", "prompt-mean", "rollout-mean"]
ShortStep = Literal["pad", "drop", "error"]
Sync = Literal["micro", "step"]
Placement = Literal["global", "local"]


@dataclass(frozen=True, kw_only=True)
class Steps:
    """How the batch splits into optimizer steps (mini-batches). Give exactly one field.

    Attributes:
        num_steps: exactly this many steps; prompts are dealt in order, as evenly as possible
            (step sizes differ by at most one prompt). Nothing is dropped.
        prompts_per_step: each step holds this many whole prompts (GRPO groups), whatever the
            number of samples they produced (step-wise trajectories). Trailing prompts that do
            not fill a step are dropped and reported.
        rollouts_per_step: each step holds this many whole rollouts. A prompt group may not be
            cut by a step boundary (PlanError names it). Trailing rollouts that do not fill a
            step are dropped and reported.
    """

    num_steps: int | None = None
    prompts_per_step: int | None = None
    rollouts_per_step: int | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("num_steps", "prompts_per_step", "rollouts_per_step") if getattr(self, n) is not None]
        if len(given) != 1:
            raise PlanError(f"Steps needs exactly one of num_steps, prompts_per_step, rollouts_per_step; "
                            f"got {given or 'none'}. Pass one, e.g. Steps(prompts_per_step=32), or steps=None "
                            "for a single step.")
        name = given[0]
        object.__setattr__(self, name, int_field(f"Steps.{name}", getattr(self, name), minimum=1))

    @property
    def unit(self) -> str:
        return "steps" if self.num_steps is not None else ("prompts" if self.prompts_per_step is not None else "rollouts")

    def to_dict(self) -> dict[str, Any]:
        return {"num_steps": self.num_steps, "prompts_per_step": self.prompts_per_step,
                "rollouts_per_step": self.rollouts_per_step}


@dataclass(frozen=True)
class Loss:
    """The loss objective of a step and the engine's gradient conventions.

    Attributes:
        mode: one of ``LOSS_MODES`` (see docs/loss.md for each objective).
        grad_reduction: ``"mean"`` when the engine averages gradients over the W ranks of the
            DP (×CP) plane (DDP, FSDP, Megatron), ``"sum"`` when it sums them.
        engine_divides_by_micro_count: True when the engine divides each micro-batch loss by the
            step's micro-batch count K before backward (Megatron's forward_backward_func).
        norm_constant: H of ``seq-mean-token-sum-norm`` (e.g. the max response length); required
            for that mode, refused for the others.
    """

    mode: LossMode = "token-mean"
    grad_reduction: Literal["mean", "sum"] = field(default="mean", kw_only=True)
    engine_divides_by_micro_count: bool = field(default=False, kw_only=True)
    norm_constant: float | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.mode not in LOSS_MODES:
            raise PlanError(f"Loss.mode={self.mode!r} is not a known mode; choose one of {', '.join(LOSS_MODES)}.")
        if self.grad_reduction not in ("mean", "sum"):
            raise PlanError(f"Loss.grad_reduction={self.grad_reduction!r} must be 'mean' (DDP/FSDP average "
                            "gradients over ranks) or 'sum'; set the one your engine uses.")
        if not isinstance(self.engine_divides_by_micro_count, bool):
            raise PlanError(f"Loss.engine_divides_by_micro_count={self.engine_divides_by_micro_count!r} must be a "
                            "bool; pass True when the engine divides each micro-batch loss by the micro count "
                            "(Megatron), else False.")
        if self.mode == "seq-mean-token-sum-norm":
            if self.norm_constant is None:
                raise PlanError("Loss mode 'seq-mean-token-sum-norm' needs norm_constant (H, e.g. the max "
                                "response length): pass Loss('seq-mean-token-sum-norm', norm_constant=H).")
            try:
                h = float_field("Loss.norm_constant", self.norm_constant, positive=True)
            except PlanError as exc:
                raise PlanError(f"{exc} Fix: pass a finite H > 0, e.g. the max response length: "
                                "Loss('seq-mean-token-sum-norm', norm_constant=H).") from None
            object.__setattr__(self, "norm_constant", h)
        elif self.norm_constant is not None:
            raise PlanError(f"Loss.norm_constant is only used by 'seq-mean-token-sum-norm', not {self.mode!r}; "
                            "drop it or change the mode.")

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "grad_reduction": self.grad_reduction,
                "engine_divides_by_micro_count": self.engine_divides_by_micro_count,
                "norm_constant": self.norm_constant}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Loss:
        return cls(d["mode"], grad_reduction=d["grad_reduction"],
                   engine_divides_by_micro_count=d["engine_divides_by_micro_count"],
                   norm_constant=d["norm_constant"])


@dataclass(frozen=True, kw_only=True)
class ContextParallel:
    """Context parallelism. Give exactly one field.

    Attributes:
        size: a fixed CP degree c: each of the ``dp_size`` DP ranks is a group of c GPUs and a
            micro-batch may hold up to ``c × max_tokens_per_micro`` tokens. W = dp_size × c.
        max_size: dynamic CP: ``dp_size`` counts every GPU of the DP×CP plane; in each micro
            slot the plane is cut into power-of-two CP groups of at most ``max_size`` GPUs, sized
            per micro-batch so no GPU holds more than ``max_tokens_per_micro`` tokens.
            W = dp_size (every rank of the plane).
    """

    size: int | None = None
    max_size: int | None = None

    def __post_init__(self) -> None:
        given = [n for n in ("size", "max_size") if getattr(self, n) is not None]
        if len(given) != 1:
            raise PlanError(f"ContextParallel needs exactly one of size (fixed) or max_size (dynamic); got "
                            f"{given or 'none'}. Pass one, e.g. ContextParallel(size=2).")
        name = given[0]
        v = int_field(f"ContextParallel.{name}", getattr(self, name), minimum=1, maximum=MAX_COUNT)
        if name == "max_size" and v & (v - 1):
            raise PlanError(f"ContextParallel.max_size={v} must be a power of two (1, 2, 4, ...).")
        object.__setattr__(self, name, v)

    @property
    def dynamic(self) -> bool:
        return self.max_size is not None

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "max_size": self.max_size}


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """Everything the planner needs besides the batch (binding API).

    Attributes:
        dp_size: data-parallel ranks (with dynamic CP: every GPU of the DP×CP plane).
        max_tokens_per_micro: dynamic batching: the most tokens ONE GPU processes in one
            micro-batch (sum of ``seq_lens``; a micro-batch over a CP group of c GPUs may hold
            c × this). Exactly one of this and ``micro_batch_size``.
        micro_batch_size: static batching: at most this many samples per micro-batch.
        steps: a :class:`Steps`; None means one step holding every sample.
        align: micro-batches per rank per step must be a multiple of this (Megatron's
            ``microbatch_group_size_per_vp_stage`` under virtual pipeline parallelism).
        short_step: when a step cannot give every rank ``align``-aligned non-empty
            micro-batches: ``"pad"`` adds placeholder micro-batches, ``"drop"`` drops the fewest
            trailing rollouts (reported in ``Plan.dropped``), ``"error"`` raises PlanError.
        cost: cost model for balancing and predicted times (default ``TokenCost()``).
        sync: ``"micro"`` when ranks meet at every micro-batch (FSDP/ZeRO-3, pipelines) — the
            planner minimises Σ_m max_r cost; ``"step"`` when they meet once per step (DDP with
            no_sync) — it minimises max_r Σ_m cost.
        loss: a :class:`Loss` (default ``Loss("token-mean")``).
        context_parallel: a :class:`ContextParallel`, or None for none.
        seed: reserved for a randomised planning stage; no stage of this version draws a random
            number, so the seed does not change the layout (every step, micro-batch and loss
            scale is the same for any seed). It is recorded in the plan's JSON, and so in its
            fingerprint: ranks that plan with different seeds disagree on the fingerprint.
        share_prefixes: pack each micro-batch as the prefix tree of its samples (the Batch's
            ``prefix_parent``/``shared_prefix_lens``), every shared token once: the cap counts
            unique tokens and ``Micro.num_tokens`` is what the GPU holds. Needs dynamic batching
            and no context parallel (for now).
        pipeline_stages: pipeline-parallel stages p per DP rank (1: none). Every step gets
            K >= p micro-batches per rank (fewer is mostly bubble), and each rank's micro-batches
            run in the order of least predicted 1F1B time (docs/passes.md).
        virtual_stages: model chunks per pipeline stage (Megatron's
            ``virtual_pipeline_model_parallel_size``); > 1 selects the interleaved 1F1B schedule,
            whose micro-batch group (``microbatch_group_size_per_vp_stage``) is ``align`` and
            must be >= ``pipeline_stages``.
        layout: what a micro-batch occupies on the GPU, so what the cap counts (docs/layouts.md):
            ``"varlen"`` (one packed row, the default), ``"padded"`` (``[n, max L]``) or
            ``"padded-2d"`` (``[n, max prompt + max response]``, prompts left- and responses
            right-padded; needs ``Batch(prompt_lens=...)``). The cost model sees that shape.
        pad_to_multiple_of: m: each sample occupies ⌈L/m⌉·m tokens (varlen), the row width is a
            multiple of m (padded). 2·cp for zigzag ring attention, 16 for FP8 kernels.
        pad_row_to_multiple_of: r: the packed row (varlen, all CP ranks together) is padded to a
            multiple of r, counted in the cap; padded layouts round the row width up to it.
            tp for sequence-parallel TP (cp·tp under context parallel).
        max_vision_tokens_per_micro: most vision-encoder patches (``Batch.vision_tokens``) one
            micro-batch may hold; None: no vision cap.
        vision_cost: the cost of vision patches (:class:`VisionCost`); None: a patch costs like
            an LLM token of the cost model (``linear``/``quadratic`` within each image).
        placement: ``"global"`` (default): the planner chooses every sample's rank, so the data
            must be (re)distributed to follow the plan. ``"local"``: every sample stays on the
            rank that already holds it (``Batch(..., rank_of=...)``, which ``plan_distributed``
            fills from the gathering rank); the plan still gives every rank the same K, the token
            cap, lockstep-balanced slots and exact loss scales (docs/planner.md, "Local
            placement"). Not with dynamic context parallel.
    """

    dp_size: int
    max_tokens_per_micro: int | None = None
    micro_batch_size: int | None = None
    steps: Steps | None = None
    align: int = 1
    short_step: ShortStep = "pad"
    cost: CostModel | None = None
    sync: Sync = "micro"
    loss: Loss | None = None
    context_parallel: ContextParallel | None = None
    seed: int = 0
    share_prefixes: bool = False
    pipeline_stages: int = 1
    virtual_stages: int = 1
    # -- what a micro-batch occupies on the GPU (footprint.py, docs/layouts.md) --
    layout: Layout = "varlen"
    pad_to_multiple_of: int = 1
    pad_row_to_multiple_of: int = 1
    max_vision_tokens_per_micro: int | None = None
    vision_cost: VisionCost | None = None
    placement: Placement = "global"
    memory: MemoryModel | None = None
    max_bytes_per_micro: int | None = None

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("dp_size", int_field("PlanConfig.dp_size", self.dp_size, minimum=1, maximum=MAX_COUNT))
        check_memory(self, set_)
        if (self.max_tokens_per_micro is None) == (self.micro_batch_size is None) and self.memory is None:
            got = ("both max_tokens_per_micro={} and micro_batch_size={}".format(self.max_tokens_per_micro,
                                                                                 self.micro_batch_size)
                   if self.max_tokens_per_micro is not None else "neither")
            raise PlanError(f"PlanConfig needs exactly one of max_tokens_per_micro (dynamic batching, tokens per "
                            f"GPU) and micro_batch_size (static batching, samples per micro-batch); got {got}. "
                            "Pass only max_tokens_per_micro=<tokens per GPU> or only micro_batch_size=<samples>.")
        if self.max_tokens_per_micro is not None:
            set_("max_tokens_per_micro", int_field("PlanConfig.max_tokens_per_micro", self.max_tokens_per_micro, minimum=1))
            if self.max_tokens_per_micro > 2 ** 50:
                raise PlanError(f"PlanConfig.max_tokens_per_micro={self.max_tokens_per_micro} is beyond any GPU "
                                "(at most 2**50 supported); set it to the most tokens one GPU may process in one "
                                "micro-batch.")
        elif self.memory is None:  # a memory budget without a token cap: check_memory refused micro_batch_size
            set_("micro_batch_size", int_field("PlanConfig.micro_batch_size", self.micro_batch_size, minimum=1))
        if self.steps is not None and not isinstance(self.steps, Steps):
            raise PlanError(f"PlanConfig.steps must be a microplan.Steps or None, got {type(self.steps).__name__}; "
                            "pass e.g. steps=Steps(prompts_per_step=32).")
        set_("align", int_field("PlanConfig.align", self.align, minimum=1, maximum=MAX_COUNT))
        if self.short_step not in ("pad", "drop", "error"):
            raise PlanError(f"PlanConfig.short_step={self.short_step!r} must be 'pad', 'drop' or 'error'; set one of "
                            "them (see the PlanConfig docstring).")
        if self.cost is None:
            set_("cost", TokenCost())
        elif not isinstance(self.cost, CostModel):
            raise PlanError(f"PlanConfig.cost must be a cost model, got {self.cost!r}; pass cost=TokenCost(), "
                            "FlopsCost(linear=..., quadratic=...) or FlopsCost.from_hf_config(config).")
        if self.sync not in ("micro", "step"):
            raise PlanError(f"PlanConfig.sync={self.sync!r} must be 'micro' (ranks meet every micro-batch: "
                            "FSDP/ZeRO-3, pipelines) or 'step' (DDP with no_sync); set one of them.")
        if self.loss is None:
            set_("loss", Loss("token-mean"))
        elif not isinstance(self.loss, Loss):
            raise PlanError(f"PlanConfig.loss must be a microplan.Loss, got {self.loss!r}; pass e.g. "
                            "loss=Loss('token-mean').")
        cp = self.context_parallel
        if cp is not None:
            if not isinstance(cp, ContextParallel):
                raise PlanError(f"PlanConfig.context_parallel must be a microplan.ContextParallel or None, got {cp!r}; "
                                "pass e.g. context_parallel=ContextParallel(size=2).")
            if not self.dynamic:
                raise PlanError("context_parallel needs dynamic batching: set max_tokens_per_micro, not micro_batch_size.")
            if cp.dynamic and cp.max_size > self.dp_size:  # type: ignore[operator]
                raise PlanError(f"ContextParallel.max_size={cp.max_size} exceeds dp_size={self.dp_size} (the GPUs of "
                                "the DP×CP plane); lower max_size or raise dp_size.")
            if cp.dynamic and self.dp_size % cp.max_size:  # type: ignore[operator]
                raise PlanError(f"dynamic context parallel needs dp_size (the GPUs of the DP×CP plane) to be a multiple "
                                f"of ContextParallel.max_size={cp.max_size} so power-of-two CP groups tile it; got "
                                f"dp_size={self.dp_size}.")
        set_("seed", int_field("PlanConfig.seed", self.seed, minimum=0))
        if not isinstance(self.share_prefixes, bool):
            raise PlanError(f"PlanConfig.share_prefixes={self.share_prefixes!r} must be True or False.")
        if self.share_prefixes and not self.dynamic:
            raise PlanError("PlanConfig.share_prefixes=True needs dynamic batching (a micro-batch holds a prefix tree "
                            "of unique tokens, not a sample count): set max_tokens_per_micro, not micro_batch_size.")
        if self.placement not in ("global", "local"):
            raise PlanError(f"PlanConfig.placement={self.placement!r} must be 'global' (the plan chooses each "
                            "sample's rank) or 'local' (samples stay on the rank that holds them: pass "
                            "Batch(..., rank_of=...)).")
        if self.placement == "local" and cp is not None and cp.dynamic:
            raise PlanError("PlanConfig.placement='local' cannot be combined with dynamic context parallel "
                            "(ContextParallel(max_size=...)): dynamic CP groups span DP ranks, so samples would "
                            "move. Use placement='global', or a fixed ContextParallel(size=c).")
        _check_layout(self, set_)
        self._check_pipeline()

    def _check_pipeline(self) -> None:
        """pipeline_stages / virtual_stages (Megatron's rules for the interleaved schedule)."""
        p = int_field("PlanConfig.pipeline_stages", self.pipeline_stages, minimum=1, maximum=MAX_COUNT)
        v = int_field("PlanConfig.virtual_stages", self.virtual_stages, minimum=1, maximum=MAX_COUNT)
        object.__setattr__(self, "pipeline_stages", p)
        object.__setattr__(self, "virtual_stages", v)
        k = max(self.align, p)
        if self.dp_size * k > MAX_SLOTS:
            which = "align" if self.align >= p else "pipeline_stages"
            raise PlanError(f"dp_size={self.dp_size} × {which}={k} = {self.dp_size * k:,} micro-batches per step at "
                            f"the least, over the {MAX_SLOTS:,} (2**24) a plan holds; lower dp_size or {which} "
                            "(each micro-batch of a plan is an object in memory).")
        if v > 1 and p == 1:
            raise PlanError(f"PlanConfig.virtual_stages={v} needs pipeline parallelism: set pipeline_stages to the "
                            "pipeline degree p >= 2, or virtual_stages=1.")
        if v > 1 and self.align < p:
            raise PlanError(f"the interleaved pipeline schedule (virtual_stages={v}) runs micro-batches in groups of "
                            f"align={self.align} (Megatron's microbatch_group_size_per_vp_stage), which must be >= "
                            f"pipeline_stages={p}; set align to a value >= {p} (Megatron's default is p), or "
                            "virtual_stages=1.")

    # -- derived -----------------------------------------------------------------------------
    @property
    def dynamic(self) -> bool:
        """True for token-capped (dynamic) batching, False for fixed ``micro_batch_size``."""
        return self.max_tokens_per_micro is not None or self.memory is not None

    @property
    def static_cp_size(self) -> int:
        cp = self.context_parallel
        return cp.size if cp is not None and cp.size is not None else 1

    @property
    def grad_world(self) -> int:
        """W: ranks whose gradients are averaged under ``grad_reduction='mean'``."""
        return self.dp_size * self.static_cp_size

    def to_dict(self) -> dict[str, Any]:
        return {
            "dp_size": self.dp_size, "max_tokens_per_micro": self.max_tokens_per_micro,
            "micro_batch_size": self.micro_batch_size,
            "steps": None if self.steps is None else self.steps.to_dict(),
            "align": self.align, "short_step": self.short_step,
            "cost": self.cost.to_dict(), "sync": self.sync,  # type: ignore[union-attr]
            "loss": self.loss.to_dict(),  # type: ignore[union-attr]
            "context_parallel": None if self.context_parallel is None else self.context_parallel.to_dict(),
            "seed": self.seed,
            **({"share_prefixes": True} if self.share_prefixes else {}),
            "pipeline_stages": self.pipeline_stages, "virtual_stages": self.virtual_stages,
            **_layout_dict(self),
            **({"placement": self.placement} if self.placement != "global" else {}),
            **memory_dict(self),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PlanConfig:
        return cls(dp_size=d["dp_size"], max_tokens_per_micro=d["max_tokens_per_micro"],
                   micro_batch_size=d["micro_batch_size"],
                   steps=None if d["steps"] is None else Steps(**d["steps"]),
                   align=d["align"], short_step=d["short_step"], cost=cost_from_dict(d["cost"]),
                   sync=d["sync"], loss=Loss.from_dict(d["loss"]),
                   context_parallel=None if d["context_parallel"] is None else ContextParallel(**d["context_parallel"]),
                   seed=d["seed"], share_prefixes=bool(d.get("share_prefixes", False)),
                   pipeline_stages=d.get("pipeline_stages", 1), virtual_stages=d.get("virtual_stages", 1),
                   placement=d.get("placement", "global"), **_layout_from_dict(d), **memory_from_config_dict(d))


# -- layouts, padding rules and vision tokens (issue 11; footprint.py) ------------------------------

_LAYOUT_DEFAULTS: dict[str, Any] = {"layout": "varlen", "pad_to_multiple_of": 1, "pad_row_to_multiple_of": 1,
                                    "max_vision_tokens_per_micro": None, "vision_cost": None}


def _check_layout(cfg: PlanConfig, set_: Any) -> None:
    """Validate the layout fields (called at the end of ``PlanConfig.__post_init__``)."""
    if cfg.layout not in LAYOUTS:
        raise PlanError(f"PlanConfig.layout={cfg.layout!r} is not a layout; choose 'varlen' (one packed row), "
                        "'padded' ([n, max L]) or 'padded-2d' ([n, max prompt + max response]).")
    for name in ("pad_to_multiple_of", "pad_row_to_multiple_of"):
        v = int_field(f"PlanConfig.{name}", getattr(cfg, name), minimum=1)
        if v > 2 ** 20:
            raise PlanError(f"PlanConfig.{name}={v} is beyond any kernel's tile (at most 2**20); "
                            + _INT_FIX[f"PlanConfig.{name}"])
        set_(name, v)
    cap = None if cfg.max_tokens_per_micro is None else cfg.max_tokens_per_micro * cfg.static_cp_size
    unit = math.lcm(cfg.pad_to_multiple_of, cfg.pad_row_to_multiple_of) if cfg.layout != "varlen" \
        else cfg.pad_row_to_multiple_of
    if cap is not None and unit > cap:
        raise PlanError(f"padding to a multiple of {unit} tokens exceeds max_tokens_per_micro={cfg.max_tokens_per_micro}"
                        f"{f' × cp size {cfg.static_cp_size}' if cfg.static_cp_size > 1 else ''}: every micro-batch "
                        "would be over the cap; lower pad_row_to_multiple_of / pad_to_multiple_of or raise the cap.")
    m, r = cfg.pad_to_multiple_of, cfg.pad_row_to_multiple_of
    cp = cfg.context_parallel
    split = cfg.static_cp_size > 1 or (cp is not None and cp.dynamic)  # dynamic CP splits rows too
    if cfg.layout == "varlen" and split and m > 1 and r > 1 and r % m:
        raise PlanError(f"under context parallel the row's trailing pad sequence must split like a sample (zigzag "
                        f"chunks): pad_row_to_multiple_of={r} must be a multiple of pad_to_multiple_of={m}; use "
                        f"{math.lcm(m, r)}.")
    v = cfg.max_vision_tokens_per_micro
    if v is not None:
        set_("max_vision_tokens_per_micro", int_field("PlanConfig.max_vision_tokens_per_micro", v, minimum=1))
        if not cfg.dynamic:
            raise PlanError("max_vision_tokens_per_micro needs dynamic batching: set max_tokens_per_micro, not "
                            "micro_batch_size.")
    if cfg.vision_cost is not None and not isinstance(cfg.vision_cost, VisionCost):
        raise PlanError(f"PlanConfig.vision_cost must be a microplan.VisionCost or None, got {cfg.vision_cost!r}; "
                        "pass e.g. vision_cost=VisionCost(linear=..., quadratic=...).")
    if cfg.share_prefixes and cfg.layout != "varlen":
        raise PlanError(f"share_prefixes=True packs each micro-batch as one tree row (every shared token once); "
                        f"layout={cfg.layout!r} gives every sample its own padded row of the batch's width, where "
                        "a shared prefix cannot be stored once. Use layout='varlen' (padding multiples and "
                        "pad_row_to_multiple_of compose with sharing), or plan without sharing.")
    cp = cfg.context_parallel
    if cp is not None and cp.dynamic and cfg.layout != "varlen":
        raise PlanError(f"layout={cfg.layout!r} is not supported with dynamic context parallel "
                        "(ContextParallel(max_size=...)): its CP groups split packed varlen rows. Use "
                        "layout='varlen' (padding multiples and a vision cap compose with dynamic CP), or "
                        "ContextParallel(size=c).")


def _layout_dict(cfg: PlanConfig) -> dict[str, Any]:
    """The layout fields that differ from their defaults (so older plans' JSON is unchanged)."""
    out = {k: getattr(cfg, k) for k, d in _LAYOUT_DEFAULTS.items() if getattr(cfg, k) != d}
    if cfg.vision_cost is not None:
        out["vision_cost"] = cfg.vision_cost.to_dict()
    return out


def _layout_from_dict(d: dict[str, Any]) -> dict[str, Any]:
    out = {k: d.get(k, v) for k, v in _LAYOUT_DEFAULTS.items()}
    if out["vision_cost"] is not None:
        out["vision_cost"] = VisionCost.from_dict(out["vision_cost"])
    return out
