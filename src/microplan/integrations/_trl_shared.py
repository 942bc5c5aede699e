"""GRPOTrainer's per-token log-probs from prefix-tree rows: every shared prompt token computed once.

Design note. Every model pass of ``GRPOTrainer`` — the training forward in ``_compute_loss`` and
the old / reference log-prob passes in ``_generate_and_score_completions`` — goes through ONE
method, ``_get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
batch_size=None, compute_entropy=False, ...)`` returning ``[B, logits_to_keep]`` log-probs (and
entropies) of the completion columns. :func:`per_token_logps` has that contract:

1. each row's real tokens are its attention-mask run (left-padded prompt + right-padded
   completion); ``microplan.find_shared_prefixes`` finds the shared prompts (and completions that
   begin alike), and the rows become micro-batches holding their prefix trie: the training
   forward one micro-batch (the chunk TRL gives it), the no-grad passes micro-batches planned by
   ``microplan.plan_forward`` with ``share_prefixes=True`` under TRL's own padded footprint per
   forward (``batch_size`` × width tokens);
2. ``microplan.torch.pack_micro`` lays each trie out in one row; the model runs it with
   ``register_attention()``'s attention, which ``install`` sets on the policy and reference
   models (generation runs under the models' own attention: :func:`attention` around it); a forward hook on the backbone gathers,
   for every (row, completion token), the hidden state of the token that predicts it (the branch
   point's for a first completion token) — so TRL's own fused LM head (temperature, logit scale,
   softcapping, fp32 cast) scores exactly the ``(hidden, label)`` pairs the padded batch scores;
3. the results are scattered back to ``[B, logits_to_keep]`` (0 at padding, which TRL masks).

Exactness: a causal LM's outputs at a token depend only on the tokens before it, so the tree
gives each (row, token) the padded batch's log-prob; positions differ from TRL's by the row's
left padding (the same for all rows of one prompt), which rotary embeddings do not see beyond
rounding. Falls back to TRL's method for multimodal inputs, an aux loss, or a row whose mask is
not one run after a non-empty prompt. Trade-off: the no-grad passes pack by unique tokens under
TRL's padded footprint, so they run fewer, fuller forwards; the per-segment attention costs one
kernel call per tree segment and layer (docs/prefix.md), small next to the GEMMs it saves.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from ..batch import Batch
from ..config import PlanConfig
from ..cost.models import TokenCost
from ..forward import plan_forward
from ..prefix import find_shared_prefixes, micro_tree
from ..types import Micro

__all__ = ["per_token_logps", "backbone_of", "attention"]

_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
               "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def per_token_logps(trainer: Any, original: Any, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    logits_to_keep: int, batch_size: int | None = None, compute_entropy: bool = False,
                    compute_aux_loss: bool = False, **multimodal: Any) -> tuple[Any, Any, Any]:
    """``GRPOTrainer._get_per_token_logps_and_entropies`` on prefix-tree rows (module note)."""
    spans = _spans(attention_mask, input_ids.shape[1] - int(logits_to_keep))
    if compute_aux_loss or any(multimodal.get(k) is not None for k in _MULTIMODAL) or spans is None:
        return original(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                        compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
    a, b, plen = spans
    B, W = input_ids.shape
    C = int(logits_to_keep)
    host = input_ids.cpu()
    tokens = [host[i, a[i]:b[i]] for i in range(B)]
    parent, shared = find_shared_prefixes(tokens)
    lens = (b - a).astype(np.int64)
    batch = Batch(lens, prompt_lens=plen, prefix_parent=parent, shared_prefix_lens=shared)
    if batch_size is None:  # the training forward: TRL's chunk is one micro-batch
        members = np.arange(B, dtype=np.int64)
        micros = [Micro(members, lens, lens - plen, np.zeros(B), tree=micro_tree(parent, shared, lens, members))]
    else:  # no-grad passes: tries under TRL's padded footprint per forward
        cap = max(int(batch_size) * W, int(lens.max()))
        fwd = plan_forward(batch, PlanConfig(dp_size=1, max_tokens_per_micro=cap, share_prefixes=True, cost=TokenCost()))
        micros = [m for step in fwd.steps for m in step.micros[0] if not m.is_placeholder]
    device = input_ids.device
    logps = entropy = None
    parts = [_run_micro(trainer, model, micro, tokens, a, plen, W - C, device, compute_entropy) for micro in micros]
    rows = torch.cat([p[0] for p in parts]).to(device)
    cols = torch.cat([p[1] for p in parts]).to(device)
    lp = torch.cat([p[2] for p in parts])
    logps = lp.new_zeros(B, C).index_put((rows, cols), lp)
    if compute_entropy:
        ent = torch.cat([p[3] for p in parts])
        entropy = ent.new_zeros(B, C).index_put((rows, cols), ent)
    return logps, entropy, None


def _spans(attention_mask: torch.Tensor, prompt_width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Each row's real-token run ``[a, b)`` and prompt length, or None when some row is not one run
    that starts inside the prompt columns (TRL's method handles such rows)."""
    m = attention_mask.detach().cpu().numpy() != 0
    W = m.shape[1]
    col = np.arange(W)
    a = np.where(m, col, W).min(axis=1)
    b = np.where(m, col, -1).max(axis=1) + 1
    if not (b - a == m.sum(axis=1)).all() or (a >= prompt_width).any():
        return None
    return a.astype(np.int64), b.astype(np.int64), (prompt_width - a).astype(np.int64)


def _run_micro(trainer: Any, model: Any, micro: Micro, tokens: list[torch.Tensor], a: np.ndarray, plen: np.ndarray,
               prompt_width: int, device: torch.device, compute_entropy: bool) -> tuple[torch.Tensor, ...]:
    """One trie through the model and TRL's fused head: (rows, cols, log-probs, entropies) of its completion tokens."""
    from ..torch import pack_micro
    packed = pack_micro(micro, tokens)
    pred, labels, out_rows, out_cols = [], [], [], []
    for k, i in enumerate(micro.indices.tolist()):
        r = packed.tree.sample_rows[k]
        t = torch.arange(int(plen[i]), r.numel())          # completion tokens of sample i (positions in it)
        pred.append(r[t - 1])
        labels.append(tokens[i][t])
        out_rows.append(torch.full_like(t, i))
        out_cols.append(t + int(a[i]) - prompt_width)
    pred_rows, lab = torch.cat(pred).to(device), torch.cat(labels).to(device)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in packed.model_inputs().items()}
    with _gather_hidden(model, pred_rows), trainer.accelerator.autocast():
        out = model(**inputs, shift_labels=lab[None], fused_lm_head=True)
    lp = out.log_probs[0]
    ent = out.entropy[0] if compute_entropy else None
    return torch.cat(out_rows), torch.cat(out_cols), lp, ent


def backbone_of(model: Any) -> torch.nn.Module:
    """The module TRL's fused head calls for hidden states (``base_model`` of the patched model)."""
    m = model
    while hasattr(m, "module") and isinstance(getattr(m, "module"), torch.nn.Module):  # DDP / accelerate wrappers
        m = m.module
    if hasattr(m, "get_base_model"):  # PEFT: TRL patches the base model
        m = m.get_base_model()
    return m.base_model


@contextmanager
def attention(models: Any, names: list[str]):
    """Each model's backbone runs its ``names`` entry inside, the attention it had after."""
    before = [backbone_of(m).config._attn_implementation for m in models]
    for m, name in zip(models, names):
        backbone_of(m).set_attn_implementation(name)
    try:
        yield
    finally:
        for m, name in zip(models, before):
            backbone_of(m).set_attn_implementation(name)


@contextmanager
def _gather_hidden(model: Any, rows: torch.Tensor):
    """While active, the backbone returns only the hidden states at ``rows`` (the predicting tokens)."""
    def hook(_module: Any, _args: Any, output: Any) -> Any:
        output.last_hidden_state = output.last_hidden_state.index_select(1, rows)
        return output
    handle = backbone_of(model).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
