"""microplan as TRL's gradient-accumulation split: a drop-in for ``split_tensor_dict`` (GRPO trainer).

Why this seam. Of the three frameworks considered, TRL's planner seam is the smallest public one:
``GRPOTrainer._prepare_inputs`` generates one local generation batch and cuts it into
``steps_per_generation`` micro-batches with ONE module-level function,
``trl.trainer.grpo_trainer.split_tensor_dict(tensor_dict, num_chunks)``, which takes equal row
counts in order. OpenRLHF's micro-batching lives inside ``NaiveReplayBuffer.setup_dynamic_batch``
(state on the buffer, an all-reduce MAX and KK without the cap mixed with loss bookkeeping) and
needs flash-attn and deepspeed to install; SkyRL is not installable from the package index for
this Python. TRL installs from PyPI on CPU.

What it does. The chunks become microplan micro-batches of this process's rows: exactly
``num_chunks`` of them (``align = num_chunks``), balanced by the rows' real tokens (prompt mask +
completion mask), heaviest first; each chunk's completion tensors are then trimmed to its longest completion, so a chunk of short
completions runs short tensors. Rows are never dropped (TRL's split drops the remainder
of ``B % num_chunks``). Exactness: the chunks have unequal row counts, which is exact for TRL's
globally normalised losses (``dapo`` — the default —, ``cispo``, ``vespo``: each chunk divides by
the generation batch's ``num_items_in_batch``) and NOT for the per-chunk means (``grpo``, ``bnpo``,
``dr_grpo``, ``sapo``, ``luspo``); :func:`install` refuses those. Multimodal batches (extra 2-D
keys) are split by rows without trimming.

    import microplan.integrations.trl as mpt
    mpt.install(trainer)        # checks trainer.loss_type; patches TRL's split; mpt.uninstall()
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..batch import Batch
from ..config import PlanConfig
from ..cost.models import TokenCost
from ..errors import PlanError
from ..planner import build_plan

__all__ = ["split_tensor_dict", "install", "uninstall", "EXACT_LOSS_TYPES"]

EXACT_LOSS_TYPES = ("dapo", "cispo", "vespo")
_COMPLETION_KEYS = ("completion_ids", "completion_mask", "old_per_token_logps", "ref_per_token_logps",
                    "sampling_per_token_logps", "importance_sampling_ratio", "tool_mask")
_PROMPT_KEYS = ("prompt_ids", "prompt_mask")
_PATCHED: list[tuple[Any, str, Any]] = []


def split_tensor_dict(tensor_dict: dict[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """TRL's ``split_tensor_dict``: ``num_chunks`` dicts of rows, token-balanced and trimmed (module note)."""
    rows = _rows(tensor_dict)
    k = int(num_chunks)
    if k < 1 or rows < k:
        raise PlanError(f"split_tensor_dict: {rows} rows cannot fill num_chunks={k} non-empty chunks; generate at "
                        "least steps_per_generation rows per process.")
    lens = _row_tokens(tensor_dict, rows)
    cfg = PlanConfig(dp_size=1, max_tokens_per_micro=int(lens.sum()), align=k, cost=TokenCost())
    micros = build_plan(Batch(lens), cfg).steps[0].micros[0]
    assert len(micros) == k  # one rank, no cap that binds: K is align = num_chunks
    trim = set(tensor_dict) <= set(_COMPLETION_KEYS) | set(_PROMPT_KEYS) | {"advantages", "num_items_in_batch"}
    return [_take(tensor_dict, m.indices, trim) for m in micros]


def _rows(d: dict[str, Any]) -> int:
    first = next((v for v in d.values() if v is not None and (isinstance(v, list) or v.ndim > 0)), None)
    if first is None:
        raise PlanError("split_tensor_dict: the dict holds no per-row tensor or list to split.")
    return len(first)


def _row_tokens(d: dict[str, Any], rows: int) -> np.ndarray:
    """Real tokens of each row: prompt mask + completion mask sums (1 per row when masks are absent)."""
    tok = np.zeros(rows, dtype=np.int64)
    for key in ("prompt_mask", "completion_mask"):
        m = d.get(key)
        if m is not None and not isinstance(m, list):
            tok += m.sum(dim=1).cpu().numpy().astype(np.int64)
    return np.maximum(tok, 1)


def _take(d: dict[str, Any], idx: np.ndarray, trim: bool) -> dict[str, Any]:
    import torch
    rows = torch.tensor(idx, dtype=torch.long)  # a copy: the plan's index arrays are read-only
    out: dict[str, Any] = {}
    for key, v in d.items():
        if v is None:
            out[key] = None
        elif isinstance(v, list):
            out[key] = [v[int(i)] for i in idx]
        elif v.ndim == 0:
            out[key] = v
        else:
            out[key] = v[rows.to(v.device)]
    if trim:
        _trim(out)
    return out


def _trim(c: dict[str, Any]) -> None:
    """Cut the trailing completion columns that are padding in every row of this chunk.

    Only trailing columns: a causal model's outputs at earlier positions do not depend on them, and
    ``logits_to_keep`` follows the width. The left-padded prompt is left alone (removing left
    padding would shift positions for models that derive them from the column index).
    """
    cm = c.get("completion_mask")
    if cm is None or cm.ndim != 2:
        return
    T = cm.shape[1]
    w = int((cm != 0).nonzero()[:, 1].max()) + 1 if bool(cm.any()) else 1
    for key in _COMPLETION_KEYS:
        v = c.get(key)
        if v is not None and v.ndim >= 2 and v.shape[1] == T:
            c[key] = v[:, :w]


def install(trainer: Any = None) -> None:
    """Route TRL's GRPO gradient-accumulation split through microplan in this process.

    ``trainer``: the ``GRPOTrainer`` (or anything with ``loss_type``); its loss must be one of
    :data:`EXACT_LOSS_TYPES`, else PlanError (unequal chunks would change a per-chunk mean).
    """
    try:
        import trl.trainer.grpo_trainer as grpo
    except ImportError as exc:
        raise ImportError("microplan.integrations.trl.install() needs TRL: pip install trl") from exc
    loss_type = getattr(trainer, "loss_type", None) if trainer is not None else None
    if trainer is not None and loss_type not in EXACT_LOSS_TYPES:
        raise PlanError(f"GRPOTrainer.loss_type={loss_type!r} normalises each gradient-accumulation chunk by its own "
                        f"size, so unequal token-balanced chunks would change the objective; use one of "
                        f"{', '.join(EXACT_LOSS_TYPES)} (dapo is TRL's default) or keep TRL's split.")
    if _PATCHED:
        return
    import trl.trainer.utils as tu
    for mod in (grpo, tu):
        _PATCHED.append((mod, "split_tensor_dict", mod.split_tensor_dict))
        mod.split_tensor_dict = split_tensor_dict


def uninstall() -> None:
    """Put TRL's own split back."""
    while _PATCHED:
        mod, name, original = _PATCHED.pop()
        setattr(mod, name, original)
