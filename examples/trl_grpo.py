"""TRL's GRPOTrainer with microplan's gradient-accumulation split: one real optimizer step, on CPU.

    python examples/trl_grpo.py          # needs: pip install -e ".[trl]" (in the clone)

``microplan.integrations.trl.install(trainer)`` replaces TRL's ``split_tensor_dict`` (equal row
counts, in order) with token-balanced chunks trimmed to their own longest completion. The
trainer here is real and tiny: a float64 2-layer Llama with random weights, a word-level
tokenizer, 16 one-line prompts, 4 completions each, reward = completion length, SGD with lr 1
and no clipping, so the parameter update is the gradient itself. The same step runs twice from
the same seed — with TRL's own split, then with microplan's — and the script prints each
split's chunk shapes and checks that every row trains, that microplan's chunks are trimmed, and
that the update is the same (TRL's ``dapo`` loss divides every chunk by the generation batch's
token count, so the split cannot change the gradient). The model is float64 end to end (no bf16;
HF's ``LlamaRMSNorm`` casts to float32 even in a float64 model, so every norm is swapped for a
dtype-preserving one, same math and parameters, as tests/_tiny_model.py does). One float32 step
remains, TRL's own: its fused LM head (``fused_lm_head=True`` in GRPOTrainer) computes the
log-probs in float32, so the two updates agree to ~2e-9 (measured 2.3e-9), checked at 1e-8. A third run adds ``share_prefixes=True``:
each group's prompt is computed once per micro-batch (prefix-tree rows) in the training forward,
with the same update (checked at 1e-6). Prints the ``OK`` result lines first, then the figures;
exits non-zero on any mismatch. transformers' and TRL's warnings about this toy setup (CPU,
tiny model, no tqdm) are silenced, so the output is the result.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import warnings

import torch

import microplan.integrations.trl as mpt


def quiet() -> None:
    """Silence the third-party chatter this toy run triggers (FutureWarnings, info logs)."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(transformers|trl|accelerate|torch)\.")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in ("transformers", "trl", "accelerate", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)


def float64_norms(model: torch.nn.Module) -> None:
    """Make every LlamaRMSNorm compute in its input dtype (HF's casts to float32 even in a float64 model)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class RMSNormSameDtype(LlamaRMSNorm):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for m in model.modules():
        if type(m) is LlamaRMSNorm:
            m.__class__ = RMSNormSameDtype


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
    float64_norms(model)
    with torch.no_grad():
        model.lm_head.weight[29] += 2.5  # <eos> likely: completions of several lengths
    data = Dataset.from_dict({"prompt": [" ".join(f"w{(i * 7 + j) % 28}" for j in range(1 + i % 5)) for i in range(16)]})
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=24,
                      steps_per_generation=2, gradient_accumulation_steps=2, max_steps=1, report_to="none",
                      use_cpu=True, save_strategy="no", seed=0, optim="sgd", learning_rate=1.0,
                      lr_scheduler_type="constant", max_grad_norm=0.0, disable_tqdm=True, loss_type="dapo", bf16=False)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=args, train_dataset=data, processing_class=tk)
    from transformers.trainer_callback import PrinterCallback
    trainer.remove_callback(PrinterCallback)  # the raw per-step log dicts (disable_tqdm=True prints them)
    return trainer


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
    quiet()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        theirs, their_shapes = grpo_step(False, os.path.join(out, "trl"))
        ours, our_shapes = grpo_step(True, os.path.join(out, "microplan"))
        shared, _ = grpo_step(True, os.path.join(out, "shared"), share=True)
    rel = float((ours - theirs).norm() / theirs.norm())
    assert [sum(r for r, _ in g) for g in our_shapes] == [sum(r for r, _ in g) for g in their_shapes], "rows lost"
    assert min(w for g in our_shapes for _, w in g) < max(w for g in their_shapes for _, w in g), "no chunk trimmed"
    assert rel < 1e-8, f"the update differs from TRL's own split by {rel:.1e}"
    rel_shared = float((shared - theirs).norm() / theirs.norm())
    assert rel_shared < 1e-6, f"the update with shared prompts differs from TRL's by {rel_shared:.1e}"
    print(f"OK every row trains, chunks trimmed, same parameter update as TRL's own split (relative difference {rel:.1e})")
    print(f"OK each prompt computed once per micro-batch, same parameter update as TRL's own path "
          f"(relative difference {rel_shared:.1e})")
    print(f"TRL split chunks (rows, completion width): {their_shapes}")
    print(f"microplan split chunks (rows, completion width): {our_shapes}")
    print(f"relative difference of the parameter updates: {rel:.1e}")
    print(f"relative difference of the parameter updates with shared prompts: {rel_shared:.1e}")


if __name__ == "__main__":
    main()
    sys.exit(0)
