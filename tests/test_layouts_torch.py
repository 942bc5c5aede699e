"""microplan.torch for padded layouts and pad-to-multiple rules: structure by hand, then exact
gradients on the tiny float64 model against the per-sample reference (tests/_tiny_model.py).

Every case plans a real RL batch (GRPO groups; step-wise rollouts with a no-loss turn), packs
each micro-batch of every rank with ``pack_micro`` (varlen rows with pads inside sequences and a
trailing pad sequence, or ``[n, W]`` padded batches, 1D and prompt/response 2D), runs the model,
backwards ``weighted_loss`` and compares the summed, rank-averaged gradient with ∇J computed
sample by sample from the DESIGN.md table. The naive per-micro token mean is checked to be
wrong on the same data, so the assertions can fail.
"""

from __future__ import annotations

import pytest
import torch

import microplan as mp
from microplan import PlanError
from microplan.torch import (PaddedMicro, next_token_labels, next_token_weights, pack_micro, pack_values,
                             restore_order, token_logprobs, weighted_loss)

from _exactness import one_thread
from _tiny_model import attach_old_logp, flat_grad, make_dataset, make_model, per_token_loss, reference_grad

TOL = 1e-10


def _plan(lens, cfg_kw, prompt_lens=None):
    b = mp.Batch(lens, prompt_lens=prompt_lens)
    return b, mp.plan(b, mp.PlanConfig(**cfg_kw))


# -- varlen rows with pad-to-multiple padding -------------------------------------------------

def test_varlen_padding_inside_sequences_and_a_trailing_pad_sequence():
    toks = [torch.arange(10, 10 + n) for n in (5, 3)]
    micro = mp.plan(mp.Batch([5, 3]), mp.PlanConfig(dp_size=1, max_tokens_per_micro=32, pad_to_multiple_of=4,
                                                    pad_row_to_multiple_of=6)).steps[0].micros[0][0]
    p = pack_micro(micro, toks, pad_token_id=0)
    # sample 0: 5 -> 8, sample 1: 3 -> 4; row 12 is a multiple of 6: no pad sequence
    assert p.seq_lens == (8, 4) and p.sample_lens == (5, 3) and p.row_pad == 0 and p.num_tokens == micro.num_tokens == 12
    assert p.input_ids.tolist() == [10, 11, 12, 13, 14, 0, 0, 0, 10, 11, 12, 0]
    assert p.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    assert p.cu_seqlens.tolist() == [0, 8, 12] and p.cu_seqlens_unpadded.tolist() == [0, 5, 8]
    assert p.loss_mask.tolist() == [False] + [True] * 4 + [False] * 3 + [False, True, True, False]
    micro = mp.plan(mp.Batch([5, 3]), mp.PlanConfig(dp_size=1, max_tokens_per_micro=32, pad_to_multiple_of=4,
                                                    pad_row_to_multiple_of=16)).steps[0].micros[0][0]
    q = pack_micro(micro, toks)
    assert q.seq_lens == (8, 4, 4) and q.row_pad == 4 and q.num_tokens == micro.num_tokens == 16
    assert q.cu_seqlens.tolist() == [0, 8, 12, 16] and q.position_ids[-4:].tolist() == [0, 1, 2, 3]
    assert q.max_seqlen == 8 and q.num_samples == 2
    assert [t.tolist() for t in q.split(q.input_ids)] == [toks[0].tolist(), toks[1].tolist()]
    assert pack_values(q, [1.0, 2.0], fill=-1).tolist() == [1.0] * 5 + [-1.0] * 3 + [2.0] * 3 + [-1.0] * 5
    # restore_order splits by real lengths, leaving padding out
    back = restore_order([q], [q.input_ids.double()])
    assert [v.tolist() for v in back.values] == [toks[0].double().tolist(), toks[1].double().tolist()]


@pytest.mark.parametrize("change, match", [
    (dict(sample_lens=(3, 3)), "padded to the next multiple"),       # a sample padded more than needed
    (dict(row_pad=0), "2 entries for 3 samples"),                    # the pad sequence taken for a sample
    (dict(pad_row_to_multiple_of=32), "multiple of"),               # row not a multiple of the rule
])
def test_packed_validate_checks_the_padding_convention(change, match):
    micro = mp.plan(mp.Batch([5, 3]), mp.PlanConfig(dp_size=1, max_tokens_per_micro=32, pad_to_multiple_of=4,
                                                    pad_row_to_multiple_of=16)).steps[0].micros[0][0]
    p = pack_micro(micro, [torch.arange(5), torch.arange(3)])
    p.validate()
    from dataclasses import replace
    with pytest.raises(PlanError, match=match):
        replace(p, **change).validate()
    bad_mask = p.loss_mask.clone()
    bad_mask[6] = True  # a pad of sample 0
    with pytest.raises(PlanError, match="pad"):
        replace(p, loss_mask=bad_mask).validate()


def test_placeholder_is_padded_like_a_row():
    cfg = mp.PlanConfig(dp_size=2, max_tokens_per_micro=32, pad_to_multiple_of=4, pad_row_to_multiple_of=8)
    plan = mp.plan(mp.Batch([5]), cfg)
    ph = next(m for r in plan.steps[0].micros for m in r if m.is_placeholder)
    p = pack_micro(ph, [])
    assert p.is_placeholder and p.num_tokens == 8 and p.cu_seqlens.tolist() == [0, 8] and p.num_samples == 0
    assert float(p.loss_weights.abs().sum()) == 0.0
    padded = mp.plan(mp.Batch([5]), mp.PlanConfig(dp_size=2, max_tokens_per_micro=32, layout="padded",
                                                  pad_to_multiple_of=4))
    ph = next(m for r in padded.steps[0].micros for m in r if m.is_placeholder)
    q = pack_micro(ph, [])
    assert isinstance(q, PaddedMicro) and q.token_shape == (1, 4) and q.num_samples == 0
    assert q.attention_mask.tolist() == [[1, 0, 0, 0]]


# -- padded [n, W] micro-batches --------------------------------------------------------------

def test_padded_micro_right_pads_rows():
    toks = [torch.arange(10, 10 + n) for n in (5, 3)]
    b, plan = _plan([5, 3], dict(dp_size=1, max_tokens_per_micro=64, layout="padded", pad_to_multiple_of=4,
                                 cost=mp.TokenCost(per_micro=100.0)))
    micro = plan.steps[0].micros[0][0]
    p = pack_micro(micro, toks, pad_token_id=0)
    assert isinstance(p, PaddedMicro) and p.token_shape == (2, 8) and p.num_tokens == micro.num_tokens == 16
    row = {int(i): j for j, i in enumerate(p.sample_indices.tolist())}
    assert p.input_ids[row[0]].tolist() == [10, 11, 12, 13, 14, 0, 0, 0]
    assert p.attention_mask[row[1]].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert p.position_ids[row[0]].tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert p.loss_mask[row[0]].tolist() == [False, True, True, True, True, False, False, False]
    assert set(p.model_inputs()) == {"input_ids", "attention_mask", "position_ids"}
    assert [t.tolist() for t in p.split(p.input_ids)] == [toks[i].tolist() for i in p.sample_indices.tolist()]
    assert pack_values(p, [1.0, 2.0]).shape == (2, 8)


def test_padded_2d_left_pads_prompts_and_right_pads_responses():
    # sample 0: prompt 4 + response 1; sample 1: prompt 1 + response 4 -> width 4 + 4 = 8
    toks = [torch.tensor([1, 2, 3, 4, 5]), torch.tensor([6, 7, 8, 9, 10])]
    b, plan = _plan([5, 5], dict(dp_size=1, max_tokens_per_micro=64, layout="padded-2d",
                                 cost=mp.TokenCost(per_micro=100.0)), prompt_lens=[4, 1])
    micro = plan.steps[0].micros[0][0]
    p = pack_micro(micro, toks, pad_token_id=0)
    assert p.token_shape == (2, 8) and micro.num_tokens == 16
    row = {int(i): j for j, i in enumerate(p.sample_indices.tolist())}
    assert p.input_ids[row[0]].tolist() == [1, 2, 3, 4, 5, 0, 0, 0]   # prompt ends at column 4
    assert p.input_ids[row[1]].tolist() == [0, 0, 0, 6, 7, 8, 9, 10]  # prompt left-padded to 4
    assert p.offsets[row[1]] == 3 and p.position_ids[row[1]].tolist() == [0, 0, 0, 0, 1, 2, 3, 4]
    assert p.loss_mask[row[1]].tolist() == [False] * 4 + [True] * 4      # response = loss tokens
    assert p.loss_mask[row[0]].tolist() == [False] * 4 + [True] + [False] * 3


def test_padded_loss_helpers_are_row_aligned():
    b, plan = _plan([4, 2], dict(dp_size=1, max_tokens_per_micro=64, layout="padded", cost=mp.TokenCost(per_micro=9.0)))
    p = pack_micro(plan.steps[0].micros[0][0], [torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6])])
    logits = torch.randn(2, 4, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    lp = token_logprobs(logits, p)
    j = {int(i): r for r, i in enumerate(p.sample_indices.tolist())}
    ls = logits.log_softmax(-1).tolist()
    assert lp[j[0]].tolist() == pytest.approx([0.0, ls[j[0]][0][2], ls[j[0]][1][3], ls[j[0]][2][4]], abs=1e-14)
    assert lp[j[1]].tolist() == pytest.approx([0.0, ls[j[1]][0][6], 0.0, 0.0], abs=1e-14)  # pads: 0
    labels = next_token_labels(p)
    assert labels[j[1]].tolist() == [6, -100, -100, -100]
    w = next_token_weights(p)
    assert w[j[1]].tolist() == [p.loss_weights[j[1], 1].item(), 0, 0, 0]
    ell = torch.randn(2, 4, dtype=torch.float64)
    assert torch.allclose(weighted_loss(ell, p), (ell * p.loss_weights).sum())
    assert torch.allclose(weighted_loss(ell, p, aligned="logit"), (ell * w).sum())
    with pytest.raises(PlanError, match=r"\[n, W\]"):
        weighted_loss(ell.reshape(-1), p)


def test_padded_validate_catches_broken_layouts():
    from dataclasses import replace
    b, plan = _plan([4, 2], dict(dp_size=1, max_tokens_per_micro=64, layout="padded", cost=mp.TokenCost(per_micro=9.0)))
    p = pack_micro(plan.steps[0].micros[0][0], [torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6])])
    p.validate()
    bad = p.attention_mask.clone()
    bad[:, -1] = 1
    with pytest.raises(PlanError, match="attention_mask"):
        replace(p, attention_mask=bad).validate()
    m = p.loss_mask.clone()
    m[:, 0] = True
    with pytest.raises(PlanError, match="first token"):
        replace(p, loss_mask=m).validate()
    with pytest.raises(PlanError, match="multiple"):
        replace(p, width_multiple=3).validate()


# -- exact gradients --------------------------------------------------------------------------

LAYOUTS = {
    "varlen-pad4-row8": dict(max_tokens_per_micro=40, pad_to_multiple_of=4, pad_row_to_multiple_of=8),
    "varlen-pad16": dict(max_tokens_per_micro=64, pad_to_multiple_of=16),
    "padded": dict(max_tokens_per_micro=48, layout="padded"),
    "padded-m8": dict(max_tokens_per_micro=64, layout="padded", pad_to_multiple_of=8),
    "padded-2d": dict(max_tokens_per_micro=64, layout="padded-2d", pad_to_multiple_of=2),
    "padded-static": dict(micro_batch_size=3, layout="padded"),
}
MODES = ("token-mean", "seq-mean-token-mean", "prompt-mean")


@pytest.fixture(scope="module")
def model_and_data():
    with one_thread():
        model = make_model(0)
        data = {name: attach_old_logp(make_dataset(name, seed=k), model) for k, name in enumerate(("grpo", "stepwise"))}
    return model, data


def _batch(ds) -> mp.Batch:
    plens = [len(t) - int(m.sum()) for t, m in zip(ds.tokens, ds.masks)]  # masks: prompt then response
    return mp.Batch(ds.seq_lens, loss_tokens=ds.loss_tokens, prompt_lens=plens, prompt_ids=ds.prompt_ids,
                    rollout_ids=ds.rollout_ids)


def _plan_grads(model, ds, plan, kind):
    """Per step: Σ over ranks and micro-batches of ∇ weighted_loss, ÷ W (DDP mean)."""
    W = plan.config.grad_world
    out = []
    for step in plan.steps:
        model.zero_grad(set_to_none=True)
        for row in step.micros:
            for micro in row:
                p = pack_micro(micro, ds.tokens, loss_masks=ds.masks)
                p.validate()
                assert p.num_tokens == max(micro.num_tokens, 1) or micro.is_placeholder
                extra = {} if isinstance(p, PaddedMicro) else {"attention_mask": None}
                logits = model(**p.model_inputs(), **extra, use_cache=False).logits
                logp = token_logprobs(logits, p)
                ell = per_token_loss(logp, pack_values(p, ds.old_logp), pack_values(p, ds.adv), kind)
                (weighted_loss(ell, p) / W).backward()
        out.append((step.samples.tolist(), flat_grad(model).clone()))
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dname", ["grpo", "stepwise"])
def test_gradients_equal_the_per_sample_reference(model_and_data, layout, dname):
    model, data = model_and_data
    ds = data[dname]
    worst = 0.0
    with one_thread():
        for mode in MODES:
            for kind in ("ppo", "pg"):
                # a per-micro cost makes the planner group samples (and pad them) rather than run each alone
                plan = mp.plan(_batch(ds), mp.PlanConfig(dp_size=2, loss=mp.Loss(mode), steps=mp.Steps(prompts_per_step=3),
                                                         cost=mp.TokenCost(per_micro=32.0), **LAYOUTS[layout]))
                plan.validate()
                for samples, got in _plan_grads(model, ds, plan, kind):
                    ref = reference_grad(model, ds, samples, mode, kind)
                    err = float((got - ref).norm() / ref.norm())
                    worst = max(worst, err)
                    assert err < TOL, f"{layout} {dname} {mode} {kind} step {samples}: rel err {err:.2e}"
    padded = sum(m.num_tokens for s in plan.steps for r in s.micros for m in r)
    assert padded > sum(ds.seq_lens) or layout == "padded-static"  # the layout really padded something


def test_naive_per_micro_mean_is_wrong_in_a_padded_layout(model_and_data):
    """The same forwards with each micro-batch's own token mean (÷K) miss ∇J: the test above can fail."""
    model, data = model_and_data
    ds = data["stepwise"]
    with one_thread():
        plan = mp.plan(_batch(ds), mp.PlanConfig(dp_size=1, max_tokens_per_micro=48, layout="padded",
                                                 steps=mp.Steps(prompts_per_step=6)))
        step = plan.steps[0]
        K = step.micro_count
        assert K > 1
        model.zero_grad(set_to_none=True)
        for micro in step.micros[0]:
            p = pack_micro(micro, ds.tokens, loss_masks=ds.masks)
            logp = token_logprobs(model(**p.model_inputs(), use_cache=False).logits, p)
            ell = per_token_loss(logp, pack_values(p, ds.old_logp), pack_values(p, ds.adv), "pg")
            ((ell * p.loss_mask).sum() / p.loss_mask.sum().clamp(min=1) / K).backward()
        naive = flat_grad(model).clone()
        ref = reference_grad(model, ds, step.samples.tolist(), "token-mean", "pg")
        assert float((naive - ref).norm() / ref.norm()) > 1e-3
