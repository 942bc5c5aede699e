"""microplan inside TRL's GRPOTrainer: token-balanced accumulation chunks, every loss type, shared prompts.

Why this seam. TRL's planner seam is the smallest public one: ``GRPOTrainer._prepare_inputs``
generates one local generation batch and cuts it into ``steps_per_generation`` chunks with ONE
module-level function, ``trl.trainer.grpo_trainer.split_tensor_dict(tensor_dict, num_chunks)``
(equal row counts, in order), and every model pass goes through ONE method,
``_get_per_token_logps_and_entropies``. (OpenRLHF's micro-batching lives inside its replay buffer
and needs flash-attn and deepspeed; SkyRL is not installable for this Python.)

What ``install(trainer, share_prefixes=False, memory=None, max_bytes_per_micro=None)`` does:

1. replaces the split with :func:`split_tensor_dict`: rows move only among the chunks of one
   optimizer step (``_trl_split.windows``: one generation feeding two optimizer steps keeps each
   step's rows), under the loss type's rule (``_trl_split.RULES``): ``dapo``/``cispo``/``vespo``
   any non-empty chunks; ``grpo``/``sapo``/``dr_grpo``/``luspo`` TRL's row count per chunk;
   ``bnpo`` — and any loss with the entropy bonus, a top-entropy mask or an aux loss — TRL's rows;
   balanced by tokens within that, each chunk trimmed to its longest completion;
2. with ``share_prefixes=True``: keeps each prompt group in one chunk where the rule allows,
   sets ``microplan.torch.register_attention()`` on the policy and reference models (their own
   attention runs generation) and replaces ``_get_per_token_logps_and_entropies`` with
   prefix-tree rows
   (:mod:`._trl_shared`): each distinct prompt — and completion prefix — once per micro-batch in
   the training forward and the old / reference log-prob passes. TRL's losses, KL, importance
   sampling and masks consume the same ``[B, T]`` tensors as before;
3. with ``memory=`` / ``max_bytes_per_micro=``: the split also keeps every chunk's padded batch
   under the predicted-bytes budget (:mod:`._trl_memory`). TRL fixes the chunk count, so the
   budget picks which rows share a chunk (long completions together), never how many chunks.

Every rule is exact: the parameters after the optimizer steps equal TRL's own in float64 up to
rounding (tests/test_integration_trl.py, every loss type, with and without sharing). Rows that
TRL's split leaves out (``B % num_chunks``) are left out here too.

    import microplan.integrations.trl as mpt
    mpt.install(trainer, share_prefixes=True)   # mpt.uninstall() restores TRL
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

from ..errors import PlanError
from ._trl_split import RULES, partition, row_groups, windows

__all__ = ["split_tensor_dict", "install", "uninstall", "installed", "rule_of", "EXACT_LOSS_TYPES"]

#: every loss type the drop-in handles exactly (the rule of each: ``_trl_split.RULES``).
EXACT_LOSS_TYPES = tuple(RULES)
_COMPLETION_KEYS = ("completion_ids", "completion_mask", "old_per_token_logps", "ref_per_token_logps",
                    "sampling_per_token_logps", "importance_sampling_ratio", "tool_mask")
_PROMPT_KEYS = ("prompt_ids", "prompt_mask")
_PATCHED: list[tuple[Any, str, Any]] = []
_STATE: dict[str, Any] = {"trainer": None, "rule": "free", "share": False, "memory": None}


def split_tensor_dict(tensor_dict: dict[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """TRL's ``split_tensor_dict``: ``num_chunks`` dicts of rows, re-cut within each optimizer step (module note).

    Called by an installed trainer, it follows that trainer's accumulation windows and loss rule;
    called directly, all chunks are one window under the ``free`` rule.
    """
    rows = _rows(tensor_dict)
    k = int(num_chunks)
    if k < 1 or rows < k:
        raise PlanError(f"split_tensor_dict: {rows} rows cannot fill num_chunks={k} non-empty chunks; generate at "
                        "least steps_per_generation rows per process.")
    size = rows // k  # TRL's chunk size; rows past k * size train in no chunk, as in TRL
    trainer, rule, share = _STATE["trainer"], _STATE["rule"], _STATE["share"]
    step, args = getattr(trainer, "_step", None), getattr(trainer, "args", None)
    if step is None or args is None:
        wins = windows(k, None, None)
    else:
        wins = windows(k, int(step), int(args.gradient_accumulation_steps), int(getattr(trainer, "num_iterations", 1)))
    lens = _row_tokens(tensor_dict, rows)
    groups, prompt = _groups(tensor_dict, rows)
    trim = set(tensor_dict) <= set(_COMPLETION_KEYS) | set(_PROMPT_KEYS) | {"advantages", "num_items_in_batch"}
    out = []
    for win in wins:
        first = win.start * size
        sel = np.arange(first, win.stop * size, dtype=np.int64)
        parts = partition(lens[sel], groups[sel], prompt[sel], [size] * len(win), rule, share)
        if _STATE["memory"] is not None:
            parts = _fit_memory(tensor_dict, sel, parts, rule, trim)
        out.extend(_take(tensor_dict, sel[p], trim) for p in parts)
    return out


def _fit_memory(d: dict[str, Any], sel: np.ndarray, parts: list[np.ndarray], rule: str, trim: bool) -> list[np.ndarray]:
    """``parts`` re-cut so every chunk's padded batch fits the installed budget (``_trl_memory``)."""
    from ._trl_memory import fit_budget
    model, budget = _STATE["memory"]
    prompt, cm = d.get("prompt_ids"), d.get("completion_mask")
    prompt_width = 0 if prompt is None or isinstance(prompt, list) else int(prompt.shape[1])
    if cm is None or isinstance(cm, list) or cm.ndim != 2:
        widths = np.ones(sel.size, dtype=np.int64)
    elif trim:  # each row's last real completion column (the chunk is trimmed to its longest)
        m = (cm[sel].cpu().numpy() != 0)
        last = np.where(m.any(axis=1), m.shape[1] - np.argmax(m[:, ::-1], axis=1), 1)
        widths = np.maximum(last, 1).astype(np.int64)
    else:
        widths = np.full(sel.size, int(cm.shape[1]), dtype=np.int64)
    return fit_budget(parts, widths, prompt_width, rule, model, budget)


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


def _groups(d: dict[str, Any], rows: int) -> tuple[np.ndarray, np.ndarray]:
    ids, mask = d.get("prompt_ids"), d.get("prompt_mask")
    if ids is None or mask is None or isinstance(ids, list) or isinstance(mask, list):
        return np.arange(rows, dtype=np.int64), np.zeros(rows, dtype=np.int64)
    return row_groups(ids, mask)


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


def rule_of(trainer: Any) -> str:
    """The re-cut rule exact for this trainer's loss (``free``, ``count`` or ``keep``; module note).

    Raises PlanError for a loss type whose normaliser is unknown to this version."""
    loss_type = getattr(trainer, "loss_type", None)
    if loss_type not in RULES:
        raise PlanError(f"GRPOTrainer.loss_type={loss_type!r} is not one microplan knows how to keep exact (known: "
                        f"{', '.join(RULES)}); keep TRL's own split (do not call install) for this loss.")
    per_chunk_stats = (getattr(trainer, "_entropy_bonus_enabled", False)
                       or float(getattr(trainer, "top_entropy_quantile", 1.0)) < 1.0
                       or getattr(trainer, "aux_loss_enabled", False))
    return "keep" if per_chunk_stats else RULES[loss_type]


def install(trainer: Any = None, *, share_prefixes: bool = False, memory: Any = None,
            max_bytes_per_micro: int | None = None) -> None:
    """Route TRL's GRPO gradient-accumulation split (and, with ``share_prefixes``, its model passes) through microplan.

    ``trainer``: the ``GRPOTrainer``; its ``loss_type`` picks the exact rule (:func:`rule_of`), its
    step counter and accumulation steps the optimizer-step windows. Without a trainer the split
    is patched with one window and the ``free`` rule (exact for ``dapo``/``cispo``/``vespo`` when
    one generation feeds one optimizer step). ``share_prefixes=True`` needs the trainer.
    ``memory`` / ``max_bytes_per_micro``: a :class:`microplan.MemoryModel` of the training pass and
    the bytes one GPU may add per chunk (both or neither): every chunk's padded batch is predicted
    under the budget, or the split raises a PlanError naming the fix (``_trl_memory``). Not with
    ``share_prefixes=True`` (the chunks then run as prefix tries, which this budget does not price).
    """
    try:
        import trl.trainer.grpo_trainer as grpo
    except ImportError as exc:
        raise ImportError("microplan.integrations.trl.install() needs TRL: pip install trl") from exc
    if not isinstance(share_prefixes, bool):
        raise PlanError(f"install(share_prefixes={share_prefixes!r}) must be True or False.")
    if share_prefixes and trainer is None:
        raise PlanError("install(share_prefixes=True) needs the GRPOTrainer: install(trainer, share_prefixes=True).")
    budget = _memory_budget(memory, max_bytes_per_micro, share_prefixes)
    rule = rule_of(trainer) if trainer is not None else "free"
    if _PATCHED:
        uninstall()
    _STATE.update(trainer=trainer, rule=rule, share=share_prefixes, memory=budget)
    import trl.trainer.utils as tu
    for mod in (grpo, tu):
        _PATCHED.append((mod, "split_tensor_dict", mod.split_tensor_dict))
        mod.split_tensor_dict = split_tensor_dict
    if share_prefixes:
        _share(trainer)


def _memory_budget(memory: Any, max_bytes_per_micro: Any, share: bool) -> tuple[Any, int] | None:
    """``(model, budget)`` of ``install(memory=..., max_bytes_per_micro=...)``, validated as PlanConfig validates them."""
    if memory is None and max_bytes_per_micro is None:
        return None
    from ..config import PlanConfig
    cfg = PlanConfig(dp_size=1, memory=memory, max_bytes_per_micro=max_bytes_per_micro)
    if share:
        raise PlanError("install(share_prefixes=True, memory=...): the shared path runs each chunk as a prefix-tree "
                        "row, whose bytes the TRL budget does not price yet; pass one of them.")
    return cfg.memory, int(cfg.max_bytes_per_micro)


def _share(trainer: Any) -> None:
    """Tree rows for every model pass of ``trainer`` (see ``_trl_shared``): microplan's attention on
    the policy and reference models, their own around generation."""
    from ..torch import register_attention
    from ._trl_shared import attention, backbone_of, per_token_logps
    name = register_attention()
    models = [m for m in (trainer.model, getattr(trainer, "ref_model", None)) if m is not None]
    own = [backbone_of(m).config._attn_implementation for m in models]
    for m, before in zip(models, own):
        _PATCHED.append((m, "attention", before))
        backbone_of(m).set_attn_implementation(name)
    logps, generate = trainer._get_per_token_logps_and_entropies, trainer._generate_single_turn

    def shared(self: Any, model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, **kwargs: Any) -> Any:
        return per_token_logps(self, logps, model, input_ids, attention_mask, logits_to_keep, **kwargs)

    def generate_with_own_attention(self: Any, *args: Any, **kwargs: Any) -> Any:
        with attention(models, own):
            return generate(*args, **kwargs)
    for attr, fn in (("_get_per_token_logps_and_entropies", shared), ("_generate_single_turn", generate_with_own_attention)):
        _PATCHED.append((trainer, attr, None))
        setattr(trainer, attr, types.MethodType(fn, trainer))


def uninstall() -> None:
    """Put TRL's own split, model passes and attention back."""
    while _PATCHED:
        obj, name, original = _PATCHED.pop()
        if name == "attention":
            from ._trl_shared import backbone_of
            backbone_of(obj).set_attn_implementation(original)
        elif original is None:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, original)
    _STATE.update(trainer=None, rule="free", share=False, memory=None)


def installed() -> bool:
    return bool(_PATCHED)
