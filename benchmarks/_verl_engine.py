"""verl 0.9.1's real actor engine on CPU: a CPU platform, the engine as a worker builds it, GRPO batches.

Design note. verl's ``FSDPEngineWithLMHead(model_config, engine_config, optimizer_config,
checkpoint_config).initialize()`` loads the model from a local directory, applies verl's monkey
patches, wraps it in FSDP2 (``fully_shard`` over the process group's device mesh) and builds the
optimizer — all of which runs on CPU over gloo, except for what this module supplies:

1. verl has no CPU platform: detection falls back to ``PlatformCUDA``, whose ``current_device()``
   calls ``torch.cuda.current_device()`` (``get_device_id()`` in ``forward_step``,
   ``forward_backward_batch``, ``fsdp2_clip_grad_norm_``) and whose ``device_module`` is
   ``torch.cuda`` (memory logging). :func:`cpu_platform` registers one with verl's own plugin
   API, ``set_platform``.
2. verl's default attention is ``flash_attention_2`` (flash-attn: CUDA only); the model config's
   ``override_config={"attn_implementation": "sdpa"}`` (verl's switch) picks sdpa, and verl's
   remove-padding path runs: with ``attention_mask=None`` transformers 5 derives the packed row's
   block-causal mask from the restarting position ids.
3. not CUDA but this environment: verl's monkey patch imports TRL's
   ``AutoModelForCausalLMWithValueHead``, which the installed TRL no longer has (verl is
   installed ``--no-deps``); the patch is told TRL is absent.

:func:`grpo_batch` makes verl's actor batch the way the PPO trainer does (left-right padded
prompts and responses → ``left_right_2_no_padding``). Used by tests/test_integration_verl_share.py
and benchmarks/bench_verl_share.py.
"""

from __future__ import annotations

import types
from typing import Any

__all__ = ["cpu_platform", "actor_engine", "params", "grpo_batch"]


def cpu_platform() -> None:
    """Register a CPU platform with verl (module note): device "cpu", no device memory statistics."""
    import verl.models.transformers.monkey_patch as vmp
    from verl.plugin.platform.platform_cuda import PlatformCUDA
    from verl.plugin.platform.platform_manager import set_platform
    zero = lambda *a, **k: 0  # noqa: E731
    device = types.SimpleNamespace(mem_get_info=lambda *a: (0, 0), memory_allocated=zero, memory_reserved=zero,
                                   max_memory_allocated=zero, max_memory_reserved=zero, synchronize=zero,
                                   empty_cache=zero, reset_peak_memory_stats=zero, manual_seed=zero,
                                   current_device=lambda: "cpu", is_available=lambda: False, device_count=lambda: 1)

    class CPUPlatform(PlatformCUDA):
        device_name = property(lambda self: "cpu")
        device_module = property(lambda self: device)

        def current_device(self) -> str:
            return "cpu"
    set_platform(CPUPlatform())
    vmp.is_trl_available = lambda: False  # the installed TRL lacks the value-head class verl's patch imports


def actor_engine(path: str, *, lr: float = 1.0, attention: str = "sdpa") -> Any:
    """verl's actor engine as a verl worker builds it: FSDP2, float32, gradient checkpointing, SGD;
    ``attention``: the model's attention implementation (verl's ``override_config``)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
    model = HFModelConfig(path=path, load_tokenizer=False, use_remove_padding=True, enable_gradient_checkpointing=True,
                          override_config={"attn_implementation": attention})
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine = FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, model_dtype="fp32", mixed_precision=fp32)
    optim = FSDPOptimizerConfig(optimizer="SGD", optimizer_impl="torch.optim", lr=lr, weight_decay=0.0,
                                clip_grad=1e9, total_training_steps=1)
    eng = FSDPEngineWithLMHead(model, engine, optim, CheckpointConfig())
    eng.initialize()
    return eng


def params(eng: Any) -> Any:
    """All parameters, gathered from their FSDP2 shards, as one flat tensor."""
    import torch
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().clone()
                      for p in eng.module.parameters()])


def grpo_batch(groups: list[tuple[int, list[int]]], *, vocab: int, seed: int, update: bool, max_token_len: int,
               temperature: float = 1.0, shared_response_prefix: int = 0, global_batch_size: int | None = None) -> Any:
    """verl's actor batch: ``groups`` of (prompt length, response lengths), random tokens; the
    second response of a group starts with the first one's first ``shared_response_prefix``
    tokens. ``update``: with ``old_log_probs`` and per-sample ``advantages`` for ``ppo_loss``;
    ``global_batch_size``: the mini-batch's samples over all ranks (default: this batch's)."""
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding
    g = torch.Generator().manual_seed(seed)
    P = max(p for p, _ in groups)
    R = max(r for _, rs in groups for r in rs)
    ids, am, resp, rmask = [], [], [], []
    for plen, rls in groups:
        prompt = torch.randint(0, vocab, (plen,), generator=g)
        first = None
        for j, rl in enumerate(rls):
            r = torch.randint(0, vocab, (rl,), generator=g)
            if j == 1 and first is not None and shared_response_prefix:
                k = min(shared_response_prefix, rl, first.numel())
                r[:k] = first[:k]
            first = r if j == 0 else first
            row, mask = torch.zeros(P + R, dtype=torch.long), torch.zeros(P + R, dtype=torch.long)
            row[P - plen:P], row[P:P + rl], mask[P - plen:P + rl] = prompt, r, 1
            ids.append(row), am.append(mask)
            resp.append(row[P:].clone()), rmask.append((torch.arange(R) < rl).float())
    ids, am = torch.stack(ids), torch.stack(am)
    B = ids.shape[0]
    data = {"input_ids": ids, "attention_mask": am, "position_ids": (am.cumsum(1) - 1).clamp(min=0),
            "prompts": ids[:, :P].clone(), "responses": torch.stack(resp), "response_mask": torch.stack(rmask)}
    if update:
        data["old_log_probs"] = -2.0 + 0.5 * torch.randn(B, R, generator=g)
        data["advantages"] = torch.randn(B, 1, generator=g).expand(B, R).clone()
    td = left_right_2_no_padding(TensorDict(data, batch_size=[B]))
    tu.assign_non_tensor(td, use_remove_padding=True, use_dynamic_bsz=True, max_token_len_per_gpu=max_token_len,
                         temperature=temperature, calculate_entropy=True, use_fused_kernels=False,
                         global_batch_size=global_batch_size or B)
    return td
