"""Attention-kernel presets and the hedged defaults of ``FlopsCost.from_hf_config``.

Design note. A GPU is not a FLOP counter: an attention FLOP runs slower than a weight-GEMM FLOP
(softmax, masking, lower tensor-core utilisation), and how much depends on the kernel. Each
preset scales the attention FLOPs of :func:`microplan.cost.forward_flops` by a *slowdown*
(GEMM throughput / attention throughput, forward + backward) and says whether the kernel works
per sample (varlen: Σ L²) or over the packed row (dense masked: T²). Published figures (H100,
head dim 128, causal, forward + backward, documents >= 4k tokens; the flash-attention
repository's benchmark figures, the FlashAttention-3 paper, tritonbench):

| preset        | slowdown | regime  | source                                                        |
|---------------|----------|---------|---------------------------------------------------------------|
| ``flops``     | 1.0      | varlen  | pure FLOP count (the pre-0.2 default)                         |
| ``fa3``       | 1.5      | varlen  | FlashAttention-3: GEMM/attention throughput 1.4-1.6           |
| ``fa2``       | 2.5      | varlen  | FlashAttention-2: 2.4-2.7                                     |
| ``sdpa-packed`` | 2.5    | packed  | dense kernel over the packed row with a block-diagonal mask   |
|               |          |         | (transformers sdpa/eager with restarting position_ids): all   |
|               |          |         | T² pairs, no tile skipping; slowdown as FA2 (rough: profile)  |
| ``hedged``    | 2.25     | varlen  | the default when the kernel is unknown (see below)            |

Short documents (< 1k tokens) run attention 2-5x slower per FLOP than GEMMs, but their
attention is a small share of their cost, so a per-document slowdown matters little there.

Hedged default. When nothing is measured, the default should lose least over the plausible
range of truths. ``benchmarks/bench_cost_defaults.py`` plans with each candidate default and
scores the plans under simulated truths with attention 1-3x slower per FLOP and a per-micro
overhead of 0-5 % of a cap-full micro-batch; the candidate with the smallest worst-case loss is
``hedged`` (slowdown 2.25, 1,024 tokens per micro-batch). The per-micro default
is expressed in tokens of linear compute (``DEFAULT_PER_MICRO_TOKENS``), so it scales with the
model like an FSDP all-gather does (bytes and FLOPs per token both grow with the parameter
count): 1,024 tokens of a 7B model is ~0.1 s at 400 TFLOP/s, the intra-node FSDP figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import PlanError

__all__ = ["AttentionKernel", "ATTENTION_KERNELS", "DEFAULT_ATTENTION", "DEFAULT_PER_MICRO_TOKENS",
           "attention_kernel"]


@dataclass(frozen=True, kw_only=True)
class AttentionKernel:
    """How an attention kernel's cost relates to its FLOP count.

    Attributes:
        name: the preset's name.
        slowdown: GEMM throughput / attention throughput: one attention FLOP costs this many
            weight-GEMM FLOPs (>= 1 on every GPU we know of).
        packed: True for dense kernels over the packed row (cost in T², not Σ L²).
        source: where the figure comes from.
    """

    name: str
    slowdown: float
    packed: bool
    source: str


ATTENTION_KERNELS: dict[str, AttentionKernel] = {k.name: k for k in (
    AttentionKernel(name="flops", slowdown=1.0, packed=False, source="pure FLOP count"),
    AttentionKernel(name="fa3", slowdown=1.5, packed=False,
                    source="FlashAttention-3 paper / flash-attention benchmarks, H100: 1.4-1.6"),
    AttentionKernel(name="fa2", slowdown=2.5, packed=False,
                    source="flash-attention repository benchmarks, H100: 2.4-2.7"),
    AttentionKernel(name="sdpa-packed", slowdown=2.5, packed=True,
                    source="dense masked kernel over the packed row: every T² pair; rough, profile it"),
    AttentionKernel(name="hedged", slowdown=2.25, packed=False,
                    source="least worst-case loss for slowdown 1-3 (benchmarks/bench_cost_defaults.py)"),
)}

DEFAULT_ATTENTION = "hedged"

#: Fixed per-micro-batch cost of the default model, in tokens of linear (weight) compute.
DEFAULT_PER_MICRO_TOKENS = 1024.0


def attention_kernel(name: str) -> AttentionKernel:
    """The preset called ``name``; PlanError listing the presets otherwise."""
    if not isinstance(name, str) or name not in ATTENTION_KERNELS:
        raise PlanError(f"attention={name!r} is not a known attention kernel; choose one of "
                        f"{', '.join(repr(k) for k in ATTENTION_KERNELS)} (docs/cost.md), or profile your "
                        "kernel with microplan.torch.profile_cost.")
    return ATTENTION_KERNELS[name]
