"""Shared prefixes (issue 14), planning side: tokens computed, K and balance with and without sharing.

Design note. For every family × dp × seed we build ONE optimizer step (whole prompts holding
~16/32/64 samples per GPU, cycled by seed; on odd seeds the step then loses its last prompt, as
after a dynamic-sampling filter) with its prefix forest, and plan it three ways under the ~7B cost
model of bench_planners (``metrics.dense_7b_cost``): ``microplan`` = ``PlanConfig(share_prefixes=
True)``; ``no-sharing`` = the same config without it; on GRPO families, verl's PrefixGrouper path
(``peers/prefix_grouper.py``: whole groups per rank, a fixed micro-batch size in samples, the
prompt once per group) with micro_batch_size = m·n (``pg``: m groups, m = round(cap / mean group
tokens), tuned to the cap on average), n (``pg-1group``) and m·n + n/2 (``pg-split``: groups cut
by micro-batch boundaries, like verl's own example, n = 5 with 16 per micro-batch).

Families (name: generator, context window, cap per GPU, group):
- ``stepwise-append``: ``stepwise-multiturn``, 16,384, 24,576, 4 rollouts per prompt; each turn
  shares the previous turn whole (append-only history).
- ``stepwise-edits``: the same with ``history_edits=0.3`` (30 % of turns share only 20–90 %).
- ``grpo-short``: ``grpo-longtail`` defaults, 16,384, 32,768, n = 8 (prompts 32–1,024 tokens).
- ``grpo-long``: ``grpo-longtail`` with ``prompt_len=(3000, 5000)``, ``max_len=6656``, 32,768, n = 8:
  responses have median ~1k tokens (1,014 over 4,096 samples, p10–p90 276–2,622; 19 % truncated).
- ``branching-agent`` (:func:`branching_agent`, written here): agent episodes whose turns fork
  at random into 2–3 sibling branches (parallel tool calls, sub-agents, retries); 16,384, 24,576,
  2 episodes per prompt.

Columns are tokens computed (the unique tokens the micro-batches hold), the step's unshared
tokens and its prefix trie (the fewest tokens any plan computes), K vs K_lb, micro-batches over
the cap counting unique tokens, lockstep time / LB with each plan's own LB (for sharing plans
and PrefixGrouper: the LB on the step's prefix trie, ``PlanStats.time_lower_bound``), lockstep /
trie LB for every row (so ratios between rows are predicted speed-ups), planning time.

Independent recount. Synthetic token ids realise the forest (:func:`realise_tokens`: a position
inside a declared shared prefix copies the parent's id, every other position gets a fresh id), so
any set of samples holds exactly as many prefix-trie nodes as distinct ids. Every micro-batch's
unique tokens and attention work Σ(2·position + 1) are recounted from those ids
(:class:`Recount`), never from ``microplan.prefix``, and compared with ``Micro.num_tokens``,
``PlanStats`` and the plan's lockstep time; the over-cap column counts the recount.

Measured trade-off (2026-11-24, benchmarks/README.md): sharing computes 3.4× fewer tokens on
stepwise-append and 2.9× on grpo-long (median), but with whole prefix trees as packing atoms the
lockstep time sits 1.05–1.37× above the trie LB (median) against ≤ 1.002× without sharing.

``find_shared_prefixes`` is timed on 2,048 samples holding 8M tokens (random ids from a 151,936
vocabulary realising a scaled grpo-long or stepwise-append forest), median of 3 runs.

Measured model time (forward + backward with and without sharing on a real transformer) is not
part of this script: it lives in ``benchmarks/bench_prefix_measured.py``.

Run: ``python -m benchmarks.bench_prefix [--quick]``. Prints the tables and writes
``benchmarks/results/prefix-<date>-<host>.{json,png}``.
"""

from __future__ import annotations

import datetime
import socket
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

if __package__ in (None, ""):  # run as a script: make ``benchmarks`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import microplan as mp  # noqa: E402
from microplan.traces import generate  # noqa: E402

from benchmarks._results import save_json  # noqa: E402
from benchmarks.bench_planners import (SPG, _agg, _mw, bench_args, format_table, group_rows, run_grid,  # noqa: E402
                                       whole_prompts)
from benchmarks.metrics import dense_7b_cost  # noqa: E402
from benchmarks.peers import PeerCrash  # noqa: E402
from benchmarks.peers.prefix_grouper import pg_micro_tokens, plan_prefix_grouper  # noqa: E402


class Family(NamedTuple):
    """A benchmark family: its generator and the step's geometry."""

    source: str          # a microplan.traces family, or "branching-agent"
    kwargs: dict         # generator keyword arguments beyond num_prompts / seed
    max_len: int         # context window (tokens)
    cap: int             # per-GPU token cap (unique tokens under sharing)
    group: int           # samples (GRPO) or rollouts / episodes (step-wise, agent) per prompt
    grpo: bool           # a group shares exactly its prompt: PrefixGrouper applies


FAMILIES: dict[str, Family] = {
    "stepwise-append": Family("stepwise-multiturn", {}, 16384, 24576, 4, False),
    "stepwise-edits": Family("stepwise-multiturn", {"history_edits": 0.3}, 16384, 24576, 4, False),
    "grpo-short": Family("grpo-longtail", {}, 16384, 32768, 8, True),
    "grpo-long": Family("grpo-longtail", {"prompt_len": (3000, 5000)}, 6656, 32768, 8, True),
    "branching-agent": Family("branching-agent", {}, 16384, 24576, 2, False),
}
PLANNERS = {
    "microplan": f"microplan {mp.__version__} PlanConfig(share_prefixes=True)",
    "no-sharing": f"microplan {mp.__version__} the same config, share_prefixes=False",
    "pg": "verl PrefixGrouper path: whole groups per rank, micro_batch_size = m·n (m groups ~ the cap on average)",
    "pg-1group": "verl PrefixGrouper path, micro_batch_size = n (one group per micro-batch)",
    "pg-split": "verl PrefixGrouper path, micro_batch_size = m·n + n/2 (groups cut by micro-batch boundaries)",
}
PG = ("pg", "pg-1group", "pg-split")
TARGETS = {"saving_stepwise_append": 3.0, "saving_grpo_long": 2.5, "over_cap": 0, "never_more_tokens": True,
           "find_shared_prefixes_s": 5.0}


# -- families and steps ---------------------------------------------------------------------------

def branching_agent(*, num_prompts: int, episodes_per_prompt: int = 2, max_len: int = 16384, seed: int = 0,
                    fork_p: float = 0.25, max_samples: int = 24) -> mp.Batch:
    """Agent episodes as prefix trees: one sample per turn, each turn's history = its parent turn.

    Per prompt (prompt ~ LogUniform(32, min(1024, max_len/2))) and horizon h ~ LN(4, 0.4), each of
    ``episodes_per_prompt`` episodes grows depth-first from a first turn (prompt + response): a
    turn appends an observation ~ LN(0.02·max_len, 0.9) and a response ~ LN(0.025·max_len, 0.7)
    to its parent turn's whole sequence; after a turn the branch stops with probability 1/h (or at
    the window: the response is truncated at ``max_len``), else continues with 1 child, or with
    probability ``fork_p`` forks into 2–3 siblings. At most ``max_samples`` turns per episode.
    Samples come in depth-first order (parents first); rollout = episode; an episode's first turn
    shares the prompt with the prompt's first episode. Deterministic in ``seed``.
    """
    rng = np.random.default_rng([seed, 14])
    hi = min(1024, max_len // 2)
    plens = np.clip(np.rint(np.exp(rng.uniform(np.log(min(32, hi)), np.log(hi), num_prompts))), 1, hi).astype(int)
    horizon = 4.0 * np.exp(0.4 * rng.standard_normal(num_prompts))
    draw = lambda m, s: max(1, int(round(m * np.exp(s * rng.standard_normal()))))  # noqa: E731
    seq, part, parent, shared, pid, rid = [], [], [], [], [], []
    for p in range(num_prompts):
        first = -1
        for e in range(episodes_per_prompt):
            stack, count = [(-1, 0)], 0                    # (parent sample, parent's length)
            while stack and count < max_samples:
                par, base = stack.pop()
                obs = int(plens[p]) if par < 0 else draw(0.02 * max_len, 0.9)
                if base + obs >= max_len:
                    continue
                i, L = len(seq), min(base + obs + draw(0.025 * max_len, 0.7), max_len)
                link = (par, base) if par >= 0 else ((first, int(plens[p])) if first >= 0 else (-1, 0))
                seq.append(L), part.append(base + obs), parent.append(link[0]), shared.append(link[1])
                pid.append(p), rid.append(p * episodes_per_prompt + e)
                first = i if first < 0 else first
                count += 1
                if L >= max_len or rng.random() < 1.0 / horizon[p]:
                    continue
                kids = int(rng.integers(2, 4)) if rng.random() < fork_p else 1
                stack.extend([(i, L)] * kids)
    return mp.Batch(seq, prompt_lens=part, prompt_ids=pid, rollout_ids=rid, prefix_parent=parent,
                    shared_prefix_lens=shared)


def family_batch(family: str, num_prompts: int, seed: int) -> mp.Batch:
    """A whole generated batch of ``family`` (see :data:`FAMILIES`), prefix forest included."""
    f = FAMILIES[family]
    if f.source == "branching-agent":
        return branching_agent(num_prompts=num_prompts, episodes_per_prompt=f.group, max_len=f.max_len, seed=seed)
    return generate(f.source, num_prompts=num_prompts, samples_per_prompt=f.group, max_len=f.max_len, seed=seed,
                    **f.kwargs)


def take(b: mp.Batch, n: int) -> mp.Batch:
    """The batch's first ``n`` samples, forest included (parents are earlier, so it stays valid)."""
    cut = slice(0, n)
    return mp.Batch(b.seq_lens[cut], loss_tokens=b.loss_tokens[cut], prompt_lens=b.prompt_lens[cut],
                    prompt_ids=np.asarray(b.prompt_ids)[cut], rollout_ids=np.asarray(b.rollout_ids)[cut],
                    prefix_parent=b.prefix_parent[cut], shared_prefix_lens=b.shared_prefix_lens[cut])


def make_step(family: str, dp: int, spg: int, seed: int) -> mp.Batch:
    """One step: the shortest prefix of whole prompts holding >= dp·spg samples; on odd seeds the
    last of those prompts is dropped (a dynamic-sampling filter), so group counts need not divide dp."""
    f = FAMILIES[family]
    target = dp * spg
    prompts = -(-target // f.group) + 1
    while True:
        b = family_batch(family, prompts, seed)
        if b.num_samples >= target:
            break
        prompts *= 2
    pid = np.asarray(b.prompt_ids)
    cut = whole_prompts(pid, target)
    if seed % 2:
        cut = int(np.searchsorted(pid, pid[cut - 1], side="left"))
    return take(b, cut)


# -- independent recount ----------------------------------------------------------------------------

class Tokens(NamedTuple):
    """Token ids of every sample, concatenated: sample i is ``flat[offsets[i]:offsets[i + 1]]``."""

    flat: np.ndarray
    offsets: np.ndarray

    def of(self, i: int) -> np.ndarray:
        return self.flat[self.offsets[i]:self.offsets[i + 1]]


def realise_tokens(batch: mp.Batch, *, vocab: int | None = None, seed: int = 0) -> Tokens:
    """Token ids realising the batch's forest: sample i's first ``shared_prefix_lens[i]`` ids are its
    parent's, the rest are fresh (``vocab=None``: ids never used before, so two samples agree on a
    position exactly when the forest says they do) or random in [0, vocab)."""
    lens = batch.seq_lens
    parent = batch.prefix_parent if batch.prefix_parent is not None else np.full(lens.size, -1)
    shared = batch.shared_prefix_lens if batch.shared_prefix_lens is not None else np.zeros(lens.size, dtype=np.int64)
    offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    flat = np.empty(int(offs[-1]), dtype=np.int64)
    rng = np.random.default_rng(seed)
    fresh = 0
    for i in range(lens.size):
        o, L = int(offs[i]), int(lens[i])
        s = int(shared[i]) if parent[i] >= 0 else 0
        if s:
            q = int(offs[parent[i]])
            flat[o:o + s] = flat[q:q + s]
        k = L - s
        flat[o + s:o + L] = np.arange(fresh, fresh + k) if vocab is None else rng.integers(0, vocab, k)
        fresh += k
    return Tokens(flat, offs)


class Recount:
    """Unique tokens and attention work Σ(2·position + 1) of any set of samples, from fresh-id
    tokens (:func:`realise_tokens` with ``vocab=None``): one distinct id = one prefix-trie node."""

    def __init__(self, tokens: Tokens) -> None:
        self.tokens = tokens
        lens = np.diff(tokens.offsets)
        pos = np.arange(tokens.flat.size, dtype=np.int64) - np.repeat(tokens.offsets[:-1], lens)
        self.position = np.zeros(int(tokens.flat.max(initial=-1)) + 1, dtype=np.int64)
        self.position[tokens.flat] = pos                   # a fresh id sits at one position everywhere

    def count(self, members: np.ndarray) -> tuple[int, int]:
        """(unique tokens, attention work) of the samples ``members``."""
        if not len(members):
            return 0, 0
        ids = np.unique(np.concatenate([self.tokens.of(int(i)) for i in members]))
        return int(ids.size), int((2 * self.position[ids] + 1).sum())


# -- one case -------------------------------------------------------------------------------------

def _plan(batch: mp.Batch, dp: int, cap: int, cost, share: bool) -> tuple[mp.Plan, float]:
    cfg = mp.PlanConfig(dp_size=dp, max_tokens_per_micro=cap, cost=cost, share_prefixes=share)
    t = time.perf_counter()
    p = mp.plan(batch, cfg)
    dt = time.perf_counter() - t
    p.validate()
    return p, dt


def _micro_cost(cost, tokens: int, work: int) -> float:
    """The additive FlopsCost of one micro-batch of ``tokens`` unique tokens and attention ``work``."""
    return cost.per_micro + cost.linear * tokens + cost.quadratic * work


def score_microplan(plan: mp.Plan, rc: Recount, cost, ms: float) -> dict:
    """One microplan row: recounted tokens (unique under sharing, Σ seq_lens without), checks."""
    step = plan.steps[0]
    share = plan.config.share_prefixes
    cap = plan.config.max_tokens_per_micro
    grid = np.zeros((step.dp_size, step.micro_count))
    tokens = over = mismatch = 0
    for r, row in enumerate(step.micros):
        for m, micro in enumerate(row):
            if micro.is_placeholder:
                grid[r, m] = _micro_cost(cost, 1, 1)
                continue
            u, d = rc.count(micro.indices) if share else \
                (int(micro.seq_lens.sum()), int((micro.seq_lens ** 2).sum()))
            mismatch += u != micro.num_tokens
            tokens += u
            over += u > cap
            grid[r, m] = _micro_cost(cost, u, d)
    st = plan.stats
    lock = float(grid.max(axis=0).sum())
    return dict(tokens=tokens, padded=tokens, K=step.micro_count, K_lb=st.micro_count_lower_bound, over_cap=over,
                mismatch=mismatch + (share and tokens != st.tokens_with_sharing), placeholders=step.num_placeholders,
                lockstep=st.lockstep_time, lb=st.time_lower_bound, lockstep_check=abs(lock / st.lockstep_time - 1),
                equal_counts=True, ms=ms * 1e3, crash=None)


def pg_micro_batch_size(batch: mp.Batch, group: int, cap: int, kind: str) -> int:
    """``ppo_micro_batch_size_per_gpu`` of a PrefixGrouper row (see the module note)."""
    n_groups = batch.num_prompts
    per_group = (float(np.sum(batch.seq_lens - batch.prompt_lens)) +
                 float(np.sum(batch.prompt_lens[np.unique(batch.prompt_codes, return_index=True)[1]]))) / n_groups
    m = max(1, int(round(cap / per_group)))
    return {"pg": m * group, "pg-1group": group, "pg-split": m * group + group // 2}[kind]


def score_pg(batch: mp.Batch, kind: str, group: int, dp: int, cap: int, cost, rc: Recount, lb: float,
             k_lb: int) -> dict:
    """One PrefixGrouper row, priced like a sharing plan (unique tokens, attention by depth)."""
    mbs = pg_micro_batch_size(batch, group, cap, kind)
    t = time.perf_counter()
    try:
        plan = plan_prefix_grouper(batch.seq_lens, batch.prompt_codes, dp=dp, micro_batch_size=mbs)
    except PeerCrash as e:
        return dict(crash=str(e), micro_batch_size=mbs)
    ms = (time.perf_counter() - t) * 1e3
    K = max(len(row) for row in plan)
    grid = np.zeros((dp, K))
    tokens = padded = over = mismatch = 0
    for r, row in enumerate(plan):
        for m, idx in enumerate(row):
            pt = pg_micro_tokens(idx, batch.seq_lens, batch.prompt_lens, batch.prompt_codes)
            mismatch += (pt.real, pt.depth_sq) != rc.count(idx)
            tokens, padded, over = tokens + pt.real, padded + pt.padded, over + (pt.real > cap)
            grid[r, m] = _micro_cost(cost, pt.real, pt.depth_sq)
    return dict(tokens=tokens, padded=padded, K=K, K_lb=k_lb, over_cap=over, mismatch=mismatch, placeholders=0,
                lockstep=float(grid.max(axis=0).sum()), lb=lb, lockstep_check=0.0,
                equal_counts=len({len(row) for row in plan}) == 1, ms=ms, crash=None, micro_batch_size=mbs)


def run_case(family: str, dp: int, seed: int, cost, planners: list[str]) -> list[dict]:
    """Plan and score one step every way; one row per planner (PrefixGrouper rows on GRPO only)."""
    f = FAMILIES[family]
    spg = SPG[seed % len(SPG)]
    batch = make_step(family, dp, spg, seed)
    rc = Recount(realise_tokens(batch))
    trie, _ = rc.count(np.arange(batch.num_samples))
    base = dict(family=family, dp=dp, seed=seed, spg=spg, samples=batch.num_samples, prompts=batch.num_prompts,
                cap=f.cap, tokens_unshared=int(batch.seq_lens.sum()), tokens_lb=trie)
    shared, ms_s = _plan(batch, dp, f.cap, cost, True)
    plain, ms_p = _plan(batch, dp, f.cap, cost, False)
    lb_trie = shared.stats.time_lower_bound
    base["lb_trie"] = lb_trie
    base["lb_check"] = int(trie != shared.stats.tokens_lower_bound)
    scored = {"microplan": score_microplan(shared, rc, cost, ms_s),
              "no-sharing": score_microplan(plain, rc, cost, ms_p)}
    if f.grpo:
        for kind in PG:
            scored[kind] = score_pg(batch, kind, f.group, dp, f.cap, cost, rc, lb_trie,
                                    shared.stats.micro_count_lower_bound)
    rows = []
    for name in planners:
        if name not in scored:
            continue
        s = scored[name]
        row = {**base, "planner": name, **s}
        if s["crash"] is None:
            row.update(saving=base["tokens_unshared"] / s["tokens"], to_lb=s["tokens"] / trie,
                       lockstep_ratio=s["lockstep"] / s["lb"], trie_ratio=s["lockstep"] / lb_trie,
                       speedup=scored["no-sharing"]["lockstep"] / s["lockstep"], pad_ratio=s["padded"] / s["tokens"])
        rows.append(row)
    return rows


# -- summary --------------------------------------------------------------------------------------

def summarise(rows: list[dict], keys: tuple[str, ...] = ("family", "dp", "planner")) -> list[dict]:
    """Median and worst of every column per group of ``keys`` (crashed cases counted apart)."""
    out = []
    for key, rs in group_rows(rows, keys).items():
        ok = [r for r in rs if r["crash"] is None]
        s = dict(zip(keys, key), cases=len(rs), crashes=len(rs) - len(ok))
        for col in ("tokens_unshared", "tokens", "tokens_lb", "K", "K_lb", "over_cap", "lockstep_ratio", "trie_ratio",
                    "to_lb", "pad_ratio", "ms"):
            s[col] = _agg([float(r[col]) for r in ok])
        for col in ("saving", "speedup"):
            s[col] = _agg([r[col] for r in ok], worst=min)
        s["mismatch"] = sum(int(r["mismatch"]) + int(r["lb_check"]) for r in ok)
        s["lockstep_check"] = max((r["lockstep_check"] for r in ok), default=0.0)
        s["never_more"] = all(r["tokens"] <= r["tokens_unshared"] for r in ok)
        out.append(s)
    return out


def _m(x: tuple[float, float]) -> str:
    return f"{x[0] / 1e6:.2f}"


COLUMNS = [("unshared M", 10, lambda s: _m(s["tokens_unshared"])),
           ("computed M", 10, lambda s: _m(s["tokens"])),
           ("trie M", 7, lambda s: _m(s["tokens_lb"])),
           ("saving", 11, lambda s: _mw(s["saving"], ".2f")),
           ("comp/trie", 11, lambda s: _mw(s["to_lb"], ".3f")),
           ("K", 7, lambda s: _mw(s["K"], ".0f")),
           ("Klb", 7, lambda s: _mw(s["K_lb"], ".0f")),
           ("over-cap", 8, lambda s: _mw(s["over_cap"], ".0f")),
           ("recount", 7, lambda s: "ok" if s["mismatch"] == 0 else f"{s['mismatch']} bad"),
           ("lockstep/LB", 13, lambda s: _mw(s["lockstep_ratio"], ".4f")),
           ("lock/trieLB", 13, lambda s: _mw(s["trie_ratio"], ".3f")),
           ("speedup", 11, lambda s: _mw(s["speedup"], ".2f")),
           ("padded", 11, lambda s: _mw(s["pad_ratio"], ".2f")),
           ("plan ms", 11, lambda s: _mw(s["ms"], ".0f")),
           ("crash", 5, lambda s: f"{s['crashes']}/{s['cases']}")]


def _blank(s: dict) -> bool:
    return s["cases"] == s["crashes"]


def table(summary: list[dict], keys: tuple[str, ...] = ("family", "dp", "planner")) -> str:
    """bench_planners.format_table with this benchmark's columns (an all-crash row shows its crashes)."""
    cols = [(n, w, (lambda f: lambda s: "-" if _blank(s) and n != "crash" else f(s))(f)) for n, w, f in COLUMNS]
    return format_table(summary, keys, cols)


# -- find_shared_prefixes --------------------------------------------------------------------------

def scaled(batch: mp.Batch, tokens: int) -> mp.Batch:
    """The batch's forest with every length scaled so the samples hold ~``tokens`` tokens."""
    f = tokens / float(batch.seq_lens.sum())
    seq = np.maximum(1, np.rint(batch.seq_lens * f)).astype(np.int64)
    par = batch.prefix_parent
    sh = np.rint(batch.shared_prefix_lens * f).astype(np.int64)
    sh = np.where(par >= 0, np.minimum(np.minimum(sh, seq), seq[np.maximum(par, 0)]), 0)
    return mp.Batch(seq, prefix_parent=np.where(sh > 0, par, -1), shared_prefix_lens=sh)


def time_find_shared_prefixes(family: str, *, samples: int = 2048, tokens: int = 8_000_000, repeats: int = 3,
                              vocab: int = 151_936) -> dict:
    """Median wall time of ``find_shared_prefixes`` over ``repeats`` runs, and whether it recovered
    at least every declared shared prefix (random ids can extend one by chance)."""
    group = FAMILIES[family].group
    b = family_batch(family, -(-samples // group) * 2, seed=0)
    b = scaled(take(b, samples), tokens)
    toks = realise_tokens(b, vocab=vocab, seed=1)
    seqs = [toks.of(i) for i in range(b.num_samples)]
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        parent, shared = mp.find_shared_prefixes(seqs)
        times.append(time.perf_counter() - t)
    declared = b.shared_prefix_lens
    return dict(family=family, samples=b.num_samples, tokens=int(b.seq_lens.sum()), repeats=repeats,
                times=times, median_s=float(np.median(times)), covers_declared=bool((shared >= declared).all()),
                exact=float(np.mean(shared == declared)), target_s=TARGETS["find_shared_prefixes_s"])


# -- targets and chart ----------------------------------------------------------------------------

def check_targets(rows: list[dict], timing: list[dict]) -> dict:
    """The issue's planning targets, evaluated on every case (worst case), with the medians."""
    mp_rows = [r for r in rows if r["planner"] == "microplan"]

    def saving(fam: str) -> dict:
        rs = [r for r in mp_rows if r["family"] == fam]
        if not rs:
            return {}
        v = [r["saving"] for r in rs]
        return dict(min=min(v), median=float(np.median(v)), cases=len(v),
                    pooled=sum(r["tokens_unshared"] for r in rs) / sum(r["tokens"] for r in rs),
                    trie_min=min(r["tokens_unshared"] / r["tokens_lb"] for r in rs))
    out = {"saving_stepwise_append": saving("stepwise-append"), "saving_grpo_long": saving("grpo-long"),
           "never_more_tokens": all(r["tokens"] <= r["tokens_unshared"] for r in mp_rows),
           "over_cap": sum(r["over_cap"] for r in mp_rows),
           "recount_mismatches": sum(int(r["mismatch"]) + int(r["lb_check"]) for r in mp_rows),
           "find_shared_prefixes_s": {t["family"]: t["median_s"] for t in timing}}
    out["pass"] = {
        "saving_stepwise_append": out["saving_stepwise_append"].get("min", 0) >= TARGETS["saving_stepwise_append"],
        "saving_grpo_long": out["saving_grpo_long"].get("min", 0) >= TARGETS["saving_grpo_long"],
        "never_more_tokens": out["never_more_tokens"], "over_cap": out["over_cap"] == 0,
        "find_shared_prefixes_s": all(t["median_s"] <= TARGETS["find_shared_prefixes_s"] for t in timing)}
    return out


def plot(summary: list[dict], path: Path) -> None:
    """Per family (dp pooled): tokens computed / unshared, and lockstep / trie LB, per planner."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = list(dict.fromkeys(s["family"] for s in summary))
    planners = list(dict.fromkeys(s["planner"] for s in summary))
    by = {(s["family"], s["planner"]): s for s in summary}
    fig, axes = plt.subplots(2, 1, figsize=(12, 8))
    w = 0.8 / len(planners)
    x = np.arange(len(fams))
    for i, p in enumerate(planners):
        ok = [f for f in fams if (f, p) in by and not _blank(by[f, p])]
        xs = [x[fams.index(f)] + i * w for f in ok]
        axes[0].bar(xs, [1.0 / by[f, p]["saving"][0] for f in ok], w, label=p)
        axes[1].bar(xs, [by[f, p]["trie_ratio"][0] for f in ok], w, label=p)
        axes[1].scatter(xs, [by[f, p]["trie_ratio"][1] for f in ok], marker="_", color="k", s=60)
    axes[0].set_ylabel("tokens computed / unshared (median)")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set_ylabel("lockstep / trie LB (bar: median, tick: worst)")
    for ax in axes:
        ax.set_xticks(x + 0.4 - w / 2, fams)
    axes[0].set_ylim(0, 1.2)
    axes[0].legend(ncol=5, fontsize=8, loc="upper center")
    fig.suptitle("shared prefixes: tokens computed and predicted step time (~7B dense FLOPs), dp 8 and 32 pooled")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict:
    args, dps, seeds = bench_args(argv, __doc__, list(PLANNERS), (8, 32), families=list(FAMILIES))
    cost = dense_7b_cost()
    print(f"cost model: FlopsCost(linear={cost.linear:.3g}, quadratic={cost.quadratic:.6g}, "
          f"per_micro={cost.per_micro:.3g})  [~7B dense]; sharing plans priced by unique tokens and depth")
    rows = run_grid(run_case, args.families, dps, seeds, cost, args.planners)
    summary = summarise(rows)
    print("cells: median/worst over seeds (saving, speedup: worst = smallest); M = millions of tokens (median)")
    print(table(summary))
    pooled = summarise(rows, ("family", "planner"))
    timing = [time_find_shared_prefixes(f) for f in ("grpo-long", "stepwise-append")]
    print("\nfind_shared_prefixes:")
    for t in timing:
        print(f"  {t['family']:16s} {t['samples']} samples, {t['tokens'] / 1e6:.2f}M tokens: median "
              f"{t['median_s']:.2f} s of {t['repeats']} ({', '.join(f'{x:.2f}' for x in t['times'])}); "
              f"covers every declared prefix: {t['covers_declared']}, exact {100 * t['exact']:.1f} %")
    targets = check_targets(rows, timing)
    print(f"\nindependent recount: mismatches {targets['recount_mismatches']}, lockstep max rel diff "
          f"{max(r['lockstep_check'] for r in rows if r['crash'] is None):.1e}")
    print("targets:", {k: ("PASS" if v else "FAIL") for k, v in targets["pass"].items()})
    for key in ("saving_stepwise_append", "saving_grpo_long"):
        t = targets[key]
        if t:
            print(f"  {key} (target >= {TARGETS[key]}, every case): min {t['min']:.2f}, median {t['median']:.2f}, "
                  f"pooled {t['pooled']:.2f} over {t['cases']} cases; the trie's own bound (unshared / trie) "
                  f"min {t['trie_min']:.2f}")
    result = dict(date=datetime.date.today().isoformat(), host=socket.gethostname(), quick=args.quick,
                  cost=cost.to_dict(), families={k: dict(v._asdict()) for k, v in FAMILIES.items()}, spg=SPG,
                  dp=list(dps), seeds=list(seeds), labels=PLANNERS, targets=TARGETS, target_check=targets,
                  find_shared_prefixes=timing, summary=summary, pooled=pooled, rows=rows)
    if not args.no_write:
        stem = save_json("prefix", result)
        plot(pooled, stem.with_suffix(".png"))
        print(f"\nwrote {stem}.json and {stem}.png")
    return result


if __name__ == "__main__":
    main()
