"""Slow, obviously-correct reference implementations and input generators for the core tests.

Nothing here imports microplan's internals: expectations are re-derived from DESIGN.md, so a
bug in the planner cannot hide behind the same bug in its own helpers.

* :func:`first_appearance_codes` / :func:`expected_split` — which samples each optimizer step
  should hold, straight from the ``Steps`` contract.
* :func:`check_plan` — invariants 1–5 checked sample by sample in plain Python.
* :func:`objective` — the loss J of one step from per-token losses, one line per row of the
  DESIGN.md table (float64).
* :func:`brute_force` — optimal lockstep / step-sync time and minimal K for ≤ 8 samples by
  enumerating every set partition of the samples.
* :func:`gen_case` — random batches (structure, lengths, loss tokens) from a numpy seed, and
  the hypothesis strategies :func:`cases` / :func:`configs` built on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
from hypothesis import strategies as st

import microplan as mp

# ---------------------------------------------------------------------------------------------
# ids and step membership, from the contract
# ---------------------------------------------------------------------------------------------


def first_appearance_codes(ids: list[Any]) -> np.ndarray:
    """Dense codes 0, 1, ... in order of first appearance (DESIGN: 'order of first appearance')."""
    seen: dict[Any, int] = {}
    return np.array([seen.setdefault(v, len(seen)) for v in ids], dtype=np.int64)


class ExpectedError(Exception):
    """The contract says this input must be refused with a PlanError."""


def expected_split(pc: np.ndarray, rc: np.ndarray, steps: mp.Steps | None) -> tuple[list[np.ndarray] | None, set[int]]:
    """(samples of each step, samples dropped by the step split).

    For ``num_steps`` the exact dealing of prompts is the planner's choice, so the per-step
    lists are None and :func:`check_num_steps` checks the dealing rules instead. Raises
    :class:`ExpectedError` when the contract demands a PlanError.
    """
    n = pc.size
    if n == 0:
        return [], set()
    if steps is None:
        return [np.arange(n)], set()
    P, R = int(pc.max()) + 1, int(rc.max()) + 1
    if steps.num_steps is not None:
        if steps.num_steps > P:
            raise ExpectedError("more steps than prompt groups")
        return None, set()
    if steps.prompts_per_step is not None:
        p = steps.prompts_per_step
        full = P // p
        if full == 0:
            raise ExpectedError("no step forms: every sample would be dropped")
        out = [np.flatnonzero(pc // p == s) for s in range(full)]
        return out, set(np.flatnonzero(pc >= full * p).tolist())
    r = steps.rollouts_per_step
    full = R // r
    if full == 0:
        raise ExpectedError("no step forms: every sample would be dropped")
    bucket = np.minimum(rc // r, full)  # `full` = the dropped tail
    for prompt in range(P):
        if np.unique(bucket[pc == prompt]).size > 1:
            raise ExpectedError("rollouts_per_step cuts a prompt group")
    out = [np.flatnonzero(bucket == s) for s in range(full)]
    return out, set(np.flatnonzero(bucket == full).tolist())


def check_num_steps(plan: mp.Plan, pc: np.ndarray, k: int, fit_dropped_ok: bool) -> None:
    """num_steps=k: exactly k steps, each a contiguous run of whole prompts, sizes within one."""
    assert len(plan.steps) == k
    P = int(pc.max()) + 1
    prompts_of = [sorted(set(pc[step.samples].tolist())) for step in plan.steps]
    if not fit_dropped_ok:
        allp = [p for ps in prompts_of for p in ps]
        assert allp == list(range(P)), "num_steps must deal every prompt, in order"
        sizes = [len(ps) for ps in prompts_of]
        assert max(sizes) - min(sizes) <= 1, f"uneven dealing {sizes}"
        for ps in prompts_of:
            assert ps == list(range(ps[0], ps[-1] + 1)), "a step's prompts must be contiguous"
    prev = -1
    for ps in prompts_of:
        if ps:
            assert ps[0] > prev, "steps must take prompts in order"
            prev = ps[-1]


# ---------------------------------------------------------------------------------------------
# invariants 1-5, checked independently of validate()
# ---------------------------------------------------------------------------------------------


def trie_size(token_ids: list[np.ndarray], idx: list[int]) -> int:
    """Distinct prefixes among the samples ``idx``: the tokens their prefix trie holds, counted from
    the token ids themselves (a nested-dict trie), independently of microplan.prefix."""
    root: dict = {}
    nodes = 0
    for i in idx:
        node = root
        for tok in token_ids[i].tolist():
            nxt = node.get(tok)
            if nxt is None:
                nxt = node[tok] = {}
                nodes += 1
            node = nxt
    return nodes


def check_plan(plan: mp.Plan, seq_lens: np.ndarray, loss_tokens: np.ndarray, pc: np.ndarray, rc: np.ndarray,
               cfg: mp.PlanConfig, token_ids: list[np.ndarray] | None = None) -> dict[str, Any]:
    """Assert invariants 1–5 of DESIGN.md on ``plan``; return per-sample step and micro info.

    With ``cfg.share_prefixes`` the tokens a micro-batch holds are its samples' trie, counted from
    ``token_ids`` (required then): the cap applies to that count."""
    n = seq_lens.size
    dp, align = cfg.dp_size, cfg.align
    cp = cfg.context_parallel
    dynamic_cp = cp is not None and cp.max_size is not None
    c = cp.size if cp is not None and cp.size is not None else 1
    step_of = np.full(n, -1, dtype=np.int64)
    count = np.zeros(n, dtype=np.int64)
    for s, step in enumerate(plan.steps):
        assert step.index == s
        assert len(step.micros) == dp, f"step {s}: {len(step.micros)} rank rows, dp={dp}"
        K = step.micro_count
        assert K >= 1 and K % align == 0, f"step {s}: K={K} not a positive multiple of align={align}"
        real_in_step = []
        for r in range(dp):
            row = step.micros[r]
            assert len(row) == K, f"step {s} rank {r}: {len(row)} micros, expected {K}"
            assert plan.rank(r)[s] is row or tuple(plan.rank(r)[s]) == tuple(row)
            for m, micro in enumerate(row):
                idx = [int(i) for i in micro.indices]
                assert micro.indices.dtype == np.int64 and micro.loss_scale.dtype == np.float64
                assert micro.seq_lens.dtype == np.int64 and micro.loss_tokens.dtype == np.int64
                assert micro.is_placeholder == (len(idx) == 0)
                if dynamic_cp:  # a power-of-two group of ranks that all run this same micro-batch
                    w = micro.cp_size
                    assert w >= 1 and w & (w - 1) == 0 and w <= cp.max_size
                    g = micro.cp_group
                    assert len(g) == w and g[micro.cp_rank] == r
                    for q, other in enumerate(g):
                        peer = step.micros[other][m]
                        assert peer.cp_group == g and peer.cp_rank == q and peer.indices.tolist() == idx
                    if idx and micro.cp_rank != 0:
                        continue  # counted once, at CP rank 0
                else:
                    assert micro.cp_size == c
                if not idx:  # invariant 5: explicit, empty, no loss
                    assert micro.seq_lens.size == micro.loss_tokens.size == micro.loss_scale.size == 0
                    assert micro.num_tokens == 0
                    continue
                assert micro.seq_lens.tolist() == [int(seq_lens[i]) for i in idx]
                assert micro.loss_tokens.tolist() == [int(loss_tokens[i]) for i in idx]
                assert micro.loss_scale.size == len(idx) and np.isfinite(micro.loss_scale).all()
                for j, i in enumerate(idx):  # a sample without loss tokens carries no loss
                    if loss_tokens[i] == 0:
                        assert micro.loss_scale[j] == 0.0
                tokens = held_tokens(idx, seq_lens, plan.batch.prompt_lens, cfg)  # padding included
                if getattr(cfg, "share_prefixes", False):
                    assert token_ids is not None, "check_plan needs token_ids for a prefix-sharing plan"
                    shared = trie_size(token_ids, idx)
                    assert shared <= tokens
                    tokens = shared
                assert micro.num_tokens == tokens
                assert micro.real_tokens == sum(int(seq_lens[i]) for i in idx)
                if cfg.max_tokens_per_micro is not None:  # invariant 3 (per GPU of the CP group)
                    gpu = -(-tokens // micro.cp_size)  # cp_shard: a GPU computes its ⌈U/c⌉ owned rows, no more
                    assert gpu <= cfg.max_tokens_per_micro, f"micro with {tokens} tokens over cap ({gpu} per GPU)"
                else:
                    assert len(idx) <= cfg.micro_batch_size
                if cfg.placement == "local":  # pinned: a sample runs only on the rank that holds it
                    assert all(int(plan.batch.rank_of[i]) == r for i in idx), f"step {s} rank {r}: a sample moved"
                for i in idx:
                    count[i] += 1
                    step_of[i] = s
                real_in_step.extend(idx)
        assert sorted(real_in_step) == step.samples.tolist()
        assert real_in_step, f"step {s} trains nothing"
    dropped = set(plan.dropped.tolist())
    assert plan.dropped.tolist() == sorted(dropped)
    assert set(plan.drop_reasons) == dropped
    assert all(isinstance(v, str) and v for v in plan.drop_reasons.values())
    for i in range(n):  # invariant 1
        assert count[i] <= 1, f"sample {i} in {count[i]} micro-batches"
        assert (count[i] == 1) != (i in dropped), f"sample {i}: planned {count[i]}x, dropped={i in dropped}"
    for codes, name, whole in ((rc, "rollout", True), (pc, "prompt", False)):  # invariant 4
        where: dict[int, set[int]] = {}
        for i in range(n):
            where.setdefault(int(codes[i]), set()).add(int(step_of[i]))  # -1 = dropped
        for g, ss in where.items():
            kept = ss - {-1}
            assert len(kept) <= 1, f"{name} {g} spans steps {sorted(kept)}"
            if whole:
                assert len(ss) == 1, f"rollout {g} partly dropped"
    return {"step_of": step_of}


def micro_shape(idx: list[int], seq_lens: np.ndarray, prompt_lens: np.ndarray | None, cfg: mp.PlanConfig) -> list[int]:
    """The sequence lengths the GPU runs for samples ``idx``, from the rules of docs/layouts.md
    (written out here, not read from microplan.footprint): varlen: each sample padded to a
    multiple of ``pad_to_multiple_of``, plus the row's pad to a multiple of
    ``pad_row_to_multiple_of`` as one more sequence; padded: n rows of the longest sample
    (2D: longest prompt + longest response) rounded up to lcm of both multiples."""
    m, r = cfg.pad_to_multiple_of, cfg.pad_row_to_multiple_of
    L = [int(seq_lens[i]) for i in idx]
    if cfg.layout == "varlen":
        shape = [-(-x // m) * m for x in L]
        pad = -(-sum(shape) // r) * r - sum(shape)
        return shape + ([pad] if pad else [])
    u = math.lcm(m, r)
    if cfg.layout == "padded":
        w = max(L)
    else:
        p = [int(prompt_lens[i]) for i in idx]  # type: ignore[index]
        w = max(p) + max(x - y for x, y in zip(L, p))
    return [-(-w // u) * u] * len(L)


def held_tokens(idx: list[int], seq_lens: np.ndarray, prompt_lens: np.ndarray | None, cfg: mp.PlanConfig) -> int:
    """Tokens the GPU holds for a micro-batch of samples ``idx`` (0 for a placeholder)."""
    return sum(micro_shape(idx, seq_lens, prompt_lens, cfg)) if idx else 0


def sample_costs(cost: Any, lens: np.ndarray) -> np.ndarray:
    """Per-sample cost from the public fields of TokenCost / FlopsCost (not sample_costs())."""
    L = np.asarray(lens, dtype=np.float64)
    if isinstance(cost, mp.TokenCost):
        return L.copy()
    return cost.linear * L + cost.quadratic * L * L


def micro_body(cost: Any, lens: Any, *, rows: bool = False) -> float:
    """One micro-batch's cost without per_micro, from the public fields (DESIGN: "a cost may be
    non-additive over the samples"): Σ per-sample terms, except under a dense kernel
    (packed_quadratic > 0), where a pack of two or more samples costs linear·T + packed_quadratic·T²
    and a lone sample runs unmasked, priced per sample. ``rows``: a padded [n, W] layout, each row
    its own (masked, when n >= 2) sequence: under a dense kernel each costs linear·W + packed·W²."""
    L = np.asarray(lens, dtype=np.float64)
    T = float(L.sum())
    pq = float(getattr(cost, "packed_quadratic", 0.0))
    if pq > 0 and L.size >= 2:
        if rows:
            return float((cost.linear * L + pq * L * L).sum())
        return float(cost.linear) * T + pq * T * T
    return float(sample_costs(cost, L).sum())


def grad_world(cfg: mp.PlanConfig) -> int:
    """W of DESIGN.md: dp × static CP degree; under dynamic CP every rank of the plane (dp)."""
    cp = cfg.context_parallel
    return cfg.dp_size * (cp.size if cp is not None and cp.size is not None else 1)


def is_dynamic_cp(cfg: mp.PlanConfig) -> bool:
    return cfg.context_parallel is not None and cfg.context_parallel.max_size is not None


def step_times(plan: mp.Plan, s: int) -> tuple[float, float]:
    """(lockstep, step-sync) time of step s, computed from the micro-batches directly. A micro-batch
    of CP degree c costs Σ sample costs of its shape (``micro_shape``) / c + per_micro per GPU; a
    placeholder is one dummy token."""
    cfg, step = plan.config, plan.steps[s]
    cost = cfg.cost
    dummy = micro_body(cost, [1])
    grid = np.zeros((step.dp_size, step.micro_count))
    lens, plens = plan.batch.seq_lens, plan.batch.prompt_lens
    for r, row in enumerate(step.micros):
        for m, micro in enumerate(row):
            if micro.is_placeholder:
                body = dummy / micro.cp_size
            else:
                shape = np.array(micro_shape(micro.indices.tolist(), lens, plens, cfg))
                body = micro_body(cost, shape, rows=cfg.layout != "varlen") / micro.cp_size
            grid[r, m] = body + cost.per_micro
    return float(grid.max(axis=0).sum()), float(grid.sum(axis=1).max())


# ---------------------------------------------------------------------------------------------
# the loss objective, straight from the DESIGN.md table
# ---------------------------------------------------------------------------------------------


def objective(mode: str, token_losses: list[np.ndarray], prompt: list[int], rollout: list[int],
              H: float | None = None) -> float:
    """J of one step. ``token_losses[i]``: the n_i per-token losses of the step's i-th sample.

    Conventions the table leaves implicit (documented in weigh.py and here): a sample with
    n_i = 0 still counts in |S|; a group whose samples carry no loss token still counts in
    |P| / |R| and contributes 0 (its 0/0 term is taken as 0); token-mean with Σ n_i = 0 is 0.
    """
    S = len(token_losses)
    sums = [float(np.sum(t, dtype=np.float64)) for t in token_losses]
    n = [t.size for t in token_losses]
    if S == 0:
        return 0.0
    if mode == "token-mean":
        return sum(sums) / sum(n) if sum(n) else 0.0
    if mode == "token-sum":
        return sum(sums)
    if mode == "seq-mean-token-sum":
        return sum(sums) / S
    if mode == "seq-mean-token-mean":
        return sum(sums[i] / n[i] for i in range(S) if n[i]) / S
    if mode == "seq-mean-token-sum-norm":
        return sum(sums) / (S * H)
    if mode in ("prompt-mean", "rollout-mean"):
        key = prompt if mode == "prompt-mean" else rollout
        groups: dict[int, list[int]] = {}
        for i, g in enumerate(key):
            groups.setdefault(g, []).append(i)
        total = 0.0
        for members in groups.values():
            num = sum(sums[i] for i in members)
            den = sum(n[i] for i in members)
            total += num / den if den else 0.0
        return total / len(groups)
    raise ValueError(mode)


# ---------------------------------------------------------------------------------------------
# brute force optimum for tiny instances
# ---------------------------------------------------------------------------------------------


def set_partitions(items: tuple[int, ...]):
    """Every partition of ``items`` into non-empty blocks (Bell(n) of them)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for b in range(len(part)):
            yield part[:b] + [[first] + part[b]] + part[b + 1:]
        yield [[first]] + part


def lockstep_of_grid(grid: list[list[float]]) -> float:
    """Σ_m max_r cost(r, m) of an explicit ranks × slots grid."""
    return sum(max(row[m] for row in grid) for m in range(len(grid[0])))


def lockstep_sorted_blocks(micro_costs: list[float], dp: int) -> float:
    """Optimal Σ_m max_r over all arrangements of fixed micro costs into a dp-wide grid:
    sort descending and cut into slots of dp (checked against full enumeration in tests)."""
    srt = sorted(micro_costs, reverse=True)
    return sum(srt[0::dp])


def lockstep_all_arrangements(micro_costs: list[float], dp: int) -> float:
    """min over every permutation of the micro-batches into the grid (tiny inputs only)."""
    import itertools
    K = len(micro_costs) // dp
    best = math.inf
    for perm in itertools.permutations(micro_costs):
        grid = [list(perm[r * K:(r + 1) * K]) for r in range(dp)]
        best = min(best, lockstep_of_grid(grid))
    return best


@dataclass
class Optimum:
    k_min: int                 # smallest aligned K that fits every sample (placeholders allowed)
    k_min_full: int | None     # smallest aligned K with dp·K non-empty micro-batches (no placeholder)
    lockstep: float            # min over K and layouts of Σ_m max_r cost(r, m)
    step_sync: float           # min over K and layouts of max_r Σ_m cost(r, m)
    lockstep_at_k_min: float   # the same, with K fixed to k_min
    step_sync_at_k_min: float


def brute_force(lens: list[int], costs: list[float], *, dp: int, align: int, cap: int | None = None,
                mbs: int | None = None, per_micro: float = 0.0, dummy: float = 1.0, packed: float = 0.0,
                k_max: int | None = None, linear: float = 1.0) -> Optimum:
    """Exhaustive optimum over all assignments of ≤ 8 samples into dp·K bins.

    A bin (micro-batch) costs Σ sample costs + per_micro; an empty bin is a placeholder and
    costs dummy + per_micro (one dummy token), as in PlanStats. Bins may hold at most ``cap``
    tokens (dynamic) or ``mbs`` samples (static). K ranges over multiples of ``align``.
    Samples are enumerated as set partitions (bin labels only matter through the grid).
    ``packed`` > 0 prices a micro-batch of two or more samples as a dense kernel does,
    linear·T + packed·T² (T its tokens; a lone sample keeps its sample cost); then only the
    lockstep optimum is computed (step_sync is NaN). ``k_max`` caps K for the lockstep optimum.
    """
    n = len(lens)
    assert 1 <= n <= 8
    items = tuple(range(n))

    def ok(block) -> bool:
        return sum(lens[i] for i in block) <= cap if cap is not None else len(block) <= mbs

    parts = [p for p in set_partitions(items) if all(ok(b) for b in p)]
    assert parts, "some sample fits no bin"

    def aligned(k: int) -> int:
        return -(-max(k, 1) // align) * align

    fewest = min(len(p) for p in parts)
    k_min = aligned(-(-fewest // dp))
    sizes = {len(p) for p in parts}
    k_min_full = next((k for k in range(align, n // dp + 1, align) if dp * k in sizes), None) if n >= dp else None

    @lru_cache(maxsize=None)
    def min_bins(block: tuple[int, ...]) -> int:
        return min(len(p) for p in set_partitions(block) if all(ok(b) for b in p)) if block else 0

    # lockstep: any K above k_hi leaves >= align full slots of placeholders after sorting,
    # and removing them lowers the time, so the optimum has K <= k_hi.
    k_hi = max(k_min, aligned(-(-n // dp)))
    if k_max is not None:
        k_hi = max(k_min, min(k_hi, k_max))
    lock_best, lock_kmin = math.inf, math.inf
    for K in range(k_min, k_hi + 1, align):
        for p in parts:
            if len(p) > dp * K:
                continue
            micro = [(linear * sum(lens[i] for i in b) + packed * sum(lens[i] for i in b) ** 2
                      if packed and len(b) >= 2 else sum(costs[i] for i in b)) + per_micro for b in p] \
                + [dummy + per_micro] * (dp * K - len(p))
            t = lockstep_sorted_blocks(micro, dp)
            lock_best = min(lock_best, t)
            if K == k_min:
                lock_kmin = min(lock_kmin, t)

    # step sync: only each rank's set of samples matters; a rank holding X in K slots uses
    # min(K, |X|) real micro-batches (feasible iff min_bins(X) <= K) and the rest placeholders.
    # K above max(k_min, n) only adds placeholders to every rank.
    sync_best, sync_kmin = math.inf, math.inf
    if packed:
        return Optimum(k_min, k_min_full, lock_best, math.nan, lock_kmin, math.nan)
    rank_parts = [p for p in set_partitions(items) if len(p) <= dp]
    for K in range(k_min, max(k_min, aligned(n)) + 1, align):
        for p in rank_parts:
            worst = 0.0 if len(p) == dp else K * (dummy + per_micro)  # idle ranks: all placeholders
            feasible = True
            for X in p:
                X = tuple(sorted(X))
                if min_bins(X) > K:
                    feasible = False
                    break
                worst = max(worst, sum(costs[i] for i in X) + K * per_micro + (K - min(K, len(X))) * dummy)
            if feasible:
                sync_best = min(sync_best, worst)
                if K == k_min:
                    sync_kmin = min(sync_kmin, worst)
    return Optimum(k_min, k_min_full, lock_best, sync_best, lock_kmin, sync_kmin)


# ---------------------------------------------------------------------------------------------
# input generation
# ---------------------------------------------------------------------------------------------

STRUCTURES = ("flat", "grpo", "grpo_var", "stepwise", "fanout")
LENGTHS = ("uniform", "small", "big", "longtail", "cap", "bimodal")
LOSS_KINDS = ("default", "prompt_lens", "random", "some_zero", "all_zero")


@dataclass
class Case:
    """A random batch plus the raw arrays it was built from (for independent checks)."""

    seq_lens: np.ndarray
    loss_tokens: np.ndarray           # the effective loss tokens (after defaults)
    prompt_ids: list[Any] | None      # as passed to Batch (None = default)
    rollout_ids: list[Any] | None
    pc: np.ndarray                    # independent first-appearance codes
    rc: np.ndarray
    cap: int                          # every length <= cap
    kwargs: dict[str, Any] = field(default_factory=dict)

    def batch(self) -> mp.Batch:
        return mp.Batch(self.seq_lens, **self.kwargs)

    @property
    def num_prompts(self) -> int:
        return int(self.pc.max()) + 1 if self.pc.size else 0

    @property
    def num_rollouts(self) -> int:
        return int(self.rc.max()) + 1 if self.rc.size else 0


def gen_structure(rng: np.random.Generator, n: int, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and rollout number of each of exactly n samples (grouped, in order)."""
    prompts: list[int] = []
    rollouts: list[int] = []
    g = int(rng.integers(1, 9))
    p = r = 0
    while len(prompts) < n:
        if kind == "flat":
            shape = [1]
        elif kind == "grpo":
            shape = [1] * g
        elif kind == "grpo_var":
            shape = [1] * int(rng.integers(1, 9))
        elif kind == "stepwise":  # several rollouts per prompt, several turns per rollout
            shape = [int(rng.integers(1, 6)) for _ in range(int(rng.integers(1, 5)))]
        else:  # fanout: mostly single-sample rollouts, some fan out
            shape = [1 if rng.random() < 0.85 else int(rng.integers(2, 4))]
        for turns in shape:
            prompts += [p] * turns
            rollouts += [r] * turns
            r += 1
        p += 1
    return np.array(prompts[:n]), np.array(rollouts[:n])


def gen_lengths(rng: np.random.Generator, n: int, cap: int, kind: str) -> np.ndarray:
    if kind == "uniform":
        x = rng.integers(1, cap + 1, n)
    elif kind == "small":
        x = rng.integers(1, max(1, cap // 8) + 1, n)
    elif kind == "big":  # every sample more than half the cap: singleton micro-batches
        x = rng.integers(cap // 2 + 1, cap + 1, n)
    elif kind == "longtail":
        x = np.ceil(rng.lognormal(mean=math.log(max(cap / 30, 1)), sigma=1.6, size=n))
    elif kind == "cap":
        x = np.full(n, cap)
    else:  # bimodal
        small = rng.integers(1, max(1, cap // 10) + 1, n)
        big = rng.integers(max(1, (3 * cap) // 4), cap + 1, n)
        x = np.where(rng.random(n) < 0.2, big, small)
    return np.clip(x, 1, cap).astype(np.int64)


def _relabel(rng: np.random.Generator, codes: np.ndarray, style: str) -> list[Any]:
    m = int(codes.max()) + 1
    labels = rng.choice(10 ** 6, size=m, replace=False)
    if style == "str":
        return [f"id-{int(labels[c])}" for c in codes]
    return [int(labels[c]) for c in codes]


def gen_case(seed: int, n: int, structure: str, lengths: str, loss_kind: str, cap: int, *,
             shuffle: bool, id_style: str, pass_ids: bool) -> Case:
    """A random batch; ``shuffle`` interleaves groups, ``pass_ids=False`` relies on the defaults
    where the structure allows it (flat: no ids at all; one sample per rollout: no rollout_ids)."""
    rng = np.random.default_rng(seed)
    prompts, rollouts = gen_structure(rng, n, structure)
    lens = gen_lengths(rng, n, cap, lengths)
    if shuffle:
        perm = rng.permutation(n)
        prompts, rollouts, lens = prompts[perm], rollouts[perm], lens[perm]
    kwargs: dict[str, Any] = {}
    if structure == "flat" and not pass_ids:
        pids = rids = None
        pc = rc = np.arange(n, dtype=np.int64)
    else:
        pids = _relabel(rng, prompts, id_style)
        kwargs["prompt_ids"] = pids
        pc = first_appearance_codes(pids)
        if structure in ("flat", "grpo", "grpo_var") and not pass_ids:
            rids, rc = None, np.arange(n, dtype=np.int64)  # default: every sample its own rollout
        else:
            rids = _relabel(rng, rollouts, "str" if id_style == "int" else "int")
            kwargs["rollout_ids"] = rids
            rc = first_appearance_codes(rids)
    if loss_kind == "default":
        lt = lens - 1  # DESIGN: a causal LM predicts seq_len - 1 tokens of a sample with no prompt
    elif loss_kind == "prompt_lens":
        plens = rng.integers(0, lens + 1)
        kwargs["prompt_lens"] = plens
        lt = lens - plens
    elif loss_kind == "random":
        lt = rng.integers(0, lens + 1)
        kwargs["loss_tokens"] = lt
    elif loss_kind == "some_zero":
        lt = np.where(rng.random(n) < 0.3, 0, rng.integers(0, lens + 1))
        kwargs["loss_tokens"] = lt
    else:
        lt = np.zeros(n, dtype=np.int64)
        kwargs["loss_tokens"] = lt
    return Case(lens, np.asarray(lt, dtype=np.int64), pids, rids, pc, rc, cap, kwargs)


@st.composite
def cases(draw, max_samples: int = 600, max_cap: int = 32768, lengths: tuple[str, ...] = LENGTHS) -> Case:
    n = draw(st.one_of(st.integers(1, 12), st.integers(1, 80), st.integers(1, max_samples)))
    cap = draw(st.one_of(st.integers(1, 16), st.integers(16, 4096), st.sampled_from([1024, max_cap])))
    cap = min(cap, max_cap)
    return gen_case(
        draw(st.integers(0, 2 ** 32 - 1)), n,
        draw(st.sampled_from(STRUCTURES)), draw(st.sampled_from(lengths)), draw(st.sampled_from(LOSS_KINDS)), cap,
        shuffle=draw(st.booleans()), id_style=draw(st.sampled_from(["int", "str"])), pass_ids=draw(st.booleans()))


def loss_strategy(draw) -> mp.Loss:
    mode = draw(st.sampled_from(mp.LOSS_MODES))
    H = draw(st.sampled_from([1.0, 7.0, 4096.0, 0.37])) if mode == "seq-mean-token-sum-norm" else None
    return mp.Loss(mode, grad_reduction=draw(st.sampled_from(["mean", "sum"])),
                   engine_divides_by_micro_count=draw(st.booleans()), norm_constant=H)


MICRO_BUDGET = 6000  # Σ over steps of dp·align: keeps dp·K reasonable


@st.composite
def configs(draw, case: Case, *, cp: bool = True, max_dp: int = 256) -> mp.PlanConfig:
    P, R = case.num_prompts, case.num_rollouts
    kind = draw(st.sampled_from(["none", "num", "prompts", "rollouts"]))
    if kind == "none":
        steps, est = None, 1
    elif kind == "num":
        k = draw(st.integers(1, max(1, min(P, 40))))
        if draw(st.integers(0, 9)) == 0:
            k = P + 1  # more steps than prompt groups: a PlanError
        steps, est = mp.Steps(num_steps=k), k
    elif kind == "prompts":
        p = draw(st.integers(1, max(1, P)))
        steps, est = mp.Steps(prompts_per_step=p), max(1, P // p)
    else:
        r = draw(st.integers(1, max(1, R)))
        steps, est = mp.Steps(rollouts_per_step=r), max(1, R // r)
    align = draw(st.one_of(st.just(1), st.integers(1, 8)))
    dp_max = max(1, min(max_dp, MICRO_BUDGET // (est * align)))
    dp = draw(st.one_of(st.integers(1, min(8, dp_max)), st.integers(1, dp_max)))
    c = draw(st.sampled_from([None, None, None, 2, 4])) if cp else None
    dyn = c is not None and draw(st.booleans())
    if dyn:  # dynamic CP: the plane's dp GPUs are cut into groups of up to c; dp % c == 0
        dp = max(c, dp - dp % c)
    if draw(st.booleans()):
        if c is not None:  # CP: samples may be up to c × the per-GPU cap (exactly, at the smallest cap)
            cap = -(-case.cap // c) + draw(st.integers(0, 3))
        else:
            cap = case.cap + draw(st.sampled_from([0, 0, 1, case.cap]))
        cpc = None if c is None else (mp.ContextParallel(max_size=c) if dyn else mp.ContextParallel(size=c))
        size = dict(max_tokens_per_micro=cap, context_parallel=cpc)
    else:
        size = dict(micro_batch_size=draw(st.integers(1, 16)))
    cost = draw(st.sampled_from([mp.TokenCost(), mp.TokenCost(per_micro=64.0),
                                 mp.FlopsCost(linear=1.0, quadratic=1e-3, per_micro=10.0),
                                 mp.FlopsCost(linear=0.0, quadratic=1.0),
                                 # non-additive: a dense kernel over the packed row (T² per micro-batch)
                                 mp.FlopsCost(linear=1.0, packed_quadratic=1e-3, per_micro=40.0),
                                 mp.FlopsCost(linear=1.0, quadratic=5e-4, packed_quadratic=5e-4, per_micro=5.0)]))
    return mp.PlanConfig(dp_size=dp, steps=steps, align=align, short_step=draw(st.sampled_from(["pad", "drop", "error"])),
                         cost=cost, sync=draw(st.sampled_from(["micro", "step"])), loss=loss_strategy(draw),
                         seed=draw(st.integers(0, 3)), **size)


def replace(cfg: mp.PlanConfig, **changes: Any) -> mp.PlanConfig:
    import dataclasses
    return dataclasses.replace(cfg, **changes)
