"""microplan.integrations.trl against the REAL trl package: its split's contract, its GRPO module binding.

Skipped, with the install command as the reason, when trl is not importable (CI installs it with
the "trl" extra).
"""

from __future__ import annotations

import inspect

import pytest
import torch

trl_utils = pytest.importorskip("trl.trainer.utils", reason="trl is not installed; install it with: pip install 'microplan[trl]'")

import microplan as mp  # noqa: E402
import microplan.integrations.trl as mpt  # noqa: E402


def _generation_batch(rows: int = 24, P: int = 12, T: int = 64, seed: int = 0) -> dict:
    """A local generation batch in GRPOTrainer's layout: left-padded prompts, right-padded completions."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(3, P + 1, (rows,), generator=g)
    clen = torch.randint(1, 9, (rows,), generator=g)
    clen[:4] = torch.tensor([T, T - 3, 50, 40])[: min(rows, 4)]  # long completions, all in TRL's first chunk
    prompt_mask = (torch.arange(P)[None, :] >= (P - plen)[:, None]).long()
    completion_mask = (torch.arange(T)[None, :] < clen[:, None]).long()
    return {
        "prompt_ids": torch.randint(5, 100, (rows, P), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(5, 100, (rows, T), generator=g) * completion_mask,
        "completion_mask": completion_mask,
        "old_per_token_logps": torch.randn(rows, T, generator=g) * completion_mask,
        "advantages": torch.randn(rows, generator=g),
        "num_items_in_batch": completion_mask.sum(),
    }


def test_same_signature_as_trls_split():
    assert inspect.signature(mpt.split_tensor_dict).parameters.keys() == \
        inspect.signature(trl_utils.split_tensor_dict).parameters.keys()


def test_chunks_cover_the_rows_balanced_and_trimmed():
    batch = _generation_batch()
    rows, k = 24, 4
    ours = mpt.split_tensor_dict(batch, k)
    theirs = trl_utils.split_tensor_dict(batch, k)
    assert len(ours) == len(theirs) == k
    tokens = (batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1))
    seen = []
    for c in ours:
        assert c["num_items_in_batch"] is batch["num_items_in_batch"]  # the global normaliser, unchanged
        n = c["advantages"].numel()
        assert n > 0 and all(c[key].shape[0] == n for key in c if c[key].ndim > 0)
        w = c["completion_ids"].shape[1]
        assert c["completion_mask"].shape[1] == c["old_per_token_logps"].shape[1] == w
        assert c["completion_mask"][:, -1].any(), "an all-padding trailing column was kept"
        assert c["prompt_ids"].shape[1] == 12  # prompts untouched (left padding kept)
        # every row of the chunk is a row of the batch, its completion prefix unchanged
        for i in range(n):
            j = int(((batch["advantages"] == c["advantages"][i])).nonzero()[0])
            seen.append(j)
            assert torch.equal(batch["completion_ids"][j, :w], c["completion_ids"][i])
            assert torch.equal(batch["completion_mask"][j, w:], torch.zeros_like(batch["completion_mask"][j, w:]))
    assert sorted(seen) == list(range(rows))
    load = [int(tokens[torch.isin(batch["advantages"], c["advantages"])].sum()) for c in ours]
    trl_load = [int((c["prompt_mask"].sum() + c["completion_mask"].sum())) for c in theirs]
    assert max(load) - min(load) <= int(tokens.max())   # LPT: within one row of each other
    assert max(load) < max(trl_load)                    # TRL's equal-row split piles the long rows together
    # the dapo loss is split-invariant: Σ over chunks of (ℓ·mask).sum() / normaliser is the same
    ell = lambda c: (c["old_per_token_logps"] * c["completion_mask"]).sum()  # noqa: E731
    norm = batch["num_items_in_batch"]
    assert torch.allclose(sum(ell(c) for c in ours) / norm, sum(ell(c) for c in theirs) / norm, rtol=1e-12)


def test_install_checks_the_loss_and_patches_the_grpo_module():
    import trl.trainer.grpo_trainer as grpo

    class Trainer:
        loss_type = "grpo"
    with pytest.raises(mp.PlanError, match="loss_type='grpo'"):
        mpt.install(Trainer())
    Trainer.loss_type = "dapo"
    before = grpo.split_tensor_dict
    mpt.install(Trainer())
    try:
        assert grpo.split_tensor_dict is mpt.split_tensor_dict and trl_utils.split_tensor_dict is mpt.split_tensor_dict
        chunks = grpo.split_tensor_dict(_generation_batch(), 3)  # what _prepare_inputs calls
        assert len(chunks) == 3
    finally:
        mpt.uninstall()
    assert grpo.split_tensor_dict is before
    with pytest.raises(mp.PlanError, match="cannot fill"):
        mpt.split_tensor_dict(_generation_batch(rows=2), 3)


def _grpo_step(patch: bool) -> tuple[torch.Tensor, list]:
    """One optimizer step of TRL's real GRPOTrainer (tiny float64 Llama, word-level tokenizer, CPU,
    SGD lr 1, no clipping): returns the parameter update and the chunk shapes the split produced."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer
    import trl.trainer.grpo_trainer as grpo

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
    before = [p.detach().clone() for p in model.parameters()]
    data = Dataset.from_dict({"prompt": [" ".join(f"w{(i * 7 + j) % 28}" for j in range(1 + i % 5)) for i in range(16)]})
    args = GRPOConfig(output_dir="trl-out", per_device_train_batch_size=4, num_generations=4, max_completion_length=24,
                      steps_per_generation=2, gradient_accumulation_steps=2, max_steps=1, report_to="none",
                      use_cpu=True, save_strategy="no", seed=0, optim="sgd", learning_rate=1.0,
                      lr_scheduler_type="constant", max_grad_norm=0.0, disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=args, train_dataset=data, processing_class=tk)
    if patch:
        mpt.install(trainer)
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


def test_a_real_grpo_step_gives_the_same_update_as_trls_split(tmp_path, monkeypatch):
    """GRPOTrainer (loss_type 'dapo', TRL's default) trained one step with TRL's split and with the
    drop-in: same completions, the drop-in's chunks trimmed to their own width, and the same
    parameter update to 1e-6 (measured 1.8e-9: HF's RMSNorm computes in float32)."""
    monkeypatch.chdir(tmp_path)
    theirs, their_shapes = _grpo_step(False)
    ours, our_shapes = _grpo_step(True)
    assert len(our_shapes) == len(their_shapes) == 1 and len(our_shapes[0]) == 2
    assert sum(s[0] for s in our_shapes[0]) == sum(s[0] for s in their_shapes[0])  # every row trains
    assert min(s[1] for s in our_shapes[0]) < their_shapes[0][0][1], "no chunk was trimmed"
    assert float((ours - theirs).norm() / theirs.norm()) < 1e-6
