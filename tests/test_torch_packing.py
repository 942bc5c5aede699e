"""microplan.torch without a model: pack_micro, placeholders, the loss helpers, restore_order."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import microplan as mp
from microplan import PlanError
from microplan.torch import (PackedMicro, next_token_labels, next_token_weights, pack_micro, pack_values,
                             restore_order, token_logprobs, weighted_loss)


def _data(lens, prompt_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    toks = [torch.randint(0, 50, (n,), generator=g) for n in lens]
    return toks, mp.Batch(lens, prompt_lens=prompt_lens)


def _micro(idx, lens, loss_tokens, scale):
    return mp.Micro(idx, lens, loss_tokens, scale)


# -- pack_micro ------------------------------------------------------------------------------------
def test_pack_fields_dtypes_and_default_mask():
    toks, _ = _data([4, 6, 3], [1, 2, 1])
    micro = _micro([2, 0], [3, 4], [2, 3], [0.5, 0.25])
    p = pack_micro(micro, toks)
    assert torch.equal(p.input_ids, torch.cat([toks[2], toks[0]])) and p.input_ids.dtype == torch.int64
    assert p.position_ids.tolist() == [0, 1, 2, 0, 1, 2, 3] and p.position_ids.dtype == torch.int64
    assert p.cu_seqlens.tolist() == [0, 3, 7] and p.cu_seqlens.dtype == torch.int32
    assert p.max_seqlen == 4 and type(p.max_seqlen) is int
    assert p.loss_weights.tolist() == [0, 0.5, 0.5, 0, 0.25, 0.25, 0.25]  # last loss_tokens positions
    assert p.loss_mask.tolist() == [False, True, True, False, True, True, True]
    assert p.sample_indices.tolist() == [2, 0] and p.sample_indices.dtype == torch.int64
    assert p.seq_lens == (3, 4) and p.num_tokens == 7 and p.num_samples == 2 and not p.is_placeholder
    assert p.loss_weights.dtype == torch.float64
    assert pack_micro(micro, toks, weight_dtype=torch.float32).loss_weights.dtype == torch.float32


def test_pack_explicit_masks_dict_and_lists():
    toks = {10: [5, 6, 7, 8], 11: np.array([1, 2, 3])}
    masks = {10: [0, 1, 0, 1], 11: torch.tensor([False, True, True])}
    p = pack_micro(_micro([11, 10], [3, 4], [2, 2], [1.0, 2.0]), toks, loss_masks=masks)
    assert p.input_ids.tolist() == [1, 2, 3, 5, 6, 7, 8]
    assert p.loss_weights.tolist() == [0, 1, 1, 0, 2, 0, 2]


@pytest.mark.parametrize("bad, match", [
    (dict(token_ids=[[1, 2, 3]] * 2 + [[1, 2]]), "seq_len=3"),                      # length disagrees
    (dict(loss_masks=[[0, 1, 1], [0, 1, 0], [0, 0, 1]]), "loss_tokens=2"),         # mask sum disagrees
    (dict(loss_masks=[[0, 1, 1], [0, 1, 1], [0, 2, 0]]), "0/1"),                   # not binary
    (dict(loss_masks=[[1, 0, 1], [0, 1, 1], [0, 1, 1]]), "first token"),           # first token in loss
    (dict(token_ids=[torch.ones(3)] * 3), "integers"),                             # float tokens
    (dict(token_ids=[[1, 2, 3]]), "no entry for global sample 2"),                 # missing sample
    (dict(token_ids=[torch.ones(3, 1, dtype=torch.long)] * 3), "1-D"),
])
def test_pack_refuses_bad_input(bad, match):
    micro = _micro([0, 2], [3, 3], [2, 2], [1.0, 1.0])
    kw = {"token_ids": [[1, 2, 3]] * 3, **bad}
    with pytest.raises(PlanError, match=match):
        pack_micro(micro, kw.pop("token_ids"), **kw)


def test_default_mask_covering_first_token_is_refused():
    toks, _ = _data([3], None)
    batch = mp.Batch([3], loss_tokens=[3])  # an explicit loss on the first token: never predicted
    micro = mp.plan(batch, mp.PlanConfig(dp_size=1, micro_batch_size=1)).steps[0].micros[0][0]
    with pytest.raises(PlanError, match="prompt_lens"):
        pack_micro(micro, toks)


def test_defaults_walk_end_to_end():
    """Batch(lens) -> plan -> pack_micro with no other argument: every token but each sample's first
    carries loss, and the weights make Σ w·ℓ the token-mean of those tokens exactly."""
    lens = [50, 7, 1, 23]
    toks, _ = _data(lens, None, seed=3)
    batch = mp.Batch(lens)
    assert batch.loss_tokens.tolist() == [49, 6, 0, 22]
    plan = mp.plan(batch, mp.PlanConfig(dp_size=2, max_tokens_per_micro=64))
    plan.validate()
    losses = {i: torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
              for i, n in enumerate(lens)}
    total = torch.zeros((), dtype=torch.float64)
    for r in range(2):
        for micro in plan.steps[0].micros[r]:
            p = pack_micro(micro, toks)
            total = total + weighted_loss(pack_values(p, losses), p)
    want = sum(losses[i][1:].sum() for i in range(4)) / sum(n - 1 for n in lens)
    # W = dp_size = 2 ranks are averaged by the engine: the per-rank sum is 2 × J
    assert torch.allclose(total / 2, want, rtol=1e-12, atol=0)


def test_pack_refuses_non_micro():
    with pytest.raises(PlanError, match="Micro"):
        pack_micro([0, 1], [[1, 2]])


def test_placeholder_is_a_valid_one_token_input_with_every_field():
    ph = mp.Micro.placeholder()
    p = pack_micro(ph, [], pad_token_id=7)
    real = pack_micro(_micro([0], [3], [1], [1.0]), [[1, 2, 3]])
    assert p.is_placeholder and p.num_samples == 0 and p.num_tokens == 1
    assert p.input_ids.tolist() == [7] and p.position_ids.tolist() == [0]
    assert p.cu_seqlens.tolist() == [0, 1] and p.cu_seqlens.dtype == torch.int32 and p.max_seqlen == 1
    assert p.loss_weights.tolist() == [0.0] and p.loss_mask.tolist() == [False]
    assert p.sample_indices.numel() == 0 and p.sample_indices.dtype == torch.int64
    for name in ("input_ids", "position_ids", "cu_seqlens", "loss_weights", "loss_mask", "sample_indices"):
        assert getattr(p, name).dtype == getattr(real, name).dtype, name
    p.validate()
    assert pack_values(p, {}).tolist() == [0.0] and p.split(torch.zeros(1)) == ()


@pytest.mark.parametrize("change, match", [
    (dict(cu_seqlens=torch.tensor([1, 3, 7], dtype=torch.int32)), "start at 0"),
    (dict(cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32)), "end at T"),
    (dict(cu_seqlens=torch.tensor([0, 3, 7], dtype=torch.int64)), "int32"),
    (dict(cu_seqlens=torch.tensor([0, 7], dtype=torch.int32)), "n\\+1"),
    (dict(cu_seqlens=torch.tensor([0, 4, 7], dtype=torch.int32)), "disagrees"),
    (dict(max_seqlen=3), "max_seqlen"),
    (dict(max_seqlen=4.0), "max_seqlen"),
    (dict(position_ids=torch.arange(7)), "position_ids"),
    (dict(loss_weights=torch.ones(7, dtype=torch.float64)), "loss_weights"),
    (dict(input_ids=torch.zeros(6, dtype=torch.int64)), "input_ids"),
    (dict(seq_lens=(3, 3, 1)), "n\\+1"),
])
def test_validate_catches_what_kernels_trust(change, match):
    p = pack_micro(_micro([0, 1], [3, 4], [2, 3], [1.0, 1.0]), [[1, 2, 3], [1, 2, 3, 4]])
    p.validate()
    with pytest.raises(PlanError, match=match):
        replace(p, **change).validate()


def test_to_split_and_model_inputs():
    p = pack_micro(_micro([0, 1], [3, 4], [2, 3], [1.0, 1.0]), [[1, 2, 3], [4, 5, 6, 7]])
    q = p.to("cpu")
    assert q.cu_seqlens.dtype == torch.int32 and q.max_seqlen == p.max_seqlen and q.seq_lens == p.seq_lens
    mi = p.model_inputs()
    assert mi["input_ids"].shape == (1, 7) and mi["position_ids"].shape == (1, 7)
    parts = p.split(torch.arange(7)[None, :, None].expand(1, 7, 2))
    assert [t.shape for t in parts] == [(3, 2), (4, 2)] and parts[1][0, 0] == 3
    with pytest.raises(PlanError, match="T=7"):
        p.split(torch.zeros(6))


def test_pack_values():
    p = pack_micro(_micro([1, 0], [2, 3], [1, 2], [1.0, 1.0]), [[1, 2, 3], [4, 5]])
    assert pack_values(p, [0.5, -1.0]).tolist() == [-1.0, -1.0, 0.5, 0.5, 0.5]
    assert pack_values(p, [torch.tensor([1., 2., 3.]), torch.tensor([4., 5.])]).tolist() == [4, 5, 1, 2, 3]
    with pytest.raises(PlanError, match="shape"):
        pack_values(p, [torch.zeros(2), torch.zeros(2)])


# -- loss helpers ----------------------------------------------------------------------------------
def _packed_and_logits(seed=0):
    p = pack_micro(_micro([0, 1], [3, 4], [2, 2], [0.5, 2.0]), [[1, 2, 3], [4, 5, 6, 7]])
    logits = torch.randn(7, 9, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return p, logits


def test_token_logprobs_are_label_aligned_and_zero_at_sample_starts():
    p, logits = _packed_and_logits()
    lp = token_logprobs(logits, p)
    ls = logits.log_softmax(-1)
    want = [0.0, ls[0, 2], ls[1, 3], 0.0, ls[3, 5], ls[4, 6], ls[5, 7]]
    assert torch.allclose(lp, torch.tensor(want, dtype=torch.float64), atol=1e-15, rtol=0)
    assert torch.equal(token_logprobs(logits[None], p), lp)
    assert torch.allclose(token_logprobs(logits, p, temperature=2.0)[1], (logits[0] / 2).log_softmax(-1)[2])
    with pytest.raises(PlanError, match="T=7"):
        token_logprobs(logits[:6], p)


def test_next_token_labels_and_weights_stop_at_sample_boundaries():
    p, _ = _packed_and_logits()
    assert next_token_labels(p).tolist() == [2, 3, -100, 5, 6, 7, -100]
    assert next_token_labels(p, ignore_index=-1).tolist()[2] == -1
    assert next_token_weights(p).tolist() == [0.5, 0.5, 0.0, 0.0, 2.0, 2.0, 0.0]


def test_weighted_loss_token_and_logit_alignment_agree():
    p, logits = _packed_and_logits()
    logits.requires_grad_(True)
    a = weighted_loss(-token_logprobs(logits, p), p)
    ce = torch.nn.functional.cross_entropy(logits, next_token_labels(p), reduction="none", ignore_index=-100)
    b = weighted_loss(ce, p, aligned="logit")
    ls = logits.log_softmax(-1)
    want = -(0.5 * (ls[0, 2] + ls[1, 3]) + 2.0 * (ls[4, 6] + ls[5, 7]))  # the mask marks the last 2 tokens of each
    assert torch.allclose(a, want, atol=1e-14) and torch.allclose(b, want, atol=1e-14)
    ga, = torch.autograd.grad(a, logits)
    gb, = torch.autograd.grad(b, logits)
    assert torch.allclose(ga, gb, atol=1e-14)
    assert ga[2].abs().sum() == 0 and ga[6].abs().sum() == 0  # last tokens predict across / past samples


def test_weighted_loss_masks_nonfinite_zero_weight_positions_and_checks_shape():
    p, _ = _packed_and_logits()
    losses = torch.tensor([float("nan"), 1.0, 1.0, float("inf"), 0.0, 1.0, 1.0], dtype=torch.float64)
    assert weighted_loss(losses, p).item() == pytest.approx(0.5 * 2 + 2.0 * 2)
    with pytest.raises(PlanError, match="T=7"):
        weighted_loss(torch.zeros(5), p)
    with pytest.raises(PlanError, match="floating"):
        weighted_loss(torch.zeros(7, dtype=torch.int64), p)
    with pytest.raises(PlanError, match="aligned"):
        weighted_loss(losses, p, aligned="label")  # type: ignore[arg-type]


def test_placeholder_loss_is_zero_and_connected_to_the_graph():
    p = pack_micro(mp.Micro.placeholder(), [])
    x = torch.ones(1, dtype=torch.float64, requires_grad=True)
    loss = weighted_loss(x * 3.0, p)
    loss.backward()
    assert loss.item() == 0.0 and x.grad is not None and x.grad.item() == 0.0


# -- restore_order ---------------------------------------------------------------------------------
def _plan_with_placeholders():
    lens = [5, 7, 3, 9, 4, 6]
    toks, batch = _data(lens, [1] * 6, seed=3)
    cfg = mp.PlanConfig(dp_size=2, max_tokens_per_micro=12, align=2, steps=mp.Steps(num_steps=2))
    plan = mp.plan(batch, cfg)
    assert sum(s.num_placeholders for s in plan.steps) > 0
    return toks, plan


def test_restore_packed_outputs_to_sample_order_dropping_placeholders():
    toks, plan = _plan_with_placeholders()
    seen = []
    for r in range(2):
        micros = [m for step in plan.rank(r) for m in step]
        packs = [pack_micro(m, toks) for m in micros]
        outs = [p.input_ids.double() * 2 for p in packs]  # a packed [T] "output" per micro, placeholders too
        res = restore_order(packs, outs)
        want = sorted(i for m in micros for i in m.indices.tolist())
        assert res.sample_indices.tolist() == want and len(res) == len(want)
        for i, v in zip(want, res.values):
            assert torch.equal(v, toks[i].double() * 2)
        assert torch.equal(restore_order(micros, outs).cat(), res.cat())  # Micro works as well as PackedMicro
        seen += want
    assert sorted(seen) == list(range(6))


def test_restore_per_sample_outputs_and_explicit_order():
    toks, plan = _plan_with_placeholders()
    micros = [m for step in plan.rank(0) for m in step]
    lists = [[torch.tensor(float(i)) for i in m.indices.tolist()] for m in micros]
    stacked = [torch.tensor([float(i) for i in m.indices.tolist()]) if not m.is_placeholder else torch.zeros(5)
               for m in micros]
    real = [i for m in micros for i in m.indices.tolist()]
    order = real[::-1]
    a = restore_order(micros, lists, order=order)
    b = restore_order(micros, stacked, order=order, kind="sample")
    assert a.sample_indices.tolist() == order and a.stack().tolist() == [float(i) for i in order]
    assert torch.equal(a.stack(), b.stack()) and set(a.as_dict()) == set(order)


def test_restore_refuses_mismatches():
    toks, plan = _plan_with_placeholders()
    micros = [m for step in plan.rank(0) for m in step]
    packs = [pack_micro(m, toks) for m in micros]
    outs = [p.input_ids for p in packs]
    real = [i for m in micros for i in m.indices.tolist()]
    with pytest.raises(PlanError, match="outputs for"):
        restore_order(packs, outs[:-1])
    with pytest.raises(PlanError, match="not produced"):
        restore_order(packs, outs, order=real[:-1] + [99])
    with pytest.raises(PlanError, match="duplicates"):
        restore_order(packs, outs, order=real + real[:1])
    j = next(k for k, p in enumerate(packs) if not p.is_placeholder)
    with pytest.raises(PlanError, match="T="):
        restore_order(packs, outs[:j] + [outs[j][:-1]] + outs[j + 1:])
    with pytest.raises(PlanError, match="per-sample values"):
        restore_order(packs, outs[:j] + [[outs[j]] * 9] + outs[j + 1:])
    with pytest.raises(PlanError, match="two micro-batches"):
        restore_order(packs + packs[j:j + 1], outs + outs[j:j + 1])
    with pytest.raises(PlanError, match="kind"):
        restore_order(packs, outs, kind="row")  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="Micro or PackedMicro"):
        restore_order([object()], [outs[0]])


def test_restore_only_placeholders_gives_empty_result():
    res = restore_order([mp.Micro.placeholder()], [torch.zeros(1)])
    assert len(res) == 0 and res.sample_indices.size == 0
    with pytest.raises(PlanError, match="no real samples"):
        res.cat()


# -- property: pack → restore round-trips every rank, weights sum to the plan's -----------------------
@given(lens=st.lists(st.integers(2, 20), min_size=1, max_size=24), dp=st.integers(1, 4),
       cap=st.integers(20, 48), align=st.integers(1, 3), data=st.data())
def test_pack_restore_roundtrip_property(lens, dp, cap, align, data):
    prompt = [data.draw(st.integers(1, n - 1)) for n in lens]
    toks = [torch.arange(n) + 100 * i for i, n in enumerate(lens)]
    batch = mp.Batch(lens, prompt_lens=prompt)
    plan = mp.plan(batch, mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, align=align,
                                        loss=mp.Loss("seq-mean-token-mean")))
    total_weight, restored = 0.0, {}
    for r in range(dp):
        micros = [m for step in plan.rank(r) for m in step]
        packs = [pack_micro(m, toks) for m in micros]
        for m, p in zip(micros, packs):
            assert p.num_tokens == max(m.num_tokens, 1) and p.is_placeholder == m.is_placeholder
            total_weight += float(p.loss_weights.sum())
        restored.update(restore_order(packs, [p.input_ids for p in packs]).as_dict())
    assert sorted(restored) == list(range(len(lens)))
    assert all(torch.equal(restored[i], toks[i]) for i in restored)
    # seq-mean-token-mean: Σ_i c_i n_i = 1 (every sample has loss tokens), times W for the mean reduction
    assert total_weight == pytest.approx(dp, rel=1e-12)


def test_distributed_names_reexported_when_present():
    import microplan.torch as mt
    here = Path(mt.__file__).parent
    for name, files in (("gather_batch", ("distributed.py", "gather.py")),
                        ("verify_agreement", ("distributed.py", "verify.py", "agreement.py"))):
        defined = any(name in (here / f).read_text() for f in files if (here / f).exists())
        assert (name in mt.__all__) == defined == hasattr(mt, name), name
    assert isinstance(pack_micro(_micro([0], [2], [1], [1.0]), [[1, 2]]), PackedMicro)


def test_to_device_keeps_the_bookkeeping_on_the_host():
    """``to`` moves what kernels read; ``sample_indices`` stays on the host so pack_values and
    restore_order never sync the device to read it."""
    plan = mp.plan(mp.Batch([3, 4, 5]), mp.PlanConfig(dp_size=1, max_tokens_per_micro=16))
    p = pack_micro(plan.rank(0)[0][0], [torch.arange(3), torch.arange(4), torch.arange(5)])
    moved = p.to("meta")
    assert moved.input_ids.device.type == "meta" and moved.loss_weights.device.type == "meta"
    assert moved.sample_indices.device.type == "cpu" and moved.sample_indices.tolist() == p.sample_indices.tolist()
    padded = mp.plan(mp.Batch([3, 4]), mp.PlanConfig(dp_size=1, max_tokens_per_micro=16, layout="padded"))
    q = pack_micro(padded.rank(0)[0][0], [torch.arange(3), torch.arange(4)]).to("meta")
    assert q.input_ids.device.type == "meta" and q.sample_indices.device.type == "cpu"
