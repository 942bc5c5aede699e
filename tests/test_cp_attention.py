"""Context-parallel execution: ``PackedMicro.cp_shard`` and ``context_parallel`` (all-gather KV).

Host-side properties of the cut and the shards (hypothesis, flat and tree rows, c = 2..4): the
members' owned tokens partition the row and are all a member computes (⌈U/c⌉ rows at most),
every per-sample entry is scored once, from its predecessor's row on the member that owns it,
every owned query sees exactly the keys it sees unsharded, the shards' per-sample weights,
values and log-probs are the row's. On 4 gloo CPU processes (tests/_cp_exactness.py): a float64 transformers Llama
run by CP groups of 2 and 4, flat rows under fixed and dynamic CP and tree rows, gives J and
∇J equal to the single-process per-sample computation within 1e-12 relative for every loss mode.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import microplan as mp
from microplan.cp_cut import cp_loads, zigzag_owner
from microplan.torch import context_parallel, pack_micro, pack_values, register_attention

import _cp_exactness as X
from _exactness import one_thread
from _gloo import RankError, run_gloo
from _tiny_model import make_model

# ---------------------------------------------------------------- the cut (numpy)


@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(1, 8))
def test_zigzag_cut_balances_tokens_and_is_standard_on_multiples(lens, c):
    owner = zigzag_owner(lens, c)
    assert owner.size == sum(lens) and set(owner.tolist()) <= set(range(c))
    counts = np.bincount(owner, minlength=c)
    assert counts.max() - counts.min() <= 1                      # leftovers rotate over the whole row
    off = np.concatenate([[0], np.cumsum(lens)])
    for k, L in enumerate(lens):
        seg = owner[off[k]:off[k + 1]]
        if L % (2 * c) == 0:                                      # the standard zigzag: chunks q and 2c-1-q
            want = np.repeat(np.concatenate([np.arange(c), np.arange(c)[::-1]]), L // (2 * c))
            assert seg.tolist() == want.tolist()
            loads = cp_loads([L], [17], c, owner=seg)            # equal attention cost per member
            assert np.allclose(loads.attention, loads.attention[0]) and (loads.tokens == L // c).all()


def test_cut_refuses_bad_input():
    with pytest.raises(mp.PlanError, match="cp_size=0"):
        zigzag_owner([4], 0)
    with pytest.raises(mp.PlanError, match="positive"):
        zigzag_owner([4, 0], 2)
    with pytest.raises(mp.PlanError, match="one per segment"):
        cp_loads([4, 4], [0], 2)


# ---------------------------------------------------------------- shards (host side)


def _full_row(seed: int, tree: bool, pad: int = 1) -> tuple[mp.Micro, list[torch.Tensor], list[torch.Tensor]]:
    rng = np.random.default_rng(seed)
    toks, masks = [], []
    for i in range(int(rng.integers(1, 7))):
        if tree and toks and rng.random() < 0.7:                 # continue or branch off an earlier sample
            base = toks[int(rng.integers(0, len(toks)))]
            tail = torch.as_tensor(rng.integers(0, 9, int(rng.integers(1, 6))))
            t = torch.cat([base[: int(rng.integers(1, len(base) + 1))], tail])
        else:
            t = torch.as_tensor(rng.integers(0, 9, int(rng.integers(1, 12))))
        toks.append(t.to(torch.int64))
        m = torch.as_tensor(rng.random(len(t)) < 0.6)
        m[0] = False
        masks.append(m)
    parent, shared = mp.find_shared_prefixes(toks) if tree else (None, None)
    batch = mp.Batch([len(t) for t in toks], loss_tokens=[int(m.sum()) for m in masks], prefix_parent=parent,
                     shared_prefix_lens=shared)
    plan = mp.plan(batch, mp.PlanConfig(dp_size=1, max_tokens_per_micro=10**4, share_prefixes=tree,
                                        pad_to_multiple_of=pad))
    return plan.steps[0].micros[0][0], toks, masks


def _visible_keys(p) -> list[list[int]]:
    """For each row of an unsharded row: the rows it attends to (its path up to itself)."""
    out = [None] * p.num_tokens
    cu = p.cu_seqlens.tolist()
    for k in range(len(p.seq_lens)):
        if p.tree is not None:
            path = p.tree.key_index[p.tree.cu_seqlens_k[k]:p.tree.cu_seqlens_k[k + 1]].tolist()
        else:
            path = list(range(cu[k], cu[k + 1]))
        L = cu[k + 1] - cu[k]
        for j in range(L):
            out[cu[k] + j] = path[: len(path) - (L - 1 - j)]
    return out


@given(st.integers(0, 10**6), st.booleans(), st.integers(2, 4), st.booleans())
def test_shards_partition_the_row_and_see_exactly_its_keys(seed, tree, c, padded):
    micro, toks, masks = _full_row(seed, tree, pad=2 * c if padded and not tree else 1)
    p = pack_micro(micro, toks, loss_masks=masks)
    if padded and not tree:  # sequences padded to 2c: every member owns the standard zigzag, no leftovers
        assert all(n % (2 * c) == 0 for n in p.seq_lens)
    visible = _visible_keys(p)
    prev_full = _prev_rows(p)
    owned_all, owned_by, w_by = [], [], {}
    values = {i: torch.arange(len(t), dtype=torch.float64) * 10 + i for i, t in enumerate(toks)}
    owner = zigzag_owner(np.asarray(p.seq_lens), c)
    for q in range(c):
        s = p.cp_shard(q, cp_size=c)
        s.validate()
        cp = s.cp
        rows = cp.rows.tolist()
        own = cp.own_index.tolist()
        assert s.num_tokens <= -(-p.num_tokens // c)                # owned rows only: no halo
        assert own == list(range(s.num_tokens)) or (not own and s.num_tokens == 1)
        owned_all += [rows[j] for j in own]
        owned_by.append(own)
        slot_row = {}                                             # gathered slot -> full row
        for m in range(c):
            for i, r in enumerate(np.flatnonzero(owner == m).tolist()):
                slot_row[m * cp.width + i] = r
        cu, cuk = s.cu_seqlens.tolist(), s.tree.cu_seqlens_k.tolist()
        for k in range(len(s.seq_lens)):
            keys = [slot_row[x] for x in s.tree.key_index[cuk[k]:cuk[k + 1]].tolist()]
            L = cu[k + 1] - cu[k]
            for j in range(L):                                    # bottom-right causal alignment
                assert keys[: len(keys) - (L - 1 - j)] == visible[rows[cu[k] + j]]
        assert torch.equal(s.input_ids, p.input_ids[cp.rows])
        assert torch.equal(s.position_ids, p.position_ids[cp.rows])
        v = pack_values(s, values)
        assert v.numel() == s.tree.sample_weights.numel() == cp.target_ids.numel()
        start = 0
        for i, pos, lr in zip(s.sample_indices.tolist(), cp.sample_positions, s.tree.sample_rows):
            n = pos.numel()
            assert torch.equal(v[start:start + n], values[i][pos])
            assert torch.equal(cp.target_ids[start:start + n], toks[i][pos])       # each entry's label
            full_rows = p.tree.sample_rows[p.sample_indices.tolist().index(i)] if p.tree is not None else \
                p.cu_seqlens[p.sample_indices.tolist().index(i)] + torch.arange(len(toks[i]))
            for t, r in zip(pos.tolist(), lr.tolist()):            # scored from its predecessor's row, held here
                assert rows[r] == (prev_full[int(full_rows[t])] if t else int(full_rows[0]))
                assert owner[rows[r]] == q
            for t, w in zip(pos.tolist(), s.tree.sample_weights[start:start + n].tolist()):
                w_by[(i, t)] = w_by.get((i, t), 0.0) + w
            start += n
        assert float(s.loss_weights.sum()) == pytest.approx(float(s.tree.sample_weights.sum()), abs=1e-12)
    assert sorted(owned_all) == list(range(p.num_tokens))        # each token owned exactly once
    if padded and not tree:
        assert len({len(o) for o in owned_by}) == 1                # equal shares
    full = {}                                                     # the shards' per-sample weights add up to the row's
    for i, n in zip(p.sample_indices.tolist(), p.real_lens):
        w = masks[i].to(torch.float64) * float(micro.loss_scale[micro.indices.tolist().index(i)])
        full.update({(i, t): float(w[t]) for t in range(n)})
    assert w_by.keys() == full.keys() and all(w_by[k] == full[k] for k in full)


@given(st.integers(0, 10**6), st.booleans(), st.integers(2, 4))
def test_shard_logprobs_are_the_rows_logprobs_from_the_same_logits(seed, tree, c):
    """The members' log-probs, each computed from the full row's logits at its own rows only,
    are the unsharded row's per-sample log-probs entry for entry, bit for bit (a branch node's
    logits score every child's first token on the member that owns the node)."""
    from microplan.torch import token_logprobs
    micro, toks, masks = _full_row(seed, tree)
    p = pack_micro(micro, toks, loss_masks=masks)
    logits = torch.randn(p.num_tokens, 9, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    full = p.expand(token_logprobs(logits, p))
    per_sample = dict(zip(p.sample_indices.tolist(), torch.split(full, list(p.real_lens))))
    seen = {}
    for q in range(c):
        s = p.cp_shard(q, cp_size=c)
        lp = s.expand(token_logprobs(logits[s.cp.rows], s))
        for i, pos, part in zip(s.sample_indices.tolist(), s.cp.sample_positions, s.split(lp)):
            assert torch.equal(part, per_sample[i][pos])
            seen.update({(i, t): q for t in pos.tolist()})
    assert len(seen) == sum(p.real_lens)                          # every entry scored by exactly one member


@given(st.integers(0, 10**6), st.booleans(), st.integers(2, 4))
def test_chunked_logprobs_of_a_shard_match_its_token_logprobs(seed, tree, c):
    """chunked_token_logprobs on a shard (hidden states and LM head) gives the shard's per-sample
    layout, as token_logprobs on the logits does; a member scoring nothing gets an empty one."""
    from microplan.torch import chunked_token_logprobs, token_logprobs
    micro, toks, masks = _full_row(seed, tree)
    p = pack_micro(micro, toks, loss_masks=masks)
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(p.num_tokens, 5, generator=g, dtype=torch.float64)
    head = torch.randn(9, 5, generator=g, dtype=torch.float64)
    for q in range(c):
        s = p.cp_shard(q, cp_size=c)
        h = hidden[s.cp.rows]
        want = token_logprobs(h @ head.T, s)
        got = chunked_token_logprobs(h, head, s, chunk_tokens=3)
        assert got.shape == want.shape == (s.tree.sample_weights.numel(),)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_a_branch_node_scores_each_childs_first_token():
    """A prompt of 6 tokens and three completions: the row of the prompt's last token scores the
    first token of each completion, all on the member that owns that row."""
    prompt = torch.arange(6)
    toks = [torch.cat([prompt, torch.tensor([10 + k, 20 + k])]) for k in range(3)]
    parent, shared = mp.find_shared_prefixes(toks)
    plan = mp.plan(mp.Batch([8, 8, 8], prefix_parent=parent, shared_prefix_lens=shared),
                   mp.PlanConfig(dp_size=1, max_tokens_per_micro=64, share_prefixes=True))
    p = pack_micro(plan.steps[0].micros[0][0], toks)
    branch = int(p.tree.sample_rows[0][5])                        # the prompt's last token, shared by all three
    for q in range(2):
        s = p.cp_shard(q, cp_size=2)
        s.validate()
        at = s.cp.rows[s.tree.flat_rows] == branch
        targets = sorted(s.cp.target_ids[at & s.cp.predicted].tolist())
        held = branch in s.cp.rows.tolist()
        assert targets == ([10, 11, 12] if held else [])
        assert s.num_tokens <= -(-p.num_tokens // 2)


def _prev_rows(p) -> list[int]:
    """The row whose logits predict each row of an unsharded row (-1: none)."""
    from microplan.torch.loss import predecessor_index
    return predecessor_index(p, "cpu").tolist()


def test_a_shard_whose_layouts_have_equal_lengths_takes_per_sample_losses():
    """Seed 5, c = 2, member 1: the shard holds as many rows as per-sample entries, in a different
    order. Its losses are written in the per-sample layout (token_logprobs / pack_values), so
    weighted_loss reads them so without per_sample=True; per_sample=False is refused (its rows'
    logits score the tokens after them: there is no loss per row)."""
    from microplan.torch import weighted_loss
    micro, toks, masks = _full_row(5, True)
    s = pack_micro(micro, toks, loss_masks=masks).cp_shard(1, cp_size=2)
    S = s.tree.sample_weights.numel()
    assert S == s.num_tokens and not s.tree.in_row_order
    ell = torch.arange(S, dtype=torch.float64) + 1.0
    assert float(weighted_loss(ell, s)) == float(weighted_loss(ell, s, per_sample=True)) == \
        float((ell * s.tree.sample_weights).sum())
    with pytest.raises(mp.PlanError, match="per sample"):
        weighted_loss(ell, s, per_sample=False)
    with pytest.raises(mp.PlanError, match="per-sample layout"):
        s.expand(torch.zeros(S + 1))


def test_a_shard_of_a_row_padded_to_a_row_multiple_validates():
    """Regression: PackedMicro.validate() held a shard to its full row's row multiple (6 rows of
    a 12-token row padded to 4 are no multiple of 4) and refused every such shard."""
    toks = [torch.arange(5), torch.arange(6)]
    plan = mp.plan(mp.Batch([5, 6]), mp.PlanConfig(dp_size=1, max_tokens_per_micro=64, pad_row_to_multiple_of=4))
    p = pack_micro(plan.steps[0].micros[0][0], toks)
    assert p.num_tokens == 12
    for q in range(2):
        s = p.cp_shard(q, cp_size=2)
        assert s.num_tokens == 6
        s.validate()


def test_placeholder_and_tiny_rows_give_every_member_a_query():
    plan = mp.plan(mp.Batch([3]), mp.PlanConfig(dp_size=2, max_tokens_per_micro=8))
    ph = next(m for row in plan.steps[0].micros for m in row if m.is_placeholder)
    p = pack_micro(ph, {})
    for q in range(4):
        s = p.cp_shard(q, cp_size=4)
        s.validate()
        assert s.num_tokens == 1 and s.is_placeholder and pack_values(s, {}).numel() == 0
        assert s.cp.own_index.numel() == (1 if q == 0 else 0)


def test_shard_refusals():
    micro, toks, masks = _full_row(3, True)
    p = pack_micro(micro, toks, loss_masks=masks)
    assert p.cp_shard(0) is p                                     # cp_size 1: the row itself
    with pytest.raises(mp.PlanError, match="cp_rank=2 must be an int in 0..1"):
        p.cp_shard(2, cp_size=2)
    with pytest.raises(mp.PlanError, match="already a CP shard"):
        p.cp_shard(0, cp_size=2).cp_shard(0, cp_size=2)
    with pytest.raises(mp.PlanError, match="cp_size=0"):
        p.cp_shard(0, cp_size=0)
    with pytest.raises(mp.PlanError, match="initialised torch.distributed"):
        with context_parallel(None):
            pass
    model = make_model(3, attn=register_attention(), max_positions=128)
    with pytest.raises(mp.PlanError, match="inside `with microplan.torch.context_parallel"):
        model(**p.cp_shard(1, cp_size=2).model_inputs(), use_cache=False)


# ---------------------------------------------------------------- exactness on gloo


@pytest.fixture(scope="module")
def gloo_results():
    with one_thread():
        state = {k: v.clone() for k, v in make_model(3, max_positions=128).state_dict().items()}
        data = X.datasets()
        refs = X.reference(state, data)
    res = run_gloo(X.rank_worker, X.WORLD, args=(state, data, refs), timeout_s=600)
    for r, out in enumerate(res):
        assert not isinstance(out, RankError), f"rank {r}: {out.type}: {out.message}\n{out.traceback}"
    return res


@pytest.mark.parametrize("case", X.cases(), ids=lambda c: "-".join(map(str, c)))
def test_cp_gradients_and_objective_are_exact(gloo_results, case):
    kind, c, _, _ = case
    worst_g = max(out[case]["errors"][m][0] for out in gloo_results for m in mp.LOSS_MODES)
    worst_J = max(out[case]["errors"][m][1] for out in gloo_results for m in mp.LOSS_MODES)
    assert worst_g < 1e-12 and worst_J < 1e-12, (case, worst_g, worst_J)
    widths = sorted({w for out in gloo_results for w in out[case]["ran"]["widths"]})
    assert all(out[case]["ran"]["sharded"] > 0 for out in gloo_results)   # every process ran real CP
    assert max(widths) == c
    if kind.startswith("dynamic"):                                # slots mixing CP widths ran
        assert len(widths) > 1, widths
    assert sum(out[case]["ran"]["crossed"] for out in gloo_results) > 0    # targets held by another member
    assert all(out[case]["ran"]["max_rows_over_share"] <= 0 for out in gloo_results)  # ⌈U/c⌉ rows per GPU


def test_members_owning_nothing_run_and_a_wrong_group_is_refused(gloo_results):
    """A placeholder over 4 members (3 own no token): every member runs forward and backward, the
    loss is an exact 0 connected to the graph, no collective hangs. A shard of a 4-wide group run
    under a 2-process group is a PlanError on every member, before any collective."""
    for out in gloo_results:
        extra = out["extras"]
        assert extra["placeholder_loss"] == 0.0 and extra["placeholder_grad_norm"] == 0.0
        assert "is member" in extra["wrong_group"] and "CP group of 4" in extra["wrong_group"]
