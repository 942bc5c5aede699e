"""Peak bytes a call adds: ``peak_bytes(fn, *, device) -> int``.

Design note. What a micro-batch costs in memory is the peak of the bytes allocated while it runs
ABOVE what was allocated before (parameters, accumulated gradients, optimizer state, the packed
inputs): the planner's :class:`microplan.MemoryModel` predicts exactly that.

- CUDA: ``torch.cuda.reset_peak_memory_stats`` then ``max_memory_allocated − memory_allocated``
  before the call (the caching allocator's block rounding included: what the GPU really holds).
- CPU (and anything else): :class:`StorageTracker`, a ``TorchDispatchMode`` that sees every op.
  A storage first seen as an op's INPUT existed before the call and is never counted; one first
  seen as an OUTPUT was allocated during the call: its ``nbytes`` are added, and subtracted by a
  weakref finaliser when the storage dies. Views share their storage (counted once); in-place
  ops return an input's storage (not counted again). The peak of the running sum is the answer:
  deterministic, independent of the host allocator, and the same quantity the CUDA path reads
  up to the allocator's rounding.

Guarantee: the CPU count includes every tensor storage an op creates while the mode is active,
autograd's saved tensors and the backward's temporaries included (CPU autograd runs the backward
on the calling thread, inside the mode). It does not count host memory outside tensors.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["StorageTracker", "peak_bytes"]


class StorageTracker(TorchDispatchMode):
    """Counts the bytes of every tensor storage created while active (see the module note).

    Attributes:
        current: bytes of the storages created inside the mode and still alive.
        peak: the largest ``current`` seen since entering.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _release(self, nbytes: int) -> None:
        self.current -= nbytes

    def _storages(self, tree: Any) -> list[torch.UntypedStorage]:
        out = []
        for t in tree_flatten(tree)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                try:
                    out.append(t.untyped_storage())
                except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, some subclasses)
                    pass
        return out

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for st in self._storages((args, kwargs)):
            if st not in self._seen:
                self._seen[st] = 0  # existed before: never counted
        out = func(*args, **kwargs)
        for st in self._storages(out):
            if st not in self._seen:
                n = int(st.nbytes())
                self._seen[st] = n
                self.current += n
                weakref.finalize(st, self._release, n)
        if self.current > self.peak:
            self.peak = self.current
        return out


def peak_bytes(fn: Callable[[], Any], *, device: torch.device | str | None = None) -> int:
    """Peak bytes ``fn()`` allocates above what was allocated when it started (see the module note).

    ``device``: a CUDA device reads the caching allocator's peak; anything else (default CPU)
    counts tensor storages with :class:`StorageTracker`. ``fn``'s return value is dropped before
    the call returns.
    """
    dev = torch.device("cpu" if device is None else device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out = fn()
        del out
        torch.cuda.synchronize(dev)
        return int(torch.cuda.max_memory_allocated(dev) - base)
    tracker = StorageTracker()
    with tracker:
        out = fn()
        del out
    return int(tracker.peak)
