"""A minimal GRPO training step with microplan end to end: plan → pack → loss → restore.

    torchrun --nproc_per_node=2 examples/grpo_step.py     # any world size, gloo on CPU
    python examples/grpo_step.py                          # spawns 2 gloo ranks itself

A tiny random Llama (Hugging Face transformers) samples 4 responses for each of 8 prompts; the
reward is the share of even token ids in the response; GRPO advantages are group-normalised.
Every rank reads the same rollout buffer (here: regenerated with a shared seed), so every rank
computes the same plan and proves it with the fingerprint. Then, per optimizer step (4 prompts):

1. old log-probs: forward-only over the rank's micro-batches, ``restore_order`` back to samples;
2. training: ``pack_micro`` → packed forward → ``token_logprobs`` → PPO clipped surrogate per
   token → ``weighted_loss`` → backward, under DDP ``no_sync`` until the last micro-batch; DDP
   averages gradients over ranks, which the plan's ``loss_scale`` (grad_reduction="mean") expects;
3. report J (the loss-mode objective), the gradient norm, then ``optimizer.step()``.

No normalisation appears outside microplan: no token counts, no micro counts, no world size —
and J and |grad| print the same (to float32 rounding) for 1, 2, 3 or 4 ranks: the split does not
change the gradient. (``python examples/grpo_step.py 4`` picks the world size; ``... 1 2 4`` runs
each in turn.)
"""

from __future__ import annotations

import os
import socket
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

import microplan as mp
from microplan.torch import pack_micro, pack_values, restore_order, token_logprobs, weighted_loss

try:
    from microplan.torch import verify_agreement
except ImportError:  # pragma: no cover - a build without the collectives module
    verify_agreement = None

PROMPTS, GROUP, MAX_NEW, VOCAB, CLIP = 8, 4, 10, 64, 0.2


def make_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attn_implementation="sdpa")
    torch.manual_seed(0)  # same weights everywhere (DDP would broadcast rank 0's anyway)
    return LlamaForCausalLM(cfg)


@torch.no_grad()
def rollouts(model: torch.nn.Module, seed: int) -> tuple[list[torch.Tensor], list[int], list[int], list[float]]:
    """Sample GROUP responses per prompt (stop at token 0 or MAX_NEW); tokens, prompt lens, ids, advantages."""
    g = torch.Generator().manual_seed(seed)
    tokens, prompt_lens, prompt_ids, rewards = [], [], [], []
    for p in range(PROMPTS):
        prompt = torch.randint(1, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
        for _ in range(GROUP):
            seq = prompt.clone()
            for _ in range(MAX_NEW):
                logits = model(input_ids=seq[None], use_cache=False).logits[0, -1]
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
                seq = torch.cat([seq, nxt])
                if int(nxt) == 0:
                    break
            resp = seq[len(prompt):]
            tokens.append(seq)
            prompt_lens.append(len(prompt))
            prompt_ids.append(p)
            rewards.append(float((resp % 2 == 0).double().mean()))
    r = torch.tensor(rewards).view(PROMPTS, GROUP)
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    return tokens, prompt_lens, prompt_ids, adv.tolist()


def train(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, prompt_lens, prompt_ids, adv = rollouts(model, seed=1)

    batch = mp.Batch([len(t) for t in tokens], prompt_lens=prompt_lens, prompt_ids=prompt_ids)
    config = mp.PlanConfig(dp_size=world, max_tokens_per_micro=48, steps=mp.Steps(prompts_per_step=4),
                           loss=mp.Loss("token-mean"))  # DDP averages: grad_reduction="mean" (default)
    plan = mp.plan(batch, config)
    if verify_agreement is not None:
        verify_agreement(plan)  # every rank raises the same PlanError if any rank planned differently
    if rank == 0:
        print(f"{batch.num_samples} samples, {sum(batch.seq_lens)} tokens; plan {plan.fingerprint()[:16]} "
              f"({len(plan.steps)} steps, K = {[s.micro_count for s in plan.steps]}, "
              f"{sum(s.num_placeholders for s in plan.steps)} placeholders) on {world} rank{'s' if world != 1 else ''}", flush=True)

    for s, micros in enumerate(plan.rank(rank)):
        packs = [pack_micro(m, tokens) for m in micros]  # placeholders → valid 1-token, weight-0 rows
        with torch.no_grad():  # 1. old log-probs, restored to samples by global index
            outs = [token_logprobs(model(**p.model_inputs(), use_cache=False).logits, p) for p in packs]
        old_logp = restore_order(packs, outs).as_dict()

        objective = torch.zeros((), dtype=torch.float64)
        for m, p in enumerate(packs):  # 2. training micro-batches
            sync = m == len(packs) - 1
            with nullcontext() if sync else ddp.no_sync():
                logp = token_logprobs(ddp(**p.model_inputs(), use_cache=False).logits, p)
                ratio = torch.exp(logp - pack_values(p, old_logp, dtype=logp.dtype))
                a = pack_values(p, adv, dtype=logp.dtype)
                ell = -torch.minimum(ratio * a, ratio.clamp(1 - CLIP, 1 + CLIP) * a)
                loss = weighted_loss(ell, p)  # Σ loss_scale·ℓ — nothing else
                loss.backward()
            objective += loss.detach()
        dist.all_reduce(objective)  # Σ over ranks of Σ_j loss_scale_j Σ_t ℓ = W·J
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {s}: J = {float(objective) / world:+.6f}  |grad| = {float(grad_norm):.6f}  "
                  f"micro-batches/rank = {len(packs)}  placeholders here = {sum(p.is_placeholder for p in packs)}",
                  flush=True)


def _spawned(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    _run()


def _run() -> None:
    dist.init_process_group("gloo")
    try:
        train(dist.get_rank(), dist.get_world_size())
    finally:
        dist.destroy_process_group()


def main() -> None:
    if "RANK" in os.environ:  # launched by torchrun
        _run()
        return
    worlds = [int(w) for w in sys.argv[1:]] or [2]  # several sizes: the same J and |grad| for each
    # Linux: fork the ranks from this process, which has imported transformers once (spawn would
    # re-import torch + transformers in every rank, ~8 s each on a small CPU machine).
    method = "fork" if sys.platform == "linux" else "spawn"
    if method == "fork":
        import transformers.models.llama.modeling_llama  # noqa: F401  (imported once, inherited)
    for world in worlds:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        t = time.perf_counter()
        torch.multiprocessing.start_processes(_spawned, args=(world, port), nprocs=world, join=True,
                                              start_method=method)
        print(f"done in {time.perf_counter() - t:.1f}s")

if __name__ == "__main__":
    main()
