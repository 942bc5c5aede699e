"""``Footprint.bin_shape``: every bin's tokens and cost at once, as the layout rules of
docs/layouts.md price each micro-batch alone (``reference.micro_shape`` / ``micro_body``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import microplan as mp
from microplan.footprint import footprint_of
from reference import held_tokens, micro_body, micro_shape


@given(st.integers(0, 2 ** 32 - 1), st.sampled_from(["varlen", "padded", "padded-2d"]), st.sampled_from([1, 16]),
       st.sampled_from([1, 8]), st.booleans())
def test_bin_shape_prices_each_bin_as_the_layout_rules(seed, layout, m, r, dense):
    rng = np.random.default_rng(seed)
    n, nb = int(rng.integers(1, 60)), int(rng.integers(1, 12))
    lens = rng.integers(2, 500, n)
    plens = np.minimum(rng.integers(1, 100, n), lens - 1)
    cost = mp.FlopsCost(linear=3.0, quadratic=0.01, per_micro=40.0, packed_quadratic=0.02 if dense else 0.0)
    cfg = mp.PlanConfig(dp_size=1, max_tokens_per_micro=10 ** 6, layout=layout, pad_to_multiple_of=m,
                        pad_row_to_multiple_of=r, cost=cost)
    batch = mp.Batch(lens, prompt_lens=plens)
    fp = footprint_of(batch, cfg)
    idx = rng.permutation(n)[: int(rng.integers(1, n + 1))]
    bin_of = rng.integers(0, nb, idx.size)
    tokens, costs = fp.bin_shape(cost, idx, bin_of, nb)
    assert tokens.dtype == np.int64 and np.array_equal(tokens, fp.bin_tokens(idx, bin_of, nb))
    assert np.array_equal(costs, fp.bin_costs(cost, idx, bin_of, nb))
    for b in range(nb):
        members = idx[bin_of == b].tolist()
        assert tokens[b] == held_tokens(members, lens, plens, cfg)
        body = micro_body(cost, micro_shape(members, lens, plens, cfg), rows=layout != "varlen") if members else 0.0
        assert costs[b] == pytest.approx(body + cost.per_micro, rel=1e-12)
