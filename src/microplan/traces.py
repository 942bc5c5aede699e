"""Seeded synthetic RL traces, so microplan can be tried and benchmarked with no data.

Design note. Each family draws per-sample lengths from a small generative model of an RL
rollout phase (numpy only, one ``Generator`` seeded by ``(seed, family)``; same arguments give
the same Batch in any process). Samples come out grouped the way a trainer sees them: the
responses of one prompt are contiguous, the turns of one rollout are contiguous and in order.
Lengths are scaled to ``max_len`` so the shapes hold at 4k, 16k or 128k, and every family
truncates at ``max_len`` the way a rollout engine does (``max_response_length``): a truncated
response fills the window exactly, which puts a visible spike at ``seq_len == max_len``.

Prompt lengths: one per prompt (the samples of a group share their prompt), log-uniform in
``prompt_len=(lo, hi)`` (default ``(32, min(1024, max_len // 2))``), or fixed when an int.
``LN(m, s)`` below is a lognormal with median ``m`` and log-space standard deviation ``s``.

- ``grpo-longtail``: GRPO groups of ``samples_per_prompt`` responses. Prompt difficulty
  ``d ~ LN(1, 0.7)`` scales the group (hard prompts give long groups); response
  ``~ LN(0.16·max_len·d, 0.8)``: a long right tail, ~4 % truncated at max_len.
- ``bimodal``: each prompt has a reasoning propensity ``q ~ Beta(2, 2)``; each response is a
  long chain of thought with probability q, ``~ LN(0.7·max_len, 0.45)`` (~25 % of them
  truncated), else a short answer ``~ LN(0.02·max_len, 0.5)``.
- ``stepwise-multiturn``: ``samples_per_prompt`` rollouts per prompt; a rollout has
  ``T ~ Geometric(1/h)`` turns (≤ 16) with a per-prompt horizon ``h ~ LN(3, 0.4)``; one sample per
  turn, sharing the rollout id. Turn t's sample holds the whole context so far: its prompt part
  is the previous turn's ``seq_len`` plus a tool/environment observation ``~ LN(0.02·max_len,
  0.9)`` (turn 1: the prompt), its loss part a new response ``~ LN(0.025·max_len, 0.7)``. So
  ``seq_len`` grows turn by turn; a rollout stops at ``max_len`` (last response truncated) or
  when the next observation no longer fits. Samples per prompt vary with the turn counts.
- ``long-context``: GRPO groups whose bulk looks like ``grpo-longtail`` at a 16k scale
  (responses ``~ LN(0.16·base·d, 0.8)``, ``base = min(max_len, 16384)``), while 1 prompt in 8
  is a long document: prompt ``~ LogUniform(max_len/4, 0.9·max_len)``, responses
  ``~ LN(0.1·max_len, 0.6)``, all truncated at ``max_len``. With ``max_len=131072`` those samples span 32k–128k: far over any per-GPU cap,
  the family that needs context parallel.

Ids: ``prompt_ids`` are ``0..num_prompts-1``, ``rollout_ids`` number the rollouts globally.
Cost: O(samples) numpy, well under a second for a million samples.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ._checks import int_field
from .batch import Batch
from .errors import PlanError

__all__ = ["FAMILIES", "generate"]

FAMILIES: tuple[str, ...] = ("grpo-longtail", "bimodal", "stepwise-multiturn", "long-context")

_MAX_TURNS = 16
_LONG_DOC_FRACTION = 0.125


def generate(family: str, *, num_prompts: int = 256, samples_per_prompt: int = 8,
             max_len: int = 16384, prompt_len: tuple[int, int] | int | None = None,
             seed: int = 0, history_edits: float = 0.0) -> Batch:
    """A synthetic RL batch of one of :data:`FAMILIES` (see the module note for each model).

    Args:
        family: one of ``FAMILIES``.
        num_prompts: prompts (groups) in the batch, >= 1.
        samples_per_prompt: responses per prompt (GRPO group size); rollouts per prompt for
            ``stepwise-multiturn``, whose samples are turns. >= 1.
        max_len: the context window: no sample is longer; truncated samples are exactly this
            long. >= 2.
        prompt_len: prompt tokens, an int (fixed) or ``(lo, hi)`` (log-uniform per prompt);
            default ``(32, min(1024, max_len // 2))``. Needs ``1 <= lo <= hi < max_len``.
        seed: >= 0; the same arguments give the same Batch, bit for bit.
        history_edits: ``stepwise-multiturn`` only: the probability that the history is edited
            before a turn (summarised, a tool result dropped), so the turn shares only a random
            20–90 % of the previous turn's tokens instead of all of them. 0 = append-only.

    Returns:
        A :class:`Batch` with ``prompt_lens``, ``prompt_ids`` and ``rollout_ids`` set,
        ``loss_tokens`` = ``seq_lens - prompt_lens`` (the response, or the turn's new response),
        and the shared prefixes (``prefix_parent``/``shared_prefix_lens``): a GRPO group's samples
        share the prompt with the group's first sample; a step-wise turn shares the previous
        turn's whole sequence (append-only history), and a rollout's first turn shares the prompt
        with the prompt's first rollout.

    Raises:
        PlanError: unknown family or an argument out of range.
    """
    if family not in _GENERATORS:
        raise PlanError(f"unknown trace family {family!r}; choose one of {', '.join(FAMILIES)}.")
    P = int_field("generate: num_prompts", num_prompts, minimum=1)
    G = int_field("generate: samples_per_prompt", samples_per_prompt, minimum=1)
    L = int_field("generate: max_len", max_len, minimum=2)
    seed = int_field("generate: seed", seed, minimum=0)
    lo, hi = _prompt_range(prompt_len, L)
    edits = float(history_edits)
    if not 0.0 <= edits <= 1.0:
        raise PlanError(f"generate: history_edits={history_edits!r} must be a probability in [0, 1].")
    if edits and family != "stepwise-multiturn":
        raise PlanError("generate: history_edits applies to the 'stepwise-multiturn' family only.")
    rng = np.random.default_rng([seed, FAMILIES.index(family)])
    plens = _loguniform_int(rng, lo, hi, P)
    if family == "stepwise-multiturn":
        return _stepwise_multiturn(rng, plens, G, L, edits)
    return _GENERATORS[family](rng, plens, G, L)


# -- argument handling ---------------------------------------------------------------------------

def _prompt_range(prompt_len: tuple[int, int] | int | None, max_len: int) -> tuple[int, int]:
    """``(lo, hi)`` of prompt lengths, checked against ``max_len``."""
    if prompt_len is None:
        hi = min(1024, max_len // 2)
        return min(32, hi), hi
    if isinstance(prompt_len, (tuple, list)):
        if len(prompt_len) != 2:
            raise PlanError(f"prompt_len={prompt_len!r} must be an int or a (lo, hi) pair.")
        lo = int_field("generate: prompt_len[0]", prompt_len[0], minimum=1)
        hi = int_field("generate: prompt_len[1]", prompt_len[1], minimum=1)
    else:
        lo = hi = int_field("generate: prompt_len", prompt_len, minimum=1)
    if lo > hi:
        raise PlanError(f"prompt_len=({lo}, {hi}) has lo > hi; pass (lo, hi) with lo <= hi.")
    if hi >= max_len:
        raise PlanError(f"prompt_len upper bound {hi} must be < max_len={max_len} so every response has at "
                        "least one token; lower prompt_len or raise max_len.")
    return lo, hi


# -- distributions -------------------------------------------------------------------------------

def _loguniform_int(rng: np.random.Generator, lo: float, hi: float, size: int) -> np.ndarray:
    """Ints log-uniform in [lo, hi] (lo >= 1)."""
    if lo == hi:
        return np.full(size, int(lo), dtype=np.int64)
    x = np.exp(rng.uniform(np.log(lo), np.log(hi), size))
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def _lognormal_int(rng: np.random.Generator, median: np.ndarray | float, sigma: float,
                   size: int) -> np.ndarray:
    """Ints >= 1 from a lognormal with the given median(s); capped far above any window."""
    x = np.asarray(median, dtype=np.float64) * np.exp(sigma * rng.standard_normal(size))
    return np.maximum(np.rint(np.minimum(x, 2.0**40)), 1).astype(np.int64)


def _groups(plens: np.ndarray, responses: np.ndarray, G: int, max_len: int) -> Batch:
    """GRPO batch: G responses per prompt (contiguous), truncated to the window."""
    P = plens.size
    prompt = np.repeat(plens, G)
    resp = np.minimum(responses, max_len - prompt)
    ids = np.repeat(np.arange(P, dtype=np.int64), G)
    first = ids * G                                                    # each group's first sample
    parent = np.where(np.arange(P * G) == first, -1, first)
    return Batch(prompt + resp, prompt_lens=prompt, prompt_ids=ids, rollout_ids=np.arange(P * G, dtype=np.int64),
                 prefix_parent=parent, shared_prefix_lens=np.where(parent >= 0, prompt, 0))


# -- families ------------------------------------------------------------------------------------

def _grpo_longtail(rng: np.random.Generator, plens: np.ndarray, G: int, max_len: int) -> Batch:
    difficulty = np.exp(0.7 * rng.standard_normal(plens.size))
    resp = _lognormal_int(rng, np.repeat(0.16 * max_len * difficulty, G), 0.8, plens.size * G)
    return _groups(plens, resp, G, max_len)


def _bimodal(rng: np.random.Generator, plens: np.ndarray, G: int, max_len: int) -> Batch:
    n = plens.size * G
    q = np.repeat(rng.beta(2.0, 2.0, plens.size), G)
    long = rng.random(n) < q
    short_r = _lognormal_int(rng, 0.02 * max_len, 0.5, n)
    long_r = _lognormal_int(rng, 0.7 * max_len, 0.45, n)
    return _groups(plens, np.where(long, long_r, short_r), G, max_len)


def _long_context(rng: np.random.Generator, plens: np.ndarray, G: int, max_len: int) -> Batch:
    P = plens.size
    base = min(max_len, 16384)
    is_doc = rng.random(P) < _LONG_DOC_FRACTION
    doc_len = _loguniform_int(rng, max(1, max_len // 4), max(1, int(0.9 * max_len)), P)
    prompts = np.where(is_doc, np.maximum(doc_len, plens), plens)
    prompts = np.minimum(prompts, max_len - 1)
    difficulty = np.exp(0.7 * rng.standard_normal(P))
    bulk = _lognormal_int(rng, np.repeat(0.16 * base * difficulty, G), 0.8, P * G)
    docs = _lognormal_int(rng, 0.1 * max_len, 0.6, P * G)
    return _groups(prompts, np.where(np.repeat(is_doc, G), docs, bulk), G, max_len)


def _stepwise_multiturn(rng: np.random.Generator, plens: np.ndarray, G: int, max_len: int,
                        edits: float = 0.0) -> Batch:
    P = plens.size
    R = P * G
    horizon = np.repeat(3.0 * np.exp(0.4 * rng.standard_normal(P)), G)
    turns = np.minimum(rng.geometric(np.minimum(1.0 / horizon, 1.0)), _MAX_TURNS)
    rollout = np.repeat(np.arange(R, dtype=np.int64), turns)
    first = np.concatenate(([0], np.cumsum(turns)[:-1]))           # index of each rollout's turn 1
    n = rollout.size
    obs = _lognormal_int(rng, 0.02 * max_len, 0.9, n)
    obs[first] = np.repeat(plens, G)                                   # turn 1 "observes" the prompt
    resp = _lognormal_int(rng, 0.025 * max_len, 0.7, n)
    raw_end = _segment_cumsum(obs + resp, first, turns)                # untruncated seq_len per turn
    prompt_part = raw_end - resp                                       # context before the response
    prev_end = np.where(np.isin(np.arange(n), first), 0, np.roll(raw_end, 1))
    keep = (prompt_part < max_len) & (prev_end < max_len)              # a prefix of each rollout
    seq_all = np.minimum(raw_end, max_len)
    # prefixes: a turn continues the previous turn (append-only) unless its history was edited;
    # a rollout's first turn shares the prompt with the prompt's first rollout
    is_first = np.isin(np.arange(n), first)
    prompt_first = first[(np.arange(R) // G) * G]                       # turn 1 of the prompt's rollout 0
    parent = np.where(is_first, prompt_first[rollout], np.arange(n) - 1)
    shared = np.where(is_first, np.repeat(plens, G)[rollout], np.roll(seq_all, 1))
    edited = (~is_first) & (rng.random(n) < edits) if edits else np.zeros(n, dtype=bool)
    shared = np.where(edited, np.floor(shared * rng.uniform(0.2, 0.9, n)).astype(np.int64), shared)
    parent = np.where(parent == np.arange(n), -1, parent)               # the first rollout's first turn
    shared = np.where(parent < 0, 0, np.minimum(shared, seq_all))
    new_index = np.cumsum(keep) - 1                                     # kept turns are a prefix per rollout
    parent = np.where(parent >= 0, new_index[np.maximum(parent, 0)], -1)[keep]
    seq = seq_all[keep]
    return Batch(seq, prompt_lens=prompt_part[keep], prompt_ids=rollout[keep] // G, rollout_ids=rollout[keep],
                 prefix_parent=parent, shared_prefix_lens=np.where(parent >= 0, shared[keep], 0))


def _segment_cumsum(x: np.ndarray, first: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Cumulative sum of ``x`` restarting at each segment start ``first`` (segments contiguous)."""
    total = np.cumsum(x)
    before = np.concatenate(([0], total))[first]                       # sum before each segment
    return total - np.repeat(before, counts)


_GENERATORS: dict[str, Callable[[np.random.Generator, np.ndarray, int, int], Batch]] = {
    "grpo-longtail": _grpo_longtail,
    "bimodal": _bimodal,
    "stepwise-multiturn": _stepwise_multiturn,
    "long-context": _long_context,
}
