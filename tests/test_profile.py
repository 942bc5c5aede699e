"""microplan.torch.profile_cost and the timing helpers.

A fake ``run_micro`` advances an injected clock by a known cost of the micro-batch it is given
(deterministic, instant), so the design, the fit, the held-out error and the regime detection are
checked exactly; a small real model checks the whole loop end to end on CPU.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

import microplan as mp
from microplan import CostMeter, FlopsCost, PlanError
from microplan.torch import (MicroTimer, PackedMicro, lockstep_records, profile_cost, profile_design,
                             register_attention, time_call)
from microplan.torch.profile import MIN_CAP, attention_regime, check_identifiable


class FakeMachine:
    """A clock and a run_micro whose time is ``truth.micro_cost(seq_lens)`` (times 1 + a fixed jitter)."""

    def __init__(self, truth: FlopsCost, *, jitter: float = 0.0, seed: int = 0):
        self.truth, self.jitter, self.t, self.calls = truth, jitter, 0.0, []
        self.rng = np.random.default_rng(seed)

    def clock(self) -> float:
        return self.t

    def run(self, p: PackedMicro) -> None:
        assert isinstance(p, PackedMicro)
        p.validate()
        self.calls.append(p.seq_lens)
        noise = 1.0 + self.jitter * float(self.rng.uniform(-1, 1)) if self.jitter else 1.0
        self.t += self.truth.micro_cost(list(p.seq_lens)) * noise


VARLEN = FlopsCost(linear=2e-4, quadratic=6e-8, per_micro=0.02)
PACKED = FlopsCost(linear=2e-4, quadratic=0.0, packed_quadratic=1.1e-7, per_micro=0.01)
LINEAR = FlopsCost(linear=3e-4, quadratic=1e-12, per_micro=0.05)


@pytest.mark.parametrize("truth,regime", [(VARLEN, "varlen"), (PACKED, "packed"), (LINEAR, "linear")])
def test_exact_machine_recovers_coefficients_and_regime(truth, regime):
    fake = FakeMachine(truth)
    res = profile_cost(fake.run, max_tokens_per_micro=4096, clock=fake.clock, vocab_size=50)
    assert res.regime == regime
    np.testing.assert_allclose(res.cost.coefficients(), truth.coefficients(), rtol=1e-6, atol=1e-15)
    assert res.r2 > 1 - 1e-9 and res.heldout_median_error < 1e-9 and res.heldout_max_error < 1e-9
    # the regime calibrate chose: a dense kernel fits the packed term too
    assert set(res.terms) == {"linear", "quadratic", "per_micro"} | ({"packed_quadratic"} if regime == "packed" else set())


def test_noisy_machine_heldout_error_and_rows():
    fake = FakeMachine(PACKED, jitter=0.03, seed=1)
    res = profile_cost(fake.run, max_tokens_per_micro=4096, repeats=5, clock=fake.clock, time_budget_s=None)
    design = profile_design(4096)
    assert res.regime == "packed"
    assert res.heldout_median_error < 0.03 and res.r2 > 0.99
    assert len(res.rows) == len(design.fit) + len(design.heldout) == res.num_rows + len(design.heldout)
    for row, comp in zip(res.rows, design.fit + design.heldout):
        assert row["seq_lens"] == list(comp) and len(row["times"]) == 5
        assert row["seconds"] == pytest.approx(float(np.median(row["times"])))
        assert row["heldout"] == (comp in design.heldout)
    # warm-up (3 distinct compositions) + 5 passes over everything
    assert len(fake.calls) == 3 + 5 * len(res.rows)


def test_design_spans_the_cap_and_holds_out_unseen_compositions():
    d = profile_design(4096, heldout=6, seed=3)
    fit = {tuple(sorted(c)) for c in d.fit}
    assert (4096,) in d.fit and any(sum(c) == 4096 and len(c) >= 32 for c in d.fit)
    assert min(sum(c) for c in d.fit) <= 64 and len({sum(c) for c in d.fit}) >= 5
    assert len(d.heldout) == 6 and not fit & {tuple(sorted(c)) for c in d.heldout}
    assert all(1 <= sum(c) <= 4096 and min(c) >= 1 for c in d.fit + d.heldout)
    assert profile_design(4096, seed=3) == d and profile_design(4096, seed=4).heldout != d.heldout
    check_identifiable(d.fit)


def test_time_budget_stops_adding_passes():
    fake = FakeMachine(VARLEN)
    res = profile_cost(fake.run, max_tokens_per_micro=4096, repeats=10, clock=fake.clock, time_budget_s=30.0)
    warm = sum(VARLEN.micro_cost(list(c)) for c in fake.calls[:3])
    one_pass = sum(VARLEN.micro_cost(r["seq_lens"]) for r in res.rows)
    k = 1
    while k < 10 and warm + (k + 1) * one_pass <= 30.0:  # the next pass would still end within budget
        k += 1
    assert 2 <= k < 10 and {len(r["times"]) for r in res.rows} == {k}
    fake2 = FakeMachine(VARLEN)
    res2 = profile_cost(fake2.run, max_tokens_per_micro=4096, repeats=4, clock=fake2.clock, time_budget_s=0.001)
    assert {len(r["times"]) for r in res2.rows} == {1}  # the first pass always runs


def test_collinear_compositions_are_refused_before_running():
    fake = FakeMachine(VARLEN)
    with pytest.raises(PlanError, match="quadratic.*packs of several samples"):
        profile_cost(fake.run, max_tokens_per_micro=4096, clock=fake.clock,
                     compositions=[[4096], [2048], [1024], [16], [300]])  # singles only: Σ L² = T²
    with pytest.raises(PlanError, match="per_micro|linear"):
        profile_cost(fake.run, max_tokens_per_micro=4096, clock=fake.clock,
                     compositions=[[4096], [2048, 2048], [512] * 8, [64] * 64])  # one total only
    with pytest.raises(PlanError, match="too small to profile"):
        profile_cost(fake.run, max_tokens_per_micro=MIN_CAP - 1, clock=fake.clock)
    assert fake.calls == []
    # singles are enough when the backend is known to be varlen
    res = profile_cost(fake.run, max_tokens_per_micro=4096, clock=fake.clock, packed=False,
                       compositions=[[4096], [2048], [1024], [16], [300]])
    np.testing.assert_allclose(res.cost.coefficients(), VARLEN.coefficients(), rtol=1e-6)


@pytest.mark.parametrize("kw,match", [
    (dict(repeats=0), "repeats"), (dict(time_budget_s=-1), "time_budget_s"), (dict(packed="yes"), "packed"),
    (dict(compositions=[[5000]] * 4), "summing to <="), (dict(heldout=[[0, 3]]), ">= 1 lengths"),
    (dict(vocab_size=0), "vocab_size")])
def test_bad_options(kw, match):
    fake = FakeMachine(VARLEN)
    with pytest.raises(PlanError, match=match):
        profile_cost(fake.run, max_tokens_per_micro=4096, clock=fake.clock, **kw)


def test_attention_regime_thresholds():
    assert attention_regime(FlopsCost(linear=1.0), 4096) == "linear"
    assert attention_regime(FlopsCost(linear=1.0, quadratic=1e-3), 4096) == "varlen"
    assert attention_regime(FlopsCost(linear=1.0, quadratic=1e-4, packed_quadratic=2e-4), 4096) == "packed"


# -- timing helpers -------------------------------------------------------------------------------
def test_micro_timer_host_clock_feeds_meter():
    t = [0.0]
    timer = MicroTimer("cpu", clock=lambda: t[0])
    micros = [mp.Micro([0, 1], [100, 50], [99, 49], [1.0, 1.0]), mp.Micro([2], [400], [399], [1.0])]
    for m, dt in zip(micros, (0.5, 1.5)):
        with timer.time(m):
            t[0] += dt
    with pytest.raises(RuntimeError):
        with timer.time(micros[0]):
            raise RuntimeError("boom")  # dropped, not recorded half-timed
    meter = CostMeter(prior=FlopsCost(linear=1.0))
    out = timer.feed(meter)
    assert [o.seconds for o in out] == [0.5, 1.5] and [o.micro for o in out] == micros
    assert meter.num_records == 2 and len(timer) == 0 and timer.resolve() == []


class _FakeEvent:
    log: list[str] = []
    n = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        _FakeEvent.n += 1
        self.i = _FakeEvent.n

    def record(self):
        _FakeEvent.log.append(f"record{self.i}")

    def synchronize(self):
        _FakeEvent.log.append(f"sync{self.i}")

    def elapsed_time(self, end):
        return 1000.0 * (end.i - self.i)  # milliseconds


def test_micro_timer_cuda_path_syncs_once_at_resolve(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: _FakeEvent.log.append("device_sync"))
    _FakeEvent.log, _FakeEvent.n = [], 0
    timer = MicroTimer("cuda")
    assert timer.uses_events
    for m in ("a", "b", "c"):
        with timer.time(m):
            pass
    assert not any(s.startswith("sync") for s in _FakeEvent.log)  # no host sync inside the step
    out = timer.resolve()
    assert _FakeEvent.log[-1] == "sync6" and sum(s.startswith("sync") for s in _FakeEvent.log) == 1
    assert [o.micro for o in out] == ["a", "b", "c"] and all(o.seconds == 1.0 for o in out)
    _FakeEvent.log = []
    assert time_call(lambda: None, device="cuda") == 1.0 and _FakeEvent.log[0] == "device_sync"


def test_lockstep_records_keep_the_slowest_micro_per_slot():
    cost = FlopsCost(linear=1.0)
    a, b = mp.Micro([0], [10], [9], [1.0]), mp.Micro([1], [30], [29], [1.0])
    c, d = mp.Micro([2], [50], [49], [1.0]), mp.Micro([3], [5], [4], [1.0])
    recs = lockstep_records([[a, c], [b, d]], [[3.0, 6.0], [3.1, 5.9]], cost)
    assert [(r.micro, r.seconds) for r in recs] == [(b, 3.1), (c, 6.0)]
    with pytest.raises(PlanError, match="same number"):
        lockstep_records([[a], [b, d]], [[1.0], [1.0, 2.0]], cost)
    with pytest.raises(PlanError, match="every micros"):
        lockstep_records([[a]], [[1.0, 2.0]], cost)


# -- a real model, end to end ---------------------------------------------------------------------
def _llama(impl):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                      attn_implementation=impl)
    model = LlamaForCausalLM(cfg).float()
    return lambda p: model(**p.model_inputs(), use_cache=False).logits.float().mean().backward()


@pytest.mark.parametrize("impl,regime", [("sdpa", "packed"), ("varlen", "varlen")])
def test_real_backends_show_their_regime_on_a_work_clock(impl, regime, monkeypatch):
    """The real model under both backends, on a clock that counts the work done: tokens, plus the
    score elements of every sdpa call (what a compute-bound attention kernel pays). Deterministic,
    so the regime the backend *does* is detected whatever the machine's load."""
    work = [0.0]
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, *a, **kw):
        work[0] += 1e-7 * q.shape[-2] * k.shape[-2]
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model_run = _llama(register_attention() if impl == "varlen" else impl)

    def run(p):
        work[0] += 1e-4 * p.num_tokens + 1e-2
        model_run(p)

    res = profile_cost(run, max_tokens_per_micro=256, repeats=1, warmup=0, vocab_size=64, clock=lambda: work[0])
    assert res.regime == regime and res.heldout_max_error < 1e-6 and res.r2 > 1 - 1e-9


@pytest.mark.parametrize("impl,regime", [("sdpa", "packed"), ("varlen", None)])
def test_real_model_timed_end_to_end(impl, regime):
    """Wall-clock timing of a real model: the loop runs and reports. sdpa over a packed row computes
    every T² pair, which the wall clock shows whatever the load (4 of 4 runs on the loaded 2-core
    machine): its regime must be "packed". microplan's varlen attention at this size (T ≤ 512, hidden
    64) spends its time in per-sample overheads, and the regime the wall clock picks is noise (it
    came out "packed" in 4 of 4 runs, held-out error 5-13 %): its regime is asserted on the work
    clock above, not here. The clock is this thread's CPU time with torch on one thread, so other
    processes sharing the cores (a parallel test worker, a loaded CI box) do not move the timings:
    under `pytest -n 2` the wall clock read "varlen" for sdpa once."""
    run = _llama(register_attention() if impl == "varlen" else impl)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        res = profile_cost(run, max_tokens_per_micro=512, repeats=2, vocab_size=64, device="cpu", time_budget_s=60,
                           clock=time.thread_time)
    finally:
        torch.set_num_threads(threads)
    assert res.num_rows == len(profile_design(512).fit)
    if regime is not None:
        assert res.regime == regime, res.cost.describe()
    assert all(math.isfinite(c) and c >= 0 for c in res.cost.coefficients())
    assert res.cost.linear + res.cost.quadratic + res.cost.packed_quadratic > 0
    assert res.heldout_median_error is not None and math.isfinite(res.heldout_median_error)
    assert all(r["seconds"] > 0 and len(r["times"]) >= 1 for r in res.rows)
