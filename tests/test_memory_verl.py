"""verl install with a memory budget: micro-batches planned under max_bytes_per_micro, the forward model in
forward-only passes, the budget validated at install and cleared by uninstall."""

from __future__ import annotations

import numpy as np
import pytest
from _require import require

verl = require("verl")

import microplan as mp  # noqa: E402
import microplan.integrations.verl as mpv  # noqa: E402
from microplan.integrations import _verl_meter  # noqa: E402

MODEL = mp.MemoryModel(per_token=30_000.0, per_sample_sq=40.0, per_micro=1e6,
                       forward=mp.MemoryModel(per_token=8_000.0, per_micro=1e6))


@pytest.fixture
def installed():
    yield
    mpv.uninstall()


def test_budget_bounds_every_micro_batch(installed):
    lens = np.random.default_rng(0).integers(20, 900, 64)
    B = 60 * 2 ** 20
    mpv.install(memory=MODEL, max_bytes_per_micro=B, meter=False)
    layout = mpv.plan_micro_batches(lens, max_token_len=10 ** 6, dp_group=None)
    layout.plan.validate()
    assert layout.plan.config.memory == MODEL and layout.plan.stats.max_micro_bytes <= B
    assert sorted(i for lst in layout.index_lists for i in lst) == list(range(lens.size))
    _verl_meter.STATE["forward_only"] = True  # what the wrapped engine sets inside a forward-only pass
    try:
        fwd = mpv.plan_micro_batches(lens, max_token_len=10 ** 6, dp_group=None)
    finally:
        _verl_meter.STATE["forward_only"] = False
    assert fwd.plan.config.memory == MODEL.forward and len(fwd.index_lists) < len(layout.index_lists)
    mpv.uninstall()
    plain = mpv.plan_micro_batches(lens, max_token_len=10 ** 6, dp_group=None)
    assert plain.plan.config.memory is None and len(plain.index_lists) == 1


def test_install_refuses_half_a_budget(installed):
    with pytest.raises(mp.PlanError, match="max_bytes_per_micro"):
        mpv.install(memory=MODEL)
