"""microplan.torch: turn a plan's micro-batches into tensors, losses and restored outputs.

Install with ``pip install -e '.[torch]'`` in the microplan clone. One training step on rank ``r``::

    from microplan.torch import pack_micro, token_logprobs, weighted_loss, restore_order

    for micro in plan.steps[s].micros[r]:                  # placeholders included
        p = pack_micro(micro, token_ids).to(device)        # varlen row, label-aligned weights
        logits = model(**p.model_inputs(), use_cache=False).logits
        logp = token_logprobs(logits, p)                   # [T], 0 at sample starts
        weighted_loss(per_token_loss(logp), p).backward()  # Σ w·ℓ — no other normalisation
    # DDP/FSDP average the gradients (grad_reduction="mean"): the result is exactly ∇J.

The forward passes before it (old and reference log-probs) are one call on a forward plan::

    fwd = microplan.plan_forward(batch, cfg, like=plan)    # the training geometry: bit-identical
    old = forward_logprobs(model, fwd.rank(r), token_ids)  # per sample, in sample order
    old_logp = pack_values(p, old.as_dict())               # into a training micro-batch

Around the plan, the collectives of an SPMD trainer (each takes the process group explicitly):
``plan_distributed`` (gather every rank's lengths, plan, verify the fingerprints),
``exchange_samples`` / ``exchange_outputs`` (move tensors to the ranks the plan assigns and
back), ``verify_agreement`` and ``collective_guard`` (a failure on one rank is an error on every
rank, never a hang). See docs/loss.md for the loss modes and docs/integration.md for the
SPMD and single-controller recipes.

Context parallel (docs/context_parallel.md): ``PackedMicro.cp_shard(cp_rank)`` keeps one CP
member's share of a flat or tree row; under ``with context_parallel(group):`` the attention of
``register_attention`` all-gathers the group's keys and values (backward reduce-scatters them).

Measured cost (docs/cost.md): ``register_attention`` (per-sample varlen attention for
transformers models), ``profile_cost`` (time designed micro-batches, fit the cost model),
``MicroTimer`` / ``lockstep_records`` (time the loop's micro-batches for a ``CostMeter``).
Measured memory (docs/memory.md): ``profile_memory`` (peak bytes of designed micro-batches, fit
a ``MemoryModel``), ``peak_bytes`` (one call's peak above what was allocated before it).
The numpy core never imports torch; this package never changes the plan.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("microplan.torch needs PyTorch: pip install -e '.[torch]' in the microplan clone") from exc

from .attention import register_attention
from .distributed import (LocalView, Routes, collective_guard, exchange_outputs, exchange_samples, gather_batch,
                          local_view, plan_distributed, routes, verify_agreement)
from .chunked import chunked_token_logprobs
from .cp_attention import context_parallel
from .forward import forward_logprobs, run_forward
from .loss import next_token_labels, next_token_weights, token_logprobs, weighted_loss
from .packing import PackedMicro, pack_micro, pack_values
from .memtrack import peak_bytes
from .profile import ProfileDesign, attention_regime, profile_cost, profile_design
from .profile_memory import MemoryProfile, profile_memory
from .padded import PaddedMicro
from .restore import Restored, restore_order
from .timing import MicroTimer, MicroTiming, lockstep_records, time_call

__all__ = [
    "PackedMicro", "PaddedMicro", "pack_micro", "pack_values", "token_logprobs", "next_token_labels",
    "next_token_weights", "weighted_loss", "Restored", "restore_order", "register_attention",
    # context parallel execution: a member's shard of a row, attention gathering K/V over the CP group
    "context_parallel",
    # forward-only passes (old/reference log-probs): pack, run, restore in one call
    "run_forward", "forward_logprobs", "chunked_token_logprobs",
    # measured cost: profiling, timing in the loop (docs/cost.md)
    "profile_cost", "profile_design", "ProfileDesign", "attention_regime", "MicroTimer", "MicroTiming",
    "lockstep_records", "time_call",
    # measured memory (docs/memory.md)
    "profile_memory", "MemoryProfile", "peak_bytes",
    # collectives over torch.distributed (process group passed explicitly; see distributed.py)
    "gather_batch", "local_view", "LocalView", "verify_agreement", "plan_distributed",
    "exchange_samples", "exchange_outputs", "routes", "Routes", "collective_guard",
]
