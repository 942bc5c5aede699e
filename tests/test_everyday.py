"""The everyday path (issue 21): the README's commands, the summary, the picture, errors that point
the right way. Each test failed before the change it covers."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _require import require

import microplan as mp
from microplan.cli import format_summary, main
from microplan.io import read_batch, read_plan, write_batch
from microplan.summary import LEGEND, cost_unit, sig
from microplan.traces import generate

ROOT = Path(__file__).resolve().parent.parent


# -- the README's two commands and .ci/run -----------------------------------------------------------

def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, flags=re.S)[1]
    return [line for line in block.splitlines() if line.strip()]


def test_readme_opens_with_two_commands_and_ci_runs_the_second_exactly() -> None:
    cmds = _readme_commands()
    assert len(cmds) == 2 and cmds[0].endswith("microplan demo") and "python -m pytest" in cmds[1]
    ci = [line for line in (ROOT / ".ci/run").read_text().splitlines() if line and not line.startswith("#")]
    run = [line for line in ci if "pytest" in line]
    assert run == [cmds[1]], (run, cmds[1])
    assert not any("HYPOTHESIS_PROFILE" in line for line in ci), "CI must run the README's command, unchanged"


def test_bounded_profile_is_the_default_and_never_zero_examples() -> None:
    code = ("import sys; sys.path.insert(0, 'tests'); import conftest; from hypothesis import settings; "
            "print(settings().max_examples, settings().derandomize)")
    for value, expected in ((None, "60 True"), ("", "60 True"), ("dev", "1000 False")):
        env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
        if value is not None:
            env["HYPOTHESIS_PROFILE"] = value
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
        assert out.stdout.strip() == expected, (value, out.stdout, out.stderr[-500:])


# -- the summary -------------------------------------------------------------------------------------

def _demo_plan(**kw) -> mp.Plan:
    batch = generate("grpo-longtail", num_prompts=64, max_len=16384, seed=0)
    cfg = dict(dp_size=8, max_tokens_per_micro=16384, steps=mp.Steps(prompts_per_step=32)) | kw
    return mp.plan(batch, mp.PlanConfig(**cfg))


def test_plan_summary_is_the_cli_summary_with_units_and_a_legend() -> None:
    plan = _demo_plan()
    text = plan.summary()
    assert text == format_summary(plan)
    assert "units                  : predicted cost, in tokens of compute" in text
    for term, _ in LEGEND:                                 # every term explained, one line each
        assert re.search(rf"^    {re.escape(term)} +\S", text, flags=re.M), term
    assert "inf" not in text and "nan" not in text
    # one format for every predicted figure: 4 significant figures, trailing zeros kept
    figures = re.findall(r"(\d+\.\d+[kMGT]?) tokens", text)
    assert figures and all(len(f.rstrip("kMGT").replace(".", "").lstrip("0")) == 4 for f in figures), figures


def test_summary_units_follow_the_cost() -> None:
    cfg = mp.PlanConfig(dp_size=2, max_tokens_per_micro=100)
    assert cost_unit(cfg).short == "tokens" and not cost_unit(cfg).seconds
    timed = mp.PlanConfig(dp_size=2, max_tokens_per_micro=100, cost=mp.FlopsCost(linear=2e-6, per_micro=0.01))
    assert cost_unit(timed).seconds
    hf = dict(model_type="llama", hidden_size=1024, num_hidden_layers=4, num_attention_heads=8,
              intermediate_size=4096, vocab_size=32000)
    flops = mp.PlanConfig(dp_size=2, max_tokens_per_micro=100, cost=mp.FlopsCost.from_hf_config(hf))
    assert cost_unit(flops).short == "FLOPs"
    text = mp.plan(mp.Batch([30, 40, 50, 60]), timed).summary()
    assert "in seconds" in text and re.search(r"predicted time +: 10\.18 ms \(lockstep", text)


def test_summary_of_a_padded_layout_reports_padding_apart_from_placeholders_and_no_inf() -> None:
    plan = _demo_plan(layout="padded")
    text = plan.summary()
    pad = sum(m.num_tokens for s in plan.steps for row in s.micros for m in row if not m.is_placeholder) \
        - int(plan.batch.seq_lens[np.concatenate([s.samples for s in plan.steps])].sum())
    assert pad > 0 and f"padding                : {pad:,} tokens" in text
    assert "placeholders           : 0 empty micro-batches" in text
    why = " ".join(re.search(r"why K \(step \d+\) +: (.*?)\n  dropped", text, flags=re.S)[1].split())
    assert "inf" not in why and "could not" not in why and "no packing" in why and "padded layout" in why


def test_summary_counts_placeholders_and_repr_fits_a_screen() -> None:
    plan = mp.plan(mp.Batch([900, 300, 2500, 700, 1200]), mp.PlanConfig(dp_size=4, max_tokens_per_micro=3000, align=2))
    assert plan.stats.num_placeholders == 3
    text = plan.summary()
    assert "placeholders           : 3 empty micro-batches" in text and "padding      " in text  # legend only
    assert "padding                :" not in text          # a varlen layout cannot pad: no padding row
    r = repr(plan)
    assert "\n" not in r and len(r) <= 200 and r.startswith("<Plan: 1 step × dp 4") and "K_lb" in r


def test_sig_keeps_significant_figures() -> None:
    assert [sig(x) for x in (1_100_000, 1_098_091, 999.96, 14942, 0.25, 0, 8.4716e15)] == \
        ["1.100M", "1.098M", "1.000k", "14.94k", "0.2500", "0", "8.472P"]


# -- degenerate input and errors that point the right way --------------------------------------------

@pytest.fixture
def trace(tmp_path: Path) -> Path:
    out = tmp_path / "trace.jsonl"
    write_batch(generate("grpo-longtail", num_prompts=40, samples_per_prompt=4, max_len=8192, seed=1), out)
    return out


def _err(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("microplan: error: ") and err.count("\n") == 1
    return err


def test_a_sample_over_the_cap_is_named_by_its_file_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    p = tmp_path / "b.jsonl"
    p.write_text('{"seq_len": 100}\n\n{"seq_len": 200}\n{"seq_len": 50000}\n')
    err = _err(capsys, ["plan", str(p), "--dp", "2", "--max-tokens", "1000"])
    assert "b.jsonl line 4 (sample 2, counting from 0): sample 2 occupies 50000 tokens" in err
    c = tmp_path / "b.csv"
    c.write_text("seq_len\n100\n50000\n")
    assert "b.csv row 2 (sample 1, counting from 0)" in _err(capsys, ["plan", str(c), "--dp", "2", "--max-tokens", "1000"])


def test_jsonl_string_length_is_refused_naming_the_line(tmp_path: Path) -> None:
    p = tmp_path / "s.jsonl"
    p.write_text('{"seq_len": 100}\n{"seq_len": "200"}\n')
    with pytest.raises(mp.PlanError, match=r"s\.jsonl line 2: field 'seq_len'='200' is a string; write the number of "
                                           r"tokens as a JSON number \(\"seq_len\": 200\)"):
        read_batch(p)
    c = tmp_path / "s.csv"                      # CSV has no types: text is parsed there
    c.write_text("seq_len\n100\n200\n")
    assert read_batch(c).seq_lens.tolist() == [100, 200]


def test_missing_file_says_no_such_file_whatever_its_extension(tmp_path: Path) -> None:
    with pytest.raises(mp.PlanError, match=r"trace\.txt: no such file"):
        read_batch(tmp_path / "trace.txt")


def test_a_batch_file_given_as_a_plan_says_so(tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture) -> None:
    err = _err(capsys, ["validate", str(trace)])
    assert "this is a batch file (JSONL, one sample per line), not a plan; plan it with 'microplan plan" in err
    c = tmp_path / "b.csv"
    c.write_text("seq_len,prompt_id\n5,1\n")
    with pytest.raises(mp.PlanError, match=r"batch file \(CSV with a seq_len column\), not a plan"):
        read_plan(c)
    a = tmp_path / "a.json"
    a.write_text(json.dumps([{"seq_len": 5}]))
    with pytest.raises(mp.PlanError, match=r"batch file \(a JSON array of samples\)"):
        read_plan(a)


def test_a_damaged_plan_file_names_field_and_place(tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture) -> None:
    js = tmp_path / "plan.json"
    assert main(["plan", str(trace), "--dp", "2", "--max-tokens", "9000", "--json", str(js)]) == 0
    d = json.loads(js.read_text())
    d["steps"][0][1][0]["indices"][0] = -1
    js.write_text(json.dumps(d))
    err = _err(capsys, ["validate", str(js)])
    assert "plan JSON step 0, rank 1, micro-batch 0: field 'indices' holds -1, but the plan's batch has samples 0..159" in err
    d["steps"][0][1][0]["indices"][0] = 0.5
    js.write_text(json.dumps(d))
    assert "field 'indices' holds 0.5, not a sample index" in _err(capsys, ["validate", str(js)])
    del d["steps"][0][1][0]["loss_scale"]
    d["steps"][0][1][0]["indices"][0] = 3
    js.write_text(json.dumps(d))
    assert "step 0, rank 1, micro-batch 0: field 'loss_scale' is missing" in _err(capsys, ["validate", str(js)])


def test_steps_that_cannot_form_exit_2_naming_the_option(trace: Path, capsys: pytest.CaptureFixture) -> None:
    err = _err(capsys, ["plan", str(trace), "--dp", "2", "--max-tokens", "9000", "--prompts-per-step", "1000"])
    assert "all 160 samples would be dropped; set --prompts-per-step to at most 40" in err   # the CLI's own words
    with pytest.raises(mp.PlanError, match=r"prompts_per_step=3\) forms no optimizer step"):
        mp.plan(mp.Batch([5, 6], prompt_ids=[0, 1]),
                mp.PlanConfig(dp_size=1, max_tokens_per_micro=10, steps=mp.Steps(prompts_per_step=3)))


def test_demo_without_matplotlib_says_no_png(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                             tmp_path: Path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.chdir(tmp_path)
    err = _err(capsys, ["demo", "--num-prompts", "16"])
    assert "pip install -e '.[plot]' in the microplan clone (or pass --no-png)" in err and "leave out --png" not in err
    trace = tmp_path / "t.jsonl"
    write_batch(mp.Batch([5, 6]), trace)
    err = _err(capsys, ["plan", str(trace), "--dp", "1", "--max-tokens", "10", "--png", "x.png"])
    assert "(or leave out --png)" in err


def test_gpt2_configs_use_their_documented_ffn_default() -> None:
    transformers = require("transformers")
    gpt2 = dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257, activation_function="gelu_new")
    assert mp.FlopsCost.from_hf_config(transformers.GPT2Config()) == \
        mp.FlopsCost.from_hf_config(gpt2 | {"n_inner": 3072}) == mp.FlopsCost.from_hf_config(gpt2 | {"n_inner": None})
    bad = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=100,
               intermediate_size=None)
    with pytest.raises(mp.PlanError, match=r"'intermediate_size' is null") as exc:
        mp.FlopsCost.from_hf_config(bad)
    assert "config.json" not in str(exc.value)


# -- the picture -------------------------------------------------------------------------------------

def test_picture_legend_explains_every_colour_and_the_axis_note_matches_a_tick() -> None:
    from matplotlib.figure import Figure

    from microplan.viz import _rank_bars
    from microplan.stats import micro_cost_grid
    plan = _demo_plan()
    cost = np.hstack([micro_cost_grid(plan, s) for s in range(len(plan.steps))])
    fig = Figure()
    ax = fig.subplots()
    _rank_bars(ax, plan, cost, list(range(len(plan.steps))))
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert f"{plan.stats.rank_imbalance:.3f}" == "1.000"           # balanced: no "costliest rank" alarm
    assert labels[:2] == ["rank total", "ranks balanced: none costlier (max/mean 1.000)"]
    assert {tuple(np.round(p.get_facecolor(), 3)) for p in ax.patches} == {(0.298, 0.447, 0.69, 1.0)}  # all blue
    assert labels[2].startswith("mean ") and labels[3].startswith("lower bound ") and "coincide" in labels[3]
    start = re.search(r"axis starts at (\S+), not 0", ax.get_xlabel())[1]
    assert start == ax.get_xticklabels()[0].get_text()
    assert ax.get_xlim()[0] == ax.get_xticks()[0]


def _draw(plan: mp.Plan, step: int | None):
    from matplotlib.figure import Figure

    from microplan.viz import _grids, _heatmap
    steps = list(range(len(plan.steps))) if step is None else [step]
    cost, tokens, holes, pads, ks = _grids(plan, steps)
    fig = Figure(figsize=(12, 5))
    ax = fig.subplots()
    _heatmap(fig, ax, plan, cost, tokens, holes, pads, ks, step)
    return fig, ax, cost, pads


def test_picture_scale_from_0_caption_slot_ticks_and_padding() -> None:
    """Issue 29: the scale started at the cheapest cell (a 1 % difference looked dramatic), nothing
    said what good looks like, slots had no ticks, padding was not drawn."""
    from matplotlib.collections import PatchCollection

    from microplan.viz import CAPTION
    plan = _demo_plan()
    fig, ax, cost, _ = _draw(plan, None)
    assert ax.images[0].norm.vmin == 0 and ax.images[0].norm.vmax == cost.max()
    label = " ".join(fig.axes[-1].get_xlabel().split())
    assert "scale from 0" in label and " ".join(CAPTION.split()) in label and "one colour down each column" in label
    assert len(ax.get_xticks(minor=True)) == cost.shape[1]          # one tick under every slot
    assert not any(isinstance(c, PatchCollection) for c in ax.collections)   # varlen: nothing to pad
    padded = mp.plan(generate("grpo-longtail", num_prompts=6, max_len=8192, seed=0),
                     mp.PlanConfig(dp_size=8, max_tokens_per_micro=16384, layout="padded-2d"))
    fig, ax, _, pads = _draw(padded, 0)
    held = sum(m.num_tokens for row in padded.steps[0].micros for m in row)
    real = sum(m.real_tokens for row in padded.steps[0].micros for m in row)
    assert held > real and (pads > 0).any()
    bands = [c for c in ax.collections if isinstance(c, PatchCollection)]
    assert len(bands) == 1 and len(bands[0].get_paths()) == int((pads > 0).sum())
    assert "padding share" in fig.axes[-1].get_xlabel()


def test_picture_marks_the_costliest_rank_only_when_ranks_differ(tmp_path: Path) -> None:
    from matplotlib.figure import Figure

    from microplan.viz import _rank_bars, plot_plan
    uneven = mp.plan(mp.Batch([100, 100, 100, 100, 50]), mp.PlanConfig(dp_size=2, max_tokens_per_micro=200))
    assert f"{uneven.stats.rank_imbalance:.3f}" != "1.000"
    from microplan.stats import micro_cost_grid
    fig = Figure()
    ax = fig.subplots()
    cost = micro_cost_grid(uneven, 0)
    _rank_bars(ax, uneven, cost, [0])
    worst = int(np.argmax(cost.sum(axis=1)))
    assert [t.get_text() for t in ax.get_legend().get_texts()][1] == f"costliest rank ({worst})"
    assert tuple(np.round(ax.patches[worst].get_facecolor(), 3)) == (0.839, 0.153, 0.157, 1.0)   # red
    assert plot_plan(uneven, tmp_path / "u.png").stat().st_size > 0


def test_examples_print_their_result_first_and_grammar() -> None:
    src = (ROOT / "examples" / "grpo_step.py").read_text()
    assert "on {world} ranks\"" not in src and "rank{'s' if world != 1 else ''}" in src
    cmd = shlex.split(_readme_commands()[1].split("&&")[-1])
    assert cmd[:3] == ["python", "-m", "pytest"]


def test_a_missing_installed_package_fails_the_run_with_the_install_line(tmp_path: Path) -> None:
    """trl hidden behind a package that cannot be imported: the module errors (exit != 0), never skips."""
    fake = tmp_path / "fake" / "trl"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise ImportError("simulated broken install")\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake.parent), str(ROOT / "src")]))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider",
                          "tests/test_integration_trl.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode != 0 and "skipped" not in out.stdout, out.stdout[-2000:]
    assert 'the README\'s test command installs it: pip install torch==2.13.0 -e ".[test,verl,trl]"' in out.stdout


# -- API honesty (issue 29) ----------------------------------------------------------------------------

def test_seed_is_documented_as_what_it_does() -> None:
    """PlanConfig.seed is read by no stage: its docstring said it seeds randomised tie-breaking."""
    b = generate("bimodal", num_prompts=16, max_len=4096, seed=3)
    plans = [mp.plan(b, mp.PlanConfig(dp_size=4, max_tokens_per_micro=4096, seed=s)) for s in (0, 7)]
    assert plans[0].steps == plans[1].steps and plans[0].fingerprint() != plans[1].fingerprint()
    doc = " ".join(mp.PlanConfig.__doc__.split())
    assert "tie-breaking" not in doc and "the seed does not change the layout" in doc and "fingerprint" in doc


def test_pack_micro_is_annotated_with_what_it_returns() -> None:
    require("torch")
    import typing

    from microplan.torch import PackedMicro, PaddedMicro, pack_micro
    assert typing.get_type_hints(pack_micro)["return"] == PackedMicro | PaddedMicro
    plan = mp.plan(mp.Batch([5, 7, 6]), mp.PlanConfig(dp_size=1, max_tokens_per_micro=64, layout="padded"))
    import torch
    tokens = [torch.arange(n) for n in plan.batch.seq_lens.tolist()]
    assert isinstance(pack_micro(plan.steps[0].micros[0][0], tokens), PaddedMicro)


# -- the README and the docs read as a newcomer reads them (issue 29) ----------------------------------

def test_readme_says_what_microplan_is_and_defines_its_terms_before_using_them() -> None:
    text = (ROOT / "README.md").read_text()
    body = text[text.index("```", text.index("```bash") + 3) + 3:]          # after the two commands
    first_time = re.search(r"\d+ (s|min)\b|~\d", body).start()
    assert body.index("**microplan** plans the data layout") < first_time
    for term, definition in (("K", "**K** is"), ("LB", "**LB** is"), ("lockstep", "**lockstep**"), ("VPP", "**VPP** is")):
        assert definition in body, term
        use = re.search(rf"(?<![\w*`]){re.escape(term)}(?![\w*])", body)   # first use outside its definition
        assert use is None or body.index(definition) <= use.start(), (term, body[use.start() - 80:use.start() + 20])
    assert "bundled" not in text.lower()                  # the demo's trace is generated, not shipped
    assert "TokenCost" in body[:body.index("## Shared prefixes")] and "--hf-config" in body


def test_readme_and_ci_quote_the_same_suite_times() -> None:
    times = lambda t: set(re.findall(r"~?\d+(?:\.\d+)?\s*(?:min(?: \d+ s)?|s)\b", t))  # noqa: E731
    ci = "\n".join(line for line in (ROOT / ".ci/run").read_text().splitlines() if line.startswith("#"))
    readme = (ROOT / "README.md").read_text()
    assert times(ci) and times(ci) <= times(readme), (times(ci), times(readme))


def test_readme_lists_every_batch_file_column() -> None:
    from microplan.io import FIELDS
    section = (ROOT / "README.md").read_text().split("## Command line")[1].split("\n## ")[0]
    assert all(f"`{name}`" in section for name in FIELDS), [n for n in FIELDS if f"`{n}`" not in section]
    assert "--share-prefixes" in section and "--version" in section


def test_the_reading_paths_cover_every_docs_page() -> None:
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    path = set(re.findall(r"\]\(([\w.]+\.md)", (ROOT / "docs" / "README.md").read_text()))
    assert pages <= path, pages - path
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `docs/` |"))
    assert pages <= set(re.findall(r"\(docs/([\w.]+\.md)", row)), pages - set(re.findall(r"\(docs/([\w.]+\.md)", row))
    for page in pages:                                     # the two opening lines docs/README.md promises
        head = (ROOT / "docs" / page).read_text().splitlines()[:5]
        assert any(h.startswith("**What it answers:**") for h in head), page
        assert any(h.startswith("**When to read it:**") for h in head), page


def test_nothing_tells_users_to_install_microplan_from_the_package_index() -> None:
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.py"),
             *(ROOT / "src").rglob("*.py")]
    bad = [f"{f.relative_to(ROOT)}: {m[0]}" for f in files
           for m in re.finditer(r"pip install [\"']?microplan\[[^\]]*\][\"']?", f.read_text())]
    assert not bad, bad                                    # not on the index: the clone's editable install is the way
