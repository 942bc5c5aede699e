"""TRL's GRPOTrainer with microplan's gradient-accumulation split: one real optimizer step, on CPU.

    python examples/trl_grpo.py          # needs: pip install 'microplan[trl]'

``microplan.integrations.trl.install(trainer)`` replaces TRL's ``split_tensor_dict`` (equal row
counts, in order) with token-balanced chunks trimmed to their own longest completion. The
trainer here is real and tiny: a float64 2-layer Llama with random weights, a word-level
tokenizer, 16 one-line prompts, 4 completions each, reward = completion length, SGD with lr 1
and no clipping, so the parameter update is the gradient itself. The same step runs twice from
the same seed — with TRL's own split, then with microplan's — and the script prints each
split's chunk shapes and checks that every row trains, that microplan's chunks are trimmed, and
that the update is the same (TRL's ``dapo`` loss divides every chunk by the generation batch's
token count, so the split cannot change the gradient; HF's RMSNorm computes in float32, hence
~1e-9 rather than 1e-15). A third run adds ``share_prefixes=True``: each group's prompt is
computed once per micro-batch (prefix-tree rows) in the training forward, with the same update.
Prints ``OK`` lines; exits non-zero on any mismatch.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

import microplan.integrations.trl as mpt


def make_trainer(output_dir: str):
    """GRPOTrainer on a tiny float64 Llama (TRL's default loss_type 'dapo'), one optimizer step."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer

    vocab = {f"w{i}": i for i in range(28)} | {"<pad>": 28, "<eos>": 29, "<bos>": 30, "<unk>": 31}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tk = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                 unk_token="<unk>")
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=128, pad_token_id=28, eos_token_id=29,
                      bos_token_id=30)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).double()
    with torch.no_grad():
        model.lm_head.weight[29] += 2.5  # <eos> likely: completions of several lengths
    data = Dataset.from_dict({"prompt": [" ".join(f"w{(i * 7 + j) % 28}" for j in range(1 + i % 5)) for i in range(16)]})
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=24,
                      steps_per_generation=2, gradient_accumulation_steps=2, max_steps=1, report_to="none",
                      use_cpu=True, save_strategy="no", seed=0, optim="sgd", learning_rate=1.0,
                      lr_scheduler_type="constant", max_grad_norm=0.0, disable_tqdm=True, loss_type="dapo")
    return GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                       args=args, train_dataset=data, processing_class=tk)


def grpo_step(patch: bool, output_dir: str, share: bool = False) -> tuple[torch.Tensor, list[list[tuple[int, int]]]]:
    """One optimizer step, with microplan's split when ``patch`` (and its prefix-tree model passes
    when ``share``): the parameter update and, per generation batch, the (rows, completion width)
    of each chunk the split produced."""
    import trl.trainer.grpo_trainer as grpo

    trainer = make_trainer(output_dir)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    if patch:
        mpt.install(trainer, share_prefixes=share)  # mpt.uninstall() restores TRL
    split, shapes = grpo.split_tensor_dict, []

    def spy(d, k):
        out = split(d, k)
        shapes.append([tuple(c["completion_ids"].shape) for c in out])
        return out
    grpo.split_tensor_dict = spy
    try:
        trainer.train()
    finally:
        grpo.split_tensor_dict = split
        mpt.uninstall()
    return torch.cat([(p.detach() - b).flatten() for p, b in zip(trainer.model.parameters(), before)]), shapes


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        theirs, their_shapes = grpo_step(False, os.path.join(out, "trl"))
        ours, our_shapes = grpo_step(True, os.path.join(out, "microplan"))
        shared, _ = grpo_step(True, os.path.join(out, "shared"), share=True)
    print(f"TRL split chunks (rows, completion width): {their_shapes}")
    print(f"microplan split chunks (rows, completion width): {our_shapes}")
    rel = float((ours - theirs).norm() / theirs.norm())
    print(f"relative difference of the parameter updates: {rel:.1e}")
    assert [sum(r for r, _ in g) for g in our_shapes] == [sum(r for r, _ in g) for g in their_shapes], "rows lost"
    assert min(w for g in our_shapes for _, w in g) < max(w for g in their_shapes for _, w in g), "no chunk trimmed"
    assert rel < 1e-6, f"the update differs from TRL's own split by {rel:.1e}"
    print("OK every row trains, chunks trimmed, same parameter update as TRL's own split")
    rel_shared = float((shared - theirs).norm() / theirs.norm())
    print(f"relative difference of the parameter updates with shared prompts: {rel_shared:.1e}")
    assert rel_shared < 1e-6, f"the update with shared prompts differs from TRL's by {rel_shared:.1e}"
    print("OK each prompt computed once per micro-batch, same parameter update as TRL's own path")


if __name__ == "__main__":
    main()
    sys.exit(0)
