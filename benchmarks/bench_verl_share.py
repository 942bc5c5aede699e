"""verl 0.9.1's real actor engine, its own path vs ``microplan.integrations.verl.install(share_prefixes=True)``.

Design note. verl's ``FSDPEngineWithLMHead`` built by its own ``__init__``/``initialize`` (FSDP2,
float32, gradient checkpointing; one gloo rank on CPU, see benchmarks/_verl_engine.py) runs, per
repeat and path, the log-prob pass (``infer_batch``) and one PPO update (``train_batch`` with
verl's ``ppo_loss``) on the same GRPO batch: 2 prompts of ~1.5k tokens (1,400–1,600), n = 8
responses of 100–400 tokens each (``--quick``: 2 layers, prompts of ~700, responses 50–200), a
tiny random Llama. Both paths run the model with per-sample attention
(``register_attention()``: Σ L² per micro-batch, the work of flash-attn's varlen kernel verl uses
on GPU), so the comparison is the tokens computed, not CPU sdpa's dense masked T². With
``--repeats`` > 1 the paths are interleaved (verl, microplan, verl, ...) and the minimum per path
is kept. On CPU two verl fallbacks weigh more than on GPU: ``logprobs_from_logits`` loops over
rows (flash-attn's fused cross-entropy on GPU) and the tries' branch segments run sdpa with an
explicit bottom-right mask (flash-attn varlen on GPU), so the update's speed-up here
understates the tokens saved. Reported: seconds
per pass, micro-batches, tokens computed (tries vs Σ sample lengths) and the relative
difference of the log-probs and of the update to verl's (float32).

    python -m benchmarks.bench_verl_share [--quick] [--no-write]
    # writes benchmarks/results/verl-share-<date>-<host>.json
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._results import record  # noqa: E402
from benchmarks._verl_engine import actor_engine, cpu_platform, grpo_batch, params  # noqa: E402

VOCAB = 1024


def _model(path: str, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from microplan.torch import register_attention
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      tie_word_embeddings=False, attn_implementation=register_attention())
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


def _groups(quick: bool, seed: int) -> list[tuple[int, list[int]]]:
    rng = np.random.default_rng(seed)
    (p_lo, p_hi), (r_lo, r_hi) = ((650, 750), (50, 200)) if quick else ((1400, 1600), (100, 400))
    return [(int(rng.integers(p_lo, p_hi + 1)), [int(x) for x in rng.integers(r_lo, r_hi + 1, 8)]) for _ in range(2)]


def run(path: str, share: bool | None, groups: list, cap: int) -> dict:
    """One log-prob pass and one update on a fresh engine; ``share=None``: stock verl (no install)."""
    from functools import partial

    import microplan.integrations.verl as mpv
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss
    if share is not None:
        mpv.install(share_prefixes=share, meter=False)
    try:
        from microplan.torch import register_attention
        eng = actor_engine(path, attention=register_attention())  # per-sample attention on both paths
        before = params(eng)
        seen: list[int] = []  # Σ sample lengths of each micro-batch verl's loop runs
        eng.forward_step = lambda mb, *a, **k: (seen.append(int(mb["input_ids"].offsets()[-1])),
                                                type(eng).forward_step(eng, mb, *a, **k))[1]
        batch = lambda update: grpo_batch(groups, vocab=VOCAB, seed=1, update=update, max_token_len=cap)  # noqa: E731
        t = time.perf_counter()
        with eng.eval_mode():
            lp = eng.infer_batch(batch(False))["model_output"]["log_probs"]
        t_logp = time.perf_counter() - t
        micros_logp = len(seen)
        cfg = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=4, use_dynamic_bsz=True,
                              ppo_max_token_len_per_gpu=cap, rollout_n=1)
        t = time.perf_counter()
        with eng.train_mode():
            eng.train_batch(batch(True), partial(ppo_loss, cfg))
        t_update = time.perf_counter() - t
        del eng.forward_step
        counts = mpv.token_counts() if share else None
        return {"logp_s": t_logp, "update_s": t_update, "micro_batches": [micros_logp, len(seen) - micros_logp],
                "tokens": sum(seen), "computed": counts.computed if counts else sum(seen),
                "log_probs": np.concatenate([x[:-1].numpy() for x in lp.unbind()]),
                "delta": (params(eng) - before).numpy()}
    finally:
        if share is not None:
            mpv.uninstall()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 layers, prompts ~700, responses 50-200, 1 repeat")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--no-write", action="store_true")
    opts = ap.parse_args()
    import torch
    import torch.distributed as dist
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cpu_platform()
    layers, repeats = (2, 1) if opts.quick else (4, max(1, opts.repeats))
    cap = 4096 if opts.quick else 8192
    groups = _groups(opts.quick, 0)
    rows: dict[str, list[dict]] = {"verl 0.9.1": [], "microplan share_prefixes": []}
    with tempfile.TemporaryDirectory() as path:
        _model(path, layers)
        for _ in range(repeats):  # interleaved
            rows["verl 0.9.1"].append(run(path, None, groups, cap))
            rows["microplan share_prefixes"].append(run(path, True, groups, cap))
    dist.destroy_process_group()
    base, ours = rows["verl 0.9.1"][0], rows["microplan share_prefixes"][0]
    rel_lp = float(np.linalg.norm(ours["log_probs"] - base["log_probs"]) / np.linalg.norm(base["log_probs"]))
    rel_up = float(np.linalg.norm(ours["delta"] - base["delta"]) / np.linalg.norm(base["delta"]))
    table = {}
    print(f"verl FSDPEngineWithLMHead (FSDP2, 1 gloo rank, CPU {torch.get_num_threads()} threads), "
          f"Llama {layers} layers hidden 128 float32; 2 prompts x n=8: prompts {[p for p, _ in groups]}, "
          f"responses {groups[0][1][:3]}...; max_token_len {cap}")
    print(f"{'path':26s} {'log-prob s':>10s} {'update s':>9s} {'micro-batches':>14s} {'tokens (2 passes)':>18s}")
    for name, runs in rows.items():
        t = {"logp_s": min(r["logp_s"] for r in runs), "update_s": min(r["update_s"] for r in runs),
             "micro_batches": runs[0]["micro_batches"], "tokens_computed": runs[0]["computed"],
             "tokens_unshared": runs[0]["tokens"]}
        table[name] = t
        print(f"{name:26s} {t['logp_s']:10.2f} {t['update_s']:9.2f} {str(t['micro_batches']):>14s} "
              f"{t['tokens_computed']:>18,}")
    speed = {k: table["verl 0.9.1"][k] / table["microplan share_prefixes"][k] for k in ("logp_s", "update_s")}
    print(f"speed-up: log-prob pass {speed['logp_s']:.2f}x, update {speed['update_s']:.2f}x; relative difference to "
          f"verl (float32): log-probs {rel_lp:.1e}, update {rel_up:.1e}")
    record("verl-share", write=not opts.no_write, quick=opts.quick, layers=layers, cap=cap, groups=groups,
           table=table, speedup=speed, rel_diff_log_probs=rel_lp, rel_diff_update=rel_up)


if __name__ == "__main__":
    main()
