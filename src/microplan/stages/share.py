"""Plan one step with shared prefixes: prefix trees as packing atoms, every shared token once.

Design note. With ``PlanConfig(share_prefixes=True)`` a micro-batch holds the prefix trie of
its samples (``microplan.prefix``). Steps:

1. Trees. The step's samples are grouped by the root of their prefix tree (a GRPO group's
   prompt, a trajectory's first turn, an agent rollout's root). A tree whose trie fits the cap
   is one atom; a larger one is cut in depth-first order into parts that each fit, so a part
   recomputes only the root path it needs and samples sharing long prefixes stay together.
2. Atoms are pseudo-samples for the ordinary fit (``fit.py``): their tokens are their unique
   tokens U, their cost the cost model's ``tree_costs(U, depth_sq)`` (attention per token
   grows with its depth on its path). K is chosen by predicted time, placeholders, align and
   pad/drop/error work unchanged; ``drop`` removes whole components of atoms and rollouts
   (a rollout cut over two parts drops with both), so no rollout is ever split.
3. Micro-batches. Each bin's samples, in depth-first order, get the trie of their union (two
   parts of one tree in one micro-batch share their root path again), its exact cost, and the
   usual arrangement into slots and loss scales.

Guarantees: every core invariant (the cap now counting unique tokens); a micro-batch never
holds more tokens than its samples unshared. Trade-off (benchmarks/bench_prefix.py): atoms keep
whole trees together, which is what saves tokens, at the price of coarser balancing when a few
trees are large; cutting trees finer would balance better and duplicate more prefix tokens.
"""

from __future__ import annotations

import numpy as np

from ..batch import Batch
from ..config import PlanConfig
from ..cost.models import bin_costs
from ..errors import PlanError
from ..prefix import dfs_order, micro_tree, sample_forest
from ..types import Micro, Step
from .assign import arrange
from .fit import effective_cap, fit_step
from .weigh import loss_coefficients, loss_scales

__all__ = ["plan_shared_step", "forest_of"]


def forest_of(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """(prefix_parent, shared_prefix_lens) of the batch; a flat forest when none is declared."""
    if batch.prefix_parent is None:
        n = batch.num_samples
        return np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.int64)
    return batch.prefix_parent, batch.shared_prefix_lens  # type: ignore[return-value]


class _Part:
    """A growing set of samples and the `need` of every sample its trie touches (prefix.py)."""

    def __init__(self) -> None:
        self.members: list[int] = []
        self.need: dict[int, int] = {}
        self.tokens = 0
        self.depth_sq = 0

    def gain(self, i: int, parent: np.ndarray, shared: np.ndarray, lens: np.ndarray) -> tuple[int, int, list]:
        """(Δ tokens, Δ depth_sq, updates) of adding sample i; walks up until the need is met."""
        du = dd = 0
        updates = []
        a, r = i, int(lens[i])
        while a >= 0 and r > 0:
            old = self.need.get(a, 0)
            if r <= old:
                break
            st = int(shared[a]) if parent[a] >= 0 else 0
            lo = max(old, st)
            if r > lo:
                du += r - lo
                dd += r * r - lo * lo
            updates.append((a, r))
            r = min(r, int(shared[a])) if parent[a] >= 0 else 0
            a = int(parent[a])
        return du, dd, updates

    def add(self, i: int, du: int, dd: int, updates: list) -> None:
        self.members.append(i)
        self.need.update(updates)
        self.tokens += du
        self.depth_sq += dd

    def detach(self) -> _Part:
        """Move the contents to a new part (returned) and leave this one empty."""
        done = _Part()
        done.members, done.need, done.tokens, done.depth_sq = self.members, self.need, self.tokens, self.depth_sq
        self.members, self.need, self.tokens, self.depth_sq = [], {}, 0, 0
        return done


def _atoms(samples: np.ndarray, parent: np.ndarray, shared: np.ndarray, lens: np.ndarray,
           cap: int) -> list[_Part]:
    """Trees that fit the cap whole; a larger one is cut into parts that fit, subtree by subtree
    (a branch that fits in the current part's room joins it, one that fits a fresh part starts
    one, a larger one is split at its own branches), so parts break where branches diverge."""
    roots, children = sample_forest(parent, shared, samples)
    atoms: list[_Part] = []
    for r in roots:
        part = _Part()
        stack = [r]
        while stack:  # depth-first, iteratively (trajectories can be long chains)
            i = stack.pop()
            if _place_subtree(i, children, part, atoms, parent, shared, lens, cap):
                continue
            du, dd, up = part.gain(i, parent, shared, lens)  # too large: place i, then its branches
            if part.members and part.tokens + du > cap:
                atoms.append(part.detach())
                du, dd, up = part.gain(i, parent, shared, lens)
            part.add(i, du, dd, up)
            stack.extend(children.get(i, [])[::-1])
        atoms.append(part)
    return [a for a in atoms if a.members]


def _subtree(i: int, children: dict[int, list[int]]) -> list[int]:
    out, stack = [], [i]
    while stack:
        a = stack.pop()
        out.append(a)
        stack.extend(children.get(a, [])[::-1])
    return out


def _trial(part: _Part, block: list[int], parent, shared, lens) -> int:
    """Tokens ``part`` would hold with ``block`` added (the part is left unchanged)."""
    need = dict(part.need)
    tokens = part.tokens
    probe = _Part()
    probe.need, probe.tokens = need, tokens
    for i in block:
        du, dd, up = probe.gain(i, parent, shared, lens)
        probe.add(i, du, dd, up)
    return probe.tokens


def _place_subtree(i: int, children: dict[int, list[int]], part: _Part, atoms: list[_Part], parent, shared, lens,
                   cap: int) -> bool:
    """Put the whole subtree of sample i into ``part``, or into a fresh part; False if it fits neither."""
    block = _subtree(i, children)
    if not (_trial(part, block, parent, shared, lens) <= cap):
        if not part.members or _trial(_Part(), block, parent, shared, lens) > cap:
            return False
        atoms.append(part.detach())
    for j in block:
        part.add(j, *part.gain(j, parent, shared, lens))
    return True


def _components(atoms: list[_Part], rollouts: np.ndarray, pos: dict[int, int]) -> np.ndarray:
    """Per atom, the smallest rollout code of its component (atoms joined by shared rollouts)."""
    codes = np.unique(rollouts)
    boss = {int(c): int(c) for c in codes}

    def find(c: int) -> int:
        while boss[c] != c:
            boss[c] = boss[boss[c]]
            c = boss[c]
        return c

    firsts = []
    for part in atoms:
        rc = sorted({int(rollouts[pos[i]]) for i in part.members})
        for c in rc[1:]:
            a, b = find(rc[0]), find(c)
            if a != b:
                boss[max(a, b)] = min(a, b)
        firsts.append(rc[0])
    return np.array([find(c) for c in firsts], dtype=np.int64)


def plan_shared_step(s: int, samples: np.ndarray, batch: Batch, costs: np.ndarray,
                     cfg: PlanConfig) -> tuple[Step, np.ndarray, str]:
    """The share-prefixes counterpart of the planner's per-step function."""
    cost = cfg.cost
    if not hasattr(cost, "tree_costs"):
        raise PlanError(f"share_prefixes=True needs a cost model that prices prefix trees (tree_costs): "
                        f"{type(cost).__name__} has none; use TokenCost or FlopsCost.")
    parent, shared = forest_of(batch)
    lens = batch.seq_lens
    cap = effective_cap(cfg)
    assert cap is not None and cfg.loss is not None
    atoms = _atoms(samples, parent, shared, lens, cap)
    pos = {int(i): k for k, i in enumerate(samples.tolist())}
    a_lens = np.array([p.tokens for p in atoms], dtype=np.int64)
    a_costs = cost.tree_costs(a_lens, np.array([p.depth_sq for p in atoms], dtype=np.float64))  # type: ignore[union-attr]
    label = np.array([p.members[0] for p in atoms], dtype=np.int64)   # named in cap refusals
    a_codes = _components(atoms, batch.rollout_codes[samples], pos)
    fit = fit_step(s, label, a_lens, a_costs, a_codes, cfg)
    D, K = cfg.dp_size, fit.micro_count
    members: list[list[int]] = [[] for _ in range(D * K)]
    for k, b in zip(fit.kept.tolist(), fit.bin_of.tolist()):
        members[b].extend(atoms[k].members)
    kept = np.sort(np.array([i for m in members for i in m], dtype=np.int64))
    trees = [micro_tree(parent, shared, lens, m) if m else None for m in members]
    U = np.array([t.num_tokens if t else 0 for t in trees], dtype=np.float64)
    D2 = np.array([t.depth_sq if t else 0 for t in trees], dtype=np.float64)
    grid = arrange(bin_costs(cost, cost.tree_costs(U, D2), U), D, K)  # type: ignore[union-attr,arg-type]
    coef = loss_coefficients(cfg.loss, batch.loss_tokens[kept], batch.prompt_codes[kept], batch.rollout_codes[kept])
    scale = np.zeros(batch.num_samples)
    scale[kept] = loss_scales(cfg.loss, coef, grad_world=cfg.grad_world, micro_count=K)
    micros = []
    for r in range(D):
        row = []
        for b in grid[r].tolist():
            idx = dfs_order(parent, shared, np.array(members[b], dtype=np.int64)) if members[b] else \
                np.zeros(0, dtype=np.int64)
            row.append(_micro(idx, batch, scale, r, trees[b]))
        micros.append(row)
    dropped = np.setdiff1d(samples, kept)
    why = (f"short_step='drop': trailing rollouts (whole prefix-tree components) dropped so step {s} aligns to "
           f"dp_size × align = {D} × {cfg.align} micro-batches")
    return Step(s, micros, kept, choice=fit.choice), dropped, why


def _micro(idx: np.ndarray, batch: Batch, scale: np.ndarray, rank: int, tree) -> Micro:
    cols = [idx, batch.seq_lens[idx], batch.loss_tokens[idx], scale[idx].astype(np.float64)]
    for c in cols:
        c.setflags(write=False)
    return Micro._trusted(*cols, 1, 0, (rank,), tree)
