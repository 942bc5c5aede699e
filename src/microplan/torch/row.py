"""A packed row as the modules below ``packing.py`` read it, and which row predicts each token.

Design note. :class:`~microplan.torch.packing.PackedMicro` is built by ``packing.py``, whose
:meth:`~microplan.torch.packing.PackedMicro.cp_shard` calls ``cp_shard.py``; so ``cp_shard.py``
cannot import ``packing.py`` back. It types its input with :class:`PackedRow`, the read-only
fields it uses (a ``PackedMicro`` satisfies it structurally), and builds the shard with
``dataclasses.replace`` of that row (every field given), so it never names the class.

:func:`predecessor_index` is the one definition of "the row whose logits predict token t", for
the loss (``loss.py``, which re-exports it) and for a CP shard's logit rows (``cp_shard.py``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .tree import TreeLayout

__all__ = ["PackedRow", "predecessor_index"]


class PackedRow(Protocol):
    """The fields of a packed row (:class:`~microplan.torch.packing.PackedMicro`) that
    ``cp_shard.py`` and :func:`predecessor_index` read."""

    @property
    def input_ids(self) -> torch.Tensor: ...
    @property
    def position_ids(self) -> torch.Tensor: ...
    @property
    def loss_weights(self) -> torch.Tensor: ...
    @property
    def loss_mask(self) -> torch.Tensor: ...
    @property
    def sample_indices(self) -> torch.Tensor: ...
    @property
    def seq_lens(self) -> tuple[int, ...]: ...
    @property
    def is_placeholder(self) -> bool: ...
    @property
    def cp_size(self) -> int: ...
    @property
    def pad_to_multiple_of(self) -> int: ...
    @property
    def pad_row_to_multiple_of(self) -> int: ...
    @property
    def tree(self) -> TreeLayout | None: ...
    @property
    def cp(self) -> Any: ...   # a cp_shard.CPLayout on a shard, else None (cp_shard.py imports this module)
    @property
    def num_tokens(self) -> int: ...
    @property
    def real_lens(self) -> tuple[int, ...]: ...
    def predicted(self) -> torch.Tensor: ...


def predecessor_index(packed: PackedRow, device: torch.device | str | None = None) -> torch.Tensor:
    """``[T]`` int64: the row whose logits predict token t, -1 where t starts a sample. A flat row:
    t − 1 within a sample; a prefix-shared row: the last token of the parent segment for the first
    token of a branch (``tree.prev_index``)."""
    tree = getattr(packed, "tree", None)
    if tree is not None:
        return tree.prev_index.to(device)
    pred = packed.predicted().to(device)
    prev = torch.arange(-1, pred.shape[-1] - 1, device=pred.device)
    return torch.where(pred, prev, torch.full_like(prev, -1))
