"""The PEERS.md metrics of one step's layout, identical for every planner.

Design note. Every planner's output is first brought to one form, ``plan[r][m]`` = int64 array
of the global sample indices of micro-batch m on rank r (see benchmarks/peers/_common.py; a
negative index is a zero-loss padding copy of sample ``~i``: its tokens and cost count, it is
neither lost nor duplicated). Then, with cost(micro) = per_micro + Σ (linear·L + quadratic·L²)
(an empty micro-batch costs per_micro only):

- over-cap micro-batches: tokens > cap with more than one sample (a lone sample over the cap is
  a too-long sample, not a packing fault); ``max_tokens_ratio`` = largest micro tokens / cap;
- equal counts: every rank has the same number of micro-batches; empties: micro-batches with no
  sample (padding micro-batches and those a MAX all-reduce leaves empty); lost: samples in no
  micro-batch; duplicated: extra appearances of a sample;
- lockstep time Σ_m max_r cost(r, m), over slots m < K = max_r count_r; a rank that has no slot m
  contributes 0 to that slot's max (upstream it would deadlock or run a padding micro-batch; we
  charge nothing so unequal counts are never *penalised* in time — they fail "equal counts");
- step-sync time max_r Σ_m cost(r, m);
- LB = max(Σ sample costs / dp + K_lb · per_micro, largest sample cost + per_micro),
  K_lb = ceil(tokens / (dp·cap)); ratios lockstep/LB and step-sync/LB. LB assumes the cap holds:
  a plan that breaks it with fewer than K_lb micro-batches per rank can score below 1;
- K (max micro-batches on a rank) vs K_lb;
- rank LB = max over ranks r of (Σ costs of the samples the plan put on r + ⌈tokens_r / cap⌉ ·
  per_micro, or the rank's largest sample + per_micro): the best any micro-batching can do with
  the plan's own DP split. lockstep / rank LB isolates the micro-batch and slot arrangement from
  the split (for local placement, the split is given: lockstep / LB shows the price of pinning).

The benchmark cost model (:func:`dense_7b_cost`) is a ~7B dense decoder (Llama-2-7B shape):
linear = 6·7e9 FLOPs/token (forward + backward of the weights), quadratic = 6·32·4096 FLOPs per
L² (causal attention scores and values, forward + backward, 32 layers × hidden 4096),
per_micro = 256 tokens' worth of linear FLOPs (launch/gather overhead of one micro-batch).
:func:`dense_7b_forward_cost` is its forward-only pass (2·7e9, 2·32·4096, 256 tokens' worth).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from microplan import FlopsCost

__all__ = ["StepMetrics", "step_metrics", "cost_grid", "dense_7b_cost", "dense_7b_forward_cost", "from_microplan",
           "PaddedMetrics", "padded_step_metrics", "padded_width"]

PeerPlan = list[list[np.ndarray]]


def dense_7b_cost() -> FlopsCost:
    """The benchmark's cost model: ~7B dense decoder, 32 layers, hidden 4096 (see module note)."""
    linear = 6 * 7e9
    return FlopsCost(linear=linear, quadratic=6 * 32 * 4096, per_micro=256 * linear)


# Qwen2.5-7B's config.json (the keys FlopsCost.from_hf_config reads): what a user passes on the
# default path, a cost that is not proportional to tokens (bench_speed's "path-config" row).
QWEN25_7B = dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, hidden_act="silu",
                 tie_word_embeddings=False)


def config_7b_cost() -> FlopsCost:
    """``FlopsCost.from_hf_config`` of Qwen2.5-7B with its defaults: the cost a user gets."""
    return FlopsCost.from_hf_config(QWEN25_7B)


def dense_7b_forward_cost() -> FlopsCost:
    """The same decoder's forward-only pass (log-probs): a third of the FLOPs, 256 tokens' overhead."""
    linear = 2 * 7e9
    return FlopsCost(linear=linear, quadratic=2 * 32 * 4096, per_micro=256 * linear)


@dataclass(frozen=True)
class StepMetrics:
    """One step's scores (definitions in the module docstring)."""

    over_cap: int
    max_tokens_ratio: float
    equal_counts: bool
    empties: int
    lost: int
    duplicated: int
    pad_rows: int
    K: int
    K_lb: int
    lockstep: float
    step_sync: float
    lb: float
    rank_lb: float = 0.0

    @property
    def lockstep_ratio(self) -> float:
        return self.lockstep / self.lb

    @property
    def step_sync_ratio(self) -> float:
        return self.step_sync / self.lb

    @property
    def lockstep_rank_ratio(self) -> float:
        return self.lockstep / self.rank_lb if self.rank_lb > 0 else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(lockstep_ratio=self.lockstep_ratio, step_sync_ratio=self.step_sync_ratio,
                 lockstep_rank_ratio=self.lockstep_rank_ratio)
        return d


def _real(idx: np.ndarray) -> np.ndarray:
    """Global sample index behind every entry (padding copies ~j map to j)."""
    return np.where(idx < 0, ~idx, idx)


def cost_grid(plan: PeerPlan, seq_lens: np.ndarray, cost) -> np.ndarray:
    """``grid[r, m]`` = cost of micro m on rank r; 0 where rank r has no slot m."""
    sample_cost = cost.sample_costs(np.asarray(seq_lens))
    K = max((len(row) for row in plan), default=0)
    grid = np.zeros((len(plan), K))
    for r, row in enumerate(plan):
        for m, idx in enumerate(row):
            grid[r, m] = cost.per_micro + float(sample_cost[_real(idx)].sum())
    return grid


def _tokens(plan: PeerPlan, lens: np.ndarray) -> list[tuple[int, int]]:
    """(tokens, samples) of every micro-batch."""
    return [(int(lens[_real(idx)].sum()), int(idx.size)) for row in plan for idx in row]


def _lost_duplicated(plan: PeerPlan, n: int) -> tuple[int, int, int]:
    """(lost, duplicated, padding rows); raises ValueError on an index outside the step."""
    parts = [idx for row in plan for idx in row]
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    real = flat[flat >= 0]
    if (real.size and real.max() >= n) or (flat.size and (~flat[flat < 0]).max(initial=0) >= n):
        raise ValueError(f"plan holds a sample index outside 0..{n - 1} (the step has {n} samples)")
    counts = np.bincount(real, minlength=n)
    return int((counts == 0).sum()), int(np.clip(counts - 1, 0, None).sum()), int((flat < 0).sum())


def step_metrics(plan: PeerPlan, seq_lens: np.ndarray, *, dp: int, cap: int, cost) -> StepMetrics:
    """Score one step's ``plan[r][m]`` over the step's samples ``0..len(seq_lens)-1``."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    if len(plan) != dp:
        raise ValueError(f"plan has {len(plan)} ranks, expected dp={dp}")
    lost, dup, pads = _lost_duplicated(plan, lens.size)  # also checks the indices
    micro = _tokens(plan, lens)
    over = sum(1 for t, k in micro if t > cap and k > 1)
    max_ratio = max((t for t, _ in micro), default=0) / cap
    counts = {len(row) for row in plan}
    grid = cost_grid(plan, lens, cost)
    sample_cost = cost.sample_costs(lens)
    k_lb = max(1, -(-int(lens.sum()) // (dp * cap)))
    lb = max(float(sample_cost.sum()) / dp + k_lb * cost.per_micro,
             float(sample_cost.max(initial=0.0)) + cost.per_micro)
    return StepMetrics(
        rank_lb=_rank_lower_bound(plan, lens, sample_cost, cap, cost.per_micro),
        over_cap=over, max_tokens_ratio=max_ratio, equal_counts=len(counts) == 1,
        empties=sum(1 for _, k in micro if k == 0), lost=lost, duplicated=dup, pad_rows=pads,
        K=max(counts, default=0), K_lb=k_lb,
        lockstep=float(grid.max(axis=0).sum()) if grid.size else 0.0,
        step_sync=float(grid.sum(axis=1).max()) if grid.size else 0.0, lb=lb)


def _rank_lower_bound(plan: PeerPlan, lens: np.ndarray, sample_cost: np.ndarray, cap: int, per_micro: float) -> float:
    """max_r of the best lockstep time rank r alone could reach with the samples the plan gave it."""
    best = 0.0
    for row in plan:
        parts = [_real(idx) for idx in row]
        idx = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if not idx.size:
            continue
        k = max(1, -(-int(lens[idx].sum()) // cap))
        best = max(best, float(sample_cost[idx].sum()) + k * per_micro, float(sample_cost[idx].max()) + per_micro)
    return best


def from_microplan(plan, step: int = 0) -> PeerPlan:
    """A microplan ``Plan``'s step in the plan[r][m] form (placeholders become empty arrays)."""
    return [[np.asarray(m.indices, dtype=np.int64) for m in row] for row in plan.steps[step].micros]


# -- padded layouts (benchmarks/bench_layouts.py) ---------------------------------------------------

@dataclass(frozen=True)
class PaddedMetrics:
    """One step's scores in a padded layout: every micro-batch of n samples runs as [n, W].

    cost(micro) = per_micro + n·s(W), s(L) = linear·L + quadratic·L² (the padded cost); an empty
    micro-batch costs per_micro. ``waste`` = Σ n·W / Σ real tokens. ``lb_pad`` = max(Σ padded
    bodies / dp + K_lb·per_micro, largest padded micro-batch): the balance bound of this plan's
    own micro-batches (K_lb = ⌈padded tokens / (dp·cap)⌉); ``lb_real`` = the varlen bound of
    ``step_metrics`` (real sample costs), so lockstep / lb_real folds padding and balance together.
    """

    over_cap: int
    max_tokens_ratio: float
    waste: float
    equal_counts: bool
    empties: int
    lost: int
    duplicated: int
    K: int
    lockstep: float
    step_sync: float
    lb_pad: float
    lb_real: float

    @property
    def lockstep_ratio(self) -> float:
        return self.lockstep / self.lb_pad

    @property
    def real_ratio(self) -> float:
        return self.lockstep / self.lb_real

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(lockstep_ratio=self.lockstep_ratio, real_ratio=self.real_ratio)
        return d


def padded_width(idx: np.ndarray, lens: np.ndarray, prompt_lens: np.ndarray | None) -> int:
    """W of a micro-batch: its longest sample, or (2D) longest prompt + longest response."""
    if not idx.size:
        return 0
    if prompt_lens is None:
        return int(lens[idx].max())
    return int(prompt_lens[idx].max()) + int((lens[idx] - prompt_lens[idx]).max())


def padded_step_metrics(plan: PeerPlan, seq_lens: np.ndarray, *, dp: int, cap: int, cost,
                        prompt_lens: np.ndarray | None = None) -> PaddedMetrics:
    """Score one step's ``plan[r][m]`` in a padded layout (see :class:`PaddedMetrics`)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    if len(plan) != dp:
        raise ValueError(f"plan has {len(plan)} ranks, expected dp={dp}")
    lost, dup, _ = _lost_duplicated(plan, lens.size)
    K = max((len(row) for row in plan), default=0)
    grid = np.zeros((dp, K))
    held = []
    for r, row in enumerate(plan):
        for m, idx in enumerate(row):
            idx = _real(np.asarray(idx, dtype=np.int64))
            w = padded_width(idx, lens, prompt_lens)
            held.append(idx.size * w)
            grid[r, m] = cost.per_micro + idx.size * float(cost.sample_costs(np.array([w]))[0]) if idx.size else \
                cost.per_micro
    body = float((grid - cost.per_micro).clip(min=0).sum())
    k_lb = max(1, -(-int(sum(held)) // (dp * cap)))
    lb_pad = max(body / dp + k_lb * cost.per_micro, float(grid.max(initial=0.0)))
    sc = cost.sample_costs(lens)
    k_real = max(1, -(-int(lens.sum()) // (dp * cap)))
    lb_real = max(float(sc.sum()) / dp + k_real * cost.per_micro, float(sc.max(initial=0.0)) + cost.per_micro)
    return PaddedMetrics(
        over_cap=sum(1 for h in held if h > cap), max_tokens_ratio=max(held, default=0) / cap,
        waste=sum(held) / float(lens.sum()), equal_counts=len({len(row) for row in plan}) == 1,
        empties=sum(1 for row in plan for idx in row if len(idx) == 0), lost=lost, duplicated=dup, K=K,
        lockstep=float(grid.max(axis=0).sum()) if grid.size else 0.0,
        step_sync=float(grid.sum(axis=1).max()) if grid.size else 0.0, lb_pad=lb_pad, lb_real=lb_real)
