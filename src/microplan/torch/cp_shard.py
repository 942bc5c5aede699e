"""One CP member's share of a packed row: ``PackedMicro.cp_shard(cp_rank) -> PackedMicro``.

Design note. Every member of a CP group packs the same micro-batch (flat or prefix tree), then
keeps its share. :func:`cp_shard` derives it on the host:

1. **rows**: the member's owned rows, the zigzag cut of every segment
   (:func:`microplan.cp_cut.zigzag_owner`), and nothing else. Their keys and values are what it
   contributes to the group's all-gather; the cut gives every member ⌈U/c⌉ or ⌊U/c⌋ of the U
   rows, so that is all a GPU computes (``footprint.gpu_tokens``). A member owning nothing (a
   placeholder, a row shorter than c) runs one dummy row (row 0, contributing nothing, scoring
   nothing), so every member runs the model and its collectives;
2. **targets**: the labels are shifted before the cut. The logits at row r predict the tokens
   that follow r on its paths — the next token of its sample, or, at the end of a tree segment,
   the first token of each child segment — so the member owning r scores them: every
   per-sample entry (sample i, position t ≥ 1) belongs to the owner of its predecessor's row,
   with that row as its logit row (``tree.flat_rows``), the token at t as its target
   (``cp.target_ids``) and its label-aligned weight; position 0 (no prediction, weight 0) to the
   owner of its own row. A branch node thus scores each child's first token from one row of
   logits, exactly as :func:`~microplan.torch.token_logprobs` gathers a tree row's logits
   through ``prev_index``, so no row is ever computed twice;
3. **pieces**: runs of local rows that are consecutive in one segment. Piece ``[a, b]`` of
   segment k attends, causally aligned bottom-right, to the path of k up to row b: its key
   rows, as slots of the gathered buffer (member m's i-th owned row sits at slot m·w + i, w the
   largest member's count), are ``tree.key_index`` — the table of a tree row, so the attention
   of ``register_attention()`` and flash-attn's varlen kernel run a shard as they run a tree;
4. **loss side**: the shard's loss is written in its per-sample layout: sample after sample,
   the entries it scores in position order (``cp.sample_positions``; ``pack_values`` packs
   per-sample values into it, ``token_logprobs`` returns it, ``weighted_loss`` weighs it with
   ``tree.sample_weights``). ``loss_weights`` is its row-level reduction: row r carries the
   summed weights of the entries its logits score (logit aligned).

Guarantees: over the c shards every row is owned once and every per-sample entry scored once,
from the logits of the same row as in the unsharded row, so the members' losses add up to the
row's ``Σ w·ℓ`` term by term, and each owned query sees exactly the keys it sees in the
unsharded row (tests/test_cp_attention.py checks both, and J and ∇J on gloo). A member runs at
most ⌈U/c⌉ rows. Host work O(U + Σ L + Σ key entries) per shard.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
import torch

from ..cp_cut import zigzag_owner
from ..errors import PlanError
from .row import PackedRow, predecessor_index
from .tree import TreeLayout

__all__ = ["CPLayout", "cp_shard"]

_Row = TypeVar("_Row", bound=PackedRow)   # a PackedMicro: the shard has the row's type


@dataclass(frozen=True, eq=False)
class CPLayout:
    """What a CP shard's attention and loss need beyond a tree row (``PackedMicro.cp``).

    Attributes:
        cp_rank, cp_size: this member and the group's size.
        rows: ``[T_local]`` int64 rows of the full row this shard computes (its owned rows, ascending;
            row 0 alone for a member owning nothing).
        own_index: ``[n_own]`` int64 local indices of the owned rows (their K/V go to the gather).
        counts: host tuple, owned rows per member; ``width`` = max(counts) rows per member slot.
        num_rows: U, the full row's length.
        sample_positions: per sample, ``[k_i]`` int64 positions (in the sample) of the entries this
            member scores (module note, 2).
        full_lens: per sample, its full length (what ``pack_values`` checks values against).
        target_ids: ``[S]`` int64 the token each per-sample entry scores (its label).
        predicted: ``[S]`` bool, False at a sample's position 0 (no prediction: log-prob 0).

    ``to(device)`` moves ``own_index``, ``target_ids`` and ``predicted`` (the attention and
    the loss read them); ``rows`` and ``sample_positions`` are host bookkeeping.
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
    target_ids: torch.Tensor
    predicted: torch.Tensor

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> CPLayout:
        mv = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, own_index=mv(self.own_index), target_ids=mv(self.target_ids),
                       predicted=mv(self.predicted))


def _row_structure(p: PackedRow) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(each segment's path rows, each sample's rows in position order) of a full row."""
    off = np.concatenate([[0], np.cumsum(p.seq_lens)]).astype(np.int64)
    if p.tree is not None:
        ki, cu = p.tree.key_index.cpu().numpy(), p.tree.cu_seqlens_k.cpu().numpy().astype(np.int64)
        paths = [ki[cu[k]:cu[k + 1]] for k in range(len(p.seq_lens))]
        samples = [r.cpu().numpy() for r in p.tree.sample_rows]
    else:
        paths = [np.arange(off[k], off[k + 1]) for k in range(len(p.seq_lens))]
        samples = [np.arange(off[j], off[j] + n) for j, n in enumerate(p.real_lens)] if not p.is_placeholder else []
    return paths, samples


def _sample_weights(p: PackedRow, samples: list[np.ndarray]) -> list[torch.Tensor]:
    """Each sample's label-aligned weights over its own tokens, in the full row (float64 when
    the plan's weights are, else the row's dtype)."""
    if p.tree is not None:
        return list(torch.split(p.tree.sample_weights.cpu(), [s.size for s in samples]))
    w = p.loss_weights.cpu()
    return [w[torch.from_numpy(s)] for s in samples]


def _gather_slots(owner: np.ndarray, c: int) -> tuple[np.ndarray, int, np.ndarray]:
    """(owned rows per member, the widest count w, each row's slot in the gathered buffer: member
    m's i-th owned row at m·w + i)."""
    counts = np.bincount(owner, minlength=c)
    width = int(counts.max())
    slot = np.zeros(owner.size, dtype=np.int64)
    for m in range(c):
        mine = np.flatnonzero(owner == m)
        slot[mine] = m * width + np.arange(mine.size)
    return counts, width, slot


def _pieces(rows: np.ndarray, seg_lens: tuple[int, ...], paths: list[np.ndarray],
            slot: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], list[int]]:
    """(piece starts, piece ends, key slots per piece, cu of the keys): runs of local rows
    consecutive in one segment, each attending to its segment's path up to its last row."""
    off = np.concatenate([[0], np.cumsum(seg_lens)]).astype(np.int64)
    seg = np.searchsorted(off, rows, side="right") - 1
    brk = np.flatnonzero((np.diff(rows) != 1) | (np.diff(seg) != 0)) + 1
    starts, ends = np.concatenate([[0], brk]), np.concatenate([brk, [rows.size]])
    keys, cu_k = [], [0]
    for a, b in zip(starts.tolist(), ends.tolist()):
        k, last = int(seg[a]), int(rows[b - 1])
        path = paths[k]
        keys.append(slot[path[: path.size - (int(off[k + 1]) - 1 - last)]])
        cu_k.append(cu_k[-1] + keys[-1].size)
    return starts, ends, keys, cu_k


def _targets(p: PackedRow, samples: list[np.ndarray], owner: np.ndarray, local: np.ndarray,
             cp_rank: int) -> tuple[list[torch.Tensor], ...]:
    """Per sample, the entries this member scores (module note, 2): (local logit rows, positions
    in the sample, weights, full-row rows of the target tokens)."""
    out: tuple[list[torch.Tensor], ...] = ([], [], [], [])
    for s, w in zip(samples, _sample_weights(p, samples)):
        logit = np.concatenate([s[:1], s[:-1]])  # the row whose logits score position t (t = 0: its own row)
        keep = np.flatnonzero(owner[logit] == cp_rank)
        k = torch.from_numpy(keep.astype(np.int64))
        for acc, v in zip(out, (torch.from_numpy(local[logit[keep]]), k, w[k], torch.from_numpy(s[keep]))):
            acc.append(v)
    return out


def cp_shard(p: _Row, cp_rank: int, cp_size: int | None = None) -> _Row:
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
    paths, samples = _row_structure(p)
    owned = np.flatnonzero(owner == cp_rank)
    rows = owned if owned.size else np.zeros(1, dtype=np.int64)  # owning nothing: one dummy row, no keys, no loss
    local = np.full(U, -1, dtype=np.int64)
    local[rows] = np.arange(rows.size)
    counts, width, slot = _gather_slots(owner, c)
    starts, ends, keys, cu_k = _pieces(rows, p.seq_lens, paths, slot)
    prev = predecessor_index(p, "cpu").numpy()[rows]
    prev_local = np.where(prev >= 0, local[np.maximum(prev, 0)], -1)  # the predecessor's local row, where held here
    s_rows, s_pos, s_w, s_tgt = _targets(p, samples, owner, local, cp_rank)
    wdt = p.loss_weights.dtype
    cat = lambda xs, dt: torch.cat(xs) if xs else torch.zeros(0, dtype=dt)  # noqa: E731
    flat, tgt, w64 = cat(s_rows, torch.int64), cat(s_tgt, torch.int64), cat(s_w, wdt).to(torch.float64)
    predicted = cat(s_pos, torch.int64) > 0
    tree = TreeLayout(
        prev_index=torch.from_numpy(prev_local), key_index=torch.from_numpy(np.concatenate(keys)),
        cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int32), max_seqlen_k=int(max(np.diff(cu_k))),
        sample_rows=tuple(s_rows), sample_weights=w64.to(wdt), flat_rows=flat,
        in_row_order=bool(flat.numel() == rows.size and torch.equal(flat, torch.arange(rows.size))))
    cp = CPLayout(cp_rank=cp_rank, cp_size=c, rows=torch.from_numpy(rows),
                  own_index=torch.arange(owned.size, dtype=torch.int64), counts=tuple(int(x) for x in counts),
                  width=width, num_rows=U, sample_positions=tuple(s_pos), full_lens=tuple(int(s.size) for s in samples),
                  target_ids=p.input_ids.cpu()[tgt], predicted=predicted)
    scores_loss = (p.loss_mask.cpu()[tgt] & predicted).to(torch.int64)  # rows whose logits score a loss token
    mask = torch.zeros(rows.size, dtype=torch.int64).index_add_(0, flat, scores_loss) > 0
    dev = p.input_ids.device
    take = lambda x: x.index_select(0, cp.rows.to(x.device))  # noqa: E731
    shard = replace(   # a PackedMicro (packing.py builds the row and calls this; row.py says why not by name)
        p, input_ids=take(p.input_ids), position_ids=take(p.position_ids),
        cu_seqlens=torch.from_numpy(np.concatenate([[0], ends]).astype(np.int32)),
        max_seqlen=int((ends - starts).max()),
        loss_weights=torch.zeros(rows.size, dtype=torch.float64).index_add_(0, flat, w64).to(wdt),
        loss_mask=mask, sample_indices=p.sample_indices, seq_lens=tuple(int(x) for x in ends - starts),
        is_placeholder=p.is_placeholder, cp_size=c, sample_lens=tuple(int(r.numel()) for r in s_rows),
        pad_to_multiple_of=p.pad_to_multiple_of, pad_row_to_multiple_of=p.pad_row_to_multiple_of, row_pad=0,
        tree=tree, cp=cp)
    return shard if dev.type == "cpu" else shard.to(dev)


def check_shard(p: PackedRow) -> None:
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
    if T != max(cp.own_index.numel(), 1) or not torch.equal(cp.own_index.cpu(), torch.arange(cp.own_index.numel())):
        raise PlanError(f"a CP shard computes its {cp.own_index.numel()} owned rows and nothing else (one dummy row "
                        f"when it owns none), got T={T}.")
    ki = p.tree.key_index
    if ki.numel() and (int(ki.min()) < 0 or int(ki.max()) >= cp.cp_size * cp.width):
        raise PlanError(f"key_index must address the {cp.cp_size}×{cp.width} gathered slots.")
    if len(cp.sample_positions) != len(p.tree.sample_rows) or any(
            a.numel() != b.numel() for a, b in zip(cp.sample_positions, p.tree.sample_rows)):
        raise PlanError("cp.sample_positions must hold one position per scored entry of each sample.")
    S = p.tree.sample_weights.numel()
    pos = torch.cat(cp.sample_positions) if cp.sample_positions else torch.zeros(0, dtype=torch.int64)
    if tuple(cp.target_ids.shape) != (S,) or not torch.equal(cp.predicted.cpu(), pos > 0):
        raise PlanError(f"cp.target_ids and cp.predicted must hold one entry per scored entry (S={S}), predicted "
                        "False exactly at a sample's position 0.")
    flat = p.tree.flat_rows.cpu()
    if bool((p.position_ids.cpu()[flat] != torch.clamp(pos - 1, min=0)).any()):
        raise PlanError("each scored entry's logit row must sit one position before it (its predecessor).")
    w = p.tree.sample_weights.cpu()
    if bool((w[~cp.predicted.cpu()] != 0).any()):
        raise PlanError("a sample's position 0 carries no loss (nothing predicts it).")
