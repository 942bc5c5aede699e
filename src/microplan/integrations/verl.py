"""microplan as verl's sequence balancer: the four functions of ``verl.utils.seqlen_balancing``.

One switch, in every process that balances (the driver and each worker)::

    import microplan.integrations.verl as mpv
    mpv.install()       # patches verl's functions in place; mpv.uninstall() restores them
    # with Ray: ray.init(runtime_env={"worker_process_setup_hook": "microplan.integrations.verl.install"})

or import the drop-ins by name (same signatures and return types as verl 0.9.1)::

    from microplan.integrations.verl import (get_seqlen_balanced_partitions, prepare_dynamic_batch,
                                             rearrange_micro_batches, restore_dynamic_batch)

Design note. verl balances in two places. The driver (``_balance_batch``) splits a batch over the
DP ranks with ``get_seqlen_balanced_partitions(workloads, dp, equal_size=True)``; here that is one
microplan plan with ``dp`` ranks (static batching of n/dp samples each when ``equal_size``, then
count-preserving swaps from the refine stage; one token-balanced micro-batch per rank otherwise). Each worker then cuts its share into micro-batches
with ``rearrange_micro_batches``: verl plans each rank alone and all-reduces the count with MAX;
here the ranks of ``dp_group`` all-gather their lengths (``microplan.torch.plan_distributed``,
which also checks the plan fingerprints) and make ONE plan with ``placement="local"``: the samples
stay on the rank that holds them, every rank gets the same K — the fewest at which every rank
packs under ``max_token_len`` — and the ranks' micro-batches are arranged into lockstep-balanced
slots. ``num_batches_divided_by`` is ``align``, ``min_num_micro_batch`` the minimum K, and
``force_group_size`` consecutive samples are one planning unit (they share a micro-batch, as in
verl). When a rank holds fewer samples than the K another rank needs, verl 0.9.1 raises; so does
the drop-in by default (the same :class:`~microplan.PlanError`, a ``ValueError``, on every
rank), or ``install(short_step="pad")`` gives that rank explicit empty micro-batches (empty index
lists; ``restore_dynamic_batch`` still restores the order) — with padded input only: verl's jagged
(nested) input cannot hold an empty micro-batch, so there every rank raises the same PlanError
(the plan is the same everywhere) before any micro-batch is built.

With ``install(share_prefixes=True)``, inside verl's actor engine loop the plan is made with
``share_prefixes=True`` from each rank's token ids (prefixes found on the rank, one extra
all-gather), so ``max_token_len`` caps the unique tokens of each micro-batch's prefix trie, and
``_verl_tree`` runs the engine's forward on those tries (each shared prompt once per micro-batch;
log-probs and update equal to verl's own within 1e-5 in float32, tests/test_integration_verl_share.py).

A memory budget (``install(memory=MemoryModel, max_bytes_per_micro=B)``, docs/memory.md): every
micro-batch's predicted peak also stays under B — verl's ``max_token_len`` still holds, so set
it generously and let the bytes decide; inside the engine's forward-only passes (log-probs) the
model's ``forward`` is used.

Guarantees per call: equal micro-batch counts over ``dp_group``, no micro-batch over
``max_token_len`` tokens, no empty micro-batch unless ``short_step="pad"`` asked for one, index
lists that are a permutation of the local batch. Balance uses verl's own workload model
(24576·L + L², a 7B dense decoder, plus 256 tokens' worth per micro-batch) unless
``install(cost=...)`` gives a calibrated one — which pays: on the benchmark families the lockstep
time over the split's bound is 1.028 median with verl's model and 1.0025 with the model's own
FLOPs (verl itself: 1.031; benchmarks/bench_verl.py).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import FlopsCost, PlanConfig, PlanError, TokenCost
from ..batch import Batch
from ..cost.models import CostModel
from ..plan import Plan
from ..planner import build_plan
from ..stages.refine import refine_bins
from ._verl_loss import VERL_LOSS_MODES, VerlLossWeights, loss_weights
from . import _verl_tree
from ._verl_meter import effective_lengths as _effective_lengths, planning_config, reset, unwrap_engines, wrap_engine
from ._verl_tree import TokenCounts, token_counts

__all__ = ["get_seqlen_balanced_partitions", "rearrange_micro_batches", "prepare_dynamic_batch",
           "restore_dynamic_batch", "plan_micro_batches", "VerlLayout", "loss_weights", "VerlLossWeights",
           "VERL_LOSS_MODES", "install", "uninstall", "installed", "INSTALL_HINT", "token_counts", "TokenCounts"]

INSTALL_HINT = ("pip install -e '.[verl]' (in the microplan clone) && pip install --no-deps verl==0.9.1 (verl pins transformers < 5.11: "
                "keep --no-deps so torch and transformers stay)")
#: verl's ``calculate_workload`` (FLOPs ∝ 24576·L + L², hidden size 4096 baked in), plus a fixed
#: cost per micro-batch worth 256 tokens, which verl's model lacks: without it every extra
#: micro-batch looks free and the K search would split steps for nothing.
VERL_WORKLOAD = FlopsCost(linear=24576.0, quadratic=1.0, per_micro=24576.0 * 256)
_SETTINGS: dict[str, Any] = {"short_step": "error", "share": False, "memory": None}
_PATCHED: list[tuple[Any, str, Any]] = []  # (module, name, what it held before install)
_NAMES = ("get_seqlen_balanced_partitions", "rearrange_micro_batches", "prepare_dynamic_batch",
          "restore_dynamic_batch")


class VerlLayout(NamedTuple):
    """This rank's micro-batches from one worker-side plan.

    Attributes:
        index_lists: local sample indices of each micro-batch, in execution order (verl's
            ``micro_bsz_idx``); an empty list is a placeholder (``short_step="pad"`` only).
        plan: the plan over ``dp_group`` (``dp_size=1`` without a group); samples are planning
            units (``force_group_size`` consecutive samples each), ranks in group order.
        rank: this process's rank in the group (0 without a group).
        offset: global index of this rank's first unit in ``plan.batch``.
    """

    index_lists: list[list[int]]
    plan: Plan | None
    rank: int
    offset: int


# -- driver side ---------------------------------------------------------------------------------

def get_seqlen_balanced_partitions(seqlen_list: Sequence[int], k_partitions: int, equal_size: bool) -> list[list[int]]:
    """verl's driver-side split: ``k_partitions`` non-empty lists of indices (each sorted), balanced.

    ``seqlen_list`` holds any non-negative per-item weights (verl passes workloads, sometimes as
    a tensor). ``equal_size``: every partition gets ``len / k`` items (the length must divide).
    """
    values = np.asarray(_as_list(seqlen_list), dtype=np.float64)
    n, k = values.size, int(k_partitions)
    if k < 1 or n < k:
        raise PlanError(f"get_seqlen_balanced_partitions: {n} items cannot fill k_partitions={k} non-empty "
                        "partitions; pass at least k items.")
    if equal_size and n % k:
        raise PlanError(f"get_seqlen_balanced_partitions: equal_size needs len(seqlen_list)={n} to be a multiple "
                        f"of k_partitions={k}; pad the batch or pass equal_size=False.")
    if not np.isfinite(values).all() or (values < 0).any() or (values != np.floor(values)).any():
        raise PlanError("get_seqlen_balanced_partitions: seqlen_list must hold whole numbers >= 0 "
                        "(sequence lengths or integer workloads).")
    weights = np.maximum(values, 1).astype(np.int64)  # a zero-length item still takes a slot
    size = dict(micro_batch_size=n // k) if equal_size else dict(max_tokens_per_micro=int(weights.sum()))
    plan = build_plan(Batch(weights), PlanConfig(dp_size=k, cost=TokenCost(), **size))
    bin_of = np.empty(n, dtype=np.int64)
    for r, row in enumerate(plan.steps[0].micros):
        for m in row:
            bin_of[m.indices] = r
    if equal_size:  # static batching deals rounds; swaps (counts unchanged) close the gap to the mean
        w = weights.astype(np.float64)
        bin_of = refine_bins(bin_of, weights, w, k, None, moves=False, rel_tol=1e-6, max_iters=8 * k)
    return [np.flatnonzero(bin_of == r).tolist() for r in range(k)]


# -- worker side ---------------------------------------------------------------------------------

def plan_micro_batches(seq_lens: Sequence[int] | np.ndarray, max_token_len: int, *, dp_group: Any = None,
                       num_batches_divided_by: int | None = None, same_micro_num_in_dp: bool = True,
                       min_num_micro_batch: int | None = None, use_dynamic_bsz_balance: bool = True,
                       force_group_size: int = 1, cost: CostModel | None = None,
                       short_step: str | None = None, token_ids: Sequence[Any] | None = None,
                       share_local: bool = True) -> VerlLayout:
    """The plan behind :func:`rearrange_micro_batches`, from this rank's effective lengths alone.

    Collective over ``dp_group`` when ``torch.distributed`` is initialised, ``same_micro_num_in_dp``
    and a group is given (as in verl); every rank of the group must call it. ``token_ids`` (each
    local sample's tokens; ``force_group_size=1`` only) plans with ``share_prefixes=True``: the
    samples that share a prefix on this rank are found from them, and ``max_token_len`` caps the
    unique tokens of each micro-batch (what a prefix-tree forward computes). Every rank of the
    group must pass them, or none. ``share_local=False``: this rank's micro-batches will run
    flat (its data cannot take the tree path), so none of its samples is planned as shared.
    """
    lens = np.asarray(_as_list(seq_lens), dtype=np.int64)
    g = int(force_group_size)
    if g < 1 or lens.size % g:
        raise PlanError(f"batch size {lens.size} must be divisible by force_group_size {g}.")
    units = lens.reshape(-1, g).sum(axis=1) if lens.size else lens
    short = short_step if short_step is not None else _SETTINGS["short_step"]
    if short not in ("error", "pad"):
        raise PlanError(f"short_step={short!r}: the verl drop-in supports 'error' (verl 0.9.1's behaviour: refuse) "
                        "or 'pad' (explicit empty micro-batches); 'drop' would lose samples verl restores.")
    share = token_ids is not None
    if share and (g != 1 or len(token_ids) != lens.size):
        raise PlanError(f"plan_micro_batches(token_ids=...) needs force_group_size=1 (got {g}) and one token list per "
                        f"sample ({len(token_ids)} lists for {lens.size} samples); leave token_ids out otherwise.")
    config = dict(max_tokens_per_micro=int(max_token_len), align=int(num_batches_divided_by or 1),
                  short_step=short, cost=cost, placement="local", share_prefixes=share)
    config.update(_memory_budget())
    units_min1 = np.maximum(units, 1)  # an all-padding row still occupies a micro-batch slot
    prefixes = None
    if share:  # a rank whose rows will run flat plans no sharing (its cap must count every token)
        prefixes = _local_prefixes(token_ids, units_min1) if share_local else \
            (np.full(units.size, -1, dtype=np.int64), np.zeros(units.size, dtype=np.int64))
    if _synced(dp_group, same_micro_num_in_dp):
        from ..torch.distributed import local_view, plan_distributed
        view = local_view({"seq_lens": units_min1}, group=dp_group)
        if prefixes is not None:
            view = _with_prefixes(view, prefixes, dp_group)
        cfg = _with_cost(PlanConfig(dp_size=view.world_size, **config), view.pinned(), cost)
        plan = plan_distributed(view, cfg, group=dp_group, min_micro_count=min_num_micro_batch)
        rank, offset = view.rank, view.offset
    else:
        pre = {} if prefixes is None else dict(prefix_parent=prefixes[0], shared_prefix_lens=prefixes[1])
        local = Batch(units_min1, rank_of=np.zeros(units.size, dtype=np.int64), **pre)
        plan = build_plan(local, _with_cost(PlanConfig(dp_size=1, **config), local, cost),
                          min_micro_count=min_num_micro_batch)
        rank, offset = 0, 0
    if not plan.steps:
        return VerlLayout([], plan, rank, offset)
    micros = list(plan.steps[0].micros[rank])
    slots = list(range(len(micros)))  # heaviest first, identical slot order on every rank
    if use_dynamic_bsz_balance:  # verl's pipeline order: light micro-batches at both ends
        slots = slots[::2][::-1] + slots[1::2]
    lists = [sorted(int(u - offset) * g + j for u in micros[m].indices for j in range(g)) for m in slots]
    return VerlLayout(lists, plan, rank, offset)


def rearrange_micro_batches(batch: Any, max_token_len: int, dp_group: Any = None, num_batches_divided_by: int | None = None,
                            same_micro_num_in_dp: bool = True, min_num_micro_batch: int | None = None,
                            use_dynamic_bsz_balance: bool = True, force_group_size: int = 1) -> tuple[list[Any], list[list[int]]]:
    """verl's ``rearrange_micro_batches``: (list of TensorDict micro-batches, index lists), planned by microplan."""
    import torch
    from verl.utils import tensordict_utils as tu
    _wrap_engines()
    tokens = _sharing_tokens(batch, force_group_size)
    layout = plan_micro_batches(_effective_lengths(batch), max_token_len, dp_group=dp_group,
                                num_batches_divided_by=num_batches_divided_by,
                                same_micro_num_in_dp=same_micro_num_in_dp, min_num_micro_batch=min_num_micro_batch,
                                use_dynamic_bsz_balance=use_dynamic_bsz_balance, force_group_size=force_group_size,
                                token_ids=tokens,
                                share_local=tokens is None or _verl_tree.eligible(batch))  # positions 0..L-1 here
    _refuse_jagged_placeholders(batch, layout)
    micros = [tu.index_select_tensor_dict(batch, torch.tensor(idx, dtype=torch.long)) for idx in layout.index_lists]
    return micros, layout.index_lists


def _refuse_jagged_placeholders(batch: Any, layout: VerlLayout) -> None:
    """A jagged (nested) TensorDict cannot hold an empty micro-batch (verl's ``index_select_tensor_dict``
    asserts "Must provide at least one tensor"); the plan is the same on every rank, so every rank
    refuses here, before the micro-batches (and the forward's collectives) exist."""
    if layout.plan is None or not layout.plan.steps or not getattr(batch["input_ids"], "is_nested", False):
        return
    short = [r for r, row in enumerate(layout.plan.steps[0].micros) if any(m.is_placeholder for m in row)]
    if short:
        K = layout.plan.steps[0].micro_count
        raise PlanError(f"short_step='pad' gives rank(s) {short} an empty micro-batch (every rank runs K={K}), but "
                        "verl's jagged (nested, remove-padding) input cannot hold an empty micro-batch; give every "
                        f"rank at least {K} samples (balance the batch over the ranks, or raise max_token_len_per_gpu "
                        "so fewer micro-batches are needed), or use padded input (use_remove_padding=False).")


def prepare_dynamic_batch(data: Any, max_token_len: int, dp_group: Any = None, num_batches_divided_by: int | None = None,
                          same_micro_num_in_dp: bool = True, min_num_micro_batch: int | None = None,
                          use_dynamic_bsz_balance: bool = True) -> tuple[list[Any], list[list[int]]]:
    """verl's ``prepare_dynamic_batch``: (list of DataProto micro-batches, index lists)."""
    import copy

    from verl import DataProto
    batches, lists = rearrange_micro_batches(data.batch, max_token_len=max_token_len, dp_group=dp_group,
                                             num_batches_divided_by=num_batches_divided_by,
                                             same_micro_num_in_dp=same_micro_num_in_dp,
                                             min_num_micro_batch=min_num_micro_batch,
                                             use_dynamic_bsz_balance=use_dynamic_bsz_balance)
    out = []
    for td, idx in zip(batches, lists):
        non_tensors = {key: value[idx] for key, value in data.non_tensor_batch.items()}
        out.append(DataProto.from_dict(dict(td), non_tensors, meta_info=copy.deepcopy(data.meta_info)))
    return out, lists


def restore_dynamic_batch(data: Any, batch_idx_list: list[list[int]]) -> Any:
    """verl's ``restore_dynamic_batch``: rows of the concatenated micro-batch outputs back in input order."""
    import torch
    flat = [int(i) for idx in batch_idx_list for i in idx]
    n = int(data.shape[0])
    if len(flat) != n or sorted(flat) != list(range(n)):
        raise PlanError(f"restore_dynamic_batch: the index lists hold {len(flat)} indices for {n} rows; they must "
                        "be a permutation of 0..rows-1 (the lists the micro-batches were made with).")
    inverse = torch.empty(n, dtype=torch.long)
    inverse[torch.tensor(flat, dtype=torch.long)] = torch.arange(n, dtype=torch.long)
    if data.is_nested:
        rows = data.unbind()
        return torch.nested.as_nested_tensor([rows[i] for i in inverse.tolist()], layout=torch.jagged)
    return data[inverse.to(data.device)]


# -- the switch ----------------------------------------------------------------------------------

def install(*, cost: CostModel | None = None, hf_config: Any = None, short_step: str = "error",
            share_prefixes: bool = False, meter: bool = True, memory: Any = None,
            max_bytes_per_micro: int | None = None) -> None:
    """Route verl's sequence balancing through microplan in this process (idempotent).

    Replaces the four functions in ``verl.utils.seqlen_balancing`` and in every loaded ``verl``
    module that imported them by name; modules imported later get them from the patched module.
    ``cost``: a fixed cost model to balance with; default: the trained model's FLOPs from
    ``hf_config`` (a dict or a transformers config; in a worker, verl's engine's own config),
    then the machine's seconds learned online (``meter``; see ``_verl_meter``).
    ``short_step``: ``"error"`` (default) or ``"pad"`` (see the module note).
    ``share_prefixes``: True runs verl's actor forward (log-prob and update passes of
    ``FSDPEngineWithLMHead``) on prefix-tree micro-batches — each shared prompt and response
    prefix once per micro-batch — planned with ``share_prefixes`` × ``placement="local"``; see
    ``_verl_tree`` for what runs as a tree and what keeps verl's own forward.
    ``memory`` / ``max_bytes_per_micro``: a :class:`microplan.MemoryModel` and the bytes one GPU
    may add per micro-batch (both or neither): micro-batches are also planned under the budget.
    """
    try:
        import verl.utils.seqlen_balancing as sb
    except ImportError as exc:
        raise ImportError(f"microplan.integrations.verl.install() needs verl: {INSTALL_HINT}") from exc
    if short_step not in ("error", "pad"):
        raise PlanError(f"install(short_step={short_step!r}) must be 'error' or 'pad'.")
    if not isinstance(share_prefixes, bool):
        raise PlanError(f"install(share_prefixes={share_prefixes!r}) must be True or False.")
    if cost is not None and not isinstance(cost, CostModel):
        raise PlanError(f"install(cost={cost!r}) must be a microplan cost model, e.g. FlopsCost.from_hf_config(...).")
    try:
        reset(cost=cost, hf_config=hf_config, metering=bool(meter))
    except PlanError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise PlanError(f"install(hf_config=...) could not read the model's shape: {exc}; pass a transformers "
                        "config or its dict (hidden_size, num_hidden_layers, num_attention_heads, ...).") from None
    if memory is not None or max_bytes_per_micro is not None:  # validated as PlanConfig validates them
        PlanConfig(dp_size=1, memory=memory, max_bytes_per_micro=max_bytes_per_micro)
    _SETTINGS.update(short_step=short_step, share=share_prefixes,
                     memory=None if memory is None else (memory, max_bytes_per_micro))
    _verl_tree.STATE["share"] = share_prefixes
    _verl_tree.reset_counts()
    if share_prefixes:  # wrap the engine now, so its first loop already plans tries (else: at its first balancing)
        try:
            importlib.import_module("verl.workers.engine.fsdp.transformer_impl")
        except ImportError:  # peft / accelerate / datasets missing: no engine in this process (a driver)
            pass
    if _PATCHED:
        _wrap_engines()
        return
    mine = {name: globals()[name] for name in _NAMES}
    theirs = {name: getattr(sb, name) for name in _NAMES}
    for mod in [m for name, m in list(sys.modules.items()) if name == "verl" or name.startswith("verl.")]:
        for name in _NAMES:
            if getattr(mod, name, None) is theirs[name]:
                _PATCHED.append((mod, name, theirs[name]))
                setattr(mod, name, mine[name])
    _wrap_engines()


def uninstall() -> None:
    """Put verl's own functions back wherever :func:`install` replaced them."""
    while _PATCHED:
        mod, name, original = _PATCHED.pop()
        setattr(mod, name, original)
    unwrap_engines()
    _verl_tree.unwrap()
    reset()
    _SETTINGS.update(short_step="error", share=False, memory=None)


def installed() -> bool:
    return bool(_PATCHED)


def _wrap_engines() -> None:
    """Meter verl's FSDP engine once it is imported in this process (see ``_verl_meter``); called
    by install() and by every balancing call, so an engine imported after install() is metered
    from its second step on. Importing it here would cost seconds in processes that never train."""
    engine = sys.modules.get("verl.workers.engine.fsdp.transformer_impl")
    if _PATCHED and engine is not None and hasattr(engine, "FSDPEngine"):
        wrap_engine(engine.FSDPEngine)
    if _PATCHED and _SETTINGS["share"] and engine is not None and hasattr(engine, "FSDPEngineWithLMHead"):
        _verl_tree.wrap_lm_engine(engine.FSDPEngineWithLMHead)


# -- helpers -------------------------------------------------------------------------------------

def _memory_budget() -> dict[str, Any]:
    """PlanConfig fields of the installed memory budget (the forward model inside a forward-only pass)."""
    if _SETTINGS["memory"] is None:
        return {}
    from ._verl_meter import STATE as METER
    model, budget = _SETTINGS["memory"]
    return {"memory": model.forward_model() if METER.get("forward_only") else model, "max_bytes_per_micro": budget}


def _with_cost(config: PlanConfig, batch: Batch, cost: CostModel | None) -> PlanConfig:
    """``config`` with ``cost`` when given, else the drop-in's (``_verl_meter.planning_config``:
    inside a metered training pass, the meter's exploration config of ``batch``)."""
    if cost is not None:
        return config
    return planning_config(config, batch)


def _synced(dp_group: Any, same_micro_num_in_dp: bool) -> bool:
    if not same_micro_num_in_dp or dp_group is None:
        return False
    import torch.distributed as dist
    return bool(dist.is_available() and dist.is_initialized())


def _sharing_tokens(batch: Any, force_group_size: int) -> list[Any] | None:
    """Each sample's tokens when this balancing call plans prefix-tree micro-batches: inside a
    sharing engine's loop (``_verl_tree.sharing_engine``) on jagged input it can run as trees,
    with ``force_group_size=1``. Decided from the engine and the batch's settings only, the same
    on every rank (it decides the prefix gather, a collective)."""
    if not _SETTINGS["share"] or _verl_tree.sharing_engine() is None or int(force_group_size) != 1:
        return None
    if not _verl_tree.eligible(batch, positions=False):
        return None
    ids = batch["input_ids"]
    offsets = ids.offsets().cpu().tolist()
    flat = ids.values().cpu()
    return [flat[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def _local_prefixes(token_ids: Sequence[Any], lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """This rank's ``(prefix_parent, shared_prefix_lens)`` in local indices (a parent is an earlier local sample)."""
    from ..prefix import find_shared_prefixes
    parent, shared = find_shared_prefixes(token_ids)
    return parent, np.minimum(shared, lens)


def _with_prefixes(view: Any, prefixes: tuple[np.ndarray, np.ndarray], group: Any) -> Any:
    """``view`` whose global batch carries every rank's shared prefixes (one all-gather: parents
    become global indices; samples share only within their rank, where they stay)."""
    import torch

    from ..torch._comm import all_gather_padded, comm_device
    from ..torch.gather import LocalView
    parent, shared = prefixes
    glob = np.where(parent >= 0, parent + view.offset, -1)
    mine = torch.from_numpy(np.concatenate([glob, shared]).astype(np.int64))
    got = all_gather_padded(mine.to(comm_device(group)), [2 * n for n in view.counts], group)
    cols = [g.cpu().numpy().reshape(2, -1) for g in got]
    both = np.concatenate(cols, axis=1) if cols else np.zeros((2, 0), dtype=np.int64)
    batch = Batch(view.batch.seq_lens, prefix_parent=both[0], shared_prefix_lens=both[1])
    return LocalView(batch, view.rank, view.counts)


def _as_list(values: Any) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)
