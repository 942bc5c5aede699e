"""Measure a model's memory per micro-batch: ``profile_memory(run_micro, *, max_tokens_per_micro) -> MemoryProfile``.

Design note. Mirrors ``profile_cost`` (``torch/profile.py``), with peak bytes instead of seconds:

1. Design: the compositions of ``profile_design(cap)`` — single samples of C .. C/8 (linear vs
   Σ L²), packs of 2 × C/2, 8 × C/8 and many short samples at T = C (per-sample vs packed-row
   terms), a mixed pack, packs at smaller totals, tiny micro-batches (the floor) — and held-out
   random packs at random totals, never fitted, only predicted.
2. Measure: warm up (the largest single and the tiny one: gradients allocated, lazy state built),
   then each composition's peak above what was allocated before it (``torch/memtrack.py``: CUDA
   ``max_memory_allocated`` after a reset, CPU every tensor storage created while it runs);
   ``repeats`` runs each, the largest kept.
3. Fit (``memory/fit.py``): both regimes by nonnegative least squares on relative error, the one
   with the smaller worst error kept; rows under C/8 tokens set the floor instead.
4. Margin: the worst under-prediction over the fitted and held-out rows, rounded up to 0.5 %, plus
   ``extra_margin``: stated in ``MemoryProfile.model.margin`` and its note, never guessed.
5. ``run_forward`` (optional): the same design through the no-grad pass, fitted and attached as
   ``model.forward`` (what ``plan_forward`` plans with).
6. ``trees=True`` (a model running microplan's attention, ``register_attention``): prefix-tree
   micro-batches (a prompt of C/2 shared by 4 responses of C/8, C/4 by 3 of C/4, C/8 by 14 of
   C/16) are measured too, and ``tree_factor`` is the largest measured/predicted ratio of their
   unique tokens and Σ depth (rounded up to 0.5 %, at least 1).

Guarantee: held-out errors are reported (``heldout_median_error``, ``heldout_max_error``), as
``profile_cost`` does; benchmarks/bench_memory.py measures it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._checks import float_field, int_field
from ..errors import PlanError
from ..memory.fit import MemoryFit, fit_memory, relative_errors
from ..memory.model import MemoryModel
from .memtrack import peak_bytes
from .profile import _comps, _pack, profile_design

__all__ = ["MemoryProfile", "profile_memory"]


@dataclass(frozen=True, kw_only=True)
class MemoryProfile:
    """The fitted memory model and how well it predicts.

    Attributes:
        model: the :class:`microplan.MemoryModel` (``margin`` set from the errors; ``forward``
            fitted when ``run_forward`` was given).
        regime: ``"packed"``, ``"varlen"`` or ``"linear"``.
        fit_max_error: worst ``|predicted/measured − 1|`` over the fitted rows.
        heldout_median_error / heldout_max_error: the same over the held-out compositions.
        forward_heldout_max_error: the forward model's held-out worst error (None without it).
        rows: every measurement: ``seq_lens``, ``bytes``, ``heldout``, ``pass`` ("train"/"forward").
    """

    model: MemoryModel
    regime: str
    fit_max_error: float
    heldout_median_error: float | None
    heldout_max_error: float | None
    forward_heldout_max_error: float | None = None
    rows: tuple[dict[str, Any], ...] = ()

    def describe(self) -> str:
        lines = [self.model.describe(), f"regime {self.regime}; fitted rows worst error {self.fit_max_error:.1%}"]
        if self.heldout_median_error is not None:
            lines.append(f"held-out: median error {self.heldout_median_error:.1%}, worst {self.heldout_max_error:.1%}")
        if self.model.forward is not None:
            lines.append(f"forward-only: {self.model.forward.describe()}")
        return "\n".join(lines)


def _measure(run: Callable[[Any], Any], packs: list[Any], order: list[int], repeats: int, device: Any) -> list[int]:
    out = [0] * len(packs)
    for _ in range(repeats):
        for i in order:
            out[i] = max(out[i], peak_bytes(lambda: run(packs[i]), device=device))
    return out


def _fit(fit_c: list[tuple[int, ...]], held_c: list[tuple[int, ...]], got: list[int], cap: int,
         packed: bool | None, extra: float, what: str) -> tuple[MemoryFit, MemoryModel, np.ndarray]:
    n = len(fit_c)
    fit = fit_memory(fit_c, got[:n], min_tokens=max(1, cap // 8), packed=packed)
    held_err = relative_errors(fit.model, held_c, got[n:]) if held_c else np.zeros(0)
    under_held = float(np.max(-held_err / (1.0 + held_err))) if held_c else 0.0
    margin = math.ceil(max(0.0, fit.under, under_held) * 200.0) / 200.0 + extra
    note = (f"profile_memory {what}: margin {margin:.1%} = worst under-prediction of the measured rows"
            + (f" + {extra:.1%} extra" if extra else ""))
    return fit, dataclasses.replace(fit.model, margin=margin, note=note), held_err


def profile_memory(run_micro: Callable[[Any], Any], *, max_tokens_per_micro: int,
                   compositions: Sequence[Sequence[int]] | None = None,
                   heldout: Sequence[Sequence[int]] | None = None, run_forward: Callable[[Any], Any] | None = None,
                   repeats: int = 1, warmup: int = 1, seed: int = 0, vocab_size: int = 128,
                   device: torch.device | str | None = None, packed: bool | None = None,
                   extra_margin: float = 0.0, trees: bool = False) -> MemoryProfile:
    """Measure designed micro-batches with the user's model and fit a :class:`microplan.MemoryModel`.

    Args:
        run_micro: ``run_micro(packed)`` runs one forward+backward of your model on one
            ``PackedMicro`` (random token ids), exactly as training does (same loss recipe,
            checkpointing, attention), e.g. ``lambda p: loss_fn(model(**p.model_inputs(),
            use_cache=False)).backward()``. Gradients accumulate: the static term (parameters,
            gradients, optimizer state) is outside what is measured.
        max_tokens_per_micro: the design spans 1 .. this many tokens per micro-batch; pick the
            largest a micro-batch may hold (the fit extrapolates beyond it, less reliably).
        compositions / heldout: your own micro-batches (lists of sample lengths); default
            ``profile_design``.
        run_forward: the no-grad pass (log-probs) on one ``PackedMicro``; fitted as ``model.forward``.
        repeats: runs per composition (the largest peak kept); warmup: untimed warm-up rounds.
        seed: held-out compositions and token ids. vocab_size: token ids drawn from [0, vocab_size).
        device: where the model computes (CUDA: allocator peaks; otherwise storages counted).
        packed: force (True) or forbid (False) the packed-row T² term; None lets the peaks decide.
        extra_margin: added to the measured margin (relative), e.g. for fragmentation on a GPU.
        trees: also measure prefix-tree micro-batches and set ``model.tree_factor`` (the model
            must run microplan's attention: ``register_attention()``).
    """
    if not callable(run_micro):
        raise PlanError(f"profile_memory(run_micro={run_micro!r}) must be a function of one PackedMicro.")
    if run_forward is not None and not callable(run_forward):
        raise PlanError(f"profile_memory(run_forward={run_forward!r}) must be a function of one PackedMicro or None.")
    cap = int_field("max_tokens_per_micro", max_tokens_per_micro, minimum=1)
    reps = int_field("profile_memory(repeats)", repeats, minimum=1)
    warm = int_field("profile_memory(warmup)", warmup, minimum=0)
    vocab = int_field("profile_memory(vocab_size)", vocab_size, minimum=1)
    extra = float_field("profile_memory(extra_margin)", extra_margin, minimum=0.0)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device is None else device
    design = profile_design(cap, seed=seed) if compositions is None or heldout is None else None
    fit_c = _comps(compositions, design.fit if design else (), cap, "compositions")
    held_c = _comps(heldout, design.heldout if design else (), cap, "heldout")
    gen = torch.Generator().manual_seed(int(seed))
    comps = fit_c + held_c
    packs = [_pack(c, gen, vocab, device) for c in comps]
    big = max(range(len(fit_c)), key=lambda i: (len(fit_c[i]) == 1, sum(fit_c[i])))
    tiny = min(range(len(fit_c)), key=lambda i: sum(fit_c[i]))
    order = [int(i) for i in np.random.default_rng(seed).permutation(len(comps))]
    rows: list[dict[str, Any]] = []
    models: dict[str, tuple[MemoryFit, MemoryModel, np.ndarray]] = {}
    for what, run in (("train", run_micro), ("forward", run_forward)):
        if run is None:
            continue
        for _ in range(warm):
            for i in (big, tiny):
                run(packs[i])
        got = _measure(run, packs, order, reps, device)
        models[what] = _fit(fit_c, held_c, got, cap, packed, extra, what)
        rows += [{"seq_lens": list(c), "bytes": int(b), "heldout": i >= len(fit_c), "pass": what}
                 for i, (c, b) in enumerate(zip(comps, got))]
    fit, model, held = models["train"]
    if trees:
        ratios, tree_rows = _tree_ratios(run_micro, model, cap, vocab, device, seed)
        rows += tree_rows
        model = dataclasses.replace(model, tree_factor=max(1.0, math.ceil(max(ratios) * 200.0) / 200.0))
    if "forward" in models:
        model = dataclasses.replace(model, forward=models["forward"][1])
    fwd_held = models["forward"][2] if "forward" in models else None
    return MemoryProfile(model=model, regime=fit.regime, fit_max_error=fit.max_relative_error,
                         heldout_median_error=float(np.median(np.abs(held))) if held.size else None,
                         heldout_max_error=float(np.max(np.abs(held))) if held.size else None,
                         forward_heldout_max_error=float(np.max(np.abs(fwd_held))) if fwd_held is not None
                         and fwd_held.size else None, rows=tuple(rows))


def _tree_ratios(run: Callable[[Any], Any], model: MemoryModel, cap: int, vocab: int, device: Any,
                 seed: int) -> tuple[list[float], list[dict[str, Any]]]:
    """Measured / predicted bytes of the designed prefix-tree micro-batches (module note, 6)."""
    from ..batch import Batch
    from ..config import PlanConfig
    from ..footprint import footprint_of
    from ..memory.check import bin_bytes
    from ..planner import plan
    from ..prefix import forest_of
    from .packing import pack_micro
    gen = torch.Generator().manual_seed(int(seed) + 1)
    flat = dataclasses.replace(model, tree_factor=1.0)
    ratios, rows = [], []
    for P, R, n in ((cap // 2, cap // 8, 4), (cap // 4, cap // 4, 3), (cap // 8, cap // 16, 14)):
        if P < 1 or R < 1:
            continue
        prompt = torch.randint(0, vocab, (P,), generator=gen)
        toks = [torch.cat([prompt, torch.randint(0, vocab, (R,), generator=gen)]) for _ in range(n)]
        batch = Batch(np.full(n, P + R), prompt_ids=np.zeros(n, dtype=np.int64),
                      prefix_parent=np.array([-1] + [0] * (n - 1)), shared_prefix_lens=np.array([0] + [P] * (n - 1)))
        cfg = PlanConfig(dp_size=1, max_tokens_per_micro=n * (P + R), share_prefixes=True)
        micro = plan(batch, cfg).steps[0].micros[0][0]
        packed = pack_micro(micro, toks)
        packed = packed if torch.device(device).type == "cpu" else packed.to(device)
        got = peak_bytes(lambda: run(packed), device=device)
        idx = np.asarray(micro.indices, dtype=np.int64)
        pred = int(bin_bytes(footprint_of(batch, cfg), flat, idx, np.zeros(idx.size, dtype=np.int64), 1,
                             forest=forest_of(batch))[0])
        ratios.append(got / pred)
        rows.append({"seq_lens": [P + R] * n, "shared_prefix": P, "bytes": int(got), "predicted": pred,
                     "heldout": False, "pass": "tree"})
    return ratios or [1.0], rows
