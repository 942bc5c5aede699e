"""Plan JSON round trip, fingerprints, determinism across processes, and validate() catching
corruption (so validate itself can fail)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import microplan as mp
from reference import cases, configs, replace

ROOT = Path(__file__).resolve().parent.parent


# -- fixtures -----------------------------------------------------------------------------------


def _grpo_batch(seed: int = 0, prompts: int = 12, turns: int = 3) -> mp.Batch:
    rng = np.random.default_rng(seed)
    pids, rids, lens = [], [], []
    for p in range(prompts):
        for r in range(int(rng.integers(1, 4))):
            for _ in range(int(rng.integers(1, turns + 1))):
                pids.append(f"prompt-{p * 7919 % 1000}")
                rids.append(f"p{p}/r{r}")
                lens.append(int(rng.integers(20, 100)))
    return mp.Batch(lens, prompt_ids=pids, rollout_ids=rids, loss_tokens=[x // 2 for x in lens])


def _plan(**kw) -> mp.Plan:
    batch = kw.pop("batch", None) or _grpo_batch()
    kw.setdefault("dp_size", 3)
    if "micro_batch_size" not in kw:
        kw.setdefault("max_tokens_per_micro", 128)
    plan = mp.plan(batch, mp.PlanConfig(**kw))
    plan.validate()
    return plan


def _rebuild(plan: mp.Plan, *, steps=None, dropped=None, reasons=None) -> mp.Plan:
    return mp.Plan(batch=plan.batch, config=plan.config, steps=plan.steps if steps is None else steps,
                   dropped=plan.dropped if dropped is None else dropped,
                   drop_reasons=plan.drop_reasons if reasons is None else reasons)


def _micro(plan: mp.Plan, indices, scales, like: mp.Micro | None = None) -> mp.Micro:
    idx = np.asarray(indices, dtype=np.int64)
    b = plan.batch
    kw = {} if like is None else dict(cp_size=like.cp_size, cp_rank=like.cp_rank, cp_group=like.cp_group)
    return mp.Micro(idx, b.seq_lens[idx], b.loss_tokens[idx], np.asarray(scales, dtype=np.float64), **kw)


def _replace_micros(plan: mp.Plan, s: int, changes: dict, samples=None) -> mp.Plan:
    """New plan with micros[(r, m)] of step s replaced (None removes it)."""
    step = plan.steps[s]
    rows = []
    for r, row in enumerate(step.micros):
        new_row = []
        for m, micro in enumerate(row):
            if (r, m) in changes:
                if changes[(r, m)] is not None:
                    new_row.append(changes[(r, m)])
            else:
                new_row.append(micro)
        rows.append(new_row)
    new = mp.Step(step.index, rows, step.samples if samples is None else samples)
    steps = list(plan.steps)
    steps[s] = new
    return _rebuild(plan, steps=steps)


def _real(plan: mp.Plan, s: int = 0):
    return [(r, m, micro) for r, row in enumerate(plan.steps[s].micros) for m, micro in enumerate(row)
            if not micro.is_placeholder]


def _scale_of(plan: mp.Plan, i: int) -> float:
    for step in plan.steps:
        for row in step.micros:
            for micro in row:
                hit = np.flatnonzero(micro.indices == i)
                if hit.size:
                    return float(micro.loss_scale[hit[0]])
    raise KeyError(i)


def _invalid(plan: mp.Plan, pattern: str) -> None:
    with pytest.raises(mp.PlanError, match=pattern):
        plan.validate()


# -- validate() catches corruption ---------------------------------------------------------------


def test_validate_accepts_the_untouched_plan():
    plan = _plan()
    plan.validate()
    assert _rebuild(plan) == plan
    _rebuild(plan).validate()


def test_duplicate_sample():
    plan = _plan(max_tokens_per_micro=10 ** 4, dp_size=8)
    (r0, m0, a), (r1, m1, b) = _real(plan)[:2]
    i = int(b.indices[0])
    dup = _micro(plan, list(a.indices) + [i], list(a.loss_scale) + [_scale_of(plan, i)], a)
    bad = _replace_micros(plan, 0, {(r0, m0): dup})
    _invalid(bad, "two micro-batches")
    assert bad.fingerprint() != plan.fingerprint()


def test_sample_lost():
    plan = _plan(loss=mp.Loss("token-sum", grad_reduction="sum"))  # scales stay right: only coverage breaks
    r, m, a = next((r, m, a) for r, m, a in _real(plan) if a.num_samples >= 2)
    lost = int(a.indices[-1])
    shrunk = _micro(plan, a.indices[:-1], a.loss_scale[:-1], a)
    samples = plan.steps[0].samples[plan.steps[0].samples != lost]
    _invalid(_replace_micros(plan, 0, {(r, m): shrunk}, samples=samples), f"sample {lost} is neither planned nor dropped")
    # and when Step.samples still lists it: the missing sample is named, not the bookkeeping
    _invalid(_replace_micros(plan, 0, {(r, m): shrunk}), f"sample {lost} is neither planned nor dropped")
    # Step.samples that disagrees with intact micro-batches is still caught
    _invalid(_rebuild(plan, steps=[mp.Step(0, plan.steps[0].micros, plan.steps[0].samples[1:])]),
             "Step.samples differs")


def test_missing_or_doubled_sample_is_named_with_where_not_its_symptom():
    """Issue 29: a sample deleted from a token-mean plan was reported as a wrong loss_scale, a sample
    in two micro-batches as a cap overflow."""
    plan = _plan(max_tokens_per_micro=128)                  # token-mean: every scale depends on all samples
    real = _real(plan)
    r, m, a = next((r, m, a) for r, m, a in real if a.num_samples >= 2)
    lost = int(a.indices[-1])
    shrunk = _micro(plan, a.indices[:-1], a.loss_scale[:-1], a)
    peer = next(int(j) for j in np.flatnonzero(plan.batch.prompt_codes == plan.batch.prompt_codes[lost]) if j != lost)
    where = next(f"step 0, rank {r2}, micro {m2}" for r2, m2, x in real if peer in x.indices.tolist())
    _invalid(_replace_micros(plan, 0, {(r, m): shrunk}),
             rf"sample {lost} is neither planned nor dropped: it is in no micro-batch and not in dropped \(1 such "
             rf"sample\)(; its prompt group's sample {peer} trains in {where})?$")
    # doubled into a full micro-batch: over the cap too, but the cause is named, with both places
    (r0, m0, x), (r1, m1, y) = max(((p, q) for p in real for q in real if p[:2] != q[:2]),
                                   key=lambda pq: pq[0][2].num_tokens + pq[1][2].seq_lens[0])
    i = int(y.indices[0])
    dup = _micro(plan, list(x.indices) + [i], list(x.loss_scale) + [_scale_of(plan, i)], x)
    twice = _micro(plan, list(x.indices) + [int(x.indices[0])], list(x.loss_scale) + [float(x.loss_scale[0])], x)
    _invalid(_replace_micros(plan, 0, {(r0, m0): twice}),
             rf"sample {int(x.indices[0])} appears 2 times in step 0, rank {r0}, micro {m0}; every sample trains once")
    first, second = sorted([(r0, m0), (r1, m1)])
    _invalid(_replace_micros(plan, 0, {(r0, m0): dup}),
             rf"sample {i} appears in two micro-batches: step 0, rank {first[0]}, micro {first[1]} and step 0, "
             rf"rank {second[0]}, micro {second[1]}; every sample trains in exactly one micro-batch")


def test_validate_cli_names_missing_and_doubled_samples(tmp_path, capsys):
    from microplan.cli import main
    plan = _plan(max_tokens_per_micro=128)
    d = json.loads(plan.to_json())
    row = d["steps"][0][0]
    k = next(k for k, x in enumerate(row) if len(x["indices"]) >= 2)
    gone = row[k]["indices"].pop()
    row[k]["loss_scale"].pop()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"sample {gone} is neither planned nor dropped" in err, err
    d = json.loads(plan.to_json())                          # the sample trains in a second micro-batch too
    rows = d["steps"][0]
    r2 = next(r for r in range(1, len(rows)) if rows[r][0]["indices"])
    rows[r2][0]["indices"].append(gone)
    rows[r2][0]["loss_scale"].append(0.5)
    path.write_text(json.dumps(d))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"sample {gone} appears in two micro-batches: step 0, rank 0, micro {k} and step 0, rank {r2}, micro 0" in err


def test_plan_json_with_a_huge_length_or_no_kind_is_refused(tmp_path, capsys):
    from microplan.cli import main
    plan = _plan()
    for edit, pattern in [(lambda d: d["batch"]["seq_lens"].__setitem__(0, 1e30),
                           r"plan JSON batch: field 'seq_lens' holds 1e\+30, too large for a token count"),
                          (lambda d: d["batch"]["loss_tokens"].__setitem__(1, 2.5),
                           r"plan JSON batch: field 'loss_tokens'=2\.5 must be a whole number"),
                          (lambda d: d.pop("kind"), r"plan JSON \(top level\): field 'kind' is missing"),
                          (lambda d: d.__setitem__("kind", "eval"), r"field 'kind'='eval' must be one of")]:
        d = json.loads(plan.to_json())
        edit(d)
        with pytest.raises(mp.PlanError, match=pattern):
            mp.Plan.from_json(json.dumps(d))
        path = tmp_path / "p.json"
        path.write_text(json.dumps(d))
        assert main(["validate", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("microplan: error: ") and err.count("\n") == 1 and "Traceback" not in err
    # plans written before the field (and the pipeline fields that came with it) read as training plans
    d = json.loads(plan.to_json())
    d.pop("kind"), d.pop("choices")
    d["version"] = 1
    assert mp.Plan.from_json(json.dumps(d)).kind == "train"
    d = json.loads(plan.to_json())
    del d["kind"], d["config"]["pipeline_stages"], d["config"]["virtual_stages"]
    assert mp.Plan.from_json(json.dumps(d)) == plan


def test_cap_exceeded():
    batch = mp.Batch([60] * 8)
    plan = _plan(batch=batch, dp_size=2, max_tokens_per_micro=100)  # every micro a singleton
    (ra, ma, a), (rb, mb, b) = _real(plan)[:2]
    merged = _micro(plan, list(a.indices) + list(b.indices), list(a.loss_scale) + list(b.loss_scale), a)
    bad = _replace_micros(plan, 0, {(ra, ma): merged, (rb, mb): mp.Micro.placeholder(cp_group=(rb,))})
    _invalid(bad, "120 tokens.*max_tokens_per_micro=100")


def test_micro_batch_size_exceeded():
    plan = _plan(micro_batch_size=2, dp_size=2)
    (ra, ma, a), (rb, mb, b) = _real(plan)[:2]
    merged = _micro(plan, list(a.indices) + list(b.indices), list(a.loss_scale) + list(b.loss_scale), a)
    bad = _replace_micros(plan, 0, {(ra, ma): merged, (rb, mb): mp.Micro.placeholder(cp_group=(rb,))})
    _invalid(bad, "exceed micro_batch_size=2")


def test_unequal_micro_counts():
    plan = _plan()
    K = plan.steps[0].micro_count
    _invalid(_replace_micros(plan, 0, {(1, K - 1): None}), "rank 1 has .* micro-batches, rank 0 has")
    extra = mp.Micro.placeholder(cp_group=(2,))
    step = plan.steps[0]
    rows = [list(row) for row in step.micros]
    rows[2].append(extra)
    _invalid(_rebuild(plan, steps=[mp.Step(0, rows, step.samples)]), "counts must be equal")


def test_micro_count_not_aligned():
    plan = _plan(align=2, dp_size=2, max_tokens_per_micro=1000)
    step = plan.steps[0]
    K = step.micro_count
    assert K % 2 == 0
    # cut the last slot on every rank: counts stay equal but K is odd (checked before coverage)
    _invalid(_replace_micros(plan, 0, {(r, K - 1): None for r in range(2)}), "multiple of align=2")


def test_wrong_number_of_rank_rows():
    plan = _plan()
    step = plan.steps[0]
    _invalid(_rebuild(plan, steps=[mp.Step(0, step.micros[:-1], step.samples)]), "expected dp_size=3")


def test_rollout_spans_two_steps():
    batch = mp.Batch([10] * 8, rollout_ids=[0, 0, 1, 1, 2, 2, 3, 3])
    loss = mp.Loss("token-sum", grad_reduction="sum")  # scales are 1 in any step: only atomicity breaks
    plan = _plan(batch=batch, dp_size=1, max_tokens_per_micro=10, steps=mp.Steps(num_steps=2), loss=loss)
    s0, s1 = plan.steps
    moved = int(s0.micros[0][-1].indices[0])
    row0 = [m for m in s0.micros[0] if moved not in m.indices.tolist()]
    row1 = list(s1.micros[0]) + [_micro(plan, [moved], [1.0], s1.micros[0][0])]
    steps = [mp.Step(0, [row0], np.array(sorted(i for m in row0 for i in m.indices))),
             mp.Step(1, [row1], np.array(sorted(i for m in row1 for i in m.indices)))]
    _invalid(_rebuild(plan, steps=steps), "rollout 1 spans steps 0 and 1")


def test_prompt_group_spans_two_steps():
    batch = mp.Batch([10] * 4, prompt_ids=["a", "a", "b", "b"])
    loss = mp.Loss("token-sum", grad_reduction="sum")
    plan = _plan(batch=batch, dp_size=1, max_tokens_per_micro=10, steps=mp.Steps(num_steps=2), loss=loss)
    s0, s1 = plan.steps
    a, b = s0.micros[0][1], s1.micros[0][0]
    swap0 = [s0.micros[0][0], b]
    swap1 = [a, s1.micros[0][1]]
    steps = [mp.Step(0, [swap0], np.array(sorted(i for m in swap0 for i in m.indices))),
             mp.Step(1, [swap1], np.array(sorted(i for m in swap1 for i in m.indices)))]
    _invalid(_rebuild(plan, steps=steps), "prompt group 0 spans steps")


def test_wrong_loss_scale():
    plan = _plan(loss=mp.Loss("seq-mean-token-mean"))
    r, m, a = _real(plan)[3]
    scales = a.loss_scale.copy()
    scales[0] *= 1 + 1e-9
    _invalid(_replace_micros(plan, 0, {(r, m): _micro(plan, a.indices, scales, a)}), "loss_scale differs")
    scales[0] = np.nan
    _invalid(_replace_micros(plan, 0, {(r, m): _micro(plan, a.indices, scales, a)}), "non-finite loss_scale")


def test_placeholder_with_loss_or_misaligned_arrays():
    plan = _plan(dp_size=8, batch=mp.Batch([100, 90, 80]))
    r, m = next((r, m) for r, row in enumerate(plan.steps[0].micros) for m, x in enumerate(row) if x.is_placeholder)
    e = np.zeros(0)
    bad = mp.Micro(e, e, e, np.array([1.0]), cp_group=(r,))
    assert bad.is_placeholder
    _invalid(_replace_micros(plan, 0, {(r, m): bad}), "not aligned")


def test_lengths_differ_from_the_batch():
    plan = _plan()
    r, m, a = _real(plan)[0]
    bad = mp.Micro(a.indices, a.seq_lens + 1, a.loss_tokens, a.loss_scale, cp_group=a.cp_group)
    _invalid(_replace_micros(plan, 0, {(r, m): bad}), "differ from the batch")


def test_index_out_of_range():
    plan = _plan()
    r, m, a = _real(plan)[0]
    n = plan.batch.num_samples
    bad = mp.Micro([n], [1], [0], [0.0], cp_group=a.cp_group)
    _invalid(_replace_micros(plan, 0, {(r, m): bad}), "out of range")


def test_drop_bookkeeping():
    plan = _plan(steps=mp.Steps(prompts_per_step=5))  # 12 prompts: the last 2 are dropped
    assert plan.dropped.size > 0
    d = int(plan.dropped[0])
    reasons = dict(plan.drop_reasons)
    del reasons[d]
    _invalid(_rebuild(plan, reasons=reasons), "drop_reasons")
    _invalid(_rebuild(plan, dropped=plan.dropped[1:]), "drop_reasons|neither planned nor dropped")
    planned = int(plan.steps[0].samples[0])
    _invalid(_rebuild(plan, dropped=np.append(plan.dropped, planned), reasons={**plan.drop_reasons, planned: "x"}),
             f"sample {planned} is both dropped and planned")


@pytest.mark.parametrize("extra", [10 ** 4, -1])
def test_dropped_index_out_of_range(extra):
    """A negative index must not wrap around to a real sample, a large one must not crash."""
    plan = _plan(steps=mp.Steps(prompts_per_step=5))
    d = np.append(plan.dropped, extra)
    _invalid(_rebuild(plan, dropped=d, reasons={**plan.drop_reasons, extra: "x"}), f"dropped sample {extra} is out of range")


def test_empty_or_misnumbered_steps():
    plan = _plan()
    rows = [[mp.Micro.placeholder(cp_group=(r,))] for r in range(3)]
    _invalid(_rebuild(plan, steps=list(plan.steps) + [mp.Step(1, rows, np.zeros(0))]), "trains no sample")
    step = plan.steps[0]
    _invalid(_rebuild(plan, steps=[mp.Step(5, step.micros, step.samples)]), "index 5")


@given(data=st.data(), case=cases(max_samples=60, max_cap=256))
def test_validate_catches_random_tampering(data, case):
    """Swap one real sample for another sample's index: always caught."""
    cfg = replace(data.draw(configs(case, max_dp=8)), short_step="pad")
    try:
        plan = mp.plan(case.batch(), cfg)
    except mp.PlanError:
        return
    real = [(s, r, m, x) for s, step in enumerate(plan.steps) for r, row in enumerate(step.micros)
            for m, x in enumerate(row) if not x.is_placeholder]
    if not real:
        return
    s, r, m, a = data.draw(st.sampled_from(real))
    n = plan.batch.num_samples
    j = data.draw(st.integers(0, a.num_samples - 1))
    new = data.draw(st.integers(0, n - 1).filter(lambda k: k != int(a.indices[j])))
    idx = a.indices.copy()
    idx[j] = new
    note(f"step {s} rank {r} micro {m}: sample {int(a.indices[j])} -> {new}")
    bad = _replace_micros(plan, s, {(r, m): _micro(plan, idx, a.loss_scale, a)})
    with pytest.raises(mp.PlanError, match="invalid plan"):
        bad.validate()


# -- JSON ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw", [
    {}, {"micro_batch_size": 2}, {"steps": mp.Steps(prompts_per_step=5), "align": 2},
    {"steps": mp.Steps(num_steps=3), "sync": "step", "loss": mp.Loss("rollout-mean", engine_divides_by_micro_count=True)},
    {"context_parallel": mp.ContextParallel(size=2), "max_tokens_per_micro": 64,
     "cost": mp.FlopsCost(linear=3.0, quadratic=0.01, per_micro=5.0)},
    {"loss": mp.Loss("seq-mean-token-sum-norm", norm_constant=0.1), "short_step": "drop", "dp_size": 5},
    {"dp_size": 40},
])
def test_json_round_trip_is_exact(kw):
    plan = _plan(**kw)
    text = plan.to_json()
    back = mp.Plan.from_json(text)
    assert back == plan
    assert back.to_json() == text
    assert back.fingerprint() == plan.fingerprint() == hashlib.sha256(text.encode()).hexdigest()  # hashed in pieces
    assert "".join(plan._json_chunks()) == text
    assert back.stats == plan.stats
    assert mp.Plan.from_json(plan.to_json(indent=2)) == plan
    d = json.loads(text)
    assert d["format"] == "microplan.plan" and isinstance(d["version"], int)
    assert "NaN" not in text and "Infinity" not in text
    for s, step in enumerate(plan.steps):
        for r in range(plan.config.dp_size):
            for m, micro in enumerate(step.micros[r]):
                b = back.steps[s].micros[r][m]
                assert b.loss_scale.tobytes() == micro.loss_scale.tobytes()  # bit-exact floats
                assert b.is_placeholder == micro.is_placeholder


def test_fingerprint_is_sha256_of_canonical_json():
    import hashlib
    plan = _plan()
    assert plan.fingerprint() == hashlib.sha256(plan.to_json().encode()).hexdigest()
    assert len(plan.fingerprint()) == 64


def test_fingerprint_changes_with_the_plan():
    base = _plan()
    others = [_plan(dp_size=4), _plan(max_tokens_per_micro=129), _plan(loss=mp.Loss("token-sum")),
              _plan(batch=_grpo_batch(seed=1))]
    prints = {base.fingerprint()} | {p.fingerprint() for p in others}
    assert len(prints) == 1 + len(others)


@pytest.mark.parametrize("mutate,pattern", [
    (lambda d: d.update(format="other"), "not a microplan plan"),
    (lambda d: d.update(version=999), "version"),
    (lambda d: d.pop("steps"), "field 'steps' is missing"),
    (lambda d: d["steps"][0][0][0].update(indices=[10 ** 6]), r"step 0, rank 0, micro-batch 0: field 'indices' holds "
                                                               r"1000000, but the plan's batch has samples 0\.\."),
    (lambda d: d["steps"][0][0][0].pop("loss_scale"), "step 0, rank 0, micro-batch 0: field 'loss_scale' is missing"),
    (lambda d: d["steps"][0][0][0].update(indices=[-1]), "field 'indices' holds -1, but the plan's batch has samples 0"),
    (lambda d: d["steps"][0][0][0].update(indices=[0.5]), r"field 'indices' holds 0\.5, not a sample index"),
    (lambda d: d["steps"][0][0][0].update(cp_group=3), "step 0, rank 0, micro-batch 0: field 'cp_group' must be a list"),
    (lambda d: d["steps"][0][0].__setitem__(0, 7), "step 0, rank 0, micro-batch 0: expected an object"),
    (lambda d: d.update(dropped=[-1]), r"\(top level\): field 'dropped' holds -1"),
    (lambda d: d["config"].update(dp_size=0), "dp_size"),
    (lambda d: d["batch"].update(seq_lens=[-1] * len(d["batch"]["seq_lens"])), "seq_lens"),
])
def test_from_json_refuses_malformed_plans(mutate, pattern):
    d = json.loads(_plan().to_json())
    mutate(d)
    with pytest.raises(mp.PlanError, match=pattern):
        mp.Plan.from_json(json.dumps(d))


@pytest.mark.parametrize("text", ["", "{", "[1, 2]", "null", '"plan"'])
def test_from_json_refuses_non_plans(text):
    with pytest.raises(mp.PlanError):
        mp.Plan.from_json(text)


def test_tampered_json_fails_validation():
    plan = _plan(max_tokens_per_micro=10 ** 4, dp_size=8)
    d = json.loads(plan.to_json())
    first = d["steps"][0][0][0]
    second = next(m for row in d["steps"][0] for m in row if m["indices"] and m is not first)
    first["indices"].append(second["indices"][0])
    first["loss_scale"].append(second["loss_scale"][0])
    bad = mp.Plan.from_json(json.dumps(d))
    with pytest.raises(mp.PlanError, match="two micro-batches|Step.samples"):
        bad.validate()


# -- determinism ---------------------------------------------------------------------------------

_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import microplan as mp
    out = []
    for seed in range(4):
        rng = np.random.default_rng(seed)
        n = 300
        lens = rng.integers(1, 4096, n)
        pids = [f"uid-{int(x)}" for x in rng.integers(0, 60, n)]            # interleaved string ids
        rids = [f"{p}/{int(x)}" for p, x in zip(pids, rng.integers(0, 3, n))]
        batch = mp.Batch(lens, prompt_ids=pids, rollout_ids=rids, loss_tokens=rng.integers(0, lens + 1))
        for cfg in (mp.PlanConfig(dp_size=8, max_tokens_per_micro=4096, steps=mp.Steps(prompts_per_step=7)),
                    mp.PlanConfig(dp_size=5, max_tokens_per_micro=8192, align=2, sync="step",
                                  cost=mp.FlopsCost(linear=1.0, quadratic=1e-3, per_micro=3.0),
                                  loss=mp.Loss("prompt-mean", engine_divides_by_micro_count=True), seed=seed),
                    mp.PlanConfig(dp_size=3, micro_batch_size=4, steps=mp.Steps(num_steps=3),
                                  loss=mp.Loss("seq-mean-token-sum-norm", norm_constant=4096)),
                    mp.PlanConfig(dp_size=64, max_tokens_per_micro=4096, short_step="pad")):
            out.append(mp.plan(batch, cfg).fingerprint())
    print(json.dumps(out))
""")


def _fingerprints_in_subprocess(hashseed: str) -> list[str]:
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    res = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=120,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_same_plan_in_separate_processes():
    a = _fingerprints_in_subprocess("0")
    b = _fingerprints_in_subprocess("4242")
    assert len(a) == 16 and len(set(a)) == 16
    assert a == b
    ns: dict = {}
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(_SCRIPT, "<determinism>", "exec"), ns)
    assert json.loads(buf.getvalue()) == a


@given(data=st.data(), case=cases(max_samples=200))
def test_planning_twice_gives_the_same_plan(data, case):
    cfg = data.draw(configs(case, max_dp=64))
    try:
        p = mp.plan(case.batch(), cfg)
    except mp.PlanError as exc:
        with pytest.raises(mp.PlanError) as again:
            mp.plan(case.batch(), cfg)
        assert str(again.value) == str(exc)
        return
    q = mp.plan(case.batch(), cfg)
    assert p == q and p.to_json() == q.to_json()


def test_equivalent_ids_give_the_same_layout():
    """Ids are only compared: [7, 7, 3] and ["b", "b", "a"] describe the same structure."""
    lens = [50, 60, 70, 80, 90, 40]
    a = mp.plan(mp.Batch(lens, prompt_ids=[7, 7, 3, 3, 9, 9]), mp.PlanConfig(dp_size=2, max_tokens_per_micro=128,
                                                                             steps=mp.Steps(prompts_per_step=2)))
    b = mp.plan(mp.Batch(lens, prompt_ids=["b", "b", "a", "a", "c", "c"]),
                mp.PlanConfig(dp_size=2, max_tokens_per_micro=128, steps=mp.Steps(prompts_per_step=2)))
    assert a.steps == b.steps and np.array_equal(a.dropped, b.dropped)
