"""Shared helpers of the exactness tests and benchmark: a tiny float64 causal LM, RL data, J.

The model is a 2-layer Hugging Face Llama with random weights (sdpa attention, float64). Its
packed forward (one row, position_ids restarting at 0, attention_mask=None, use_cache=False)
applies block-diagonal causal attention in transformers 5.x; ``eager`` attention is NOT used
because its softmax runs in float32 (3–5e-8 error even in a float64 model).

Precision trap: transformers' ``LlamaRMSNorm`` casts its input ``.to(torch.float32)`` — for a
float64 model a DOWNcast — so forward and backward pass through float32 at every norm. Gradients
are then float32-accurate only, and merely *reproducible* when the same per-token gradient
arrives in one backward: splitting one micro-batch's loss over two backwards (as context
parallel does) moved the gradient by 3e-8 relative. ``make_model`` therefore swaps every norm
for a dtype-preserving one (same math, same parameters), making the model float64 end to end.

``reference_objective`` computes J from the table of DESIGN.md directly — per sample, per group
— without microplan's coefficients, so the exactness tests check ``weigh.py`` rather than
trusting it. ``per_token_loss`` is the PPO clipped surrogate (or -A·logp), label aligned.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

VOCAB = 32


def _float64_norms(model: torch.nn.Module) -> None:
    """Make every LlamaRMSNorm compute in its input dtype (HF's casts to float32; see module note)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class RMSNormSameDtype(LlamaRMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for m in model.modules():
        if type(m) is LlamaRMSNorm:
            m.__class__ = RMSNormSameDtype


def make_model(seed: int = 0, *, dtype: torch.dtype = torch.float64, attn: str = "sdpa",
               max_positions: int = 64) -> torch.nn.Module:
    """A 2-layer Llama (hidden 16, 2 heads, 1 KV head) with seeded random weights, ``attn``
    attention (sdpa by default; ``microplan.torch.register_attention()`` for prefix-shared rows),
    float64 end to end (dtype-preserving RMSNorm)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
                      tie_word_embeddings=False, attn_implementation=attn)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # HF initialises with std 0.02; larger weights make the test sharper
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    _float64_norms(model)
    return model.eval()


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    """All parameter gradients as one flat float64 vector (zeros where a grad is None)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double()
                      for p in model.parameters()])


def padded_logprobs(model: torch.nn.Module, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Label-aligned log-probs per sample (entry 0 = 0), from a right-padded batched forward."""
    L = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.int64)
    att = torch.zeros(len(seqs), L, dtype=torch.int64)
    for j, s in enumerate(seqs):
        ids[j, :len(s)] = s
        att[j, :len(s)] = 1
    logits = model(input_ids=ids, attention_mask=att, use_cache=False).logits
    out = []
    for j, s in enumerate(seqs):
        lg = logits[j, :len(s) - 1]
        lp = lg.gather(-1, s[1:, None]).squeeze(-1) - torch.logsumexp(lg, -1)
        out.append(torch.cat([lp.new_zeros(1), lp]))
    return out


def per_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, kind: str,
                   clip: float = 0.2) -> torch.Tensor:
    """ℓ per token: PPO clipped surrogate ``-min(r·A, clip(r)·A)``, r = exp(logp - old), or ``-A·logp``."""
    if kind == "ppo":
        ratio = torch.exp(logp - old_logp)
        return -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip, 1 + clip) * adv)
    if kind == "pg":
        return -adv * logp
    raise ValueError(kind)


@dataclass
class Dataset:
    """An RL batch: tokens, loss masks (prompt then response), group ids, advantages, old log-probs."""

    name: str
    tokens: list[torch.Tensor]
    masks: list[torch.Tensor]
    prompt_ids: list[int]
    rollout_ids: list[int]
    adv: list[float]
    old_logp: list[torch.Tensor] | None = None

    @property
    def seq_lens(self) -> list[int]:
        return [len(t) for t in self.tokens]

    @property
    def loss_tokens(self) -> list[int]:
        return [int(m.sum()) for m in self.masks]


def make_dataset(name: str, seed: int = 0) -> Dataset:
    """``grpo``: 6 prompts × 3 single-turn samples. ``stepwise``: rollouts of 1-3 turns, 1-3
    rollouts per prompt (variable samples per prompt), one turn with no loss tokens."""
    rng = np.random.default_rng(seed)
    if name == "grpo":
        rollouts = [[1]] * 18
        prompt_of = [p for p in range(6) for _ in range(3)]
    elif name == "stepwise":
        turns = [2, 1, 3, 1, 2, 1, 3, 2, 1, 2]
        prompt_of = [0, 0, 1, 2, 2, 2, 3, 4, 4, 5]
        rollouts = [[1] * t for t in turns]
    else:
        raise ValueError(name)
    tokens, masks, pids, rids, adv = [], [], [], [], []
    for r, (turns, p) in enumerate(zip(rollouts, prompt_of)):
        a = float(rng.normal())
        for _ in turns:
            pl, rl = int(rng.integers(1, 6)), int(rng.integers(1, 12))
            tokens.append(torch.as_tensor(rng.integers(0, VOCAB, pl + rl), dtype=torch.int64))
            masks.append(torch.cat([torch.zeros(pl, dtype=torch.bool), torch.ones(rl, dtype=torch.bool)]))
            pids.append(p)
            rids.append(r)
            adv.append(a)
    if name == "stepwise":  # an observation-only turn: no loss tokens
        masks[4] = torch.zeros_like(masks[4])
    return Dataset(name, tokens, masks, pids, rids, adv)


def attach_old_logp(ds: Dataset, model: torch.nn.Module, seed: int = 1) -> Dataset:
    """old log-probs = current log-probs + N(0, 0.3) noise, so some PPO ratios leave [0.8, 1.2]."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lps = padded_logprobs(model, ds.tokens)
    ds.old_logp = [lp + 0.3 * torch.randn(lp.shape, generator=g, dtype=lp.dtype) for lp in ds.old_logp or lps]
    return ds


def reference_objective(mode: str, token_losses: dict[int, torch.Tensor], ds: Dataset, samples: list[int],
                        norm_constant: float | None = None) -> torch.Tensor:
    """J of DESIGN.md for the step's samples, straight from the table (token_losses[i]: loss tokens only)."""
    S = len(samples)
    tot = {i: token_losses[i].sum() for i in samples}
    n = {i: int(token_losses[i].numel()) for i in samples}
    if mode == "token-mean":
        return sum(tot.values()) / sum(n.values())
    if mode == "token-sum":
        return sum(tot.values())
    if mode == "seq-mean-token-sum":
        return sum(tot.values()) / S
    if mode == "seq-mean-token-mean":
        return sum(tot[i] / n[i] for i in samples if n[i] > 0) / S
    if mode == "seq-mean-token-sum-norm":
        return sum(tot.values()) / (S * norm_constant)
    if mode in ("prompt-mean", "rollout-mean"):
        key = ds.prompt_ids if mode == "prompt-mean" else ds.rollout_ids
        groups: dict[int, list[int]] = {}
        for i in samples:
            groups.setdefault(key[i], []).append(i)
        terms = [sum(tot[i] for i in g) / sum(n[i] for i in g) for g in groups.values() if sum(n[i] for i in g) > 0]
        return sum(terms) / len(groups)
    raise ValueError(mode)


def reference_grad(model: torch.nn.Module, ds: Dataset, samples: list[int], mode: str, loss_kind: str,
                   norm_constant: float | None = None) -> torch.Tensor:
    """∇J on one process: one padded forward over the step's samples, J from the table, backward."""
    model.zero_grad(set_to_none=True)
    lps = padded_logprobs(model, [ds.tokens[i] for i in samples])
    losses = {}
    for i, lp in zip(samples, lps):
        m = ds.masks[i]
        losses[i] = per_token_loss(lp[m], ds.old_logp[i][m], torch.tensor(ds.adv[i], dtype=lp.dtype), loss_kind)
    reference_objective(mode, losses, ds, samples, norm_constant).backward()
    return flat_grad(model)
