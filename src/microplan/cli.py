"""The ``microplan`` command line: demo, plan a batch file, validate a plan, write a trace.

Design note. A thin shell over the library: parse arguments into a :class:`PlanConfig`, read
the batch (``microplan.io``), call :func:`microplan.plan`, print :func:`format_summary`,
optionally write the plan JSON and a PNG (``microplan.viz``). The summary text is
``microplan.summary`` (the same as ``Plan.summary()``). Every refusal — a PlanError, a
missing file, a bad argument — prints ONE line ``microplan: error: ...`` to stderr and exits 2,
never a traceback; ``main(argv)`` returns the exit code, so tests call it in-process. A refusal
of ``plan`` or ``demo`` speaks the command line's words: the library's field names in its message
(``max_tokens_per_micro=100``, ``virtual_stages``, ``ContextParallel.max_size``) are rewritten to
the flags that set them (``--max-tokens 100``, ``--virtual-stages``, ``--cp-max-size``:
:func:`cli_words`). A plan that is legal but mostly placeholders prints
``microplan: warning: ...`` to stderr as well as its summary line.

    microplan demo [--family F] [--dp 8] [--max-tokens 16384] [--png microplan_demo.png]
    microplan plan FILE --dp N (--max-tokens T | --micro-batch-size B) [...]
    microplan plan FILE --dp N --max-tokens T --forward          (a forward-only pass, loss scale 0)
    microplan plan FILE --dp N --like PLAN.json                  (forward pass in PLAN.json's layout)
    microplan plan FILE --dp N --max-tokens T --share-prefixes   (prefix trees from the file's
                                                                  prefix_parent/shared_prefix_len)
    microplan --version
    microplan validate PLAN.json
    microplan trace FAMILY OUT.jsonl [--num-prompts P] [--samples-per-prompt G] [--max-len L]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NoReturn

from .batch import Batch
from .config import LOSS_MODES, ContextParallel, Loss, PlanConfig, Steps
from .cost import DEFAULT_ATTENTION, FlopsCost, TokenCost
from .errors import PlanError
from .forward import plan_forward
from .plan import Plan
from .planner import plan as make_plan
from .traces import FAMILIES, generate
from .summary import describe_batch, format_summary, placeholder_warning

__all__ = ["main", "build_parser", "format_summary", "describe_batch", "cli_words"]

class _UsageError(Exception):
    """A bad command line (argparse's complaint), reported as one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage dump
        raise _UsageError(f"{message} (see '{self.prog} --help')")


# -- argument types ------------------------------------------------------------------------------

def _int(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"{v} must be >= {minimum}")
        return v
    parse.__name__ = "int"
    return parse


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _prompt_len(text: str) -> int | tuple[int, int]:
    parts = text.split(",")
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be N or LO,HI (whole numbers)") from None
    if len(vals) == 1:
        return vals[0]
    if len(vals) == 2:
        return vals[0], vals[1]
    raise argparse.ArgumentTypeError(f"{text!r} must be N or LO,HI")


# -- parser --------------------------------------------------------------------------------------

def _add_output(p: argparse.ArgumentParser, png_default: str | None) -> None:
    p.add_argument("--json", metavar="OUT", help="write the plan as JSON (read it back with 'microplan validate')")
    p.add_argument("--png", metavar="OUT", default=png_default,
                   help=f"write a picture of the plan (needs matplotlib){'; default ' + png_default if png_default else ''}")
    if png_default:
        p.add_argument("--no-png", action="store_true", help="do not write the picture")
    p.add_argument("--step", type=_int(0), default=None, metavar="S",
                   help="step to draw in the PNG (default: all steps side by side)")


def _add_layout(p: argparse.ArgumentParser) -> None:
    size = p.add_mutually_exclusive_group()
    size.add_argument("--max-tokens", type=_int(1), metavar="T", help="dynamic batching: most tokens per GPU per micro-batch")
    size.add_argument("--micro-batch-size", type=_int(1), metavar="B", help="static batching: samples per micro-batch")
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--prompts-per-step", type=_int(1), metavar="P", help="whole prompt groups per optimizer step")
    steps.add_argument("--rollouts-per-step", type=_int(1), metavar="R", help="whole rollouts per optimizer step")
    steps.add_argument("--num-steps", type=_int(1), metavar="K", help="exactly K optimizer steps")
    p.add_argument("--align", type=_int(1), default=1, metavar="A", help="micro-batches per rank per step: a multiple of A (VPP)")
    p.add_argument("--short-step", choices=("pad", "drop", "error"), default="pad", help="when a step is too small to align")
    p.add_argument("--sync", choices=("micro", "step"), default="micro",
                   help="micro: ranks meet every micro-batch (FSDP, pipelines); step: once per step (DDP no_sync)")
    p.add_argument("--loss", choices=LOSS_MODES, default="token-mean", metavar="MODE", help=f"one of {', '.join(LOSS_MODES)}")
    p.add_argument("--norm-constant", type=_float, metavar="H", help="H of seq-mean-token-sum-norm")
    p.add_argument("--grad-reduction", choices=("mean", "sum"), default="mean")
    p.add_argument("--engine-divides-by-micro-count", action="store_true", help="the engine divides each micro loss by K (Megatron)")
    p.add_argument("--cost", choices=("token", "flops"), default=None,
                   help="cost model for balancing and predicted times (default token; --hf-config implies flops)")
    p.add_argument("--linear", type=_float, metavar="X", help="flops cost: per-token coefficient (default 1)")
    p.add_argument("--quadratic", type=_float, metavar="Y", help="flops cost: per squared-token coefficient (default 0)")
    p.add_argument("--packed-quadratic", type=_float, metavar="Q",
                   help="flops cost: per squared token of the packed micro-batch (dense masked attention; default 0)")
    p.add_argument("--per-micro", type=_float, metavar="Z", help="fixed cost per micro-batch (default 0)")
    p.add_argument("--hf-config", metavar="CONFIG.json",
                   help="derive the cost from a Hugging Face config.json (FlopsCost.from_hf_config)")
    p.add_argument("--attention", default=None, metavar="KERNEL",
                   help="with --hf-config: attention kernel preset (hedged, the default; fa3, fa2, sdpa-packed, flops)")
    cp = p.add_mutually_exclusive_group()
    cp.add_argument("--cp-size", type=_int(1), metavar="C", help="fixed context-parallel degree")
    cp.add_argument("--cp-max-size", type=_int(1), metavar="C", help="dynamic context parallel up to C GPUs (power of two)")
    p.add_argument("--seed", type=_int(0), default=0,
                   help="PlanConfig.seed, recorded in the plan (the planner draws no random number: the layout is the "
                        "same for any seed)")
    p.add_argument("--pipeline-stages", type=_int(1), default=1, metavar="P",
                   help="pipeline-parallel stages: K >= P micro-batches per rank, run in 1F1B order")
    p.add_argument("--virtual-stages", type=_int(1), default=1, metavar="V",
                   help="model chunks per pipeline stage (interleaved 1F1B; --align is the micro-batch group)")
    p.add_argument("--forward", action="store_true",
                   help="plan a forward-only pass (old/reference log-probs): one step, every sample, loss scale 0")
    p.add_argument("--like", metavar="PLAN.json",
                   help="plan the forward pass in the layout of this (training) plan, for bit-identical log-probs")
    p.add_argument("--layout", choices=("varlen", "padded", "padded-2d"), default="varlen",
                   help="what a micro-batch occupies: one packed row, [n, max len], or [n, max prompt + max response]")
    p.add_argument("--pad-to-multiple-of", type=_int(1), default=1, metavar="M",
                   help="pad every sample to a multiple of M (2·cp for zigzag CP, 16 for FP8)")
    p.add_argument("--pad-row-to-multiple-of", type=_int(1), default=1, metavar="R",
                   help="pad the packed row to a multiple of R (tp for sequence-parallel TP)")
    p.add_argument("--share-prefixes", action="store_true",
                   help="pack each micro-batch as the prefix tree of its samples, every shared token once (needs the "
                        "file's prefix_parent and shared_prefix_len columns, which 'microplan trace' writes)")


def build_parser() -> argparse.ArgumentParser:
    """The ``microplan`` argument parser (subcommands demo, plan, validate, trace)."""
    from . import __version__
    top = _Parser(prog="microplan", description="Plan the data layout of distributed LLM RL training.")
    top.add_argument("--version", action="version", version=f"microplan {__version__}")
    sub = top.add_subparsers(dest="command", required=True, metavar="{demo,plan,validate,trace}")
    d = sub.add_parser("demo", help="generate a synthetic RL trace, plan it and show the result")
    d.add_argument("--family", choices=FAMILIES, default="grpo-longtail")
    d.add_argument("--dp", type=_int(1), default=8, help="data-parallel ranks")
    d.add_argument("--max-tokens", type=_int(1), default=16384, metavar="T", help="tokens per GPU per micro-batch")
    d.add_argument("--num-prompts", type=_int(1), default=256, metavar="P")
    d.add_argument("--seed", type=_int(0), default=0, help="seed of the synthetic trace (recorded in the plan too)")
    _add_output(d, "microplan_demo.png")
    d.set_defaults(func=_cmd_demo)
    p = sub.add_parser("plan", help="plan a batch file (JSONL, CSV, Parquet)")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--format", choices=("jsonl", "csv", "parquet"), help="override the format implied by the extension")
    p.add_argument("--ignore-columns", type=_names, default=(), metavar="NAME[,NAME...]",
                   help="columns of the file that are not microplan's (reward, text); any other unknown column "
                        "is refused")
    p.add_argument("--dp", type=_int(1), required=True, help="data-parallel ranks")
    _add_layout(p)
    _add_output(p, None)
    p.set_defaults(func=_cmd_plan)
    v = sub.add_parser("validate", help="re-check every invariant of a plan JSON")
    v.add_argument("plan", metavar="PLAN.json")
    v.set_defaults(func=_cmd_validate)
    t = sub.add_parser("trace", help="write a synthetic RL trace to a batch file")
    t.add_argument("family", choices=FAMILIES, metavar="FAMILY", help=f"one of {', '.join(FAMILIES)}")
    t.add_argument("out", metavar="OUT")
    t.add_argument("--num-prompts", type=_int(1), default=256, metavar="P")
    t.add_argument("--samples-per-prompt", type=_int(1), default=8, metavar="G",
                   help="responses per prompt (rollouts per prompt for stepwise-multiturn)")
    t.add_argument("--max-len", type=_int(2), default=16384, metavar="L", help="context window (truncation)")
    t.add_argument("--prompt-len", type=_prompt_len, metavar="N|LO,HI", help="prompt tokens (default 32,min(1024,L/2))")
    t.add_argument("--seed", type=_int(0), default=0)
    t.add_argument("--format", choices=("jsonl", "csv", "parquet"), help="override the format implied by the extension")
    t.set_defaults(func=_cmd_trace)
    return top


# -- commands ------------------------------------------------------------------------------------

def config_from_args(args: argparse.Namespace) -> PlanConfig:
    """The PlanConfig the ``plan`` options describe; PlanError on inconsistent options."""
    steps = (Steps(prompts_per_step=args.prompts_per_step) if args.prompts_per_step else
             Steps(rollouts_per_step=args.rollouts_per_step) if args.rollouts_per_step else
             Steps(num_steps=args.num_steps) if args.num_steps else None)
    cost = _cost_from_args(args)
    if args.max_tokens is None and args.micro_batch_size is None:
        raise PlanError("one of the arguments --max-tokens --micro-batch-size is required (--max-tokens T: tokens "
                        "per GPU per micro-batch; --micro-batch-size B: samples), or --like PLAN.json to reuse a "
                        "plan's layout.")
    if args.loss == "seq-mean-token-sum-norm" and args.norm_constant is None:
        raise PlanError("--loss seq-mean-token-sum-norm needs --norm-constant H (e.g. the max response length).")
    loss = Loss(args.loss, grad_reduction=args.grad_reduction,
                engine_divides_by_micro_count=args.engine_divides_by_micro_count, norm_constant=args.norm_constant)
    cp = (ContextParallel(size=args.cp_size) if args.cp_size else
          ContextParallel(max_size=args.cp_max_size) if args.cp_max_size else None)
    return PlanConfig(dp_size=args.dp, max_tokens_per_micro=args.max_tokens, micro_batch_size=args.micro_batch_size,
                      steps=steps, align=args.align, short_step=args.short_step, cost=cost, sync=args.sync,
                      loss=loss, context_parallel=cp, seed=args.seed, pipeline_stages=args.pipeline_stages,
                      virtual_stages=args.virtual_stages, layout=args.layout,
                      pad_to_multiple_of=args.pad_to_multiple_of, pad_row_to_multiple_of=args.pad_row_to_multiple_of,
                      share_prefixes=args.share_prefixes)


def _cost_from_args(args: argparse.Namespace) -> TokenCost | FlopsCost:
    """The cost model the --cost/--hf-config options describe."""
    coef = (args.linear, args.quadratic, args.packed_quadratic)
    if args.attention is not None and not args.hf_config:
        raise PlanError("--attention picks the kernel preset of the cost derived by --hf-config; add "
                        "--hf-config CONFIG.json (or drop --attention).")
    if args.hf_config:
        if any(v is not None for v in coef):
            raise PlanError("--hf-config derives the coefficients; drop --linear/--quadratic/--packed-quadratic.")
        import json
        try:
            with open(args.hf_config, encoding="utf-8") as f:
                hf = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise PlanError(f"cannot read --hf-config {args.hf_config!r}: {exc}") from None
        return FlopsCost.from_hf_config(hf, attention=args.attention or DEFAULT_ATTENTION, per_micro=args.per_micro)
    per_micro = 0.0 if args.per_micro is None else args.per_micro
    if args.cost in (None, "token"):
        if any(v is not None for v in coef):
            raise PlanError("--linear/--quadratic/--packed-quadratic set the flops cost model; add --cost flops "
                            "(or drop them).")
        return TokenCost(per_micro=per_micro)
    return FlopsCost(linear=1.0 if args.linear is None else args.linear,
                     quadratic=0.0 if args.quadratic is None else args.quadratic,
                     packed_quadratic=0.0 if args.packed_quadratic is None else args.packed_quadratic,
                     per_micro=per_micro)


def _write_outputs(plan: Plan, args: argparse.Namespace) -> None:
    if args.json:
        from .io import write_plan
        write_plan(plan, args.json)
        print(f"wrote plan JSON to {args.json}")
    if args.png and not getattr(args, "no_png", False):
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            skip = "pass --no-png" if hasattr(args, "no_png") else "leave out --png"
            raise PlanError(f"writing {args.png} needs matplotlib: pip install -e '.[plot]' in the microplan clone "
                            f"(or {skip}).")
        from .viz import plot_plan
        if args.step is not None and args.step >= len(plan.steps):
            raise PlanError(f"--step {args.step} is outside the plan's steps 0..{len(plan.steps) - 1}.")
        plot_plan(plan, args.png, step=args.step)
        print(f"wrote picture to {args.png}")


def _demo_config(args: argparse.Namespace, family: str) -> tuple[int, ContextParallel | None]:
    """The demo's trace window and CP: long-context gets 8× the cap and the CP to hold it."""
    if family != "long-context":
        return args.max_tokens, None
    c = 8
    cp = ContextParallel(max_size=c) if args.dp >= c else ContextParallel(size=c)
    return c * args.max_tokens, cp


def _cmd_demo(args: argparse.Namespace) -> int:
    max_len, cp = _demo_config(args, args.family)
    batch = generate(args.family, num_prompts=args.num_prompts, max_len=max_len, seed=args.seed)
    per_step = max(1, args.num_prompts // 8)
    cfg = PlanConfig(dp_size=args.dp, max_tokens_per_micro=args.max_tokens, steps=Steps(prompts_per_step=per_step),
                     context_parallel=cp, seed=args.seed)
    plan = make_plan(batch, cfg)
    _warn(plan)
    print(f"microplan demo · trace {args.family!r} (seed {args.seed}, max_len {max_len:,}), "
          f"{per_step} prompts per step")
    print(plan.summary())
    _write_outputs(plan, args)
    return 0


_COST_OPTIONS = {"cost", "per_micro", "hf_config", "linear", "quadratic", "packed_quadratic", "attention", "like"}


def _layout_options_given(args: argparse.Namespace) -> list[str]:
    """The plan-layout options (everything but the cost) set to other than their defaults."""
    ref = argparse.ArgumentParser(add_help=False)
    _add_layout(ref)
    return [a.option_strings[0] for a in ref._actions
            if a.dest not in _COST_OPTIONS and getattr(args, a.dest, a.default) != a.default]


def _cmd_plan(args: argparse.Namespace) -> int:
    from .io import locate_samples, read_batch_file
    source = read_batch_file(args.file, format=args.format, ignore_columns=args.ignore_columns)
    if args.share_prefixes and not source.batch.has_prefixes:
        raise PlanError(f"--share-prefixes needs the shared prefixes of {args.file}: its columns prefix_parent and "
                        "shared_prefix_len (what 'microplan trace' writes; microplan.find_shared_prefixes computes "
                        "them from token ids) are missing; add them, or drop --share-prefixes.")
    try:
        plan = _plan_file(args, source.batch)
    except PlanError as exc:  # "sample 2 occupies ...": say where sample 2 is in the file
        if args.like and str(exc).startswith(str(args.like)):
            raise
        raise PlanError(locate_samples(str(exc), source.path, source.locations)) from None
    _warn(plan)
    print(f"batch file {args.file}")
    print(plan.summary())
    _write_outputs(plan, args)
    return 0


def _plan_file(args: argparse.Namespace, batch: Batch) -> Plan:
    """The plan (training, forward, or forward --like) the ``plan`` options ask for."""
    from .io import read_plan
    if args.like:
        ignored = _layout_options_given(args)
        if ignored:
            raise PlanError(f"--like {args.like} reuses that plan's layout; {', '.join(ignored)} would be ignored: "
                            "drop them (only --dp and the cost options apply to a --like plan).")
        like = read_plan(args.like)
        given = (args.cost, args.per_micro, args.hf_config, args.linear, args.quadratic, args.packed_quadratic)
        cost = like.config.cost if all(v is None for v in given) else _cost_from_args(args)
        cfg = replace(like.config, cost=cost)
        if args.dp != cfg.dp_size:
            raise PlanError(f"--dp {args.dp} differs from dp_size={cfg.dp_size} of {args.like}; the forward pass "
                            "runs on the plan's ranks: pass --dp " + str(cfg.dp_size) + ".")
        try:
            plan = plan_forward(batch, cfg, like=like)
        except PlanError as exc:
            raise PlanError(f"{args.like}: {exc}") from None
    elif args.forward:
        plan = plan_forward(batch, config_from_args(args))
    else:
        plan = make_plan(batch, config_from_args(args))
    return plan


def _cmd_validate(args: argparse.Namespace) -> int:
    from .io import read_plan
    plan = read_plan(args.plan)
    try:
        plan.validate()
    except PlanError as exc:
        raise PlanError(f"{args.plan}: {exc}") from None
    print(f"OK {plan.fingerprint()}  ({len(plan.steps)} steps, dp={plan.config.dp_size}, "
          f"{plan.batch.num_samples:,} samples, {plan.dropped.size:,} dropped)")
    return 0


def _cmd_trace(args: argparse.Namespace) -> int:
    from .io import write_batch
    batch = generate(args.family, num_prompts=args.num_prompts, samples_per_prompt=args.samples_per_prompt,
                     max_len=args.max_len, prompt_len=args.prompt_len, seed=args.seed)
    write_batch(batch, args.out, format=args.format)
    print(f"wrote {args.family!r} trace to {args.out}: {describe_batch(batch)}")
    return 0


def _warn(plan: Plan) -> None:
    warning = placeholder_warning(plan)
    if warning is not None:
        print(f"microplan: warning: {cli_words(warning)}", file=sys.stderr)


# the CLI flag of each config field a message may name (config.py, ContextParallel, Steps, Loss)
_FLAGS = {"max_tokens_per_micro": "--max-tokens", "micro_batch_size": "--micro-batch-size", "dp_size": "--dp",
          "align": "--align", "short_step": "--short-step", "sync": "--sync", "seed": "--seed",
          "pipeline_stages": "--pipeline-stages", "virtual_stages": "--virtual-stages", "layout": "--layout",
          "pad_to_multiple_of": "--pad-to-multiple-of", "pad_row_to_multiple_of": "--pad-row-to-multiple-of",
          "share_prefixes": "--share-prefixes", "prompts_per_step": "--prompts-per-step",
          "rollouts_per_step": "--rollouts-per-step", "num_steps": "--num-steps", "norm_constant": "--norm-constant",
          "grad_reduction": "--grad-reduction", "engine_divides_by_micro_count": "--engine-divides-by-micro-count",
          "context_parallel": "--cp-size/--cp-max-size"}
_CP_FLAGS = {"size": "--cp-size", "max_size": "--cp-max-size"}
_NAMES = "|".join(sorted(_FLAGS, key=len, reverse=True))
_VALUE = r"('[^']*'|\"[^\"]*\"|[\w.+-]+)"
_WRAPPED = re.compile(rf"\b(?:Steps|Loss)\(({_NAMES})={_VALUE}\)")
_CP = re.compile(rf"\bContextParallel(?:\((max_size|size)={_VALUE}\)|\.(max_size|size)\b(?:={_VALUE})?)")
_ASSIGN = re.compile(rf"(?:\bPlanConfig\.)?\b({_NAMES})={_VALUE}")
_BARE = re.compile(rf"(?:\bPlanConfig\.)?\b({'|'.join(n for n in _FLAGS if '_' in n)})\b")


def cli_words(message: str) -> str:
    """``message`` with the config's field names replaced by the CLI flags that set them:
    ``max_tokens_per_micro=100`` → ``--max-tokens 100``, ``ContextParallel.max_size=3`` →
    ``--cp-max-size 3``, ``Steps(num_steps=9)`` → ``--num-steps 9``, a bare
    ``virtual_stages`` → ``--virtual-stages`` (a bare one-word field such as ``align`` is an
    English word too: only "set align" and the like become "set --align")."""
    def flag(name: str, value: str | None) -> str:
        if value in (None, "True"):          # a switch (--share-prefixes) is on by being given
            return name
        return f"no {name}" if value == "False" else f"{name} {value.strip(chr(39) + chr(34))}"
    out = _WRAPPED.sub(lambda m: flag(_FLAGS[m[1]], m[2]), message)
    out = _CP.sub(lambda m: flag(_CP_FLAGS[m[1]], m[2]) if m[1] else flag(_CP_FLAGS[m[3]], m[4]), out)
    out = _ASSIGN.sub(lambda m: flag(_FLAGS[m[1]], m[2]), out)
    out = _BARE.sub(lambda m: _FLAGS[m[1]], out)
    out = re.sub(r"\b(set|raise|lower) (align|sync|seed|layout)\b", lambda m: f"{m[1]} {_FLAGS[m[2]]}", out)
    return re.sub(r" \(CLI (--[\w-]+)\)", lambda m: "" if m[1] in out[:m.start()] else m[0], out)


def _error(message: str) -> int:
    print(f"microplan: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``microplan`` command line; returns the exit code (0 ok, 2 refused)."""
    args = None
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except _UsageError as exc:
        return _error(str(exc))
    except PlanError as exc:
        # a --like plan's messages are about the saved plan's config, in its own words
        speaks_flags = getattr(args, "command", None) in ("plan", "demo") and not getattr(args, "like", None)
        return _error(cli_words(str(exc)) if speaks_flags else str(exc))
    except BrokenPipeError:  # `microplan demo | head`: stop quietly, like other tools
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:  # e.g. a full disk
        return _error(f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}")
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        return 130
