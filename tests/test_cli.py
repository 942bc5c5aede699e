"""The microplan command line (in-process via main() and as a subprocess) and the PNG picture."""

from __future__ import annotations

import builtins
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import microplan as mp
from microplan.cli import format_summary, main
from microplan.io import read_batch, read_plan
from microplan.traces import generate
from microplan.viz import human, plot_plan

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    out = tmp_path / "trace.jsonl"
    assert main(["trace", "grpo-longtail", str(out), "--num-prompts", "40", "--samples-per-prompt", "4",
                 "--max-len", "8192", "--seed", "1"]) == 0
    return out


def test_demo_prints_summary_and_writes_png_and_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    png, js = tmp_path / "demo.png", tmp_path / "demo.json"
    assert main(["demo", "--num-prompts", "64", "--png", str(png), "--json", str(js)]) == 0
    out = capsys.readouterr().out
    for key in ("8 steps", "micro-batches per rank", "lower bound", "max tokens per GPU", "rank imbalance",
                "lockstep", "step-sync", "placeholders", "dropped", "fingerprint"):
        assert key in out
    w, h = _png_size(png)
    assert w > 800 and h > 400
    plan = read_plan(js)
    plan.validate()
    assert len(plan.steps) == 8 and plan.config.dp_size == 8 and plan.config.max_tokens_per_micro == 16384
    assert plan.fingerprint()[:16] in out


def test_demo_long_context_uses_context_parallel(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    js = tmp_path / "lc.json"
    assert main(["demo", "--family", "long-context", "--num-prompts", "48", "--no-png", "--json", str(js)]) == 0
    plan = read_plan(js)
    assert plan.batch.seq_lens.max() > 16384                       # longer than one GPU's cap
    assert max(m.cp_size for s in plan.steps for row in s.micros for m in row) > 1
    assert "dynamic CP" in capsys.readouterr().out
    assert not (tmp_path / "microplan_demo.png").exists()


def test_trace_plan_validate_round_trip(tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture) -> None:
    js = tmp_path / "plan.json"
    assert main(["plan", str(trace), "--dp", "4", "--max-tokens", "8192", "--prompts-per-step", "8",
                 "--json", str(js)]) == 0
    batch = read_batch(trace)
    assert batch == generate("grpo-longtail", num_prompts=40, samples_per_prompt=4, max_len=8192, seed=1)
    expected = mp.plan(batch, mp.PlanConfig(dp_size=4, max_tokens_per_micro=8192, steps=mp.Steps(prompts_per_step=8)))
    capsys.readouterr()
    assert main(["validate", str(js)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK ") and expected.fingerprint() in out
    assert read_plan(js) == expected


def test_plan_options_map_to_config(tmp_path: Path, trace: Path) -> None:
    js = tmp_path / "p.json"
    assert main(["plan", str(trace), "--dp", "2", "--max-tokens", "8192", "--num-steps", "3", "--align", "2",
                 "--short-step", "drop", "--sync", "step", "--loss", "seq-mean-token-sum-norm",
                 "--norm-constant", "4096", "--grad-reduction", "sum", "--engine-divides-by-micro-count",
                 "--cost", "flops", "--linear", "2", "--quadratic", "0.001", "--per-micro", "50",
                 "--cp-size", "2", "--seed", "3", "--json", str(js)]) == 0
    cfg = read_plan(js).config
    assert (cfg.dp_size, cfg.align, cfg.short_step, cfg.sync, cfg.seed) == (2, 2, "drop", "step", 3)
    assert cfg.steps == mp.Steps(num_steps=3)
    assert cfg.loss == mp.Loss("seq-mean-token-sum-norm", norm_constant=4096, grad_reduction="sum",
                               engine_divides_by_micro_count=True)
    assert cfg.cost == mp.FlopsCost(linear=2, quadratic=0.001, per_micro=50)
    assert cfg.context_parallel == mp.ContextParallel(size=2)


def test_plan_static_batching_and_rollout_steps(tmp_path: Path, trace: Path) -> None:
    js = tmp_path / "s.json"
    assert main(["plan", str(trace), "--dp", "4", "--micro-batch-size", "3", "--rollouts-per-step", "32",
                 "--json", str(js)]) == 0
    plan = read_plan(js)
    assert plan.config.micro_batch_size == 3 and len(plan.steps) == 5
    assert max(m.num_samples for s in plan.steps for row in s.micros for m in row) <= 3


def test_summary_lists_dropped_samples_with_reason(trace: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", str(trace), "--dp", "4", "--max-tokens", "8192", "--prompts-per-step", "16"]) == 0
    out = capsys.readouterr().out
    assert "dropped                : 32 of 160 samples" in out      # 40 prompts = 2 × 16 + 8 left over
    assert "trailing prompt group" in out


def test_format_summary_is_reusable() -> None:
    b = generate("bimodal", num_prompts=16, seed=0)
    plan = mp.plan(b, mp.PlanConfig(dp_size=4, max_tokens_per_micro=16384, steps=mp.Steps(num_steps=2)))
    text = format_summary(plan)
    assert text.startswith("plan: 2 steps · dp=4 · cap 16,384 tokens/GPU")
    assert f"{plan.stats.rank_imbalance:.3f}" in text and plan.fingerprint()[:16] in text


@pytest.mark.parametrize("argv,match", [
    (["plan", "{tmp}/missing.jsonl", "--dp", "2", "--max-tokens", "100"], "missing.jsonl: no such file"),
    (["plan", "{trace}", "--dp", "2"], "one of the arguments --max-tokens --micro-batch-size is required"),
    (["plan", "{trace}", "--dp", "0", "--max-tokens", "100"], "argument --dp: 0 must be >= 1"),
    (["plan", "{trace}", "--dp", "2", "--max-tokens", "100"], "more than one micro-batch may hold"),
    (["plan", "{trace}", "--dp", "2", "--max-tokens", "9000", "--linear", "2"], "add --cost flops"),
    (["plan", "{trace}", "--dp", "2", "--max-tokens", "9000", "--loss", "seq-mean-token-sum-norm"], "--norm-constant"),
    (["plan", "{trace}", "--dp", "2", "--max-tokens", "9000", "--cp-size", "2", "--cp-max-size", "2"], "not allowed with"),
    (["plan", "{trace}", "--dp", "2", "--max-tokens", "9000", "--png", "{tmp}/p.png", "--step", "7"], "--step 7"),
    (["trace", "nope", "{tmp}/x.jsonl"], "invalid choice: 'nope'"),
    (["trace", "bimodal", "{tmp}/x.jsonl", "--prompt-len", "99999"], "prompt_len upper bound 99999"),
    (["trace", "bimodal", "{tmp}/x.jsonl", "--prompt-len", "a,b"], "must be N or LO,HI"),
    (["validate", "{trace}"], "trace.jsonl: this is a batch file (JSONL, one sample per line), not a plan; plan it "
                              "with 'microplan plan"),
    (["plan", "{tmp}/trace.txt", "--dp", "2", "--max-tokens", "100"], "trace.txt: no such file"),
    (["plan", "{trace}", "--dp", "2", "--max-tokens", "9000", "--prompts-per-step", "1000"],
     "--prompts-per-step 1000 forms no optimizer step: the batch has only 40 prompt groups, so all 160 "
     "samples would be dropped; set --prompts-per-step to at most 40"),
    (["plan", "{trace}", "--dp", "2", "--max-tokens", "9000", "--rollouts-per-step", "161"],
     "--rollouts-per-step 161 forms no optimizer step"),
    (["demo", "--png", "{tmp}/no/such/dir/x.png"], "cannot write the PNG"),
    ([], "the following arguments are required"),
])
def test_errors_are_one_line_exit_2(argv: list[str], match: str, tmp_path: Path, trace: Path,
                                    capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    args = [a.format(tmp=tmp_path, trace=trace) for a in argv]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("microplan: error: ")
    assert match in err
    assert "Traceback" not in err


def test_validate_rejects_a_tampered_plan(tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture) -> None:
    js = tmp_path / "t.json"
    assert main(["plan", str(trace), "--dp", "2", "--max-tokens", "8192", "--json", str(js)]) == 0
    d = json.loads(js.read_text())
    d["steps"][0][0][0]["loss_scale"][0] *= 2.0
    js.write_text(json.dumps(d))
    capsys.readouterr()
    assert main(["validate", str(js)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("microplan: error: ") and "t.json" in err and "invalid plan" in err


def test_help_exits_0(capsys: pytest.CaptureFixture) -> None:
    assert main(["plan", "--help"]) == 0
    assert "--max-tokens" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["plan", "does-not-exist.jsonl", "--dp", "2", "--max-tokens", "10"],
    ["plan", "x.jsonl", "--dp", "two", "--max-tokens", "10"],
    ["validate"],
])
def test_subprocess_exit_code_2_without_traceback(argv: list[str], tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "microplan", *argv], capture_output=True, text=True,
                       cwd=tmp_path, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith("microplan: error: ") and r.stderr.count("\n") == 1
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_subprocess_trace_then_validate_ok(tmp_path: Path) -> None:
    t, js = tmp_path / "t.csv", tmp_path / "p.json"
    run = lambda *a: subprocess.run([sys.executable, "-m", "microplan", *a], capture_output=True,  # noqa: E731
                                    text=True, cwd=tmp_path, timeout=60)
    assert run("trace", "stepwise-multiturn", str(t), "--num-prompts", "8").returncode == 0
    r = run("plan", str(t), "--dp", "2", "--max-tokens", "16384", "--prompts-per-step", "4", "--json", str(js))
    assert r.returncode == 0 and "micro-batches per rank" in r.stdout
    r = run("validate", str(js))
    assert r.returncode == 0 and r.stdout.startswith("OK ")


# -- the picture ----------------------------------------------------------------------------------

def test_plot_large_dp_stays_bounded(tmp_path: Path) -> None:
    b = generate("grpo-longtail", num_prompts=128, seed=0)
    plan = mp.plan(b, mp.PlanConfig(dp_size=128, max_tokens_per_micro=16384, steps=mp.Steps(prompts_per_step=64)))
    w, h = _png_size(plot_plan(plan, tmp_path / "big.png", step=None))
    assert w <= 18 * 120 and h <= 10 * 120


def test_plot_placeholders_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = mp.plan(mp.Batch([100, 200, 300]), mp.PlanConfig(dp_size=4, max_tokens_per_micro=1000))
    assert plan.stats.num_placeholders > 0
    assert _png_size(plot_plan(plan, tmp_path / "ph.png"))[0] > 0
    with pytest.raises(mp.PlanError, match="step=3 is outside 0..0"):
        plot_plan(plan, tmp_path / "x.png", step=3)
    from microplan.planner import build_plan  # plan() refuses an empty batch; a stepless Plan still exists
    empty = build_plan(mp.Batch(np.zeros(0, dtype=np.int64)), mp.PlanConfig(dp_size=2, max_tokens_per_micro=10))
    with pytest.raises(mp.PlanError, match="no steps to plot"):
        plot_plan(empty, tmp_path / "e.png")
    real_import = builtins.__import__

    def no_mpl(name: str, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("no matplotlib")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(mp.PlanError, match=r"pip install -e '\.\[plot\]' in the microplan clone"):
        plot_plan(plan, tmp_path / "y.png")


def test_human_numbers() -> None:
    assert [human(x) for x in (0, 950, 14942, 2.5e6, 0.25)] == ["0", "950", "14.9k", "2.5M", "0.25"]
    assert human(1098765, 4) == "1.099M"


def test_plan_with_hf_config_and_packed_kernel(tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture) -> None:
    """--hf-config derives the cost (FlopsCost.from_hf_config); under the dense packed-row kernel the
    planner runs more micro-batches than the cap needs and the summary says why."""
    cfg = {"model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
           "intermediate_size": 4096, "vocab_size": 32000}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    out = tmp_path / "plan.json"
    assert main(["plan", str(trace), "--dp", "4", "--max-tokens", "16384", "--hf-config", str(path),
                 "--attention", "sdpa-packed", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "why K (step 0)" in text and "packed-row" in text
    plan = read_plan(out)
    assert plan.config.cost == mp.FlopsCost.from_hf_config(cfg, attention="sdpa-packed")
    assert plan.steps[0].micro_count > plan.steps[0].choice.lower_bound
    assert main(["plan", str(trace), "--dp", "4", "--max-tokens", "16384", "--hf-config", str(path),
                 "--quadratic", "1"]) == 2
    assert "drop --linear" in capsys.readouterr().err
    assert main(["plan", str(trace), "--dp", "4", "--max-tokens", "16384", "--cost", "flops",
                 "--packed-quadratic", "1e-4", "--per-micro", "100"]) == 0
# -- forward passes and pipelines ------------------------------------------------------------------

def test_forward_and_like(tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture) -> None:
    train_js, fwd_js, like_js = tmp_path / "train.json", tmp_path / "fwd.json", tmp_path / "like.json"
    assert main(["plan", str(trace), "--dp", "4", "--max-tokens", "8192", "--num-steps", "2",
                 "--pipeline-stages", "2", "--json", str(train_js)]) == 0
    assert main(["plan", str(trace), "--dp", "4", "--max-tokens", "24576", "--forward", "--num-steps", "2",
                 "--cost", "flops", "--linear", "2", "--json", str(fwd_js)]) == 0
    assert main(["plan", str(trace), "--dp", "4", "--like", str(train_js), "--json", str(like_js)]) == 0
    out = capsys.readouterr().out
    assert out.count("forward plan (loss scale 0)") == 2 and "PP 2" in out and "bubble" in out
    batch, train = read_batch(trace), read_plan(train_js)
    assert train.config.pipeline_stages == 2 and all(s.micro_count >= 2 for s in train.steps)
    fwd = read_plan(fwd_js)
    assert fwd == mp.plan_forward(batch, mp.PlanConfig(dp_size=4, max_tokens_per_micro=24576,
                                                       cost=mp.FlopsCost(linear=2.0)))
    assert len(fwd.steps) == 1 and fwd.kind == "forward"  # --num-steps is ignored by a forward pass
    assert read_plan(like_js) == mp.plan_forward(batch, train.config, like=train)
    assert main(["validate", str(like_js)]) == 0


def test_like_refusals(tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture) -> None:
    train_js = tmp_path / "train.json"
    assert main(["plan", str(trace), "--dp", "4", "--max-tokens", "8192", "--json", str(train_js)]) == 0
    capsys.readouterr()
    assert main(["plan", str(trace), "--dp", "2", "--like", str(train_js)]) == 2
    assert "--dp 2 differs from dp_size=4" in capsys.readouterr().err
    other = tmp_path / "other.jsonl"
    assert main(["trace", "bimodal", str(other), "--num-prompts", "8"]) == 0
    assert main(["plan", str(other), "--dp", "4", "--like", str(train_js)]) == 2
    err = capsys.readouterr().err
    assert "made from another batch" in err and str(train_js) in err
    assert main(["plan", str(trace), "--dp", "4"]) == 2
    assert "--max-tokens --micro-batch-size is required" in capsys.readouterr().err


@pytest.mark.parametrize("argv,pattern", [
    (["--pipeline-stages", "0"], "must be >= 1"),
    (["--pipeline-stages", "4", "--virtual-stages", "2", "--align", "2"],
     "groups of --align 2 (Megatron's microbatch_group_size_per_vp_stage), which must be >= --pipeline-stages 4; "
     "set --align to a value >= 4 (Megatron's default is p), or --virtual-stages 1."),
    (["--virtual-stages", "2"], "needs pipeline parallelism"),
    (["--max-tokens", "100", "--forward"], "more than the forward cap"),
])
def test_pipeline_and_forward_option_errors(trace: Path, capsys: pytest.CaptureFixture, argv, pattern) -> None:
    base = ["plan", str(trace), "--dp", "2"] + ([] if "--max-tokens" in argv else ["--max-tokens", "8192"])
    assert main(base + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("microplan: error:") and pattern in err and err.count("\n") == 1


# -- issue 29: hostile files, flags in errors, --share-prefixes, --version, placeholder warning ---------

def test_hostile_files_end_as_one_line_exit_2_in_a_subprocess(tmp_path: Path, trace: Path) -> None:
    (tmp_path / "wide.jsonl").write_bytes('{"seq_len": 5}\n'.encode("utf-16"))
    (tmp_path / "big.jsonl").write_text('{"seq_len": 1e30}\n')
    (tmp_path / "big.csv").write_text("seq_len\n5\n1e30\n")
    js = tmp_path / "p.json"
    assert main(["plan", str(trace), "--dp", "2", "--max-tokens", "8192", "--json", str(js)]) == 0
    d = json.loads(js.read_text())
    d["batch"]["seq_lens"][3] = 1e30
    (tmp_path / "huge.json").write_text(json.dumps(d))
    for argv, says in [(["plan", "wide.jsonl", "--dp", "2", "--max-tokens", "100"], "is UTF-16 text"),
                       (["plan", "big.jsonl", "--dp", "2", "--max-tokens", "100"], "line 1: field 'seq_len'=1e+30 is too large"),
                       (["plan", "big.csv", "--dp", "2", "--max-tokens", "100"], "row 2: field 'seq_len'='1e30' is too large"),
                       (["validate", "huge.json"], "field 'seq_lens' holds 1e+30, too large for a token count")]:
        r = subprocess.run([sys.executable, "-m", "microplan", *argv], capture_output=True, text=True,
                           cwd=tmp_path, timeout=60)
        assert r.returncode == 2 and r.stderr.startswith("microplan: error: ") and r.stderr.count("\n") == 1, r.stderr
        assert says in r.stderr and "Traceback" not in r.stderr


def test_unknown_columns_refused_unless_ignored(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    p = tmp_path / "dump.jsonl"
    p.write_text('{"seq_len": 50, "prompt_id": 1, "reward": 0.5}\n{"seq_len": 60, "prompt_id": 1, "reward": 1}\n')
    assert main(["plan", str(p), "--dp", "2", "--max-tokens", "100"]) == 2
    assert "unknown field 'reward'" in capsys.readouterr().err
    assert main(["plan", str(p), "--dp", "2", "--max-tokens", "100", "--ignore-columns", "reward"]) == 0
    assert "2 samples, 1 prompts" in capsys.readouterr().out


@pytest.mark.parametrize("argv,says,not_says", [
    (["--max-tokens", "100"], "more than one micro-batch may hold (--max-tokens 100); raise --max-tokens",
     "max_tokens_per_micro"),
    (["--max-tokens", "8192", "--virtual-stages", "2"],
     "--virtual-stages 2 needs pipeline parallelism: set --pipeline-stages", "virtual_stages"),
    (["--max-tokens", "8192", "--cp-max-size", "3"], "--cp-max-size 3 must be a power of two", "ContextParallel"),
    (["--max-tokens", "8192", "--num-steps", "1000"], "--num-steps 1000 but the batch has only 40 prompt groups",
     "Steps("),
    (["--max-tokens", "8192", "--layout", "padded", "--share-prefixes"],
     "--share-prefixes packs each micro-batch as one tree row", "share_prefixes"),
    (["--micro-batch-size", "2", "--cp-size", "2"], "needs dynamic batching: set --max-tokens, not --micro-batch-size",
     "micro_batch_size"),
])
def test_errors_name_the_cli_flags(trace: Path, capsys: pytest.CaptureFixture, argv, says, not_says) -> None:
    capsys.readouterr()
    assert main(["plan", str(trace), "--dp", "2", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and not_says not in err and err.count("\n") == 1, err


def test_cli_words_leaves_other_text_alone() -> None:
    from microplan.cli import cli_words
    assert cli_words("too few samples to align the step; layout='padded-2d', align=4") == \
        "too few samples to align the step; --layout padded-2d, --align 4"
    assert cli_words("ContextParallel(max_size=8) with PlanConfig.max_tokens_per_micro") == \
        "--cp-max-size 8 with --max-tokens"
    assert cli_words("sample 3 (seq_len 40)") == "sample 3 (seq_len 40)"


def test_version(capsys: pytest.CaptureFixture) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"microplan {mp.__version__}"


def test_plan_share_prefixes_reads_the_trace_columns(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    t = tmp_path / "sw.jsonl"
    assert main(["trace", "stepwise-multiturn", str(t), "--num-prompts", "12", "--max-len", "8192"]) == 0
    plain, shared = tmp_path / "plain.json", tmp_path / "shared.json"
    base = ["plan", str(t), "--dp", "2", "--max-tokens", "8192"]
    assert main([*base, "--json", str(plain)]) == 0
    assert main([*base, "--share-prefixes", "--json", str(shared)]) == 0
    out = capsys.readouterr().out
    assert "shared prefixes        :" in out
    a, b = read_plan(plain), read_plan(shared)
    assert b.config.share_prefixes and b.batch.has_prefixes
    held = lambda p: sum(m.num_tokens for s in p.steps for row in s.micros for m in row)  # noqa: E731
    assert held(b) < held(a) and b.stats.predicted_time < a.stats.predicted_time
    assert main(["validate", str(shared)]) == 0
    # a file without the columns: told what is missing, not silently unshared
    bare = tmp_path / "bare.jsonl"
    bare.write_text('{"seq_len": 50}\n{"seq_len": 60}\n')
    assert main(["plan", str(bare), "--dp", "2", "--max-tokens", "100", "--share-prefixes"]) == 2
    assert "prefix_parent and shared_prefix_len" in capsys.readouterr().err


def test_mostly_placeholder_plan_warns_in_summary_and_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    p = tmp_path / "small.jsonl"
    p.write_text("".join(f'{{"seq_len": {100 + i}}}\n' for i in range(20)))
    capsys.readouterr()
    assert main(["plan", str(p), "--dp", "1000", "--max-tokens", "1000"]) == 0
    out, err = capsys.readouterr()
    assert err.startswith("microplan: warning: 980 placeholders for 20 real micro-batches (49×)") and "--dp 1,000" in err
    assert "  warning                : 980 placeholders for 20 real micro-batches" in out
    assert main(["plan", str(p), "--dp", "4", "--max-tokens", "1000"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "warning" not in out.split("terms:")[0]
