"""Property tests of layouts and padding rules: random batches × random configs × random multiples.

Every random config of tests/reference.py gets a random layout (varlen, padded, padded-2d) and
random multiples (per sample 1–64, per row 1–16). Then: 0 micro-batches whose padded size
exceeds the cap (counted by hand, ``reference.held_tokens``), every invariant of DESIGN.md
(``reference.check_plan``, ``Plan.validate``), stats that agree with the micro-batches, exact JSON
round trips, determinism, and ``pack_micro`` output that passes ``validate()`` with exactly the
planned footprint. A sample that fits alone only before padding must be refused, and only then.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import event, given, note
from hypothesis import strategies as st

import microplan as mp
from microplan.torch import PaddedMicro, pack_micro
from reference import cases, check_plan, configs, held_tokens, is_dynamic_cp, step_times


@st.composite
def layout_fields(draw) -> dict:
    return {"layout": draw(st.sampled_from(["varlen", "varlen", "padded", "padded-2d"])),
            "pad_to_multiple_of": draw(st.one_of(st.just(1), st.integers(1, 64), st.sampled_from([2, 4, 8, 16]))),
            "pad_row_to_multiple_of": draw(st.one_of(st.just(1), st.integers(1, 16)))}


def _batch(case, layout: str, rng: np.random.Generator) -> mp.Batch:
    kw = dict(case.kwargs)
    if layout == "padded-2d" and "prompt_lens" not in kw:  # 2D needs prompt lengths; keep the loss tokens
        kw["prompt_lens"] = rng.integers(0, case.seq_lens + 1)
        kw["loss_tokens"] = case.loss_tokens
    return mp.Batch(case.seq_lens, **kw)


def _alone_over_cap(b: mp.Batch, cfg: mp.PlanConfig) -> bool:
    """Does some sample exceed the cap on its own once padded (CP: cap × the widest group)?"""
    if cfg.max_tokens_per_micro is None:
        return False
    width = cfg.context_parallel.max_size if is_dynamic_cp(cfg) else cfg.static_cp_size
    cap = cfg.max_tokens_per_micro * width
    return any(held_tokens([i], b.seq_lens, b.prompt_lens, cfg) > cap for i in range(b.num_samples))


def _check_packing(plan: mp.Plan, limit: int = 6) -> None:
    """pack_micro of a few micro-batches (placeholders included) passes validate() and holds the footprint."""
    b = plan.batch
    toks = [torch.arange(int(n)) % 97 for n in b.seq_lens.tolist()]
    masks = [torch.cat([torch.zeros(int(n - k), dtype=torch.bool), torch.ones(int(k), dtype=torch.bool)])
             for n, k in zip(b.seq_lens.tolist(), b.loss_tokens.tolist())]
    done = 0
    for step in plan.steps:
        for row in step.micros:
            for micro in row:
                if done >= limit:
                    return
                if (micro.loss_tokens >= micro.seq_lens).any():
                    continue  # a loss on a sample's first token is refused by pack_micro (tested elsewhere)
                p = pack_micro(micro, toks, loss_masks=masks)
                p.validate()
                if isinstance(p, PaddedMicro):
                    assert p.num_tokens == max(micro.num_tokens, p.width if micro.is_placeholder else 0)
                    assert p.width % plan.config.pad_to_multiple_of == 0
                    assert p.width % plan.config.pad_row_to_multiple_of == 0
                else:
                    if not micro.is_placeholder:
                        assert p.num_tokens == micro.num_tokens
                        assert all(n % plan.config.pad_to_multiple_of == 0 for n in p.seq_lens[:p.num_samples])
                    assert p.num_tokens % plan.config.pad_row_to_multiple_of == 0
                assert float(p.loss_weights[~p.loss_mask].abs().sum()) == 0.0
                done += 1


def _check_stats(plan: mp.Plan) -> None:
    cfg, b = plan.config, plan.batch
    per_gpu = [-(-held_tokens(m.indices.tolist(), b.seq_lens, b.prompt_lens, cfg) // m.cp_size)
               for s in plan.steps for r in s.micros for m in r]
    assert plan.stats.max_micro_tokens == max(per_gpu, default=0)
    if cfg.max_tokens_per_micro is not None:
        assert plan.stats.max_micro_tokens <= cfg.max_tokens_per_micro
    lock = sum(step_times(plan, s)[0] for s in range(len(plan.steps)))
    assert plan.stats.lockstep_time == pytest.approx(lock, rel=1e-9)
    assert plan.stats.predicted_time >= plan.stats.time_lower_bound * (1 - 1e-9)
    assert plan.stats.micro_count >= plan.stats.micro_count_lower_bound


@given(data=st.data(), case=cases(max_samples=300))
def test_random_layouts_keep_every_guarantee(data, case):
    cfg0 = data.draw(configs(case, max_dp=64))
    fields = data.draw(layout_fields())
    fields["short_step"] = data.draw(st.sampled_from(["pad", "pad", "pad", cfg0.short_step]))  # mostly plannable
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    note(f"layout: {fields}")
    try:
        cfg = dataclasses.replace(cfg0, **fields)
    except mp.PlanError as exc:  # refused: dynamic CP, or a multiple beyond the cap
        msg = str(exc)
        assert is_dynamic_cp(cfg0) or "exceeds max_tokens_per_micro" in msg or "split like a sample" in msg, msg
        event("config refused")
        return
    b = _batch(case, cfg.layout, rng)
    if _alone_over_cap(b, cfg):
        with pytest.raises(mp.PlanError, match="occupies|tokens"):
            mp.plan(b, cfg)
        event("a sample over the cap once padded: refused")
        return
    try:
        plan = mp.plan(b, cfg)
    except mp.PlanError as exc:  # steps that cannot be cut or aligned: the same refusals as without padding
        msg = str(exc)
        assert "Steps(" in msg or "short_step" in msg, msg
        event("refused: steps/short_step")
        return
    event(f"layout {cfg.layout}")
    plan.validate()
    check_plan(plan, case.seq_lens, case.loss_tokens, case.pc, case.rc, cfg)  # invariants 1–5, padded cap
    _check_stats(plan)
    back = mp.Plan.from_json(plan.to_json())
    assert back == plan and back.fingerprint() == plan.fingerprint()
    back.validate()
    assert mp.plan(b, cfg).fingerprint() == plan.fingerprint()
    _check_packing(plan)


@given(data=st.data(), case=cases(max_samples=200, max_cap=512))
def test_zigzag_multiples_keep_each_cp_rank_under_the_cap(data, case):
    """Static CP c with every sample padded to 2·c (and the row to a multiple of that): each CP
    rank holds exactly num_tokens / c tokens, and that never exceeds the per-GPU cap."""
    c = data.draw(st.sampled_from([2, 4, 8]))
    cap = data.draw(st.integers(max(2 * c, -(-case.cap // c)), max(2 * c, case.cap)))
    row = 2 * c * data.draw(st.integers(1, 3))
    try:
        cfg = mp.PlanConfig(dp_size=data.draw(st.integers(1, 16)), max_tokens_per_micro=cap,
                            context_parallel=mp.ContextParallel(size=c), pad_to_multiple_of=2 * c,
                            pad_row_to_multiple_of=row)
    except mp.PlanError:
        return  # the row multiple exceeds cap × c
    b = case.batch()
    if _alone_over_cap(b, cfg):
        with pytest.raises(mp.PlanError):
            mp.plan(b, cfg)
        return
    plan = mp.plan(b, cfg)
    plan.validate()
    check_plan(plan, case.seq_lens, case.loss_tokens, case.pc, case.rc, cfg)
    for step in plan.steps:
        for r in step.micros:
            for m in r:
                assert m.num_tokens % (2 * c) == 0 and m.num_tokens // c <= cap
    assert plan.stats.max_micro_tokens <= cap
