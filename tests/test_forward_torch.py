"""The forward pass end to end with a real (tiny, random) transformers model on CPU.

The contract tested: ``plan_forward(batch, cfg, like=train_plan)`` + ``forward_logprobs`` gives
per-token log-probs BIT-identical to those the training forward computes on its micro-batches
(same packed rows, same kernels), ready to pack into the training micro-batches with
``pack_values``; a forward plan of its own geometry agrees to float rounding; chunked log-probs
agree with the full-logits recipe in value and gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import microplan as mp
from _tiny_model import make_dataset, make_model
from microplan.torch import (chunked_token_logprobs, forward_logprobs, pack_micro, pack_values, run_forward,
                             token_logprobs, weighted_loss)


def _batch(ds) -> mp.Batch:
    return mp.Batch(ds.seq_lens, loss_tokens=ds.loss_tokens, prompt_ids=ds.prompt_ids, rollout_ids=ds.rollout_ids)


def _training_logprobs(model, plan: mp.Plan, ds) -> dict[int, torch.Tensor]:
    """The training loop's log-probs (grad on, backward run), per sample, as the loss saw them."""
    seen: dict[int, torch.Tensor] = {}
    for r in range(plan.config.dp_size):
        for step in plan.rank(r):
            model.zero_grad(set_to_none=True)
            for micro in step:
                p = pack_micro(micro, ds.tokens, loss_masks=ds.masks)
                lp = token_logprobs(model(**p.model_inputs(), use_cache=False).logits, p)
                weighted_loss(-lp, p).backward()
                seen.update(zip(p.sample_indices.tolist(), (x.detach() for x in p.split(lp))))
    return seen


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name,dp,cap,steps", [("grpo", 2, 24, mp.Steps(num_steps=2)),
                                                ("stepwise", 3, 20, mp.Steps(prompts_per_step=2)),
                                                ("grpo", 8, 40, None)])  # dp=8: placeholders
def test_like_gives_bit_identical_logprobs(dtype, name, dp, cap, steps):
    ds = make_dataset(name, seed=3)
    model = make_model(seed=1, dtype=dtype)
    batch = _batch(ds)
    train = mp.plan(batch, mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, steps=steps))
    want = _training_logprobs(model, train, ds)
    fwd = mp.plan_forward(batch, train.config, like=train)
    for r in range(dp):
        old = forward_logprobs(model, fwd.rank(r), ds.tokens)
        mine = sorted(int(i) for step in train.rank(r) for m in step for i in m.indices)
        assert old.sample_indices.tolist() == mine  # every sample on the rank that trains it
        for i, lp in old.as_dict().items():
            assert lp.dtype == dtype and not lp.requires_grad
            assert torch.equal(lp, want[i]), f"sample {i}: forward and training log-probs differ"
        for step in train.rank(r):  # the old log-probs packed into the training micro-batches
            for micro in step:
                p = pack_micro(micro, ds.tokens, loss_masks=ds.masks)
                packed = pack_values(p, old.as_dict())
                if not p.is_placeholder:
                    assert torch.equal(packed, torch.cat([want[i] for i in p.sample_indices.tolist()]))
    assert sum(len(forward_logprobs(model, fwd.rank(r), ds.tokens)) for r in range(dp)) == len(want)


def test_own_geometry_agrees_to_rounding_and_restores_batch_order():
    ds = make_dataset("stepwise", seed=4)
    model = make_model(seed=2)
    batch = _batch(ds)
    train = mp.plan(batch, mp.PlanConfig(dp_size=2, max_tokens_per_micro=20))
    want = _training_logprobs(model, train, ds)
    fwd = mp.plan_forward(batch, mp.PlanConfig(dp_size=4, max_tokens_per_micro=60))
    assert fwd.steps[0].micro_count < train.steps[0].micro_count
    got: dict[int, torch.Tensor] = {}
    for r in range(4):
        got.update(forward_logprobs(model, fwd.rank(r), ds.tokens).as_dict())
    assert sorted(got) == list(range(batch.num_samples))
    for i in got:
        assert got[i].shape == (ds.seq_lens[i],) and got[i][0] == 0
        torch.testing.assert_close(got[i], want[i], rtol=1e-12, atol=1e-12)


def test_run_forward_takes_a_flat_list_an_order_and_per_sample_outputs():
    ds = make_dataset("grpo", seed=5)
    batch = _batch(ds)
    fwd = mp.plan_forward(batch, mp.PlanConfig(dp_size=4, max_tokens_per_micro=40))
    flat = [m for step in fwd.rank(1) for m in step]
    mine = sorted(int(i) for m in flat for i in m.indices)
    order = mine[::-1]
    lens = run_forward(flat, ds.tokens, lambda p: torch.tensor([float(n) for n in p.seq_lens]), kind="sample",
                       order=order)
    assert lens.sample_indices.tolist() == order
    assert [float(v) for v in lens.values] == [float(ds.seq_lens[i]) for i in order]
    with pytest.raises(mp.PlanError, match="pass the rank's Micro objects"):
        run_forward([1, 2], ds.tokens, lambda p: p.input_ids)


def test_chunked_logprobs_match_full_logits_in_value_and_gradient():
    ds = make_dataset("grpo", seed=6)
    model = make_model(seed=3)
    batch = _batch(ds)
    plan = mp.plan(batch, mp.PlanConfig(dp_size=1, max_tokens_per_micro=80))
    micro = plan.steps[0].micros[0][0]
    p = pack_micro(micro, ds.tokens, loss_masks=ds.masks)
    head = model.get_output_embeddings()

    def losses(chunk):
        model.zero_grad(set_to_none=True)
        hidden = model.get_decoder()(**p.model_inputs(), use_cache=False).last_hidden_state
        if chunk is None:
            lp = token_logprobs(head(hidden), p)
        else:
            lp = chunked_token_logprobs(hidden, head.weight, p, chunk_tokens=chunk)
        weighted_loss(-lp, p).backward()
        return lp.detach(), torch.cat([q.grad.reshape(-1) for q in model.parameters()])

    full_lp, full_g = losses(None)
    for chunk in (1, 7, p.num_tokens, 10 ** 6):
        lp, g = losses(chunk)
        torch.testing.assert_close(lp, full_lp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g, full_g, rtol=1e-10, atol=1e-12)
    # forward_logprobs with chunks equals the logits recipe to rounding
    a = forward_logprobs(model, plan.rank(0), ds.tokens).as_dict()
    b = forward_logprobs(model, plan.rank(0), ds.tokens, chunk_tokens=5).as_dict()
    for i in a:
        torch.testing.assert_close(a[i], b[i], rtol=1e-12, atol=1e-12)


def test_chunked_logprobs_bad_input():
    ds = make_dataset("grpo", seed=7)
    plan = mp.plan(_batch(ds), mp.PlanConfig(dp_size=1, max_tokens_per_micro=80))
    p = pack_micro(plan.steps[0].micros[0][0], ds.tokens)
    h = torch.zeros(p.num_tokens, 16)
    with pytest.raises(mp.PlanError, match="chunk_tokens"):
        chunked_token_logprobs(h, torch.zeros(32, 16), p, chunk_tokens=0)
    with pytest.raises(mp.PlanError, match=r"\[V, H\] with H=16"):
        chunked_token_logprobs(h, torch.zeros(32, 8), p)
    with pytest.raises(mp.PlanError, match="hidden has shape"):
        chunked_token_logprobs(h[:-1], torch.zeros(32, 16), p)


def test_placeholders_run_and_are_dropped():
    ds = make_dataset("grpo", seed=8)
    batch = _batch(ds)
    fwd = mp.plan_forward(batch, mp.PlanConfig(dp_size=24, max_tokens_per_micro=200))  # 18 samples: 6 placeholders
    calls = []

    def run(p):
        calls.append(p.is_placeholder)
        return torch.zeros(p.num_tokens)

    total = 0
    for r in range(24):
        total += len(run_forward(fwd.rank(r), ds.tokens, run))
    assert total == batch.num_samples and sum(calls) == 6 and len(calls) == 24 * fwd.steps[0].micro_count
    assert np.all([len(row) == fwd.steps[0].micro_count for row in fwd.steps[0].micros])


def test_chunked_logprobs_follow_the_tree_on_prefix_shared_rows():
    """In a tree row a branch's first token is predicted by its parent segment's last token: the
    chunked recipe must read the same predecessor as token_logprobs (value and gradient)."""
    toks = [np.arange(10, 22), np.concatenate([np.arange(10, 18), [90, 91, 92, 93, 94]]),
            np.concatenate([np.arange(10, 15), [70, 71, 72]]), np.arange(30, 37)]
    batch = mp.Batch([len(t) for t in toks], prefix_parent=[-1, 0, 0, -1], shared_prefix_lens=[0, 8, 5, 0])
    plan = mp.plan(batch, mp.PlanConfig(dp_size=1, max_tokens_per_micro=64, share_prefixes=True))
    p = pack_micro(plan.steps[0].micros[0][0], toks)
    assert p.tree is not None and p.num_tokens < sum(len(t) for t in toks)
    gen = torch.Generator().manual_seed(0)
    h0 = torch.randn(p.num_tokens, 6, generator=gen, dtype=torch.float64)
    w = torch.randn(120, 6, generator=gen, dtype=torch.float64)

    def run(chunk):
        h = h0.clone().requires_grad_(True)
        lp = token_logprobs(h @ w.T, p) if chunk is None else chunked_token_logprobs(h, w, p, chunk_tokens=chunk)
        lp.sum().backward()
        return lp.detach(), h.grad

    full_lp, full_g = run(None)
    assert (full_lp != 0).sum() == p.num_tokens - 2   # two roots: every other token is predicted
    for chunk in (1, 3, p.num_tokens):
        lp, g = run(chunk)
        torch.testing.assert_close(lp, full_lp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g, full_g, rtol=1e-12, atol=1e-12)
