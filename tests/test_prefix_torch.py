"""Prefix-shared micro-batches on a real model: exact J and gradients, tree attention, bad tokens.

A float64 transformers Llama (tests/_tiny_model.py) runs through ``register_attention()``. For
GRPO groups (some responses beginning alike), append-only step-wise trajectories and trajectories
whose history is edited, a plan with ``share_prefixes=True`` at dp 2 packs each shared token once;
per-sample losses (PPO with per-sample advantages and old log-probs, or -A·logp) are written in
the per-sample layout (``PackedMicro.expand`` / ``pack_values``) and weighed by ``weighted_loss``.
The gradients accumulated over both ranks (averaged as DDP does) must equal the per-sample
reference ∇J of DESIGN.md within 1e-12 relative (float64 throughout, RMSNorm included: roundoff
is ~1e-15), for all 7 loss modes — plain sharing and sharing composed with local placement,
padding multiples (each tree segment padded) and the row multiple.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import microplan as mp
from microplan.torch import pack_micro, pack_values, register_attention, token_logprobs, weighted_loss

from _tiny_model import (VOCAB, Dataset, attach_old_logp, flat_grad, make_model, per_token_loss, reference_grad,
                         reference_objective)

NORM_H = 16.0


def _dataset(kind: str, seed: int = 0) -> Dataset:
    """Token sequences whose prefixes really repeat (loss masks on each sample's own response)."""
    rng = np.random.default_rng(seed)
    tok = lambda n: torch.as_tensor(rng.integers(0, VOCAB, n), dtype=torch.int64)  # noqa: E731
    tokens, masks, pids, rids, adv = [], [], [], [], []

    def add(t: torch.Tensor, loss_from: int, p: int, r: int, a: float) -> None:
        tokens.append(t)
        m = torch.zeros(len(t), dtype=torch.bool)
        m[loss_from:] = True
        masks.append(m)
        pids.append(p)
        rids.append(r)
        adv.append(a)

    if kind == "grpo":  # 4 prompts × 3 responses; the 3rd response often begins like the 1st
        r = 0
        for p in range(4):
            prompt = tok(int(rng.integers(4, 9)))
            first = None
            for j in range(3):
                resp = tok(int(rng.integers(2, 8)))
                if j == 2 and first is not None and rng.random() < 0.75:
                    resp = torch.cat([first[:3], resp])  # begins alike: shared loss tokens
                first = resp if j == 0 else first
                add(torch.cat([prompt, resp]), len(prompt), p, r, float(rng.normal()))
                r += 1
    else:  # step-wise: each turn continues the previous one (edited: keeps only part of it)
        r = 0
        for p in range(3):
            for _ in range(2):
                history = tok(int(rng.integers(3, 6)))
                a = float(rng.normal())
                for _ in range(int(rng.integers(2, 4))):
                    if kind == "edited" and len(tokens) and rids[-1] == r and rng.random() < 0.6:
                        history = history[: max(1, len(history) // 2)]     # the history was summarised
                    obs, resp = tok(int(rng.integers(1, 3))), tok(int(rng.integers(2, 5)))
                    seq = torch.cat([history, obs, resp])
                    add(seq, len(seq) - len(resp), p, r, a)
                    history = seq
                r += 1
    return Dataset(kind, tokens, masks, pids, rids, adv)


def _batch(ds: Dataset, rank_of: np.ndarray | None = None) -> mp.Batch:
    parent, shared = mp.find_shared_prefixes(ds.tokens)
    return mp.Batch(ds.seq_lens, loss_tokens=ds.loss_tokens, prompt_ids=ds.prompt_ids, rollout_ids=ds.rollout_ids,
                    prefix_parent=parent, shared_prefix_lens=shared, rank_of=rank_of)


#: options composed with share_prefixes (issue "every option composes"); "local" pins samples to
#: uneven owner ranks, so a group's samples sit on both ranks and share only what is local
COMPOSITIONS = {
    "share": {},
    "local+pad4": {"placement": "local", "pad_to_multiple_of": 4},
    "row8": {"pad_row_to_multiple_of": 8},
    "local+pad2+row8+pipeline": {"placement": "local", "pad_to_multiple_of": 2, "pad_row_to_multiple_of": 8,
                                 "pipeline_stages": 2},
    # runs padded to 4, rows to 16: a GRPO row is laid out flat where its padded trie would cost more
    "pad4+row16": {"pad_to_multiple_of": 4, "pad_row_to_multiple_of": 16},
}


@pytest.fixture(scope="module")
def model():
    return make_model(3, attn=register_attention(), max_positions=128)


@pytest.mark.parametrize("kind,loss_kind,comp", [
    (k, lk, "share") for k in ("grpo", "stepwise", "edited") for lk in ("ppo", "pg")] + [
    (k, "ppo", c) for k in ("grpo", "stepwise", "edited") for c in COMPOSITIONS if c != "share"
    and (k, c) != ("stepwise", "pad4+row16")])   # a step-wise sample padded to 32 exceeds the test's cap
def test_tree_packed_gradients_are_exact(model, kind, loss_kind, comp):
    ds = attach_old_logp(_dataset(kind), model)
    opts = COMPOSITIONS[comp]
    dp = 2
    rank_of = np.random.default_rng(5).integers(0, dp, len(ds.tokens)) if opts.get("placement") == "local" else None
    batch = _batch(ds, rank_of)
    for mode in mp.LOSS_MODES:
        loss = mp.Loss(mode, norm_constant=NORM_H if mode == "seq-mean-token-sum-norm" else None)
        # step-wise: a cap under a trajectory's trie, so trees are cut into parts that re-share the root path
        cap = 40 if kind == "grpo" else max(ds.seq_lens) + 8
        cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, share_prefixes=True, loss=loss,
                            steps=mp.Steps(prompts_per_step=2), **opts)
        plan = mp.plan(batch, cfg)
        plan.validate()
        if not opts:
            assert plan.stats.tokens_with_sharing < plan.stats.tokens_without_sharing
        if comp == "pad4+row16" and mode == mp.LOSS_MODES[0]:   # both row layouts are exercised
            from microplan.prefix import micro_tree
            kinds = {micro_tree(batch.prefix_parent, batch.shared_prefix_lens, batch.seq_lens, m.indices) == m.tree
                     for st_ in plan.steps for row in st_.micros for m in row if m.indices.size > 1}
            assert kinds == {True, False} or kind != "grpo", kinds
        for s, step in enumerate(plan.steps):
            model.zero_grad(set_to_none=True)
            J = torch.zeros((), dtype=torch.float64)
            for r in range(dp):
                for micro in step.micros[r]:
                    if rank_of is not None:
                        assert (rank_of[micro.indices] == r).all()   # local placement: samples stay home
                    p = pack_micro(micro, ds.tokens, loss_masks=ds.masks)
                    assert micro.is_placeholder or p.num_tokens == micro.num_tokens <= cap  # the cap counts what is packed
                    logits = model(**p.model_inputs(), use_cache=False).logits
                    lp = p.expand(token_logprobs(logits, p)) if not p.is_placeholder else token_logprobs(logits, p)
                    old = pack_values(p, {i: ds.old_logp[i] for i in range(len(ds.tokens))})
                    adv = pack_values(p, {i: ds.adv[i] for i in range(len(ds.tokens))}, dtype=torch.float64)
                    ell = per_token_loss(lp, old.to(lp.dtype), adv.to(lp.dtype), loss_kind)
                    # ell is in the per-sample layout (expand); said explicitly, as a row whose token count
                    # equals its samples' (pads making up for shared tokens) cannot be told apart
                    L = weighted_loss(ell, p, per_sample=p.tree is not None)
                    L.backward()
                    J = J + L.detach()
            got = flat_grad(model) / dp                        # DDP averages the dp ranks' gradients
            samples = step.samples.tolist()
            want = reference_grad(model, ds, samples, mode, loss_kind, NORM_H)
            err = float((got - want).norm() / want.norm())
            assert err < 1e-12, f"{kind}/{loss_kind}/{comp}/{mode} step {s}: relative gradient error {err:.2e}"
            with torch.no_grad():  # J itself (the per-rank sums averaged over W)
                from _tiny_model import padded_logprobs
                lps = padded_logprobs(model, [ds.tokens[i] for i in samples])
                losses = {i: per_token_loss(l[ds.masks[i]], ds.old_logp[i][ds.masks[i]],
                                            torch.tensor(ds.adv[i], dtype=l.dtype), loss_kind)
                          for i, l in zip(samples, lps)}
                ref_J = reference_objective(mode, losses, ds, samples, NORM_H)
            assert abs(float(J / dp - ref_J)) <= 1e-12 * max(1.0, abs(float(ref_J)))


def test_shared_tokens_are_computed_once_and_node_losses_sum_scales(model):
    """A plain NLL depends only on the token: one loss per row token (shared ones weighted by the
    summed scales) gives the same value as the per-sample layout."""
    ds = _dataset("grpo", seed=4)
    batch = _batch(ds)
    plan = mp.plan(batch, mp.PlanConfig(dp_size=1, max_tokens_per_micro=200, share_prefixes=True,
                                        loss=mp.Loss("seq-mean-token-mean")))
    micro = plan.steps[0].micros[0][0]
    p = pack_micro(micro, ds.tokens, loss_masks=ds.masks)
    assert p.num_tokens == micro.num_tokens < sum(ds.seq_lens)
    with torch.no_grad():
        lp = token_logprobs(model(**p.model_inputs(), use_cache=False).logits, p)
    node = weighted_loss(-lp, p, per_sample=False)
    per_sample = weighted_loss(-p.expand(lp), p, per_sample=True)
    assert torch.allclose(node, per_sample, rtol=1e-12, atol=0)
    # each sample's view of the row is its own sequence, in order
    for i, view in zip(p.sample_indices.tolist(), p.split(p.input_ids)):
        assert torch.equal(view, ds.tokens[i])


def test_tokens_that_disagree_with_the_declared_prefix_are_refused():
    toks = [torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 9, 9])]
    batch = mp.Batch([4, 4], prefix_parent=[-1, 0], shared_prefix_lens=[0, 3])   # claims 3 shared, only 2 are
    micro = mp.plan(batch, mp.PlanConfig(dp_size=1, max_tokens_per_micro=16, share_prefixes=True)).steps[0].micros[0][0]
    with pytest.raises(mp.PlanError, match="sample 1: token 2 is 9.*find_shared_prefixes"):
        pack_micro(micro, toks)


def test_logit_aligned_helpers_refuse_trees():
    from microplan.torch import next_token_labels
    toks = [torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4])]
    p, s = mp.find_shared_prefixes(toks)
    batch = mp.Batch([3, 3], prefix_parent=p, shared_prefix_lens=s)
    micro = mp.plan(batch, mp.PlanConfig(dp_size=1, max_tokens_per_micro=16, share_prefixes=True)).steps[0].micros[0][0]
    packed = pack_micro(micro, toks)
    with pytest.raises(mp.PlanError, match="label aligned"):
        next_token_labels(packed)
    with pytest.raises(mp.PlanError):
        weighted_loss(torch.zeros(packed.num_tokens, dtype=torch.float64), packed, aligned="logit")
