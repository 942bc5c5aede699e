"""microplan.torch: turn a plan's micro-batches into tensors, losses and restored outputs.

Install with ``pip install microplan[torch]``. One training step on rank ``r``::

    from microplan.torch import pack_micro, token_logprobs, weighted_loss, restore_order

    for micro in plan.steps[s].micros[r]:                  # placeholders included
        p = pack_micro(micro, token_ids).to(device)        # varlen row, label-aligned weights
        logits = model(**p.model_inputs(), use_cache=False).logits
        logp = token_logprobs(logits, p)                   # [T], 0 at sample starts
        weighted_loss(per_token_loss(logp), p).backward()  # Σ w·ℓ — no other normalisation
    # DDP/FSDP average the gradients (grad_reduction="mean"): the result is exactly ∇J.

See docs/loss.md for the loss modes, the engine conventions and the framework recipes.
The numpy core never imports torch; this package never changes the plan.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("microplan.torch needs PyTorch: pip install 'microplan[torch]'") from exc

from .loss import next_token_labels, next_token_weights, token_logprobs, weighted_loss
from .packing import PackedMicro, pack_micro, pack_values
from .restore import Restored, restore_order

__all__ = [
    "PackedMicro", "pack_micro", "pack_values", "token_logprobs", "next_token_labels",
    "next_token_weights", "weighted_loss", "Restored", "restore_order",
]

# Collectives (gather_batch, verify_agreement) are written by another module owner. DESIGN asks
# for ``from .distributed import gather_batch, verify_agreement``; until that module exists, the
# names are taken from the split modules (gather.py, verify.py) when those exist.
import importlib as _importlib

for _name, _modules in (("gather_batch", ("distributed", "gather")),
                        ("verify_agreement", ("distributed", "verify", "agreement"))):
    for _mod in _modules:
        try:
            _m = _importlib.import_module(f"{__name__}.{_mod}")
        except ModuleNotFoundError as _exc:
            if _exc.name != f"{__name__}.{_mod}":
                raise  # a real missing dependency inside the module: do not hide it
            continue
        if hasattr(_m, _name):
            globals()[_name] = getattr(_m, _name)
            __all__.append(_name)
            break
del _importlib, _name, _modules, _mod
