"""microplan.integrations.trl against the REAL trl package: its split's contract, its GRPO module binding.

Fails, naming the install command, when trl is not importable: the README's test command installs
it (the "trl" extra), so a missing trl is a broken install, never a skip.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from _require import require  # noqa: E402

trl_utils = require("trl.trainer.utils")

import microplan as mp  # noqa: E402
import microplan.integrations.trl as mpt  # noqa: E402
from _examples import TRL_GRPO, run_example  # noqa: E402
from _tiny_model import _float64_norms  # noqa: E402
from microplan.integrations._trl_split import RULES, partition, windows  # noqa: E402


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
        loss_type = "ppo-something"
    with pytest.raises(mp.PlanError, match="loss_type='ppo-something'"):
        mpt.install(Trainer())
    with pytest.raises(mp.PlanError, match="needs the GRPOTrainer"):
        mpt.install(None, share_prefixes=True)
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


def test_a_real_grpo_step_gives_the_same_update_as_trls_split(tmp_path):
    """examples/trl_grpo.py: GRPOTrainer (loss_type 'dapo', TRL's default; tiny float64 Llama, CPU,
    SGD lr 1, no clipping) trained one step with TRL's split and with the drop-in: same rows, the
    drop-in's chunks trimmed to their own width, and the same parameter update to 1e-8: the model is
    float64 end to end (dtype-preserving RMSNorm, as tests/_tiny_model.py), and the one float32 step
    left is TRL's fused LM head log-probs (measured 2.3e-9; it, not the norm, is the limit: with HF's
    float32 RMSNorm the figure was 1.8e-9). The example checks it too; this re-checks its figures."""
    out = run_example(TRL_GRPO, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    figure = lambda label: re.search(rf"^{label}: (.*)$", out.stdout, flags=re.M)[1]  # noqa: E731
    their_shapes = ast.literal_eval(figure(r"TRL split chunks \(rows, completion width\)"))
    our_shapes = ast.literal_eval(figure(r"microplan split chunks \(rows, completion width\)"))
    rel = float(figure("relative difference of the parameter updates"))
    assert len(our_shapes) == len(their_shapes) == 1 and len(our_shapes[0]) == 2
    assert sum(s[0] for s in our_shapes[0]) == sum(s[0] for s in their_shapes[0])  # every row trains
    assert min(s[1] for s in our_shapes[0]) < their_shapes[0][0][1], "no chunk was trimmed"
    assert rel < 1e-8
    assert float(figure("relative difference of the parameter updates with shared prompts")) < 1e-6
    assert out.stdout.startswith("OK every row trains"), out.stdout[:500]  # the result first
    assert "OK each prompt computed once" in out.stdout
    assert "Warning" not in out.stdout + out.stderr, out.stderr[-2000:]  # quietly
    assert "{'loss'" not in out.stdout  # no raw log dicts


# -- optimizer-step windows and the loss types' rules ------------------------------------------------

def test_windows_follow_the_optimizer_steps():
    assert windows(4, 0, 2) == [range(0, 2), range(2, 4)]     # one generation, two optimizer steps
    assert windows(4, 0, 4) == [range(0, 4)] == windows(4, None, None)
    assert windows(2, 0, 4) == [range(0, 2)]                  # two generations per optimizer step
    assert windows(3, 0, 2) == [range(0, 2), range(2, 3)]     # steps 0,1 | 2 ...
    assert windows(3, 3, 2) == [range(0, 1), range(1, 3)]     # ... 3 | 4,5: the cut moves per generation
    assert windows(2, 0, 1, iterations=2) == [range(0, 1), range(1, 2)]
    assert windows(4, 0, 2, iterations=2) == [range(0, 2), range(2, 4)]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.sampled_from(sorted(set(RULES.values()))), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_partition_keeps_each_rule(k, size, rule, share, seed):
    rng = np.random.default_rng(seed)
    n = k * size
    tokens = rng.integers(1, 400, n)
    group = rng.integers(0, max(1, n // 3), n)
    prompt = rng.integers(0, 50, n)
    parts = partition(tokens, group, prompt, [size] * k, rule, share)
    assert len(parts) == k and all(p.size > 0 for p in parts)
    assert sorted(np.concatenate(parts).tolist()) == list(range(n))
    if rule in ("count", "keep"):
        assert [p.size for p in parts] == [size] * k
    if rule == "keep":
        assert all(p.tolist() == list(range(j * size, (j + 1) * size)) for j, p in enumerate(parts))


def test_split_keeps_rows_in_their_optimizer_step():
    """The defect: 4 chunks feeding 2 optimizer steps; the old split balanced over all 4."""
    batch = _generation_batch(rows=16)

    class Step:
        loss_type, _step, num_iterations = "dapo", 0, 1
        args = type("Args", (), {"gradient_accumulation_steps": 2})
    mpt.install(Step())
    try:
        chunks = mpt.split_tensor_dict(batch, 4)
    finally:
        mpt.uninstall()
    theirs = trl_utils.split_tensor_dict(batch, 4)
    for w in (0, 1):
        ours_rows = sorted(torch.cat([chunks[2 * w + j]["advantages"] for j in (0, 1)]).tolist())
        their_rows = sorted(torch.cat([theirs[2 * w + j]["advantages"] for j in (0, 1)]).tolist())
        assert ours_rows == their_rows


# -- real GRPOTrainer runs: every loss type, with and without shared prompts --------------------------

def _make_trainer(out: str, *, loss_type: str, dtype=torch.float64, spg: int = 4, gas: int = 2, beta: float = 0.0,
                  steps: int = 2, bs: int = 4, n: int = 4, prompts: int = 16, **extra):
    """GRPOTrainer on a tiny Llama (float64 end to end by default), SGD lr 1, no clipping: the
    parameter change is the accumulated gradient. beta > 0: a reference model and its pass;
    steps_per_generation > gradient_accumulation_steps: the old log-prob pass."""
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
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight[29] += 2.5  # <eos> likely: completions of several lengths
    if beta:
        path = os.path.join(out, "model")    # a path: TRL builds the reference model from it
        model.save_pretrained(path)
    else:
        path = model.to(dtype)
    data = Dataset.from_dict({"prompt": [" ".join(f"w{(i * 7 + j) % 28}" for j in range(1 + i % 5))
                                         for i in range(prompts)]})
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=bs, num_generations=n, max_completion_length=24,
                      steps_per_generation=spg, gradient_accumulation_steps=gas, max_steps=steps, report_to="none",
                      use_cpu=True, save_strategy="no", seed=0, optim="sgd", learning_rate=1.0, beta=beta,
                      lr_scheduler_type="constant", max_grad_norm=0.0, disable_tqdm=True, loss_type=loss_type,
                      **extra)
    trainer = GRPOTrainer(model=path, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          args=args, train_dataset=data, processing_class=tk)
    for m in (trainer.model, trainer.ref_model):
        if m is not None:
            m.to(dtype)
            if dtype == torch.float64:
                _float64_norms(m)  # HF's RMSNorm rounds through float32 even in a float64 model
    return trainer


def _train(patch: bool, share: bool = False, spy=None, install_kw: dict | None = None,
           **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """(θ after, θ − θ₀) of one training run (``install_kw``: more arguments of ``mpt.install``)."""
    with tempfile.TemporaryDirectory() as out:
        trainer = _make_trainer(out, **kw)
        before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])
        if patch:
            mpt.install(trainer, share_prefixes=share, **(install_kw or {}))
        try:
            trainer.train()
        finally:
            mpt.uninstall()
        after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    return after, after - before


_REFERENCE: dict = {}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("loss_type", list(RULES))
def test_every_loss_type_gives_trls_update(loss_type):
    """One generation feeding two optimizer steps (steps_per_generation 4, accumulation 2, so the
    old log-prob pass runs), float64 end to end: θ − θ₀ after two optimizer steps equals TRL's own
    within 1e-7 relative (measured ~1e-9) with TRL's split replaced, and with shared prompts on
    top. Before the window fix the split moved rows between the two optimizer steps (0.77 relative
    on dapo)."""
    kw = dict(loss_type=loss_type)
    if loss_type == "luspo":
        kw["importance_sampling_level"] = "sequence"
    _, theirs = _train(False, **kw)
    _, ours = _train(True, **kw)
    _, shared = _train(True, share=True, **kw)
    assert _rel(ours, theirs) < 1e-7, (loss_type, _rel(ours, theirs))
    assert _rel(shared, theirs) < 1e-7, (loss_type, _rel(shared, theirs))


def test_shared_prompts_match_trl_with_a_reference_model_moving_windows_and_iterations():
    """A reference model (beta 0.04: its pass runs on tries too) with steps_per_generation 3 and
    accumulation 2 (the window cut moves between generations); num_iterations 2 (each generation
    trains twice, old log-probs from the shared pass). TRL against itself: bit-identical on CPU."""
    for kw in (dict(loss_type="grpo", spg=3, gas=2, steps=3, prompts=12, beta=0.04),
               dict(loss_type="dapo", spg=2, gas=1, steps=4, bs=8, num_iterations=2)):
        _, theirs = _train(False, **kw)
        _, shared = _train(True, share=True, **kw)
        assert _rel(shared, theirs) < 1e-7, (kw, _rel(shared, theirs))
    _, again = _train(False, **kw)
    assert _rel(again, theirs) == 0.0


def test_shared_prompts_compute_each_prompt_once_per_micro_batch(monkeypatch):
    """Every pass packs tries: the training forward and the old/ref passes hold each distinct
    prompt once per micro-batch, and fewer tokens than the padded rows' real tokens."""
    import microplan.torch as mt
    seen = []
    real = mt.pack_micro

    def spy(micro, token_ids, **kw):
        packed = real(micro, token_ids, **kw)
        prompts = {tuple(token_ids[i][: int(micro.seq_lens[k] - micro.loss_tokens[k])].tolist())
                   for k, i in enumerate(micro.indices.tolist())}
        seen.append((packed.num_tokens, int(micro.seq_lens.sum()), sum(len(p) for p in prompts),
                     int(micro.loss_tokens.sum())))
        return packed
    monkeypatch.setattr(mt, "pack_micro", spy)
    _train(True, share=True, loss_type="grpo", bs=4, n=4, prompts=8, steps=1, spg=2, gas=1, beta=0.04)
    assert len(seen) >= 3  # the old and reference passes, the training forward
    for packed, flat, prompts, completions in seen:
        assert packed <= prompts + completions  # each distinct prompt once (completions may share too)
    assert sum(s[0] for s in seen) < 0.8 * sum(s[1] for s in seen)


# -- a memory budget (issue 28, item 5) --------------------------------------------------------------

_MEM = mp.MemoryModel(per_token=1.0, per_sample_sq=0.01, per_micro=5.0, margin=0.1)


def _chunk_bytes(c: dict) -> int:
    """The padded chunk's predicted bytes with the margin, from its tensors (rows x prompt + completion width)."""
    n, w = c["completion_ids"].shape[0], c["prompt_ids"].shape[1] + c["completion_ids"].shape[1]
    return int(np.ceil((n * w + 0.01 * n * w * w + 5.0) * 1.1))


def _split_with(loss_type: str, budget: int | None, batch: dict, k: int = 4) -> list[dict]:
    class Trainer:
        pass
    Trainer.loss_type = loss_type
    mpt.install(Trainer(), **({} if budget is None else dict(memory=_MEM, max_bytes_per_micro=budget)))
    try:
        return mpt.split_tensor_dict(batch, k)
    finally:
        mpt.uninstall()


def test_a_memory_budget_keeps_every_chunk_under_its_bytes():
    """dapo (any non-empty chunks): the token-balanced split spreads the four long completions over
    the four chunks, each then padded to its long row; under a budget the long rows share chunks
    and every chunk's padded batch fits. A budget the default split meets changes nothing; the
    row-count losses (grpo) cannot re-cut their way under it and say so."""
    batch = _generation_batch()
    default = _split_with("dapo", None, batch)
    worst = max(_chunk_bytes(c) for c in default)
    budget = worst // 2
    ours = _split_with("dapo", budget, batch)
    assert len(ours) == 4 and all(c["advantages"].numel() > 0 for c in ours)
    assert sorted(torch.cat([c["advantages"] for c in ours]).tolist()) == sorted(batch["advantages"].tolist())
    assert max(_chunk_bytes(c) for c in ours) <= budget < worst
    same = _split_with("dapo", worst, batch)  # already fits: the token-balanced split, untouched
    assert all(torch.equal(a["advantages"], b["advantages"]) for a, b in zip(same, default))
    with pytest.raises(mp.PlanError, match=r"max_bytes_per_micro=\d.*rows per chunk"):
        _split_with("grpo", budget, batch)
    grpo_worst = max(_chunk_bytes(c) for c in _split_with("grpo", None, batch))
    assert len(_split_with("grpo", grpo_worst, batch)) == 4
    with pytest.raises(mp.PlanError, match="steps_per_generation"):
        _split_with("dapo", 60, batch)  # not even one long row with one short row per other chunk fits


def test_install_validates_the_memory_budget():
    class Trainer:
        loss_type = "dapo"
    with pytest.raises(mp.PlanError, match="max_bytes_per_micro"):
        mpt.install(Trainer(), memory=_MEM)
    with pytest.raises(mp.PlanError, match="prefix-tree"):
        mpt.install(Trainer(), share_prefixes=True, memory=_MEM, max_bytes_per_micro=10 ** 6)
    assert not mpt.installed()


def test_a_real_grpo_step_under_a_memory_budget_gives_trls_update(monkeypatch):
    """A real GRPOTrainer (dapo, one generation feeding two optimizer steps): with a budget under
    the token-balanced split's fullest chunk (56 bytes at 1 byte per padded token), the first
    optimizer step's chunks are re-cut (rows stay in their step) and every chunk fits; the update
    still equals TRL's own."""
    from microplan.integrations import _trl_memory as tm
    seen, fit = [], tm.fit_budget

    def spy(parts, widths, prompt_width, rule, model, budget):
        out = fit(parts, widths, prompt_width, rule, model, budget)
        size = lambda ps: max(tm.padded_bytes(model, p.size, prompt_width + int(widths[p].max())) for p in ps)  # noqa: E731
        seen.append((size(parts), size(out)))
        return out
    monkeypatch.setattr(tm, "fit_budget", spy)
    mem = dict(memory=mp.MemoryModel(per_token=1.0, margin=0.0), max_bytes_per_micro=48)
    _, theirs = _train(False, loss_type="dapo")
    _, ours = _train(True, loss_type="dapo", install_kw=mem)
    assert seen and any(before > 48 for before, _ in seen) and all(after <= 48 for _, after in seen), seen
    assert _rel(ours, theirs) < 1e-7, _rel(ours, theirs)
