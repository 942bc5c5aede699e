"""TRL's real GRPOTrainer, its own path vs ``microplan.integrations.trl.install(trainer, share_prefixes=True)``.

Design note. A tiny transformers Llama (float32, random weights) on CPU; GRPO groups of n = 8
completions of 100–400 tokens to prompts of ~1.5k tokens (1,400–1,600 random words); the
completions come from a ``rollout_func`` (TRL's hook for custom generation) that returns seeded
random tokens, so generation costs nothing and both runs train on the same rows. Each run trains
``--steps`` optimizer steps (per-device batch 8 = one group per chunk, steps_per_generation 2,
gradient accumulation 1, so the old log-prob pass runs; beta 0.04, so the reference pass runs;
TRL's default gradient checkpointing). The training step is TRL's ``training_step`` wall time
(log-prob passes + loss forward + backward + optimizer) minus the rollout's; the first
generation's steps are warm-up and are not counted (``--quick``: one generation, both steps
counted). Runs are interleaved (TRL, microplan, TRL,
microplan) and the minimum per configuration is kept. Also reported: tokens the model computes
per training forward (the padded rows' real tokens vs the tries'), and the parameters' relative
difference after the run (float32: TRL's fused LM head rounds a row differently with and without
its left padding, ~1e-2 in a log-prob on this CPU, so this is not an exactness check — the
float64 checks are in tests/test_integration_trl.py).

    python -m benchmarks.bench_trl [--quick]       # writes benchmarks/results/trl-<date>-<host>.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._results import record  # noqa: E402

VOCAB_WORDS = 500


def make_trainer(out: str, *, layers: int, hidden: int, prompt_range: tuple[int, int], completion_range: tuple[int, int],
                 groups: int, steps: int, seed: int = 0):
    import torch
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    vocab = {f"w{i}": i for i in range(VOCAB_WORDS)} | {"<pad>": VOCAB_WORDS, "<eos>": VOCAB_WORDS + 1,
                                                         "<bos>": VOCAB_WORDS + 2, "<unk>": VOCAB_WORDS + 3}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tk = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                 unk_token="<unk>")
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, pad_token_id=VOCAB_WORDS, eos_token_id=VOCAB_WORDS + 1,
                      bos_token_id=VOCAB_WORDS + 2)
    torch.manual_seed(seed)
    path = os.path.join(out, "model")
    LlamaForCausalLM(cfg).save_pretrained(path)
    rng = np.random.default_rng(seed)
    prompts = [" ".join(f"w{w}" for w in rng.integers(0, VOCAB_WORDS, rng.integers(*prompt_range)))
               for _ in range(groups * steps)]
    n = 8

    def rollout(batch_prompts, trainer):
        """Seeded random completions of 100–400 tokens (no generation cost), ending in <eos>."""
        r = np.random.default_rng(abs(hash(batch_prompts[0][:64])) % 2**32)
        ids = [tk(p, add_special_tokens=False)["input_ids"] for p in batch_prompts]
        comp = [r.integers(0, VOCAB_WORDS, r.integers(*completion_range)).tolist() + [VOCAB_WORDS + 1] for _ in ids]
        return {"prompt_ids": ids, "completion_ids": comp, "logprobs": [[0.0] * len(c) for c in comp]}

    args = GRPOConfig(output_dir=out, per_device_train_batch_size=n, num_generations=n,
                      max_completion_length=completion_range[1] + 1, steps_per_generation=2,
                      gradient_accumulation_steps=1, max_steps=steps, report_to="none", use_cpu=True,
                      save_strategy="no", seed=seed, beta=0.04, disable_tqdm=True, loss_type="dapo",
                      logging_steps=10_000)
    data = Dataset.from_dict({"prompt": prompts})
    return GRPOTrainer(model=path, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                       args=args, train_dataset=data, processing_class=tk, rollout_func=rollout)


def run(share: bool | None, opts: argparse.Namespace) -> dict:
    """One training run: per-step training time without the rollout, tokens, final parameters."""
    import torch

    import microplan.integrations.trl as mpt
    import microplan.torch as mt
    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(out, layers=opts.layers, hidden=opts.hidden, prompt_range=(1400, 1601),
                               completion_range=(100, 401), groups=2, steps=opts.steps)
        if share is not None:
            mpt.install(trainer, share_prefixes=share)
        times, gen = [], [0.0]
        step, rollout = trainer.training_step, trainer.rollout_func
        packed_tokens = [0]

        def timed_rollout(*a, **k):
            t = time.perf_counter()
            try:
                return rollout(*a, **k)
            finally:
                gen[0] += time.perf_counter() - t

        def timed_step(*a, **k):
            gen[0] = 0.0
            t = time.perf_counter()
            out = step(*a, **k)
            times.append(time.perf_counter() - t - gen[0])
            return out
        real_pack = mt.pack_micro

        def counting_pack(micro, token_ids, **kw):
            packed = real_pack(micro, token_ids, **kw)
            packed_tokens[0] += packed.num_tokens
            return packed
        trainer.rollout_func, trainer.training_step, mt.pack_micro = timed_rollout, timed_step, counting_pack
        try:
            trainer.train()
        finally:
            mt.pack_micro = real_pack
            mpt.uninstall()
        params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    return {"step_s": times, "params": params, "packed_tokens": packed_tokens[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 layers, one generation (2 steps, no warm-up), 1 repeat")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-write", action="store_true")
    opts = ap.parse_args()
    opts.layers, opts.hidden, opts.steps = (2, 128, 2) if opts.quick else (4, 128, 4)
    repeats = 1 if opts.quick else opts.repeats
    import torch
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rows: dict[str, list[dict]] = {"TRL": [], "microplan share_prefixes": []}
    for _ in range(repeats):  # interleaved
        rows["TRL"].append(run(None, opts))
        rows["microplan share_prefixes"].append(run(True, opts))
    warm = 0 if opts.quick else 2  # the first generation's two steps
    table = {}
    for name, runs in rows.items():
        per_run = [float(np.sum(r["step_s"][warm:])) for r in runs]
        table[name] = {"train_s_per_step": min(per_run) / (opts.steps - warm), "runs_s": per_run,
                       "packed_tokens": runs[0]["packed_tokens"]}
    base, ours = table["TRL"]["train_s_per_step"], table["microplan share_prefixes"]["train_s_per_step"]
    speedup = base / ours
    rel = float((rows["microplan share_prefixes"][0]["params"] - rows["TRL"][0]["params"]).norm()
                / rows["TRL"][0]["params"].norm())
    print(f"GRPOTrainer, Llama {opts.layers} layers hidden {opts.hidden} float32, CPU ({torch.get_num_threads()} "
          f"threads); 2 groups × n=8 per generation, prompts 1400–1600 tokens, completions 100–400")
    print(f"{'path':28s} {'train s/step':>12s} {'runs (s, timed steps)':>22s}")
    for name, t in table.items():
        print(f"{name:28s} {t['train_s_per_step']:12.2f} {str([round(x, 1) for x in t['runs_s']]):>22s}")
    print(f"speed-up of the training step (log-prob passes + loss fwd + bwd, no generation): {speedup:.2f}x")
    print(f"tokens the tries held over the run: {table['microplan share_prefixes']['packed_tokens']:,}")
    print(f"parameters after {opts.steps} steps, relative difference to TRL's (float32, see note): {rel:.1e}")
    record("trl", write=not opts.no_write, quick=opts.quick, layers=opts.layers, hidden=opts.hidden,
           steps=opts.steps, table=table, speedup=speedup, params_rel_diff_float32=rel)


if __name__ == "__main__":
    main()
