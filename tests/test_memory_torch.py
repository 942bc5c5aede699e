"""Measured memory on CPU: peak_bytes, profile_memory's held-out error, and byte plans run micro-batch by
micro-batch under their budget (small random-weight HF models built from a config; no downloads)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import microplan as mp  # noqa: E402
from microplan.torch import pack_micro, peak_bytes, profile_memory, token_logprobs, weighted_loss  # noqa: E402

CAP = 256
VOCAB = 512


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: these tiny models only lose to thread contention on a shared machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(arch: str, attn: str, checkpointing: bool = False) -> torch.nn.Module:
    """bench_memory's random-weight model, at width 64 (FFN 128) and this file's vocabulary."""
    from benchmarks.bench_memory import tiny_model
    return tiny_model(arch, attn, checkpointing, hidden=64, vocab=VOCAB, positions=4096)[0]


def _runner(model: torch.nn.Module):
    def run(packed):  # the loss recipe of docs/integration.md
        logits = model(**packed.model_inputs(), use_cache=False).logits
        weighted_loss(-token_logprobs(logits.float(), packed), packed).backward()
    return run


def test_peak_bytes_counts_storages_above_the_start():
    keep = torch.zeros(1000)  # alive before: never counted

    def fn():
        a = torch.empty(250, dtype=torch.float32)   # 1,000 bytes
        b = torch.empty(500, dtype=torch.float64)   # 4,000 bytes, both alive: peak 5,000
        del a, b
        c = torch.empty(100, dtype=torch.float32)   # 400 bytes after they died
        keep.add_(1.0)                              # in place on an old storage: nothing new
        return c.view(10, 10)                       # a view: no new storage
    assert peak_bytes(fn) == 5000
    assert peak_bytes(lambda: None) == 0


@pytest.mark.parametrize("arch, attn, ckpt", [("llama", "sdpa", False), ("gpt2", "eager", True)])
def test_profile_memory_predicts_heldout_peaks(arch, attn, ckpt):
    model = _model(arch, attn, ckpt)
    res = profile_memory(_runner(model), max_tokens_per_micro=CAP, vocab_size=VOCAB)
    assert res.heldout_median_error <= 0.05 and res.heldout_max_error <= 0.10, res.describe()
    assert res.model.margin >= 0 and "margin" in res.model.note
    assert res.regime in ("packed", "varlen", "linear")


def test_byte_plan_runs_under_its_budget():
    """No token cap: every micro-batch's measured peak <= B, the fullest >= 0.8 B; the forward pass
    holds >= 2x the tokens per micro-batch at the same B."""
    model = _model("llama", "sdpa")
    run = _runner(model)

    def fwd(packed):
        with torch.no_grad():
            token_logprobs(model(**packed.model_inputs(), use_cache=False).logits.float(), packed)
    res = profile_memory(run, max_tokens_per_micro=CAP, vocab_size=VOCAB, run_forward=fwd)
    B = res.model.micro_bytes([CAP // 2, CAP // 2])  # the bytes of a cap-full packed row
    rng = np.random.default_rng(0)
    lens = rng.integers(8, 200, 24)
    batch = mp.Batch(lens)
    cfg = mp.PlanConfig(dp_size=2, memory=res.model, max_bytes_per_micro=B)
    plan = mp.plan(batch, cfg)
    plan.validate()
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, VOCAB, (int(L),), generator=g) for L in lens]
    peaks = [peak_bytes(lambda: run(pack_micro(m, tokens))) for step in plan.steps for row in step.micros
             for m in row if not m.is_placeholder]
    assert max(peaks) <= B, (max(peaks), B)
    assert max(peaks) >= 0.8 * B, (max(peaks), B)
    fplan = mp.plan_forward(batch, cfg)
    assert fplan.config.max_tokens_per_micro >= 2 * plan.config.max_tokens_per_micro
    fpeaks = [peak_bytes(lambda: fwd(pack_micro(m, tokens))) for step in fplan.steps for row in step.micros
              for m in row if not m.is_placeholder]
    assert max(fpeaks) <= B


def test_shared_prefix_byte_plan_runs_under_its_budget():
    """With sharing: prefix-tree micro-batches measured by profile_memory(trees=True), planned
    under B, every measured peak <= B."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from microplan.torch import register_attention
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      attn_implementation=register_attention())
    run = _runner(LlamaForCausalLM(cfg).train())
    res = profile_memory(run, max_tokens_per_micro=CAP, vocab_size=VOCAB, trees=True)
    tree_rows = [r["bytes"] / r["predicted"] for r in res.rows if r.get("pass") == "tree"]
    # split tree attention (torch/tree_attention.py) gathers no path keys: a tree row measures no
    # more than a flat row of its unique tokens (the gathered path measured 1.12-1.19 here)
    assert len(tree_rows) >= 3 and max(tree_rows) <= 1.0 and res.model.tree_factor == 1.0, tree_rows
    B = res.model.micro_bytes([CAP // 2, CAP // 2])
    from benchmarks.bench_memory import grpo_groups
    toks, batch = grpo_groups(8, (20, 90), (5, 60), vocab=VOCAB, seed=0)  # a prompt shared by 4 responses
    plan = mp.plan(batch, mp.PlanConfig(dp_size=2, memory=res.model, max_bytes_per_micro=B, share_prefixes=True))
    plan.validate()
    micros = [m for s in plan.steps for row in s.micros for m in row if not m.is_placeholder]
    assert any(m.tree.num_tokens < m.real_tokens for m in micros)  # prefixes really shared
    peaks = [peak_bytes(lambda: run(pack_micro(m, toks))) for m in micros]
    assert max(peaks) <= B, (max(peaks), B)
    assert max(peaks) >= 0.8 * B, (max(peaks), B)
