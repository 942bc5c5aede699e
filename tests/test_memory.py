"""MemoryModel and planning against bytes (core, numpy only): PlanConfig(memory=, max_bytes_per_micro=)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import microplan as mp
from microplan.memory.check import sample_bytes, step_micro_bytes
from microplan.memory.fit import fit_memory
from microplan.memory.plan import _lone_mode, pack_token_bound
from microplan.footprint import footprint_of

LLAMA = dict(model_type="llama", vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, hidden_act="silu")
MiB = 2 ** 20


def _model(kind: str = "varlen", margin: float = 0.0) -> mp.MemoryModel:
    return {"linear": mp.MemoryModel(per_token=30_000.0, per_micro=1e6, margin=margin),
            "varlen": mp.MemoryModel(per_token=30_000.0, per_sample_sq=40.0, per_micro=1e6, margin=margin),
            "packed": mp.MemoryModel(per_token=30_000.0, per_row_sq=9.0, per_micro=1e6, margin=margin)}[kind]


# -- the model ---------------------------------------------------------------------------------
def test_micro_bytes_regimes():
    v = _model("varlen")
    assert v.micro_bytes([1000]) == 30_000 * 1000 + 40 * 10 ** 6 + 10 ** 6
    assert v.micro_bytes([500, 500]) == 30_000 * 1000 + 40 * 2 * 250_000 + 10 ** 6
    p = _model("packed")
    assert p.dense and p.micro_bytes([1000]) == 30_000 * 1000 + 10 ** 6          # a lone sample: no mask
    assert p.micro_bytes([500, 500]) == 30_000 * 1000 + 9 * 10 ** 6 + 10 ** 6    # a pack pays T²
    floored = replace(v, floor=5e7)
    assert floored.micro_bytes([1]) == 50_000_000
    assert replace(v, margin=0.1).with_margin(1000) == 1100


@pytest.mark.parametrize("kw, match", [
    (dict(per_token=0.0), "per_token"), (dict(per_token=-1.0), "per_token"),
    (dict(per_token=1.0, per_row_sq=float("nan")), "finite"), (dict(per_token=1.0, margin=20.0), "margin"),
    (dict(per_token=1.0, forward=3), "forward"),
])
def test_model_refuses_bad_values(kw, match):
    with pytest.raises(mp.PlanError, match=match):
        mp.MemoryModel(**kw)


def test_model_round_trips():
    m = mp.MemoryModel.from_hf_config(LLAMA, dtype="bfloat16", attention="eager", gradient_checkpointing=True)
    from microplan.memory import memory_from_dict
    assert memory_from_dict(m.to_dict()) == m
    assert m.forward is not None and m.forward.forward is None


def test_from_hf_config_regimes_and_policies():
    kw = dict(dtype="float32")
    fa = mp.MemoryModel.from_hf_config(LLAMA, attention="fa2", **kw)
    eager = mp.MemoryModel.from_hf_config(LLAMA, attention="eager", **kw)
    sdpa = mp.MemoryModel.from_hf_config(LLAMA, attention="sdpa-packed", **kw)
    ckpt = mp.MemoryModel.from_hf_config(LLAMA, attention="fa2", gradient_checkpointing=True, **kw)
    bf16 = mp.MemoryModel.from_hf_config(LLAMA, attention="fa2", dtype="bfloat16")
    assert fa.per_sample_sq == fa.per_row_sq == 0 and eager.per_sample_sq > 0 and eager.per_row_sq > 0
    assert sdpa.per_sample_sq == 0 and sdpa.per_row_sq > 0
    assert ckpt.per_token < fa.per_token and bf16.per_token < fa.per_token
    assert fa.forward.per_token < fa.per_token / 2  # no saved activations
    with pytest.raises(mp.PlanError, match="attention"):
        mp.MemoryModel.from_hf_config(LLAMA, dtype="float32", attention="hedged")
    with pytest.raises(mp.PlanError, match="dtype"):
        mp.MemoryModel.from_hf_config(LLAMA, dtype="float13", attention="fa2")


def test_fit_recovers_coefficients():
    truth = mp.MemoryModel(per_token=1234.0, per_row_sq=3.0, per_micro=5e5)
    comps = [(1024,), (512,), (256,), (512, 512), (128,) * 8, (32,) * 32, (600, 200, 100), (300,) * 3, (128,)]
    got = fit_memory(comps, [truth.micro_bytes(c) for c in comps], min_tokens=128)
    assert got.regime == "packed"
    assert got.model.per_token == pytest.approx(1234.0, rel=1e-6)
    assert got.model.per_row_sq == pytest.approx(3.0, rel=1e-5)
    assert got.max_relative_error < 1e-6


# -- config ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(memory=_model()), "max_bytes_per_micro"),
    (dict(max_bytes_per_micro=10 ** 9), "memory model"),
    (dict(memory="x", max_bytes_per_micro=10 ** 9), "MemoryModel"),
    (dict(memory=_model(), max_bytes_per_micro=0), ">= 1"),
    (dict(memory=_model(), max_bytes_per_micro=10 ** 9, micro_batch_size=4), "micro_batch_size"),
])
def test_config_refuses(kw, match):
    with pytest.raises(mp.PlanError, match=match):
        mp.PlanConfig(dp_size=2, **kw)


def test_config_round_trip_and_old_json_unchanged():
    cfg = mp.PlanConfig(dp_size=2, memory=_model("packed", 0.05), max_bytes_per_micro=10 ** 9)
    assert mp.PlanConfig.from_dict(cfg.to_dict()) == cfg and cfg.dynamic
    assert "memory" not in mp.PlanConfig(dp_size=2, max_tokens_per_micro=100).to_dict()


# -- planning against bytes --------------------------------------------------------------------
def _all_bytes(plan: mp.Plan) -> np.ndarray:
    fp = footprint_of(plan.batch, plan.config)
    return np.concatenate([step_micro_bytes(plan.batch, plan.config, s, fp, plan.config.memory).ravel()
                           for s in plan.steps])


@st.composite
def memory_cases(draw):
    n = draw(st.integers(1, 60))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31)))
    lens = rng.integers(1, draw(st.sampled_from([50, 400, 2000])), n)
    kind = draw(st.sampled_from(["linear", "varlen", "packed"]))
    model = _model(kind, draw(st.sampled_from([0.0, 0.05])))
    mult = draw(st.sampled_from([1.0, 1.5, 4.0, 20.0]))
    extra = draw(st.sampled_from([{}, {"share_prefixes": True}, {"layout": "padded"}, {"pad_to_multiple_of": 8},
                                  {"context_parallel": mp.ContextParallel(size=2)}, {"placement": "local"},
                                  {"max_tokens_per_micro": int(lens.max()) + 50}, {"layout": "padded-2d"},
                                  {"context_parallel": mp.ContextParallel(max_size=2)}, {"vision": True}]))
    kw = {}
    if extra.pop("vision", False):  # vision patches priced per patch, under a vision cap
        kw = dict(vision_tokens=rng.integers(0, 30, n))
        extra = {"max_vision_tokens_per_micro": 60}
        model = replace(model, per_vision_token=5000.0)
    if extra.get("layout") == "padded-2d":
        kw["prompt_lens"] = np.minimum(lens, rng.integers(1, 9, n))
    if extra.get("share_prefixes"):
        parent = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
        shared = np.minimum(lens, lens[np.maximum(parent, 0)]) // 2 * (parent >= 0)
        kw |= dict(prefix_parent=parent, shared_prefix_lens=shared)
    dp = draw(st.integers(1, 4))
    if "context_parallel" in extra and extra["context_parallel"].dynamic:
        dp = 2 * draw(st.integers(1, 2))
    if extra.get("placement") == "local":
        kw["rank_of"] = rng.integers(0, dp, n)
    batch = mp.Batch(lens, **kw)
    cfg = mp.PlanConfig(dp_size=dp, memory=model, max_bytes_per_micro=2 ** 60, **extra)
    cp = cfg.context_parallel
    width = 1 if cp is None else (cp.max_size if cp.dynamic else cp.size)
    alone = int(model.with_margin(sample_bytes(footprint_of(batch, cfg), model, width)).max())  # the least budget
    return batch, replace(cfg, max_bytes_per_micro=int(alone * mult))


@given(memory_cases())
def test_every_micro_fits_the_byte_budget(case):
    batch, cfg = case
    try:
        plan = mp.plan(batch, cfg)
    except mp.PlanError as exc:  # only the documented refusal: a dense mask with padding, sharing or CP
        assert "no token cap keeps every micro-batch" in str(exc) and cfg.memory.dense and not _lone_mode(cfg)
        return
    plan.validate()
    got = _all_bytes(plan)
    assert (cfg.memory.with_margin(got) <= cfg.max_bytes_per_micro).all()
    assert plan.stats.max_micro_bytes == int(got.max())
    if cfg.max_tokens_per_micro is not None:  # both caps hold
        assert plan.config.max_tokens_per_micro <= cfg.max_tokens_per_micro
    if not _lone_mode(cfg):  # the plan's cap is tried first when planning again
        assert mp.plan(batch, plan.config).fingerprint() == plan.fingerprint()
    assert mp.Plan.from_json(plan.to_json()).fingerprint() == plan.fingerprint()


def test_a_sample_over_the_budget_is_refused_with_the_fix():
    m = _model("linear")
    with pytest.raises(mp.PlanError, match=r"sample 1 .*more than max_bytes_per_micro=40,000,000.*context parallel"):
        mp.plan(mp.Batch([100, 2000]), mp.PlanConfig(dp_size=1, memory=m, max_bytes_per_micro=40_000_000))


def test_validate_checks_the_byte_cap():
    m = _model("varlen")
    plan = mp.plan(mp.Batch(np.full(40, 300)), mp.PlanConfig(dp_size=2, memory=m, max_bytes_per_micro=60 * MiB))
    plan.validate()
    worst = plan.stats.max_micro_bytes
    tight = mp.Plan(batch=plan.batch, config=replace(plan.config, max_bytes_per_micro=worst - 1), steps=plan.steps,
                    dropped=plan.dropped, drop_reasons=plan.drop_reasons)
    with pytest.raises(mp.PlanError, match="exceeds max_bytes_per_micro"):
        tight.validate()


def test_budget_is_used_not_wasted():
    """The cap found is the largest whose plan fits: one token more would not (linear model: exact)."""
    m = _model("linear")
    B = 100 * MiB
    plan = mp.plan(mp.Batch(np.full(400, 37)), mp.PlanConfig(dp_size=1, memory=m, max_bytes_per_micro=B))
    assert plan.stats.max_micro_bytes <= B
    cap = int((B - m.per_micro) // m.per_token)  # the most tokens whose bytes fit: 3,461
    assert plan.config.max_tokens_per_micro == cap
    assert plan.stats.micro_count == -(-400 * 37 // (cap // 37 * 37))  # the fewest micro-batches that cap allows


def test_forward_plan_holds_more_tokens_per_micro():
    m = mp.MemoryModel.from_hf_config(LLAMA, dtype="float32", attention="fa2")
    batch = mp.Batch(np.random.default_rng(0).integers(50, 900, 300))
    cfg = mp.PlanConfig(dp_size=2, memory=m, max_bytes_per_micro=120 * MiB)
    train, fwd = mp.plan(batch, cfg), mp.plan_forward(batch, cfg)
    fwd.validate()
    assert fwd.config.memory == m.forward
    assert fwd.config.max_tokens_per_micro >= 2 * train.config.max_tokens_per_micro
    assert fwd.stats.micro_count * 2 <= train.stats.micro_count


def test_dense_mask_long_samples_run_alone():
    """The issue's case: under a dense packed-row mask, a 3,000-token sample fits alone while a
    pack of shorter samples at 3,000 tokens does not; no token cap is safe, a byte plan is."""
    m = mp.MemoryModel(per_token=35_661.0, per_row_sq=9.0, per_micro=4e5)
    B = m.micro_bytes([3000])
    assert m.micro_bytes([1500, 1500]) > B  # a token cap of 3,000 would be over budget
    lens = np.array([3000] + [200, 350, 500, 120, 800, 640, 90, 1000, 410] * 6)
    plan = mp.plan(mp.Batch(lens), mp.PlanConfig(dp_size=2, memory=m, max_bytes_per_micro=B))
    plan.validate()
    assert plan.stats.max_micro_bytes <= B and plan.config.max_tokens_per_micro == 3000
    pack_cap = pack_token_bound(plan.config)
    for step in plan.steps:
        for row in step.micros:
            for micro in row:
                if 0 in micro.indices.tolist():
                    assert micro.num_samples == 1  # the long sample runs alone
                elif micro.num_samples >= 2:
                    assert micro.num_tokens <= pack_cap < 3000
    with pytest.raises(mp.PlanError, match="no token cap keeps every micro-batch"):  # padding multiples: refused
        mp.plan(mp.Batch(lens), mp.PlanConfig(dp_size=2, memory=m, max_bytes_per_micro=B, pad_to_multiple_of=8))


def test_memory_meter_learns_the_machine():
    """A prior off by 30 % is rescaled from a balanced plan's near-identical peaks; the margin covers every record."""
    truth = mp.MemoryModel(per_token=39_000.0, per_row_sq=11.7, per_micro=1.3e6)
    prior = mp.MemoryModel(per_token=30_000.0, per_row_sq=9.0, per_micro=1e6, margin=0.1)
    meter = mp.MemoryMeter(prior)
    assert meter.model() is prior
    rng = np.random.default_rng(0)
    comps = [list(rng.integers(100, 400, rng.integers(3, 7))) for _ in range(20)]
    for c in comps:
        meter.record(c, truth.micro_bytes(c) * (1 + 0.01 * rng.standard_normal()))
    got = meter.model()
    assert got.per_token == pytest.approx(39_000.0, rel=0.03) and got.margin <= 0.05
    assert all(got.with_margin(got.micro_bytes(c)) >= truth.micro_bytes(c) * 0.99 for c in comps)
    free = mp.MemoryMeter()
    with pytest.raises(mp.PlanError, match="no prior"):
        free.model()
    for c in comps + [[int(sum(c))] for c in comps[:6]]:
        free.record(c, truth.micro_bytes(c))
    assert free.model().micro_bytes([250, 250]) == pytest.approx(truth.micro_bytes([250, 250]), rel=0.01)
    with pytest.raises(mp.PlanError, match="flat micro-batches"):
        free.record(mp.Micro([0], [5], [4], [1.0], cp_size=2, cp_group=(0, 1)), 1e6)


def test_from_hf_config_takes_gated_mlp_when_the_config_cannot_tell():
    """A config with no model_type nor activation is refused naming gated_mlp=, which
    from_hf_config takes (it used to name an argument only FlopsCost.from_hf_config had)."""
    cfg = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=100, intermediate_size=128)
    with pytest.raises(mp.PlanError, match="gated_mlp=True"):
        mp.MemoryModel.from_hf_config(cfg, attention="fa2")
    gated = mp.MemoryModel.from_hf_config(cfg, attention="fa2", gated_mlp=True)
    plain = mp.MemoryModel.from_hf_config(cfg, attention="fa2", gated_mlp=False)
    assert gated.per_token > plain.per_token  # 4f vs 2f MLP elements per token and layer


def test_from_hf_config_prices_dense_and_moe_layers_each_by_its_own_width():
    """An MoE model whose first layers are dense (DeepSeek's first_k_dense_replace) or listed in
    mlp_only_layers (Qwen): each layer keeps its own MLP width (the sum over layers without
    checkpointing, the largest layer with it), as the cost model reads the same keys."""
    from microplan.memory.hf import layer_elements
    moe = dict(LLAMA, model_type="deepseek_v3", num_hidden_layers=4, intermediate_size=1024, num_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1)
    base = 4 * 128 + 4 * 32 + 2 * 64 + 4 * 32   # norms, q, k + v, o (head dim 32)
    dense, expert = base + 4 * 1024, base + 4 * (2 * 64 + 64)
    assert layer_elements(moe) == (4 * expert, expert, 128, 4, 2 * 64)  # every layer MoE
    first = layer_elements(dict(moe, first_k_dense_replace=1))
    assert first.total == dense + 3 * expert and first.largest == dense
    assert layer_elements(dict(moe, mlp_only_layers=[0, 2])).total == 2 * dense + 2 * expert
    kw = dict(attention="fa2", dtype="bfloat16")
    off = mp.MemoryModel.from_hf_config(dict(moe, first_k_dense_replace=1), gradient_checkpointing=False, **kw)
    all_moe = mp.MemoryModel.from_hf_config(moe, gradient_checkpointing=False, **kw)
    assert off.per_token - all_moe.per_token == pytest.approx(2 * (dense - expert))  # bf16: 2 bytes per element
    on = mp.MemoryModel.from_hf_config(dict(moe, first_k_dense_replace=1), gradient_checkpointing=True, **kw)
    assert on.per_token >= 2 * dense  # one dense layer rebuilt at a time
    # dense and all-MoE configs keep the bytes they had when every layer was priced at one width
    for cfg, want in ((LLAMA, (26880.0, 19712.0)), (moe, (32512.0, 20224.0))):
        got = tuple(mp.MemoryModel.from_hf_config(cfg, gradient_checkpointing=ck, **kw).per_token for ck in (False, True))
        assert got == want


def test_cp_bytes_are_the_fullest_gpus():
    """Over a CP group of c GPUs the fullest GPU holds ⌈T/c⌉ of a row's T tokens (the zigzag cut,
    ``footprint.gpu_tokens``), so its linear bytes are per_token·⌈T/c⌉: a 33-token sample over 2
    GPUs adds 1e6 + 30,000·17 bytes there, not 1e6 + 30,000·16.5 (which passed the alone check and
    then met a token cap of 2 × 16 = 32 that refused it as too long)."""
    m = mp.MemoryModel(per_token=30_000.0, per_micro=1e6)
    b, cp = mp.Batch([33]), mp.ContextParallel(size=2)
    with pytest.raises(mp.PlanError, match=r"sample 0 \(33 tokens\) alone over a CP group of 2 GPUs .*1,510,000"):
        mp.plan(b, mp.PlanConfig(dp_size=1, memory=m, max_bytes_per_micro=1_509_999, context_parallel=cp))
    plan = mp.plan(b, mp.PlanConfig(dp_size=1, memory=m, max_bytes_per_micro=1_510_000, context_parallel=cp))
    plan.validate()
    assert plan.stats.max_micro_bytes == 1_510_000


def test_vision_bytes_beside_tokens_run_samples_alone():
    """Bytes priced on a second resource (vision patches) can put a micro-batch over the budget at
    every token cap that holds each sample: two 21-token samples of 30 patches each fit a 42-token
    cap together (2.56 MB) but not the 2.26 MB budget the 42-token sample alone needs. The search
    then lets samples longer than its cap run alone (as under a dense mask) instead of refusing."""
    m = mp.MemoryModel(per_token=30_000.0, per_micro=1e6, per_vision_token=5_000.0)
    b = mp.Batch([42, 21, 21], vision_tokens=[0, 30, 30])
    cfg = mp.PlanConfig(dp_size=1, memory=m, max_bytes_per_micro=2_260_000, max_vision_tokens_per_micro=60)
    plan = mp.plan(b, cfg)
    plan.validate()
    assert plan.stats.max_micro_bytes <= 2_260_000
    assert sorted(len(mb.indices) for mb in plan.steps[0].micros[0]) == [1, 1, 1]
