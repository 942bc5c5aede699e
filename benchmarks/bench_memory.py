"""Bytes, not tokens: memory models of small HF models on CPU, and byte plans run under their budget.

Design note. For each small random-weight model built from a config (Llama, GPT-2; attention
``sdpa`` and ``eager``; gradient checkpointing off and on; float32, no downloads):

1. ``profile_memory`` measures the designed micro-batches (training pass and the no-grad
   log-prob pass), fits the model, and reports the held-out median and worst error;
   ``MemoryModel.from_hf_config`` alone is scored on the same measured rows (>= cap/8 tokens).
2. A byte budget B = the profiled prediction of a cap-full packed row (4 × cap/4). A batch of
   samples of 16 .. cap/2 tokens is planned with ``memory=`` and ``max_bytes_per_micro=B`` and NO
   token cap; every micro-batch is packed and run, its peak measured: the worst and the fullest
   measured peak over B are reported (targets: <= 1, >= 0.8).
3. The best token cap C* is found by measuring: the largest cap whose full packed row (4 samples
   of C/4) peaks under B (bisection on measured rows). The same batch planned with
   ``max_tokens_per_micro=C*``: micro-batches per rank, byte plan vs token plan.
4. The log-prob pass: ``plan_forward`` at the same B, tokens per micro-batch vs the training plan.
6. The dense-mask case: B just holds one sample of 0.9·cap tokens (Llama, sdpa; prediction + margin); a
   packed row at that many tokens is over B, so no token cap is safe; the byte plan is run.
5. Sharing: a Llama on microplan's attention, profiled with ``trees=True``; 16 GRPO groups of 4
   planned with ``share_prefixes`` under B and without; every micro-batch run and measured.

Then the 7B/70B figures ``from_hf_config`` predicts (bf16, flash attention, no recomputation,
per token) next to the published formulas: Korthikanti et al. 2022 (selective recomputation,
``34·h`` bytes per layer and token at 16 bits, with sequence parallelism ÷ t) and Megatron-LM's
``theoretical_memory_usage.py`` (``(18 + 4·ffn/h)·h`` per layer), and the measured ~9 MB per token
of tinker-cloud #33 (Llama-3-8B, TP 2, no checkpointing).

Run: ``python -m benchmarks.bench_memory [--quick]``. Prints the table and writes
``benchmarks/results/memory-<date>-<host>.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from benchmarks._results import record  # noqa: E402

VOCAB = 1024
MB = 1e6

LLAMA_7B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, intermediate_size=11008, vocab_size=32000, hidden_act="silu")
LLAMA_70B = dict(model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                 num_key_value_heads=8, intermediate_size=28672, vocab_size=32000, hidden_act="silu")
LLAMA3_8B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, hidden_act="silu")


def grpo_groups(groups: int, prompt_lens: tuple[int, int], response_lens: tuple[int, int], *, vocab: int,
                seed: int):
    """GRPO groups of 4 responses sharing a random prompt (lengths drawn in [lo, hi) by numpy ``seed``,
    token ids from torch seed 0): (token tensors, the Batch with its prefix forest)."""
    import torch

    import microplan as mp
    rng, gen = np.random.default_rng(seed), torch.Generator().manual_seed(0)
    toks, lens, parent, shared, pids = [], [], [], [], []
    for p in range(groups):
        P = int(rng.integers(*prompt_lens))
        prompt = torch.randint(0, vocab, (P,), generator=gen)
        for k in range(4):
            R = int(rng.integers(*response_lens))
            toks.append(torch.cat([prompt, torch.randint(0, vocab, (R,), generator=gen)]))
            lens.append(P + R)
            parent.append(-1 if k == 0 else len(lens) - 1 - k)
            shared.append(0 if k == 0 else P)
            pids.append(p)
    return toks, mp.Batch(lens, prompt_ids=pids, prefix_parent=parent, shared_prefix_lens=shared)


def tiny_model(arch: str, attn: str, ckpt: bool, *, hidden: int = 128, vocab: int = VOCAB, positions: int = 8192):
    """A 2-layer random-weight ``arch`` ("llama" or "gpt2") of width ``hidden`` (FFN 2 × hidden) built from
    a config, with ``attn`` as its attention implementation and checkpointing when ``ckpt``: (model, config)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                          attn_implementation=attn)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=2, n_head=4, n_positions=positions, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation=attn, bos_token_id=0, eos_token_id=0)
        model = GPT2LMHeadModel(cfg)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train(), cfg


def _cell(arch: str, attn: str, ckpt: bool, cap: int, n: int) -> dict:
    import torch

    import microplan as mp
    from microplan.torch import pack_micro, peak_bytes, profile_memory, token_logprobs, weighted_loss
    model, cfg = tiny_model(arch, attn, ckpt)

    def run(p):  # the loss recipe of docs/integration.md: token log-probs in float32, weighted loss
        weighted_loss(-token_logprobs(model(**p.model_inputs(), use_cache=False).logits.float(), p), p).backward()

    def fwd(p):
        with torch.no_grad():
            token_logprobs(model(**p.model_inputs(), use_cache=False).logits.float(), p)

    res = profile_memory(run, max_tokens_per_micro=cap, vocab_size=VOCAB, run_forward=fwd)
    hf = mp.MemoryModel.from_hf_config(cfg, dtype="float32", attention="eager" if attn == "eager" else "sdpa-packed",
                                       gradient_checkpointing=ckpt)
    rows = [r for r in res.rows if r["pass"] == "train" and sum(r["seq_lens"]) >= cap // 8]
    hf_err = np.abs([hf.micro_bytes(r["seq_lens"]) / r["bytes"] - 1 for r in rows])
    B = res.model.micro_bytes([cap // 4] * 4)
    rng = np.random.default_rng(1)
    lens = rng.integers(16, cap // 2, n)
    gen = torch.Generator().manual_seed(0)
    toks = [torch.randint(0, VOCAB, (int(L),), generator=gen) for L in lens]
    batch = mp.Batch(lens)
    bplan = mp.plan(batch, mp.PlanConfig(dp_size=2, memory=res.model, max_bytes_per_micro=B))
    peaks = [peak_bytes(lambda: run(pack_micro(m, toks))) for s in bplan.steps for row in s.micros
             for m in row if not m.is_placeholder]

    def row_peak(C: int) -> int:  # a full packed row of 4 samples
        parts = [C // 4] * 3 + [C - 3 * (C // 4)]
        micro = mp.Micro(np.arange(4), np.array(parts), np.array(parts) - 1, np.ones(4))
        return peak_bytes(lambda: run(pack_micro(micro, [torch.zeros(p, dtype=torch.int64) for p in parts])))
    lo, hi = 64, 4 * cap  # the largest measured cap under B (bisection)
    while hi - lo > 16:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if row_peak(mid) <= B else (lo, mid)
    tplan = mp.plan(batch, mp.PlanConfig(dp_size=2, max_tokens_per_micro=max(lo, int(lens.max()))))
    fplan = mp.plan_forward(batch, mp.PlanConfig(dp_size=2, memory=res.model, max_bytes_per_micro=B))
    return dict(arch=arch, attention=attn, checkpointing=ckpt, regime=res.regime, margin=res.model.margin,
                heldout_median=res.heldout_median_error, heldout_worst=res.heldout_max_error,
                forward_heldout_worst=res.forward_heldout_max_error,
                hf_median=float(np.median(hf_err)), hf_worst=float(hf_err.max()), budget=B,
                worst_over_budget=max(peaks) / B, fullest=max(peaks) / B,
                byte_K=bplan.steps[0].micro_count, token_cap_measured=lo, token_K=tplan.steps[0].micro_count,
                byte_cap=bplan.config.max_tokens_per_micro, forward_cap=fplan.config.max_tokens_per_micro)


def _sharing_cell(cap: int) -> dict:
    """Llama on microplan's attention, GRPO groups sharing a prompt: profile with trees, plan with
    share_prefixes under B, run every micro-batch (and the same batch without sharing)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import microplan as mp
    from microplan.torch import (pack_micro, peak_bytes, profile_memory, register_attention, token_logprobs,
                                 weighted_loss)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      attn_implementation=register_attention())
    model = LlamaForCausalLM(cfg).train()

    def run(p):
        weighted_loss(-token_logprobs(model(**p.model_inputs(), use_cache=False).logits.float(), p), p).backward()
    res = profile_memory(run, max_tokens_per_micro=cap, vocab_size=VOCAB, trees=True)
    B = res.model.micro_bytes([cap // 4] * 4)
    toks, batch = grpo_groups(16, (cap // 16, cap // 4), (cap // 32, cap // 6), vocab=VOCAB, seed=2)
    ratios = [r["bytes"] / r["predicted"] for r in res.rows if r.get("pass") == "tree"]
    out = {"arch": "llama (microplan attention)", "tree_factor": res.model.tree_factor, "budget": B,
           "tree_rows_over_flat": [min(ratios), max(ratios)]}
    for share in (True, False):
        plan = mp.plan(batch, mp.PlanConfig(dp_size=2, memory=res.model, max_bytes_per_micro=B, share_prefixes=share))
        peaks = [peak_bytes(lambda: run(pack_micro(m, toks))) for s in plan.steps for row in s.micros
                 for m in row if not m.is_placeholder]
        key = "shared" if share else "flat"
        out[f"{key}_max_peak_over_B"] = max(peaks) / B
        out[f"{key}_K"] = plan.steps[0].micro_count
    return out


def _dense_case(cap: int) -> dict:
    """The issue's case on Llama + transformers' sdpa (a dense [T, T] mask over packed rows): B just
    holds ONE sample of 0.9·cap tokens (its prediction plus margin); no token cap both holds it and
    keeps every packed row under B; the byte plan runs it alone and packs the rest below B."""
    import torch

    import microplan as mp
    from microplan.torch import pack_micro, peak_bytes, profile_memory, token_logprobs, weighted_loss
    model, _ = tiny_model("llama", "sdpa", False)

    def run(p):
        weighted_loss(-token_logprobs(model(**p.model_inputs(), use_cache=False).logits.float(), p), p).backward()
    res = profile_memory(run, max_tokens_per_micro=cap, vocab_size=VOCAB)
    long = int(0.9 * cap)
    gen = torch.Generator().manual_seed(0)

    def measure(parts: list[int]) -> int:
        micro = mp.Micro(np.arange(len(parts)), np.array(parts), np.array(parts) - 1, np.ones(len(parts)))
        toks = [torch.randint(0, VOCAB, (p,), generator=gen) for p in parts]
        return peak_bytes(lambda: run(pack_micro(micro, toks)))
    B = res.model.with_margin(res.model.micro_bytes([long]))  # the budget that just holds the long sample
    pack_at_long = measure([long // 2, long - long // 2]) / B  # a token cap of `long`: a pack there
    lens = np.concatenate([[long], np.random.default_rng(3).integers(32, cap // 3, 40)])
    gtoks = [torch.randint(0, VOCAB, (int(L),), generator=gen) for L in lens]
    plan = mp.plan(mp.Batch(lens), mp.PlanConfig(dp_size=2, memory=res.model, max_bytes_per_micro=B))
    peaks = [peak_bytes(lambda: run(pack_micro(m, gtoks))) for s in plan.steps for row in s.micros
             for m in row if not m.is_placeholder]
    alone = all(m.num_samples == 1 for s in plan.steps for row in s.micros for m in row if 0 in m.indices)
    return dict(long_sample=long, budget=B, pack_at_long_over_B=pack_at_long, long_alone_over_B=measure([long]) / B,
                byte_plan_max_peak_over_B=max(peaks) / B, long_sample_alone=alone,
                micro_count=plan.steps[0].micro_count)


def _published() -> list[dict]:
    import microplan as mp
    out = []
    for name, cfg, t in (("Llama-2-7B", LLAMA_7B, 1), ("Llama-2-70B", LLAMA_70B, 8), ("Llama-3-8B TP2", LLAMA3_8B, 2)):
        m = mp.MemoryModel.from_hf_config(cfg, dtype="bfloat16", attention="fa2", tensor_parallel=t)
        h, L, f = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
        out.append(dict(model=name, tp=t, ours_mb_per_token=m.per_token / MB,
                        ours_ckpt_mb_per_token=mp.MemoryModel.from_hf_config(
                            cfg, dtype="bfloat16", attention="fa2", tensor_parallel=t,
                            gradient_checkpointing=True).per_token / MB,
                        korthikanti_layers_mb=34 * h * L / t / MB, megatron_layers_mb=(18 + 4 * f / h) * h * L / t / MB,
                        measured_mb=9.0 if name.startswith("Llama-3-8B") else None))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="cap 512, 60 samples, Llama only")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    import torch
    torch.set_num_threads(1)
    cap, n = (512, 60) if args.quick else (1024, 120)
    archs = ["llama"] if args.quick else ["llama", "gpt2"]
    cells = [_cell(a, attn, ck, cap, n) for a in archs for attn in ("sdpa", "eager") for ck in (False, True)]
    print(f"{'model':28} {'regime':7} {'held-out med/worst':>18} {'hf med/worst':>13} {'peak/B':>7} "
          f"{'K bytes/tokens':>15} {'fwd cap/train cap':>18}")
    for c in cells:
        label = f"{c['arch']} {c['attention']} ckpt={'on' if c['checkpointing'] else 'off'}"
        print(f"{label:28} {c['regime']:7} {c['heldout_median']:8.1%} / {c['heldout_worst']:5.1%} "
              f"{c['hf_median']:6.1%}/{c['hf_worst']:5.1%} {c['fullest']:7.3f} {c['byte_K']:7d} / {c['token_K']:<5d} "
              f"{c['forward_cap'] / c['byte_cap']:12.2f}x")
    share = _sharing_cell(cap)
    lo, hi = share["tree_rows_over_flat"]
    print(f"\nshared prefixes (16 prompts x 4, microplan attention, tree_factor {share['tree_factor']:.3f}; "
          f"tree rows measure {lo:.3f}-{hi:.3f} of the flat prediction): max peak / B "
          f"{share['shared_max_peak_over_B']:.3f} with sharing (K {share['shared_K']}), "
          f"{share['flat_max_peak_over_B']:.3f} without (K {share['flat_K']})")
    dense = _dense_case(cap)
    print(f"dense mask (Llama sdpa): B = one {dense['long_sample']}-token sample; a packed row at that token cap "
          f"holds {dense['pack_at_long_over_B']:.3f} B; the byte plan's max peak "
          f"{dense['byte_plan_max_peak_over_B']:.3f} B "
          f"(the long sample alone: {dense['long_sample_alone']})")
    pub = _published()
    print(f"\n{'config (bf16, fa2)':18} {'ours MB/token':>13} {'ckpt':>6} {'Korthikanti layers':>19} "
          f"{'Megatron layers':>16} {'measured':>9}")
    for p in pub:
        meas = f"{p['measured_mb']:.1f}" if p["measured_mb"] else "-"
        print(f"{p['model']:18} {p['ours_mb_per_token']:13.2f} {p['ours_ckpt_mb_per_token']:6.2f} "
              f"{p['korthikanti_layers_mb']:19.2f} {p['megatron_layers_mb']:16.2f} {meas:>9}")
    record("memory", write=not args.no_write, quick=args.quick, cap=cap, samples=n, cells=cells, sharing=share,
           dense_case=dense, published=pub)


if __name__ == "__main__":
    main()
