"""How TRL's generation batch may be re-cut into gradient-accumulation chunks without changing the update.

Design note. ``GRPOTrainer`` cuts one (shuffled) local generation batch of ``B`` rows into
``steps_per_generation`` chunks of ``B / steps_per_generation`` rows, in order; training step
``s`` runs chunk ``s % steps_per_generation`` and the optimizer steps after every
``gradient_accumulation_steps`` training steps. Two things bound what a re-cut may do:

1. **Windows** (:func:`windows`): a row may move only among the chunks that are always in the
   same optimizer step. From the trainer's step counter at generation time, every training step
   ``s`` of this generation's use (``num_iterations`` passes) that opens an accumulation window
   cuts the chunk sequence before chunk ``s % steps_per_generation``; the chunks between two cuts
   form one window. One generation feeding two optimizer steps (4 chunks, accumulation 2) gives
   windows ``[0, 1]`` and ``[2, 3]``, each holding exactly TRL's rows.
2. **The loss type's normaliser** (:data:`RULES`): ``free`` losses (``dapo``, ``cispo``,
   ``vespo``) divide every chunk by one constant of the generation batch, so any non-empty
   chunks are exact; ``count`` losses (``grpo``, ``sapo``, ``dr_grpo``, ``luspo``) divide by the
   chunk's row count (a mean over rows, or rows × max_completion_length), so chunks keep TRL's
   row count exactly; ``keep`` (``bnpo``: a chunk's own token count; and any loss with the entropy
   bonus, a top-entropy quantile mask or a MoE aux loss, which are per-chunk statistics) keeps
   TRL's rows in every chunk — only trimming and prefix sharing remain.

Inside a window, rows are balanced by tokens (greedy, heaviest first, onto the lightest chunk
that still has room): with ``share`` the unit is a prompt group (rows with identical prompt
tokens), whose prompt is counted once per chunk it lands in, so groups stay whole unless the row
counts force a cut. Every chunk is non-empty. Measured trade-off: whole groups balance coarsely
(a window of 2 chunks and 3 groups of 8 rows under ``count`` must cut one group: its prompt is
computed twice), but the tokens saved dwarf the imbalance (benchmarks/bench_trl.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import PlanError

__all__ = ["RULES", "windows", "partition", "row_groups"]

#: loss type → what a re-cut must keep (module note).
RULES = {"dapo": "free", "cispo": "free", "vespo": "free",
         "grpo": "count", "sapo": "count", "dr_grpo": "count", "luspo": "count",
         "bnpo": "keep"}


def windows(num_chunks: int, first_step: int | None, accumulation: int | None, iterations: int = 1) -> list[range]:
    """The chunk ranges that share an optimizer step in every use of this generation (module note, 1).

    ``first_step``: the trainer's training-step counter when the batch was generated; ``None``
    (no trainer known) gives one window of all chunks.
    """
    k = int(num_chunks)
    if first_step is None or accumulation is None:
        return [range(0, k)]
    g = max(int(accumulation), 1)
    cuts = sorted({s % k for s in range(first_step, first_step + k * max(int(iterations), 1)) if s % g == 0} - {0})
    bounds = [0, *cuts, k]
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def partition(tokens: np.ndarray, group: np.ndarray, prompt_tokens: np.ndarray, counts: list[int], rule: str,
              share: bool) -> list[np.ndarray]:
    """Rows ``0..n-1`` of one window into ``len(counts)`` non-empty chunks (module note, 2).

    ``tokens``: real tokens of each row; ``group``: prompt-group id of each row;
    ``prompt_tokens``: each row's prompt tokens (counted once per group and chunk with ``share``);
    ``counts``: TRL's row count of each chunk (kept exactly under ``count`` and ``keep``).
    """
    n, k = tokens.size, len(counts)
    if n < k:
        raise PlanError(f"split_tensor_dict: {n} rows cannot fill {k} non-empty chunks of one optimizer step; "
                        "generate at least steps_per_generation rows per process.")
    if rule == "keep":
        edges = np.concatenate([[0], np.cumsum(counts)])
        return [np.arange(edges[j], edges[j + 1], dtype=np.int64) for j in range(k)]
    cap = list(counts) if rule == "count" else [n - k + 1] * k
    units = _units(tokens, group, prompt_tokens, share)
    chunks: list[list[int]] = [[] for _ in range(k)]
    load = np.zeros(k)
    for rows, prompt in units:  # heaviest unit first
        while rows:
            room = [j for j in range(k) if len(chunks[j]) < cap[j]]
            j = min(room, key=lambda c: (load[c], -(cap[c] - len(chunks[c])), c))
            take = rows[: cap[j] - len(chunks[j])]
            rows = rows[len(take):]
            chunks[j].extend(take)
            load[j] += float(tokens[take].sum()) - (prompt * (len(take) - 1) if share else 0.0)
    if rule == "free":
        _fill_empty(chunks, tokens)
    out = [np.sort(np.asarray(c, dtype=np.int64)) for c in chunks]
    if any(c.size == 0 for c in out) or sum(c.size for c in out) != n:  # pragma: no cover - by construction
        raise PlanError(f"split_tensor_dict: internal error, chunk sizes {[c.size for c in out]} for {n} rows.")
    return out


def _units(tokens: np.ndarray, group: np.ndarray, prompt_tokens: np.ndarray, share: bool) -> list[tuple[list[int], float]]:
    """What is placed whole, heaviest first: a prompt group with ``share`` (rows heaviest first), else a row."""
    if not share:
        order = sorted(range(tokens.size), key=lambda i: (-int(tokens[i]), i))
        return [([i], 0.0) for i in order]
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group.tolist()):
        members.setdefault(int(g), []).append(i)
    units = []
    for rows in members.values():
        rows = sorted(rows, key=lambda i: (-int(tokens[i]), i))
        prompt = float(prompt_tokens[rows[0]])
        units.append((rows, float(tokens[rows].sum()) - prompt * (len(rows) - 1)))
    units.sort(key=lambda u: (-u[1], u[0][0]))
    return [(rows, float(prompt_tokens[rows[0]])) for rows, _ in units]


def _fill_empty(chunks: list[list[int]], tokens: np.ndarray) -> None:
    """``free`` rule: give every empty chunk the lightest row of the fullest chunk (fewer groups than chunks)."""
    for j in range(len(chunks)):
        if not chunks[j]:
            donor = max(range(len(chunks)), key=lambda c: (len(chunks[c]), -c))
            row = min(chunks[donor], key=lambda i: (int(tokens[i]), i))
            chunks[donor].remove(row)
            chunks[j].append(row)


def row_groups(prompt_ids: Any, prompt_mask: Any) -> tuple[np.ndarray, np.ndarray]:
    """(group id, prompt tokens) of each row: rows whose real prompt tokens are identical share a group."""
    ids = prompt_ids.cpu().numpy()
    mask = prompt_mask.cpu().numpy().astype(bool)
    seen: dict[bytes, int] = {}
    group = np.empty(ids.shape[0], dtype=np.int64)
    for i in range(ids.shape[0]):
        key = ids[i][mask[i]].astype(np.int64).tobytes()
        group[i] = seen.setdefault(key, len(seen))
    return group, mask.sum(axis=1).astype(np.int64)
