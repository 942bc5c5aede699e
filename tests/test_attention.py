"""microplan.torch.register_attention: per-sample causal attention over a packed row.

Checked against the model run on each sample alone (float64 tiny Llama): logits and gradients
equal to rounding; the attention work is Σ L² (score elements counted at the sdpa calls), where
transformers' sdpa over the packed row computes T²; the segment table (position ids, padding
masks, cu_seqlens, the bottom-right causal rule a prefix tree will need) against direct math.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import microplan as mp
from microplan import PlanError
from microplan.torch import pack_micro, register_attention, token_logprobs, weighted_loss
from microplan.torch.attention import (ATTENTION_NAME, Segments, segment_attention, segments_from_cu_seqlens,
                                       segments_from_position_ids)

from _tiny_model import VOCAB, flat_grad, make_model


def _tokens(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]


def _packed(lens, seed=0):
    toks = _tokens(lens, seed)
    micro = mp.Micro(list(range(len(lens))), lens, [n - 1 for n in lens], [1.0 + i for i in range(len(lens))])
    return toks, pack_micro(micro, toks)


@pytest.fixture(scope="module")
def name():
    return register_attention()


def _model(impl):
    m = make_model(0)
    m.set_attn_implementation(impl)
    return m


def test_register_returns_name_and_is_idempotent(name):
    assert name == ATTENTION_NAME == register_attention()
    from transformers import AttentionInterface
    assert name in AttentionInterface()


@settings(max_examples=12)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=6))
def test_packed_logits_equal_each_sample_alone(lens):
    register_attention()
    model, ref = _model(ATTENTION_NAME), make_model(0)
    toks, p = _packed(lens)
    with torch.no_grad():
        out = model(**p.model_inputs(), use_cache=False).logits[0]
        alone = torch.cat([ref(input_ids=t[None], use_cache=False).logits[0] for t in toks])
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, alone, rtol=0, atol=1e-12)


def test_packed_gradient_equals_per_sample_gradient(name):
    lens = [7, 1, 11, 4]
    model, ref = _model(name), make_model(0)
    toks, p = _packed(lens)
    model.zero_grad()
    logp = token_logprobs(model(**p.model_inputs(), use_cache=False).logits, p)
    weighted_loss(-logp, p).backward()
    g = flat_grad(model)
    ref.zero_grad()
    for i, t in enumerate(toks):
        lp = torch.log_softmax(ref(input_ids=t[None], use_cache=False).logits[0, :-1], -1)
        lp = lp.gather(-1, t[1:, None]).squeeze(-1)
        ((1.0 + i) * -lp.sum()).backward()
    torch.testing.assert_close(g, flat_grad(ref), rtol=1e-10, atol=1e-12)


def test_segments_matter(name):
    """Guard against a vacuous equality: attending across samples changes the logits."""
    model = _model(name)
    toks, p = _packed([6, 6])
    with torch.no_grad():
        sep = model(**p.model_inputs(), use_cache=False).logits[0]
        joined = model(input_ids=p.input_ids[None], use_cache=False).logits[0]  # positions 0..11: one sample
    assert (sep[6:] - joined[6:]).abs().max() > 1e-3
    torch.testing.assert_close(sep[:6], joined[:6], rtol=0, atol=1e-12)


def _score_elements(model, p, monkeypatch):
    """Σ over sdpa calls of Lq·Lk (score-matrix elements), one forward."""
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        seen.append(q.shape[-2] * k.shape[-2])
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    with torch.no_grad():
        model(**p.model_inputs(), use_cache=False)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", real)
    return sum(seen), len(seen)


def test_attention_work_is_sum_of_squares_not_packed_square(name, monkeypatch):
    lens = [9, 3, 14, 1, 5]
    _, p = _packed(lens)
    layers = make_model(0).config.num_hidden_layers
    work, calls = _score_elements(_model(name), p, monkeypatch)
    assert calls == layers * len(lens)
    assert work == layers * sum(L * L for L in lens)
    dense, _ = _score_elements(_model("sdpa"), p, monkeypatch)
    assert dense == layers * sum(lens) ** 2 > work


def test_padding_mask_excludes_pad_tokens(name):
    """A left- and right-padded batch: every real token's logits equal the sample run alone."""
    model, ref = _model(name), make_model(0)
    toks = _tokens([5, 8, 3], seed=2)
    T = 9
    ids = torch.zeros(3, T, dtype=torch.int64)
    att = torch.zeros(3, T, dtype=torch.int64)
    spans = [(4, 9), (0, 8), (2, 5)]  # left padded, right padded, both
    for j, ((a, b), t) in enumerate(zip(spans, toks)):
        ids[j, a:b], att[j, a:b] = t, 1
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=False).logits
        for j, ((a, b), t) in enumerate(zip(spans, toks)):
            alone = ref(input_ids=t[None], use_cache=False).logits[0]
            torch.testing.assert_close(out[j, a:b], alone, rtol=0, atol=1e-12)


def test_explicit_cu_seq_lens_kwargs_win(name):
    """flash-attn style kwargs forwarded through model(...) define the segments."""
    model, ref = _model(name), make_model(0)
    toks, p = _packed([4, 6])
    cu = p.cu_seqlens.to(torch.int64)
    with torch.no_grad():
        out = model(input_ids=p.input_ids[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6,
                    position_ids=p.position_ids[None], use_cache=False).logits[0]
        alone = torch.cat([ref(input_ids=t[None], use_cache=False).logits[0] for t in toks])
    torch.testing.assert_close(out, alone, rtol=0, atol=1e-12)


def test_generation_with_kv_cache_falls_back_to_sdpa(name):
    model, ref = _model(name), _model("sdpa")
    ids = _tokens([6], seed=3)[0][None]
    with torch.no_grad():
        a = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        b = ref.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


def test_batched_generation_with_left_padding_and_kv_cache(name):
    """A padded batch generates as with sdpa (the fallback used to hand sdpa the 2-D padding mask)."""
    model, ref = _model(name), _model("sdpa")
    toks = _tokens([6, 3], seed=3)
    ids = torch.zeros(2, 6, dtype=torch.long)
    mask = torch.zeros(2, 6, dtype=torch.long)
    for i, t in enumerate(toks):
        ids[i, 6 - len(t):], mask[i, 6 - len(t):] = t, 1
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        a, b = model.generate(ids, **kw), ref.generate(ids, **kw)
    assert torch.equal(a.sequences, b.sequences)
    for x, y in zip(a.scores, b.scores):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-12)


def test_chunked_prefill_over_a_kv_cache_is_causal_bottom_right(name):
    """T > 1 new tokens over S > T cached keys: token t sees the cache and the new tokens up to t."""
    model = _model(name)
    ids = _tokens([9], seed=4)[0][None]
    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False).logits[0]
        first = model(input_ids=ids[:, :5], use_cache=True)
        rest = model(input_ids=ids[:, 5:], past_key_values=first.past_key_values, use_cache=True).logits[0]
    torch.testing.assert_close(rest, whole[5:], rtol=0, atol=1e-12)


# -- the segment table ---------------------------------------------------------------------------
def test_segments_from_position_ids_and_mask():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1]])
    s = segments_from_position_ids(pos)
    assert (s.q_starts, s.q_ends) == ((0, 3, 5, 6), (3, 5, 6, 8)) and s.flat and s.covers_all
    valid = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    s = segments_from_position_ids(pos, valid)
    assert (s.q_starts, s.q_ends) == ((1, 3, 5, 7), (3, 5, 6, 8)) and not s.covers_all
    two = segments_from_position_ids(torch.tensor([[0, 1, 2], [0, 1, 0]]))
    assert (two.q_starts, two.q_ends) == ((0, 3, 5), (3, 5, 6))  # rows never merge
    assert two.attention_pairs() == 6 + 3 + 1


def test_segments_from_cu_seqlens_and_refusals():
    s = segments_from_cu_seqlens(torch.tensor([0, 3, 7], dtype=torch.int32))
    assert s.flat and s.num_tokens == 7 and s.attention_pairs() == 6 + 10
    with pytest.raises(PlanError, match="start at 0"):
        segments_from_cu_seqlens([1, 3])
    with pytest.raises(PlanError, match="at least as many keys"):
        Segments((0,), (4,), (0,), (2,), num_tokens=4)
    with pytest.raises(PlanError, match="non-empty ranges"):
        Segments((0,), (5,), (0,), (5,), num_tokens=4)


def test_bottom_right_causal_segment_matches_full_causal_rows():
    """A segment whose queries are the last tokens of its keys (a tree node below its path) sees
    exactly what those rows of full causal attention over the path see."""
    g = torch.Generator().manual_seed(0)
    N, H, D = 10, 2, 4
    q, k, v = (torch.randn(N, H, D, generator=g, dtype=torch.float64) for _ in range(3))
    full = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    seg = Segments((6,), (10,), (0,), (10,), num_tokens=N)
    out = segment_attention(q, k, v, seg)
    torch.testing.assert_close(out[6:], full.transpose(0, 1)[6:], rtol=0, atol=1e-14)
    assert float(out[:6].abs().max()) == 0.0  # queries in no segment give 0
    # GQA: 2 query heads share 1 key/value head
    o2 = segment_attention(q, k[:, :1], v[:, :1], Segments((0,), (10,), (0,), (10,), num_tokens=N))
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k[:, :1].transpose(0, 1).expand(H, N, D),
                                         v[:, :1].transpose(0, 1).expand(H, N, D), is_causal=True)
    torch.testing.assert_close(o2, ref.transpose(0, 1), rtol=0, atol=1e-14)


def test_unsupported_kwargs_are_refused(name):
    from microplan.torch.attention import varlen_attention
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(PlanError, match="sliding_window"):
        varlen_attention(torch.nn.Module(), q, q, q, None, sliding_window=2)
    with pytest.raises(PlanError, match="ONE packed row"):
        varlen_attention(torch.nn.Module(), torch.zeros(2, 2, 4, 8), torch.zeros(2, 2, 4, 8), torch.zeros(2, 2, 4, 8),
                         None, cu_seq_lens_q=torch.tensor([0, 4]))


def test_placeholder_micro_runs(name):
    model = _model(name)
    p = pack_micro(mp.Micro.placeholder(), [])
    with torch.no_grad():
        out = model(**p.model_inputs(), use_cache=False).logits
    assert out.shape == (1, 1, VOCAB) and bool(torch.isfinite(out).all())


def test_the_segment_table_is_built_once_per_forward(name, monkeypatch):
    """Every layer receives the same position_ids / cu_seq_lens tensors: the table (a host round
    trip and its checks) is built once per forward on both paths, not once per layer."""
    import microplan.torch.attention as att
    model = _model(name)
    assert model.config.num_hidden_layers >= 2
    toks, p = _packed([4, 6])
    cu = p.cu_seqlens.to(torch.int64)
    calls = {"pos": 0, "cu": 0}
    for fn, key in (("segments_from_position_ids", "pos"), ("segments_from_cu_seqlens", "cu")):
        real = getattr(att, fn)
        monkeypatch.setattr(att, fn, lambda *a, _r=real, _k=key, **kw: (calls.__setitem__(_k, calls[_k] + 1), _r(*a, **kw))[1])
    with torch.no_grad():
        model(**p.model_inputs(), use_cache=False)
        model(input_ids=p.input_ids[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6,
              position_ids=p.position_ids[None], use_cache=False)
    assert calls == {"pos": 1, "cu": 1}


def _per_segment(query, key, value, seg):
    """The reference: one sdpa call per segment (causal bottom-right), rows in no segment 0."""
    out = query.new_zeros(query.shape[0], query.shape[1], value.shape[-1])
    for qa, qb, ka, kb in zip(seg.q_starts, seg.q_ends, seg.k_starts, seg.k_ends):
        lq, lk = qb - qa, kb - ka
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq) if seg.causal else None
        o = F.scaled_dot_product_attention(query[qa:qb].transpose(0, 1)[None], key[ka:kb].transpose(0, 1)[None],
                                           value[ka:kb].transpose(0, 1)[None], attn_mask=mask,
                                           enable_gqa=query.shape[1] != key.shape[1])
        out[qa:qb] = o[0].transpose(0, 1)
    return out


@given(seed=st.integers(0, 2**31), n=st.integers(2, 10), causal=st.booleans(), kv=st.sampled_from([1, 2, 4]),
       gap=st.booleans())
def test_tree_segments_batched_equal_one_call_per_segment(seed, n, causal, kv, gap):
    """A tree table (queries apart from their path keys) runs like segments as one padded call:
    output and gradients equal one sdpa call per segment within 1e-12 relative (float64), rows in
    no segment stay 0, and a GRPO-like table (a prompt, responses of like length) takes 2 calls."""
    from microplan.torch.segment_groups import segment_groups
    g = torch.Generator().manual_seed(seed)
    lq = torch.randint(1, 14, (n,), generator=g).tolist()
    lk = [q + int(torch.randint(0, 25, (1,), generator=g)) for q in lq]
    qs, ks = [0], [0]
    for a, b in zip(lq, lk):
        qs.append(qs[-1] + a + int(gap))       # gap: one row between segments that no segment covers
        ks.append(ks[-1] + b)
    N, M = qs[-1], ks[-1]
    seg = Segments(tuple(qs[:-1]), tuple(a + b for a, b in zip(qs[:-1], lq)), tuple(ks[:-1]), tuple(ks[1:]),
                   num_tokens=max(N, M), causal=causal)
    q = torch.randn(N, 4, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(M, kv, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(M, kv, 8, dtype=torch.float64, generator=g, requires_grad=True)
    got, want = segment_attention(q, k, v, seg), _per_segment(q, k, v, seg)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    w = torch.randn(got.shape, dtype=torch.float64, generator=g)
    for a, b in zip(torch.autograd.grad((got * w).sum(), (q, k, v)), torch.autograd.grad((want * w).sum(), (q, k, v))):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert sorted(map(len, segment_groups((1500, 200, 210, 190, 205), (1500, 1700, 1710, 1690, 1705)))) == [1, 4]
