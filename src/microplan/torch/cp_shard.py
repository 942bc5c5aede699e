"""One CP member's share of a packed row: ``PackedMicro.cp_shard(cp_rank) -> PackedMicro``.

Design note. Every member of a CP group packs the same micro-batch (flat or prefix tree), then
keeps its share. :func:`cp_shard` derives it on the host:

1. **owned rows**: the zigzag cut of every segment (:func:`microplan.cp_cut.zigzag_owner`);
   their keys and values are what this member contributes to the group's all-gather, and their
   loss is what it backwards;
2. **halo rows**: the predecessor of an owned token that another member owns — the last token
   of the previous chunk, or of the parent segment for a tree branch — is computed here too
   (one extra query token per chunk boundary, weight 0, keys and values not contributed), so
   :func:`~microplan.torch.token_logprobs` finds every owned token's logits locally and no
   logits cross members. A member owning nothing (a placeholder, a row shorter than c) runs one
   halo of row 0, so every member runs the model and its collectives;
3. **pieces**: runs of local rows that are consecutive in one segment. Piece ``[a, b]`` of
   segment k attends, causally aligned bottom-right, to the path of k up to row b: its key
   rows, as slots of the gathered buffer (member m's i-th owned row sits at slot m·w + i, w the
   largest member's count), are ``tree.key_index`` — the table of a tree row, so the attention
   of ``register_attention()`` and flash-attn's varlen kernel run a shard as they run a tree;
4. **loss side**: ``loss_weights`` are the full row's on owned rows, 0 on halos; the per-sample
   layout holds, sample after sample, the owned tokens of each sample in position order
   (``tree.sample_rows``/``sample_weights``, ``cp.sample_positions`` for ``pack_values``).

Guarantees: over the c shards every token of the row is owned once, so the members' losses add
up to the row's ``Σ w·ℓ`` term by term, and each owned query sees exactly the keys it sees in
the unsharded row (tests/test_cp_attention.py checks both, and J and ∇J on gloo). Host work
O(U + Σ key entries) per shard. Trade-off: halos cost ≤ 2 tokens per segment per member —
nothing on long rows, up to half the work on a row of 4-token samples at c = 4.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..cp_cut import zigzag_owner
from ..errors import PlanError
from .tree import TreeLayout

if TYPE_CHECKING:  # pragma: no cover
    from .packing import PackedMicro

__all__ = ["CPLayout", "cp_shard"]


@dataclass(frozen=True, eq=False)
class CPLayout:
    """What a CP shard's attention needs to gather keys and values (``PackedMicro.cp``).

    Attributes:
        cp_rank, cp_size: this member and the group's size.
        rows: ``[T_local]`` int64 rows of the full row this shard computes (owned and halo, ascending).
        own_index: ``[n_own]`` int64 local indices of the owned rows (their K/V go to the gather).
        counts: host tuple, owned rows per member; ``width`` = max(counts) rows per member slot.
        num_rows: U, the full row's length.
        sample_positions: per sample, ``[k_i]`` int64 positions (in the sample) of its owned tokens.
        full_lens: per sample, its full length (what ``pack_values`` checks values against).

    ``to(device)`` moves ``own_index`` (the attention reads it); ``rows`` and
    ``sample_positions`` are host bookkeeping and stay on the host.
    """

    cp_rank: int
    cp_size: int
    rows: torch.Tensor
    own_index: torch.Tensor
    counts: tuple[int, ...]
    width: int
    num_rows: int
    sample_positions: tuple[torch.Tensor, ...]
    full_lens: tuple[int, ...]

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> CPLayout:
        return replace(self, own_index=self.own_index.to(device, non_blocking=non_blocking))


def _row_structure(p: PackedMicro) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """(predecessor row of every token, each segment's path rows, each sample's rows) of a full row."""
    from .loss import predecessor_index
    prev = predecessor_index(p, "cpu").numpy()
    off = np.concatenate([[0], np.cumsum(p.seq_lens)]).astype(np.int64)
    if p.tree is not None:
        ki, cu = p.tree.key_index.cpu().numpy(), p.tree.cu_seqlens_k.cpu().numpy().astype(np.int64)
        paths = [ki[cu[k]:cu[k + 1]] for k in range(len(p.seq_lens))]
        samples = [r.cpu().numpy() for r in p.tree.sample_rows]
    else:
        paths = [np.arange(off[k], off[k + 1]) for k in range(len(p.seq_lens))]
        samples = [np.arange(off[j], off[j] + n) for j, n in enumerate(p.real_lens)] if not p.is_placeholder else []
    return prev, paths, samples


def _sample_weights(p: PackedMicro, samples: list[np.ndarray]) -> list[torch.Tensor]:
    """Each sample's label-aligned weights over its own tokens, in the full row."""
    if p.tree is not None:
        return list(torch.split(p.tree.sample_weights.cpu(), [s.size for s in samples]))
    w = p.loss_weights.cpu()
    return [w[torch.from_numpy(s)] for s in samples]


def cp_shard(p: PackedMicro, cp_rank: int, cp_size: int | None = None) -> PackedMicro:
    """This member's share of the packed row ``p`` (see the module note); ``p`` itself when c = 1."""
    c = p.cp_size if cp_size is None else cp_size
    if p.cp is not None:
        raise PlanError("this PackedMicro is already a CP shard; call cp_shard on the full row from pack_micro.")
    if not isinstance(c, int) or isinstance(c, bool) or c < 1:
        raise PlanError(f"cp_size={c!r} must be an int >= 1 (the members of the CP group).")
    if not isinstance(cp_rank, int) or isinstance(cp_rank, bool) or not 0 <= cp_rank < c:
        raise PlanError(f"cp_rank={cp_rank!r} must be an int in 0..{c - 1} for a CP group of {c}; pass "
                        "micro.cp_rank (dynamic CP) or this process's position in its CP group (fixed CP).")
    if c == 1:
        return p
    U = p.num_tokens
    owner = zigzag_owner(np.asarray(p.seq_lens, dtype=np.int64), c)
    prev, paths, samples = _row_structure(p)
    owned = np.flatnonzero(owner == cp_rank)
    pr = prev[owned]
    halo = pr[(pr >= 0) & (owner[np.maximum(pr, 0)] != cp_rank)]
    rows = np.union1d(owned, halo) if owned.size else np.zeros(1, dtype=np.int64)
    is_own = owner[rows] == cp_rank
    local = np.full(U, -1, dtype=np.int64)
    local[rows] = np.arange(rows.size)
    counts = np.bincount(owner, minlength=c)
    width = int(counts.max())
    slot = np.zeros(U, dtype=np.int64)  # the gather buffer: member m's i-th owned row at m·width + i
    for m in range(c):
        mine = np.flatnonzero(owner == m)
        slot[mine] = m * width + np.arange(mine.size)
    # pieces: runs of local rows consecutive in one segment; keys = the segment's path up to the piece's end
    off = np.concatenate([[0], np.cumsum(p.seq_lens)]).astype(np.int64)
    seg = np.searchsorted(off, rows, side="right") - 1
    brk = np.flatnonzero((np.diff(rows) != 1) | (np.diff(seg) != 0)) + 1
    starts, ends = np.concatenate([[0], brk]), np.concatenate([brk, [rows.size]])
    keys, cu_k = [], [0]
    for a, b in zip(starts.tolist(), ends.tolist()):
        k, last = int(seg[a]), int(rows[b - 1])
        path = paths[k]
        keys.append(slot[path[: path.size - (int(off[k + 1]) - 1 - last)]])
        cu_k.append(cu_k[-1] + keys[-1].size)
    prev_local = np.where(is_own & (prev[rows] >= 0), local[np.maximum(prev[rows], 0)], -1)
    t_rows = torch.from_numpy(rows)
    own_t = torch.from_numpy(is_own)
    s_rows, s_pos, s_w = [], [], []
    for s, w in zip(samples, _sample_weights(p, samples)):
        keep = np.flatnonzero(owner[s] == cp_rank)
        s_rows.append(torch.from_numpy(local[s[keep]]))
        s_pos.append(torch.from_numpy(keep.astype(np.int64)))
        s_w.append(w[torch.from_numpy(keep)])
    flat = torch.cat(s_rows) if s_rows else torch.zeros(0, dtype=torch.int64)
    wdt = p.loss_weights.dtype
    tree = TreeLayout(
        prev_index=torch.from_numpy(prev_local), key_index=torch.from_numpy(np.concatenate(keys)),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32), max_seqlen_k=int(max(np.diff(cu_k))),
        sample_rows=tuple(s_rows), sample_weights=torch.cat(s_w).to(wdt) if s_w else torch.zeros(0, dtype=wdt),
        flat_rows=flat, in_row_order=bool(flat.numel() == rows.size and torch.equal(flat, torch.arange(rows.size))))
    full_lens = tuple(int(s.size) for s in samples)
    cp = CPLayout(cp_rank=cp_rank, cp_size=c, rows=t_rows, own_index=torch.from_numpy(np.flatnonzero(is_own)),
                  counts=tuple(int(x) for x in counts), width=width, num_rows=U, sample_positions=tuple(s_pos),
                  full_lens=full_lens)
    dev = p.input_ids.device
    take = lambda x: x.index_select(0, t_rows.to(x.device))  # noqa: E731
    from .packing import PackedMicro
    shard = PackedMicro(
        input_ids=take(p.input_ids), position_ids=take(p.position_ids),
        cu_seqlens=torch.from_numpy(np.concatenate([[0], ends]).astype(np.int32)),
        max_seqlen=int((ends - starts).max()),
        loss_weights=take(p.loss_weights) * own_t.to(p.loss_weights.device, wdt),
        loss_mask=take(p.loss_mask) & own_t.to(p.loss_mask.device), sample_indices=p.sample_indices,
        seq_lens=tuple(int(x) for x in ends - starts), is_placeholder=p.is_placeholder, cp_size=c,
        sample_lens=tuple(int(r.numel()) for r in s_rows), pad_to_multiple_of=p.pad_to_multiple_of,
        pad_row_to_multiple_of=p.pad_row_to_multiple_of, tree=tree, cp=cp)
    return shard if dev.type == "cpu" else shard.to(dev)


def check_shard(p: PackedMicro) -> None:
    """What a shard promises beyond a tree row's checks; PlanError naming the first violation."""
    cp = p.cp
    rows = cp.rows.cpu()
    T = p.num_tokens
    if tuple(rows.shape) != (T,) or bool((rows[1:] <= rows[:-1]).any()) or int(rows.min()) < 0 \
            or int(rows.max()) >= cp.num_rows:
        raise PlanError(f"cp.rows must be T={T} ascending rows of the full row of {cp.num_rows}.")
    if len(cp.counts) != cp.cp_size or sum(cp.counts) != cp.num_rows or cp.width != max(cp.counts) \
            or cp.own_index.numel() != cp.counts[cp.cp_rank]:
        raise PlanError(f"cp.counts={cp.counts} must give each of the {cp.cp_size} members' owned rows, summing to "
                        f"{cp.num_rows}, this member's matching own_index ({cp.own_index.numel()}).")
    ki = p.tree.key_index
    if ki.numel() and (int(ki.min()) < 0 or int(ki.max()) >= cp.cp_size * cp.width):
        raise PlanError(f"key_index must address the {cp.cp_size}×{cp.width} gathered slots.")
    if len(cp.sample_positions) != len(p.tree.sample_rows) or any(
            a.numel() != b.numel() for a, b in zip(cp.sample_positions, p.tree.sample_rows)):
        raise PlanError("cp.sample_positions must hold one position per owned token of each sample.")
