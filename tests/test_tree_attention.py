"""Tree rows' split attention (torch/tree_attention.py) against one sdpa call per segment over its gathered path.

Random prefix forests (branches at a parent's end and inside it, chains, padding multiples per
segment and per row) are planned with ``share_prefixes=True`` and packed; every tree row's table
runs through ``split_attention`` on the row's own keys and through the reference — one sdpa call
per segment over ``key_index``-gathered keys, causal bottom-right. Outputs and the gradients of
query, key and value agree within 1e-12 relative in float64, with and without GQA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import microplan as mp
from microplan.torch import pack_micro
from microplan.torch.attention import segments_from_cu_seqlens
from microplan.torch.tree_attention import split_attention, split_plan


def _forest(rng: np.random.Generator, n: int) -> tuple[mp.Batch, list[torch.Tensor]]:
    """n samples; each later one continues an earlier one (shared length anywhere in 1..its length) or not."""
    lens, parent, shared, toks = [], [], [], []
    for i in range(n):
        L = int(rng.integers(2, 24))
        p = int(rng.integers(-1, i)) if i else -1
        s = int(rng.integers(1, min(L - 1, lens[p]) + 1)) if p >= 0 and min(L - 1, lens[p]) >= 1 else 0
        p = p if s else -1
        head = toks[p][:s] if s else torch.zeros(0, dtype=torch.int64)
        toks.append(torch.cat([head, torch.as_tensor(rng.integers(0, 50, L - s), dtype=torch.int64)]))
        lens.append(L), parent.append(p), shared.append(s)
    return mp.Batch(lens, prefix_parent=parent, shared_prefix_lens=shared), toks


def _reference(q, k, v, seg, key_index):
    """One sdpa call per segment over its gathered path keys (bottom-right causal)."""
    k, v = k.index_select(0, key_index), v.index_select(0, key_index)
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    rows = []
    for qa, qb, ka, kb in zip(seg.q_starts, seg.q_ends, seg.k_starts, seg.k_ends):
        lq, lk = qb - qa, kb - ka
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
        o = F.scaled_dot_product_attention(q[qa:qb].transpose(0, 1)[None], k[ka:kb].transpose(0, 1)[None],
                                           v[ka:kb].transpose(0, 1)[None], attn_mask=mask,
                                           enable_gqa=q.shape[1] != k.shape[1])
        rows.append(torch.arange(qa, qb))
        out = out.index_copy(0, rows[-1], o[0].transpose(0, 1))
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a, b, rtol=1e-12, atol=1e-12 * float(b.detach().abs().max().clamp(min=1.0))))


@given(seed=st.integers(0, 2**31), n=st.integers(2, 9), kv=st.sampled_from([1, 2, 4]),
       mult=st.sampled_from([1, 4]), row=st.sampled_from([1, 16]))
@settings(deadline=None)
def test_split_attention_equals_per_segment_calls(seed, n, kv, mult, row):
    rng = np.random.default_rng(seed)
    batch, toks = _forest(rng, n)
    cfg = mp.PlanConfig(dp_size=1, max_tokens_per_micro=4096, share_prefixes=True, pad_to_multiple_of=mult,
                        pad_row_to_multiple_of=row)
    plan = mp.plan(batch, cfg)
    trees = 0
    for step in plan.steps:
        for micro in step.micros[0]:
            if micro.is_placeholder or micro.tree is None:
                continue
            p = pack_micro(micro, toks, weight_dtype=torch.float64)
            seg = segments_from_cu_seqlens(p.cu_seqlens, p.tree.cu_seqlens_k)
            ki = p.tree.key_index
            sp = split_plan(seg.q_starts, seg.q_ends, seg.k_starts, seg.k_ends, ki.numpy(), p.num_tokens)
            assert sp is not None  # a packed tree row always has the split shape
            N = p.num_tokens
            g = torch.Generator().manual_seed(seed)
            q = torch.randn(N, 4, 8, dtype=torch.float64, generator=g, requires_grad=True)
            k = torch.randn(N, kv, 8, dtype=torch.float64, generator=g, requires_grad=True)
            v = torch.randn(N, kv, 8, dtype=torch.float64, generator=g, requires_grad=True)
            got = split_attention(q, k, v, sp, scale=0.3)
            want = _reference(q * (0.3 * 8 ** 0.5), k, v, seg, ki)  # sdpa's default scale is 1/sqrt(8)
            assert _close(got, want)
            w = torch.randn(got.shape, dtype=torch.float64, generator=g)
            ga = torch.autograd.grad((got * w).sum(), (q, k, v))
            gb = torch.autograd.grad((want * w).sum(), (q, k, v))
            for a, b in zip(ga, gb):
                assert _close(a, b)
            trees += 1
    assert trees >= 1


def test_split_plan_batches_siblings_and_reads_contiguous_rows_in_place():
    """A GRPO-like row (a prompt, 3 responses): one causal root call, one group whose ancestor keys
    are the prompt rows read as a range; a table whose segment does not end in its own rows is
    not split (None: the caller keeps the gathered path)."""
    # rows: prompt 0..9, responses 10..13, 14..16, 17..21; each response's path = prompt + itself
    qs, qe = (0, 10, 14, 17), (10, 14, 17, 22)
    ki = np.concatenate([np.arange(10), np.arange(10), np.arange(10, 14), np.arange(10), np.arange(14, 17),
                         np.arange(10), np.arange(17, 22)])
    cu = np.cumsum([0, 10, 14, 13, 15])
    sp = split_plan(qs, qe, tuple(cu[:-1]), tuple(cu[1:]), ki, 22)
    assert sp is not None and sp.roots == ((0, 10),) and len(sp.groups) == 1
    grp = sp.groups[0]
    assert grp.k_range == (0, 10) and grp.q_range == (10, 22) and grp.members == ((10, 14), (14, 17), (17, 22))
    assert sp.covers_all
    bad = ki.copy()
    bad[-1] = 3  # the last response's last key is not its own last row
    assert split_plan(qs, qe, tuple(cu[:-1]), tuple(cu[1:]), bad, 22) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tree_rows_run_split_in_the_model_attention(dtype, monkeypatch):
    """``register_attention``'s function runs a CPU tree row through the split path (not the
    gathered one), with the same output as the gathered path."""
    from microplan.torch import attention
    rng = np.random.default_rng(3)
    batch, toks = _forest(rng, 8)
    plan = mp.plan(batch, mp.PlanConfig(dp_size=1, max_tokens_per_micro=4096, share_prefixes=True))
    micro = next(m for st_ in plan.steps for m in st_.micros[0] if m.tree is not None and len(m.tree.start) > 1)
    p = pack_micro(micro, toks, weight_dtype=dtype)
    kw = p.model_inputs()
    N = p.num_tokens
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, N, 8, dtype=dtype, generator=g) for h in (4, 2, 2))

    class M(torch.nn.Module):
        is_causal = True
    calls = []
    real = attention.split_attention
    monkeypatch.setattr(attention, "split_attention", lambda *a, **k_: calls.append(1) or real(*a, **k_))
    got, _ = attention.varlen_attention(M(), q, k, v, None, **{k_: kw[k_] for k_ in kw if k_ != "input_ids"})
    assert calls
    seg = segments_from_cu_seqlens(p.cu_seqlens, p.tree.cu_seqlens_k)
    want = _reference(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), seg, p.tree.key_index)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert torch.allclose(got[0], want, rtol=tol, atol=tol)


def test_float32_tree_rows_pass_their_own_validation():
    """A float32 tree row whose shared tokens sum several samples' loss scales packs (its check
    allows the weight dtype's rounding; it used to demand 1e-12 of float32 sums and refused it)."""
    rng = np.random.default_rng(3)
    batch, toks = _forest(rng, 8)
    plan = mp.plan(batch, mp.PlanConfig(dp_size=1, max_tokens_per_micro=4096, share_prefixes=True))
    packed = [pack_micro(m, toks, weight_dtype=torch.float32) for st_ in plan.steps for m in st_.micros[0]
              if m.tree is not None]
    assert any(p.tree.sample_weights.numel() > p.num_tokens for p in packed)  # shared tokens summed


def test_rows_in_no_segment_stay_zero():
    """A table that leaves a row out (row 10: no segment's query) gives 0 there and the
    per-segment result elsewhere, gradients included (float64)."""
    from microplan.torch.attention import Segments
    qs, qe = (0, 11, 15), (10, 15, 18)
    ki = np.concatenate([np.arange(10), np.arange(10), np.arange(11, 15), np.arange(10), np.arange(15, 18)])
    cu = np.cumsum([0, 10, 14, 13])
    sp = split_plan(qs, qe, tuple(cu[:-1]), tuple(cu[1:]), ki, 18)
    assert sp is not None and not sp.covers_all
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(18, h, 8, dtype=torch.float64, generator=g, requires_grad=True) for h in (4, 2, 2))
    seg = Segments(qs, qe, tuple(int(x) for x in cu[:-1]), tuple(int(x) for x in cu[1:]), num_tokens=37)
    got = split_attention(q, k, v, sp)
    want = _reference(q, k, v, seg, torch.from_numpy(ki))
    assert torch.equal(got[10], torch.zeros_like(got[10])) and _close(got, want)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        assert _close(a, b)
