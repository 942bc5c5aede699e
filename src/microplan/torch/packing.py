"""Pack one planned micro-batch into varlen tensors: ``pack_micro(micro, token_ids) -> PackedMicro``.

Design note. A micro-batch is packed as ONE row of T tokens (no padding): the samples of
``micro.indices`` concatenated in execution order, ``position_ids`` restarting at 0 per sample,
``cu_seqlens`` (int32, n+1 boundaries) and ``max_seqlen`` (a host int) for flash-attn /
``torch.nn.attention.varlen`` / Hugging Face packed attention. Everything is built on the host
(no device sync); move it with :meth:`PackedMicro.to`.

Loss weights are *label aligned*: ``loss_weights[t]`` weighs the loss of predicting token t, whose
logits sit at position t-1 of the same sample. A sample's first token is never predicted, so a
loss mask that marks it is refused (PlanError); hence every position whose prediction would
cross a sample boundary carries weight 0. ``loss_weights`` holds the sample's ``loss_scale`` on
its loss tokens and 0 elsewhere, so Σ_t loss_weights[t]·ℓ[t] is exactly the per-micro loss the
exactness contract of DESIGN.md asks for.

A placeholder micro-batch (``micro.is_placeholder``) packs to one dummy token (``pad_token_id``)
with weight 0, ``cu_seqlens=[0, 1]`` and an empty ``sample_indices``: a valid model input with
every field a real one has, so a rank runs forward/backward like its peers and contributes an
exact zero (the slime seed #1860: empty micro-batches crashed ``torch.cat`` deep downstream).

Padding (the plan's ``pad_to_multiple_of=m`` / ``pad_row_to_multiple_of=r``, docs/layouts.md).
Each sample is padded INSIDE its own sequence, at its end, to ⌈L/m⌉·m tokens: ``cu_seqlens``
holds the padded boundaries, so every sequence length is a multiple of m — what zigzag ring
attention (2·cp chunks per sequence) and Transformer Engine's THD format expect — and the
causal mask keeps every real token from seeing its own padding. The row's own padding, up to a
multiple of r (sequence-parallel TP), is a separate trailing pseudo-sequence with its own
``cu_seqlens`` entry, so no sample attends to it (flash-attn varlen accepts any extra sequence;
with zigzag CP choose r a multiple of m so it splits evenly too). Pad tokens are
``pad_token_id``, positions continue inside a sample and restart in the pseudo-sequence, and
their weight is 0. ``sample_lens`` keeps the real lengths (``split``/``pack_values`` use them).
A micro-batch of a padded layout (``layout="padded"``/``"padded-2d"``) packs to a
:class:`~microplan.torch.padded.PaddedMicro` instead (``[n, W]`` tensors).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ..errors import PlanError
from ..footprint import round_up
from ..types import Micro
from .cp_shard import CPLayout, check_shard, cp_shard
from .padded import PaddedMicro, pack_padded_micro, pack_padded_values
from .sample_inputs import _entry, _mask_tensor, _token_tensor, _value_tensor
from .tree import TreeLayout, check_tree, tree_layout

__all__ = ["PackedMicro", "pack_micro", "pack_values"]


@dataclass(frozen=True, eq=False)
class PackedMicro:
    """One micro-batch as a single packed row (binding API: see DESIGN.md).

    Attributes:
        input_ids: ``[T]`` int64 tokens of the samples, concatenated in execution order.
        position_ids: ``[T]`` int64, restarting at 0 at every sample start.
        cu_seqlens: ``[n+1]`` int32 cumulative sample lengths, ``0 .. T`` (a placeholder has the
            one dummy sequence: ``[0, 1]``).
        max_seqlen: longest packed sequence, a Python int (flash-attn wants it on the host).
        loss_weights: ``[T]`` float; the sample's ``loss_scale`` on its loss tokens, 0 elsewhere.
            Label aligned: weight t applies to the loss of predicting token t (logits at t-1).
        loss_mask: ``[T]`` bool, the loss tokens (True even where a loss_scale is 0).
        sample_indices: ``[n]`` int64 global sample indices (empty for a placeholder); bookkeeping
            on the host (``to`` leaves it there, so reading it never syncs a device).
        seq_lens: host tuple of the packed sequence lengths (``(1,)`` for a placeholder).
        is_placeholder: True for the 1-token dummy of a placeholder micro-batch.
        cp_size: the micro-batch's context-parallel degree (the plan's ``Micro.cp_size``).
        sample_lens: host tuple of the samples' real lengths (``()``: equal to ``seq_lens``, no
            padding); sequence j holds ``sample_lens[j]`` real tokens then its padding.
        row_pad: tokens of the trailing pad pseudo-sequence (0: none); when > 0 it is the last
            entry of ``seq_lens``/``cu_seqlens`` and belongs to no sample.
        pad_to_multiple_of / pad_row_to_multiple_of: the rules the padding follows (checked by
            :meth:`validate`).
        tree: for a prefix-shared micro-batch (``PlanConfig(share_prefixes=True)``), the
            :class:`~microplan.torch.tree.TreeLayout`: then the row holds every shared token once,
            ``seq_lens``/``cu_seqlens`` are its *segments* (not samples), ``position_ids`` are
            each token's position in its own samples, and attention must come from
            :func:`microplan.torch.register_attention` (``model_inputs`` passes the path table).
        cp: for one member's share of a row (:meth:`cp_shard`), the
            :class:`~microplan.torch.cp_shard.CPLayout`: its tokens are that member's owned rows,
            ``tree`` holds its attention table over the CP group's gathered keys and its
            per-sample layout (the entries its logits score: each owned row predicts the tokens
            that follow it); run the model inside :func:`microplan.torch.context_parallel`.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    loss_weights: torch.Tensor
    loss_mask: torch.Tensor
    sample_indices: torch.Tensor
    seq_lens: tuple[int, ...]
    is_placeholder: bool = False
    cp_size: int = 1
    sample_lens: tuple[int, ...] = ()
    row_pad: int = 0
    pad_to_multiple_of: int = 1
    pad_row_to_multiple_of: int = 1
    tree: TreeLayout | None = None
    cp: CPLayout | None = None

    @property
    def num_tokens(self) -> int:
        """T, the packed length, padding included (1 for an unpadded placeholder)."""
        return int(sum(self.seq_lens))

    @property
    def num_samples(self) -> int:
        """Real samples packed (0 for a placeholder)."""
        if self.tree is not None:
            return int(self.sample_indices.numel())
        return 0 if self.is_placeholder else len(self.seq_lens) - (1 if self.row_pad else 0)

    @property
    def token_shape(self) -> tuple[int]:
        """``(T,)``: the shape of every per-token tensor of this micro-batch."""
        return (self.num_tokens,)

    def predicted(self) -> torch.Tensor:
        """``[T]`` bool: token t is predicted from position t−1 of the same sequence (not a start)."""
        return self.position_ids != 0

    @property
    def real_lens(self) -> tuple[int, ...]:
        """Real tokens of each sample (``sample_lens``, or ``seq_lens`` when nothing is padded)."""
        return self.sample_lens or tuple(self.seq_lens[: self.num_samples])

    @property
    def cu_seqlens_unpadded(self) -> torch.Tensor:
        """int32 ``[len(seq_lens)+1]`` boundaries of the real tokens of each sequence (Transformer
        Engine's ``cu_seqlens_q`` beside ``cu_seqlens_q_padded`` = :attr:`cu_seqlens`; the pad
        pseudo-sequence counts 0 real tokens)."""
        real = list(self.real_lens) + [0] * (len(self.seq_lens) - len(self.real_lens))
        return torch.from_numpy(np.concatenate([[0], np.cumsum(real)]).astype(np.int32))

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> PackedMicro:
        """A copy with every model/loss tensor on ``device`` (dtypes kept; ``sample_indices`` and the
        other host fields stay on the host)."""
        mv = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, input_ids=mv(self.input_ids), position_ids=mv(self.position_ids),
                       cu_seqlens=mv(self.cu_seqlens), loss_weights=mv(self.loss_weights),
                       loss_mask=mv(self.loss_mask),
                       tree=None if self.tree is None else self.tree.to(device, non_blocking=non_blocking),
                       cp=None if self.cp is None else self.cp.to(device, non_blocking=non_blocking))

    def cp_shard(self, cp_rank: int, *, cp_size: int | None = None) -> PackedMicro:
        """This CP member's share of the row (binding API): its zigzag share of every segment's
        tokens (flat or tree row) and nothing else — at most ⌈T/c⌉ rows — with
        ``model_inputs()``, true positions, and the per-sample layout of the tokens its rows'
        logits predict (each owned row scores its successors; a branch node each child's first
        token) for ``token_logprobs`` / :func:`pack_values` / ``weighted_loss``.
        Run the model on it inside ``with microplan.torch.context_parallel(group):``, ``group``
        the CP group (this member at position ``cp_rank``). ``cp_size`` defaults to the plan's
        ``Micro.cp_size``; 1 returns the row itself. Every member gets the same split (a pure
        function of the row): see ``torch/cp_shard.py`` and docs/context_parallel.md.
        """
        return cp_shard(self, cp_rank, cp_size)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """``{"input_ids": [1, T], "position_ids": [1, T]}`` for a Hugging Face causal LM.

        Call ``model(**packed.model_inputs(), attention_mask=None, use_cache=False)``: transformers
        5.x then applies block-diagonal causal attention from the restarting position ids.

        A prefix-shared micro-batch (``tree``) also passes its attention table —
        ``cu_seq_lens_q`` (its segments), ``cu_seq_lens_k`` / ``max_length_k`` (each segment's
        path) and ``microplan_key_index`` (the path rows) — which only the attention of
        :func:`microplan.torch.register_attention` reads: build the model with it. A CP shard
        (:meth:`cp_shard`) adds ``microplan_cp``, its gather layout, and must run inside
        :func:`microplan.torch.context_parallel`.
        """
        out = {"input_ids": self.input_ids[None], "position_ids": self.position_ids[None]}
        if self.tree is not None:
            out.update(cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.tree.cu_seqlens_k,
                       max_length_q=self.max_seqlen, max_length_k=self.tree.max_seqlen_k,
                       microplan_key_index=self.tree.key_index)
        if self.cp is not None:  # a CP shard: the attention gathers the group's keys (context_parallel)
            out["microplan_cp"] = self.cp
        return out

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """A ``[T, ...]`` row tensor in the per-sample layout the loss is written in: itself for a
        flat row; for a prefix-shared row ``[Σ L, ...]``, every member's tokens in full (a shared
        token repeated for each sample that holds it), member after member — the layout of
        :func:`pack_values` and of ``tree.sample_weights``. A CP shard's loss side is already in
        its per-sample layout ``[S, ...]`` (``token_logprobs`` returns it): returned as is; a
        per-row tensor of a shard's logits (e.g. entropy) maps to it with
        ``x.index_select(0, p.tree.flat_rows)``, the row whose logits score each entry."""
        if self.tree is None:
            return x
        if self.cp is not None:
            S = self.tree.sample_weights.numel()
            y = x[0] if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == S else x
            if y.dim() == 0 or y.shape[0] != S:
                raise PlanError(f"a CP shard's loss side is its per-sample layout [S, ...] with S={S} (what "
                                f"token_logprobs and pack_values return), got shape {tuple(x.shape)}; map a per-row "
                                "tensor of the shard's logits with x.index_select(0, p.tree.flat_rows).")
            return y
        T = self.num_tokens
        y = x[0] if x.dim() >= 2 and x.shape[0] == 1 and x.shape[1] == T else x
        if y.dim() == 0 or y.shape[0] != T:
            raise PlanError(f"expand needs a [T, ...] tensor with T={T}, got shape {tuple(x.shape)}.")
        return y.index_select(0, self.tree.flat_rows.to(y.device))

    def split(self, packed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split a ``[T, ...]`` (or ``[1, T, ...]``) tensor into per-sample views of each sample's REAL
        tokens (padding left out; none for a placeholder). A CP shard splits its per-sample layout
        ``[S, ...]`` into each sample's scored entries (:meth:`expand`)."""
        if self.cp is not None:
            y = self.expand(packed)
            return tuple(torch.split(y, list(self.sample_lens))) if self.sample_lens else ()
        T = self.num_tokens
        x = packed[0] if packed.dim() >= 2 and packed.shape[0] == 1 and packed.shape[1] == T else packed
        if x.dim() == 0 or x.shape[0] != T:
            raise PlanError(f"cannot split a tensor of shape {tuple(packed.shape)} by this micro-batch: its "
                            f"token dimension must be T={T} ([T, ...] or [1, T, ...]).")
        if self.is_placeholder:
            return ()
        if self.tree is not None:  # each member's whole sequence, shared tokens included
            return tuple(x.index_select(0, r.to(x.device)) for r in self.tree.sample_rows)
        starts = np.concatenate([[0], np.cumsum(self.seq_lens)])
        return tuple(x[int(a):int(a) + n] for a, n in zip(starts.tolist(), self.real_lens))

    def validate(self) -> None:
        """Check what varlen kernels silently trust; raise PlanError naming the first violation.

        cu_seqlens: 1-D int32 of length n+1, starts at 0, strictly increasing, ends at T, and
        agrees with ``seq_lens``; ``max_seqlen`` covers the longest sequence; every [T] field has
        length T; position_ids restart at 0 at each boundary; loss weights are finite and 0
        outside ``loss_mask`` and at sample starts. Padding (see the module note): each sample's
        sequence is its real tokens then the fewest pads to a multiple of ``pad_to_multiple_of``,
        the row is a multiple of ``pad_row_to_multiple_of`` with the fewest pads in one trailing
        pseudo-sequence, and no pad carries loss. Syncs if the tensors live on a device.
        """
        T = self.num_tokens
        cu = self.cu_seqlens
        if self.tree is not None:
            self._validate_tree()
            if self.cp is not None:
                check_shard(self)
            return
        if cu.dim() != 1 or cu.dtype != torch.int32:
            raise PlanError(f"cu_seqlens must be a 1-D int32 tensor, got shape {tuple(cu.shape)} dtype {cu.dtype}.")
        c = cu.cpu().to(torch.int64)
        if c.numel() != len(self.seq_lens) + 1 or c.numel() < 2:
            raise PlanError(f"cu_seqlens has {c.numel()} entries; it needs n+1 = {len(self.seq_lens) + 1} "
                            "(one boundary per sequence plus the leading 0).")
        if int(c[0]) != 0 or int(c[-1]) != T or bool((c[1:] <= c[:-1]).any()):
            raise PlanError(f"cu_seqlens={c.tolist()} must start at 0, strictly increase and end at T={T}.")
        if c.diff().tolist() != list(self.seq_lens):
            raise PlanError(f"cu_seqlens={c.tolist()} disagrees with seq_lens={list(self.seq_lens)}.")
        if not isinstance(self.max_seqlen, int) or self.max_seqlen < max(self.seq_lens):
            raise PlanError(f"max_seqlen={self.max_seqlen!r} must be a Python int >= the longest sequence "
                            f"({max(self.seq_lens)}); varlen kernels read past it otherwise.")
        for name in ("input_ids", "position_ids", "loss_weights", "loss_mask"):
            t = getattr(self, name)
            if tuple(t.shape) != (T,):
                raise PlanError(f"{name} has shape {tuple(t.shape)}; it must be [T] = [{T}].")
        pos = self.position_ids.cpu()
        want = torch.arange(T) - torch.repeat_interleave(c[:-1], torch.tensor(self.seq_lens))
        if not torch.equal(pos, want):
            raise PlanError("position_ids must restart at 0 at every cu_seqlens boundary and count up by 1.")
        w, m = self.loss_weights.cpu(), self.loss_mask.cpu()
        if not bool(torch.isfinite(w).all()) or bool((w[~m] != 0).any()) or bool((m[c[:-1]]).any()):
            raise PlanError("loss_weights must be finite and 0 outside loss_mask, and no sample's first token "
                            "may carry loss (its prediction would come from the previous sample).")
        if self.sample_indices.numel() != self.num_samples:
            raise PlanError(f"sample_indices has {self.sample_indices.numel()} entries for {self.num_samples} samples.")
        self._validate_padding(m)

    def _validate_tree(self) -> None:
        T = self.num_tokens
        c = self.cu_seqlens.cpu().to(torch.int64)
        if self.cu_seqlens.dtype != torch.int32 or c.numel() != len(self.seq_lens) + 1 or int(c[0]) != 0 \
                or c.diff().tolist() != list(self.seq_lens):
            raise PlanError(f"cu_seqlens={c.tolist()} must be the int32 boundaries of the segments {list(self.seq_lens)}.")
        for name in ("input_ids", "position_ids", "loss_weights", "loss_mask"):
            if tuple(getattr(self, name).shape) != (T,):
                raise PlanError(f"{name} has shape {tuple(getattr(self, name).shape)}; it must be [T] = [{T}].")
        pos = self.position_ids.cpu()
        lens = torch.tensor(self.seq_lens)
        first = torch.repeat_interleave(c[:-1], lens)
        if not torch.equal(pos, pos[first] + (torch.arange(T) - first)):
            raise PlanError("position_ids must count up by 1 within each segment.")
        segs = self.seq_lens[:-1] if self.row_pad else self.seq_lens
        mult, r = self.pad_to_multiple_of, self.pad_row_to_multiple_of
        if self.cp is None and (any(n % mult for n in segs) or T % r or self.row_pad >= r
                                or (self.row_pad and self.row_pad != self.seq_lens[-1])):
            raise PlanError(f"a tree row's segments {list(self.seq_lens)} must each be a multiple of "
                            f"pad_to_multiple_of={mult}, and the row (T={T}) a multiple of pad_row_to_multiple_of={r} "
                            f"with its fewest pads in one trailing segment (row_pad={self.row_pad}).")
        check_tree(self)

    def _validate_padding(self, loss_mask: torch.Tensor) -> None:
        """The padding convention of the module note (a no-op without padding)."""
        mult, r, n = self.pad_to_multiple_of, self.pad_row_to_multiple_of, self.num_samples
        if self.sample_lens and len(self.sample_lens) != n:
            raise PlanError(f"sample_lens has {len(self.sample_lens)} entries for {n} samples.")
        seqs = list(self.seq_lens)
        for j, (real, held) in enumerate(zip(self.real_lens, seqs)):
            if not 1 <= real <= held or held != round_up(real, mult):
                raise PlanError(f"sequence {j} holds {held} tokens for a sample of {real}: it must be padded to the "
                                f"next multiple of pad_to_multiple_of={mult} ({round_up(real, mult)}).")
        if self.is_placeholder:
            if seqs[0] != round_up(round_up(1, mult), r):
                raise PlanError(f"a placeholder holds one dummy token padded to {round_up(round_up(1, mult), r)}, "
                                f"got {seqs[0]}.")
            return
        if self.row_pad != (seqs[-1] if len(seqs) > n else 0) or len(seqs) > n + 1:
            raise PlanError(f"row_pad={self.row_pad} must be the length of the one trailing pad sequence "
                            f"(seq_lens={seqs}, {n} samples).")
        body = sum(seqs[:n])
        if self.num_tokens != round_up(body, r):
            raise PlanError(f"the row holds {self.num_tokens} tokens; padding {body} to a multiple of "
                            f"pad_row_to_multiple_of={r} needs exactly {round_up(body, r)}.")
        real = torch.zeros(self.num_tokens, dtype=torch.bool)
        starts = np.concatenate([[0], np.cumsum(seqs)])
        for a, k in zip(starts.tolist(), self.real_lens):
            real[a:a + k] = True
        if bool((loss_mask & ~real).any()):
            raise PlanError("a pad token carries loss: loss_mask must be False on padding.")


def _placeholder(micro: Micro, pad_token_id: int, weight_dtype: torch.dtype, mult: int = 1,
                 row: int = 1) -> PackedMicro:
    P = int(round_up(round_up(1, mult), row))  # one dummy token, padded like a sample and a row
    return PackedMicro(
        input_ids=torch.full((P,), int(pad_token_id), dtype=torch.int64),
        position_ids=torch.arange(P, dtype=torch.int64),
        cu_seqlens=torch.tensor([0, P], dtype=torch.int32), max_seqlen=P,
        loss_weights=torch.zeros(P, dtype=weight_dtype), loss_mask=torch.zeros(P, dtype=torch.bool),
        sample_indices=torch.zeros(0, dtype=torch.int64), seq_lens=(P,), is_placeholder=True,
        cp_size=int(micro.cp_size), pad_to_multiple_of=mult, pad_row_to_multiple_of=row)


def pack_micro(micro: Micro, token_ids: Sequence[Any] | Mapping[int, Any], *,
               loss_masks: Sequence[Any] | Mapping[int, Any] | None = None, pad_token_id: int = 0,
               weight_dtype: torch.dtype = torch.float64) -> PackedMicro | PaddedMicro:
    """Pack ``micro``'s samples into one varlen row (binding API; see the module note) — or, for a
    plan of ``layout="padded"`` / ``"padded-2d"``, into a :class:`PaddedMicro` (``[n, W]`` rows).

    Args:
        micro: a :class:`microplan.Micro` from ``plan.steps[s].micros[rank][m]``.
        token_ids: ``token_ids[i]`` is the 1-D integer token tensor (or list/array) of GLOBAL
            sample i; a list over the whole batch or a dict keyed by global index. Its length must
            equal ``micro.seq_lens`` for that sample.
        loss_masks: optional, same indexing; ``loss_masks[i]`` is sample i's 0/1 mask over its
            tokens, summing to ``loss_tokens[i]``. Default: the last ``loss_tokens[i]`` positions.
        pad_token_id: the dummy token of a placeholder.
        weight_dtype: dtype of ``loss_weights``. float64 (default) keeps the plan's scales bit for
            bit; multiplying float32/bf16 losses by it promotes only the [T] loss vector.

    Raises:
        PlanError: a missing sample, a length that disagrees with the plan, non-integer tokens,
            a mask that is not 0/1, does not sum to ``loss_tokens`` or marks a sample's first token.
    """
    if not isinstance(micro, Micro):
        raise PlanError("pack_micro takes a microplan.Micro (plan.steps[s].micros[rank][m]), "
                        f"got {type(micro).__name__}.")
    fp = micro.footprint
    if micro.tree is not None and not micro.is_placeholder:
        mult, row = (1, 1) if fp is None else (fp.padding.sample_multiple, fp.padding.row_multiple)
        return _pack_tree(micro, token_ids, loss_masks, weight_dtype, mult=mult, row=row, pad_token_id=pad_token_id)
    if fp is not None and fp.padded:
        return pack_padded_micro(micro, token_ids, loss_masks=loss_masks, pad_token_id=pad_token_id,
                                 weight_dtype=weight_dtype)
    mult, row = (1, 1) if fp is None else (fp.padding.sample_multiple, fp.padding.row_multiple)
    if micro.is_placeholder:
        return _placeholder(micro, pad_token_id, weight_dtype, mult, row)
    ids, masks, weights, pos, lens, real = [], [], [], [], [], []

    def pad(k: int) -> None:  # k pad tokens: no loss
        ids.append(torch.full((k,), int(pad_token_id), dtype=torch.int64))
        masks.append(torch.zeros(k, dtype=torch.bool))
        weights.append(torch.zeros(k, dtype=torch.float64))

    for i, n, k, scale in zip(micro.indices.tolist(), micro.seq_lens.tolist(), micro.loss_tokens.tolist(),
                              micro.loss_scale.tolist()):
        ids.append(_token_tensor(_entry(token_ids, i, "token_ids"), i, n))
        m = _mask_tensor(loss_masks, i, n, k)
        masks.append(m)
        weights.append(m.to(torch.float64) * scale)
        held = int(round_up(n, mult))
        if held > n:  # inside the sample's own sequence, after its tokens
            pad(held - n)
        pos.append(torch.arange(held, dtype=torch.int64))
        lens.append(held)
        real.append(n)
    row_pad = int(round_up(sum(lens), row)) - sum(lens)
    if row_pad:  # a trailing pseudo-sequence of its own
        pad(row_pad)
        pos.append(torch.arange(row_pad, dtype=torch.int64))
        lens.append(row_pad)
    cu = np.concatenate([[0], np.cumsum(lens)])
    packed = PackedMicro(
        input_ids=torch.cat(ids), position_ids=torch.cat(pos),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)), max_seqlen=int(max(lens)),
        loss_weights=torch.cat(weights).to(weight_dtype), loss_mask=torch.cat(masks),
        sample_indices=torch.from_numpy(micro.indices.astype(np.int64)), seq_lens=tuple(lens),
        cp_size=int(micro.cp_size), sample_lens=tuple(real), row_pad=row_pad, pad_to_multiple_of=mult,
        pad_row_to_multiple_of=row)
    packed.validate()
    return packed


def _pack_tree(micro: Micro, token_ids: Any, loss_masks: Any, weight_dtype: torch.dtype, *, mult: int = 1,
               row: int = 1, pad_token_id: int = 0) -> PackedMicro:
    """A prefix-shared micro-batch: every shared token once, segments padded to ``mult`` (``tree.py``)."""
    tokens, masks = [], []
    for i, n, k in zip(micro.indices.tolist(), micro.seq_lens.tolist(), micro.loss_tokens.tolist()):
        tokens.append(_token_tensor(_entry(token_ids, i, "token_ids"), i, n))
        masks.append(_mask_tensor(loss_masks, i, n, k))
    packed = PackedMicro(**tree_layout(micro, masks, tokens, weight_dtype, mult=mult, row=row,
                                       pad_token_id=pad_token_id), cp_size=int(micro.cp_size))
    packed.validate()
    return packed


def pack_values(packed: PackedMicro, values: Sequence[Any] | Mapping[int, Any], *, fill: float = 0.0,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """Pack per-sample values into the micro-batch's ``[T]`` layout (old log-probs, advantages...).

    ``values[i]`` (indexed by GLOBAL sample index) is either a 1-D tensor of sample i's length
    (token aligned like ``input_ids``) or a scalar broadcast over its tokens. Padding (and a
    placeholder's dummy tokens) get ``fill``. The result is on the host; move it with
    ``.to(device)``. A :class:`~microplan.torch.padded.PaddedMicro` gives ``[n, W]``; a
    prefix-shared micro-batch the per-sample layout ``[Σ L]`` of :meth:`PackedMicro.expand`; a CP
    shard (:meth:`PackedMicro.cp_shard`) its per-sample layout: each sample's entries it scores.
    """
    if not isinstance(packed, PackedMicro):
        if isinstance(packed, PaddedMicro):
            return pack_padded_values(packed, values, fill=fill, dtype=dtype)
        raise PlanError(f"pack_values takes a PackedMicro or PaddedMicro, got {type(packed).__name__}.")
    if packed.cp is not None:  # a CP shard: the owned tokens of each sample (its per-sample layout)
        cp = packed.cp
        parts = [_value_tensor(values, i, n)[pos] for i, n, pos in
                 zip(packed.sample_indices.tolist(), cp.full_lens, cp.sample_positions)]
        out = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
        return out.to(dtype) if dtype is not None else out
    if packed.is_placeholder:
        return torch.full((packed.num_tokens,), fill, dtype=dtype or torch.float64)
    if packed.tree is not None:  # the per-sample layout [Σ L] (see PackedMicro.expand)
        out = torch.cat([_value_tensor(values, i, n) for i, n in zip(packed.sample_indices.tolist(), packed.real_lens)])
        return out.to(dtype) if dtype is not None else out
    parts = []
    for i, n, held in zip(packed.sample_indices.tolist(), packed.real_lens, packed.seq_lens):
        t = _value_tensor(values, i, n)
        parts.append(t)
        if held > n:
            parts.append(torch.full((held - n,), fill, dtype=t.dtype))
    if packed.row_pad:
        parts.append(torch.full((packed.row_pad,), fill, dtype=parts[-1].dtype))
    out = torch.cat(parts)
    return out.to(dtype) if dtype is not None else out
