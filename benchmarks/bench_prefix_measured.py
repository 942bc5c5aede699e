"""Prefix sharing on a real model: forward+backward time of a step with and without sharing.

Design note. A small transformers Llama (float32, random weights, built from a config; 4 layers,
hidden 512, SwiGLU 1,536 — wider than the toy models of the tests, so the weights carry a larger
share of a 2k-token sequence's time, as they do in real models; sharing saves the weights' work
on every duplicated token but only part of the attention, whose queries still see their whole
path) runs on this machine's CPU through ``microplan.torch.register_attention()`` — the same attention
function for both plans, so only the packing differs. For each family (step-wise multi-turn
trajectories with append-only histories; GRPO with long prompts), one optimizer step is planned
twice at the same cap and dp — ``share_prefixes=False`` and ``True`` — token ids realising the
trace's prefix forest are packed with ``pack_micro``, and every micro-batch of every rank is run
forward + backward (PPO-style loss through ``token_logprobs`` / ``weighted_loss``) and timed.
The two plans are timed interleaved, micro-batch by micro-batch, and each micro-batch's time is
the minimum of ``--repeats``. Reported: tokens computed, total compute (Σ over ranks) and
lockstep time (Σ_m max_r) of both plans, and their ratios. Measured, not predicted: the plan's
cost model never sees these timings.

Run: ``python -m benchmarks.bench_prefix_measured [--quick]``; writes
``benchmarks/results/prefix-measured-<date>-<host>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import microplan as mp  # noqa: E402
from microplan.traces import generate  # noqa: E402

from benchmarks._results import save_json  # noqa: E402

VOCAB = 512


def model(layers: int, hidden: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    from microplan.torch import register_attention
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      attn_implementation=register_attention())
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float().train()


def tokens_for(batch: mp.Batch, seed: int) -> list[torch.Tensor]:
    """Token ids realising the batch's prefix forest (a child copies its parent's shared prefix)."""
    rng = np.random.default_rng(seed)
    out: list[torch.Tensor] = []
    parent, shared = batch.prefix_parent, batch.shared_prefix_lens
    for i, L in enumerate(batch.seq_lens.tolist()):
        s = int(shared[i]) if parent is not None and parent[i] >= 0 else 0
        head = out[int(parent[i])][:s] if s else torch.zeros(0, dtype=torch.int64)
        out.append(torch.cat([head, torch.as_tensor(rng.integers(0, VOCAB, L - s), dtype=torch.int64)]))
    return out


def families(quick: bool) -> dict[str, mp.Batch]:
    n = 4 if quick else 8
    step = generate("stepwise-multiturn", num_prompts=n, samples_per_prompt=2, max_len=2048, seed=1)
    # the long-prompt GRPO (3-5k prompts, ~1k responses, n = 8) at CPU scale: prompt:response ~4:1
    grpo = generate("grpo-longtail", num_prompts=n // 2, samples_per_prompt=8, max_len=2048,
                    prompt_len=(1400, 1800), seed=2)
    return {"stepwise append-only": step, "GRPO long prompts": grpo}


def run_micro(net: torch.nn.Module, micro: mp.Micro, toks: list[torch.Tensor]) -> float:
    from microplan.torch import pack_micro, token_logprobs, weighted_loss
    p = pack_micro(micro, toks, weight_dtype=torch.float32)
    t0 = time.perf_counter()
    logits = net(**p.model_inputs(), use_cache=False).logits
    lp = token_logprobs(logits.float(), p)
    weighted_loss(-p.expand(lp), p, per_sample=p.tree is not None).backward()
    dt = time.perf_counter() - t0
    net.zero_grad(set_to_none=True)
    return dt


def measure(net, batch: mp.Batch, toks, dp: int, cap: int, repeats: int) -> dict:
    plans = {share: mp.plan(batch, mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, share_prefixes=share))
             for share in (False, True)}
    grids = {share: [[[float("inf")] * len(row) for row in step.micros] for step in p.steps]
             for share, p in plans.items()}
    for _ in range(repeats):
        for share in (False, True):  # interleaved: drift hits both plans alike
            for s, step in enumerate(plans[share].steps):
                for r, row in enumerate(step.micros):
                    for m, micro in enumerate(row):
                        if not micro.is_placeholder:
                            g = grids[share][s][r]
                            g[m] = min(g[m], run_micro(net, micro, toks))
    out = {}
    for share, p in plans.items():
        total = lock = 0.0
        for g in grids[share]:
            arr = np.array([[x if np.isfinite(x) else 0.0 for x in row] for row in g])
            total += float(arr.sum())
            lock += float(arr.max(axis=0).sum())
        out["shared" if share else "unshared"] = dict(
            tokens=p.stats.tokens_with_sharing, micro_count=p.stats.micro_count, total_s=total, lockstep_s=lock)
    out["token_ratio"] = out["unshared"]["tokens"] / out["shared"]["tokens"]
    out["speedup_total"] = out["unshared"]["total_s"] / out["shared"]["total_s"]
    out["speedup_lockstep"] = out["unshared"]["lockstep_s"] / out["shared"]["lockstep_s"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller steps and model")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--cap", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    layers, hidden = (2, 128) if args.quick else (4, 512)
    net = model(layers, hidden)
    rows = []
    print(f"Llama {layers} layers, hidden {hidden}, float32 on CPU ({args.threads} threads), register_attention(); "
          f"dp={args.dp}, cap={args.cap}; min of {args.repeats} timed runs per micro-batch, plans interleaved")
    print(f"{'family':<22}{'tokens unshared':>16}{'shared':>9}{'ratio':>7}{'total s':>18}{'speedup':>9}"
          f"{'lockstep s':>18}{'speedup':>9}")
    for name, batch in families(args.quick).items():
        toks = tokens_for(batch, seed=7)
        res = measure(net, batch, toks, args.dp, args.cap, args.repeats)
        u, s = res["unshared"], res["shared"]
        print(f"{name:<22}{u['tokens']:>16,}{s['tokens']:>9,}{res['token_ratio']:>7.2f}"
              f"{u['total_s']:>9.1f}/{s['total_s']:<8.1f}{res['speedup_total']:>9.2f}"
              f"{u['lockstep_s']:>9.1f}/{s['lockstep_s']:<8.1f}{res['speedup_lockstep']:>9.2f}")
        rows.append(dict(family=name, samples=batch.num_samples, **res))
    ok = all(r["speedup_total"] >= 2.0 for r in rows)
    print(f"  {'met' if ok else 'MISSED'}: forward+backward >= 2x faster with sharing on every family")
    result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), quick=args.quick, dp=args.dp,
                  cap=args.cap, repeats=args.repeats, threads=args.threads, layers=layers, hidden=hidden,
                  torch=torch.__version__, rows=rows, target_met=ok)
    if not args.no_write:
        stem = save_json("prefix-measured", result)
        print(f"wrote {stem}.json")
    return result


if __name__ == "__main__":
    main()
