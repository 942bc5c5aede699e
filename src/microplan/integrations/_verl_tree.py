"""verl's actor forward on prefix-tree rows: each shared prompt (and response prefix) once per micro-batch.

Design note. verl 0.9.1 runs every actor pass — ``compute_log_prob``, ``compute_ref_log_prob``
(``infer_batch``) and ``update_actor`` (``train_batch``) — through ONE loop,
``FSDPEngine.forward_backward_batch``, whose per-micro-batch ``FSDPEngineWithLMHead.forward_step``
is: ``prepare_model_inputs`` (the jagged micro-batch → one packed row) → ``self.module(...)`` →
``prepare_model_outputs`` (logits → per-token ``log_probs`` / ``entropy`` as jagged ``[bsz, j1]``
tensors, token t holding log p(token t+1 | ..t)) → verl's loss function. The seam is those two
``prepare_*`` methods: with ``install(share_prefixes=True)``, :func:`wrap_lm_engine` makes them

1. lay the micro-batch's samples out as their prefix trie (``find_shared_prefixes`` +
   ``pack_micro``): every shared token once, true position ids, the path table for
   ``register_attention()``'s attention, which ``forward_step`` runs with (the model's own
   attention is put back after each micro-batch);
2. score every (sample, token) pair from the row of its token in the trie: the distinct
   (row, label, temperature) triples — about one per unique token — go through verl's own
   ``logprobs_from_logits`` / entropy / Σπ² functions, and are scattered back to verl's jagged
   per-sample layout (labels are verl's rolled ids, so even a sample's unused last position
   holds what verl's does).

verl's ``forward_step`` body, loss functions, ``batch_num_tokens``, restore order and metrics are
untouched, so the losses keep their meaning; a causal LM's output at a token depends only on the
tokens before it, so each value equals the unshared one up to rounding (tests: update and
log-probs within 1e-5 in float32 on 2 gloo ranks). The planner side (``verl.py``) plans each
rank's micro-batches with ``share_prefixes=True`` under ``placement="local"``, so the token cap
counts the unique tokens the tree row computes — but only inside an engine whose forward shares
(:func:`sharing_engine`); a micro-batch this module cannot run as a tree (module note of
``eligible``) runs verl's own forward. Trade-off: one attention call per trie segment and layer
on CPU (flash-attn varlen on GPU when installed) against the GEMMs of every repeated prompt token.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = ["TokenCounts", "token_counts", "wrap_lm_engine", "unwrap", "sharing_engine", "eligible", "trie", "STATE"]

# restore: (model, its own attention) while a tree micro-batch's attention is set; last_tree: the last tree Micro run
STATE: dict[str, Any] = {"share": False, "engine": None, "computed": 0, "unshared": 0, "micro_batches": 0,
                         "restore": None, "last_tree": None}
_WRAPPED: list[tuple[Any, str, Any]] = []
_KEY = "microplan_tree"


class TokenCounts(NamedTuple):
    """Tokens of the micro-batches that ran as tree rows since ``install``: ``computed`` (the tree
    rows) against ``unshared`` (their Σ sample lengths, what verl's packed row would run), over
    ``micro_batches`` of them (a micro-batch that shares nothing runs verl's own row, uncounted)."""

    computed: int
    unshared: int
    micro_batches: int


def token_counts() -> TokenCounts:
    return TokenCounts(int(STATE["computed"]), int(STATE["unshared"]), int(STATE["micro_batches"]))


def reset_counts() -> None:
    STATE.update(computed=0, unshared=0, micro_batches=0)


def eligible(td: Any, *, positions: bool = True) -> bool:
    """Can verl's micro-batch ``td`` run as a tree row with the same outputs? Jagged text input with
    1-D position ids counting 0..L-1 in each sample (what ``left_right_2_no_padding`` makes), no
    fused kernels (they score inside the model), no top-k distillation, no multimodal inputs.
    ``positions=False`` skips the one data-dependent check (the planner's: its answer must be the
    same on every rank, since it decides a collective)."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.dataset_utils import DatasetPadMode
    get = lambda key, default: tu.get_non_tensor_data(data=td, key=key, default=default)  # noqa: E731
    if (get("pad_mode", DatasetPadMode.NO_PADDING) != DatasetPadMode.NO_PADDING or get("use_fused_kernels", False)
            or get("distillation_use_topk", False) or get("distillation_only", False) or int(get("sp_size", 1)) != 1):
        return False
    if "multi_modal_inputs" in td.keys() or "input_ids" not in td.keys() or "position_ids" not in td.keys():
        return False
    ids, pos = td["input_ids"], td["position_ids"]
    if not getattr(ids, "is_nested", False) or not getattr(pos, "is_nested", False) or pos.dim() != 2:
        return False
    if not positions:
        return True
    offsets = ids.offsets().cpu()
    return bool(_arange_positions(offsets).equal(pos.values().cpu()))


def sharing_engine() -> Any:
    """The engine whose ``forward_backward_batch`` is running and shares prefixes (None otherwise)."""
    return STATE["engine"] if STATE["share"] else None


def wrap_lm_engine(cls: Any) -> None:
    """Give ``cls`` (verl's ``FSDPEngineWithLMHead``) tree-row micro-batches (module note); idempotent."""
    if any(c is cls for c, _, _ in _WRAPPED):
        return
    step, inputs, outputs = cls.forward_step, cls.prepare_model_inputs, cls.prepare_model_outputs

    def forward_backward_batch(self: Any, data: Any, loss_function: Any, forward_only: bool = False) -> Any:
        before = STATE["engine"]  # verl's loop is the base class's (looked up per call: the meter may wrap it)
        STATE["engine"] = self if _shares(self, cls) else None
        try:
            return super(cls, self).forward_backward_batch(data, loss_function, forward_only=forward_only)
        finally:
            STATE["engine"] = before
            _own_attention()

    def forward_step(self: Any, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
        packed = trie(micro_batch) if STATE["share"] and _shares(self, cls) and eligible(micro_batch) else None
        if packed is None:  # verl's own forward (nothing shared, or a micro-batch a tree cannot run)
            _own_attention()
            return step(self, micro_batch, loss_function, forward_only)
        _tree_attention(self.module)  # kept until the next flat micro-batch or the loop's end: see _tree_attention
        self.__dict__[_KEY] = packed
        try:
            return step(self, micro_batch, loss_function, forward_only)
        finally:
            self.__dict__.pop(_KEY, None)

    def prepare_model_inputs(self: Any, micro_batch: Any) -> Any:
        packed = self.__dict__.get(_KEY)
        if packed is None:
            return inputs(self, micro_batch)
        return tree_inputs(packed, micro_batch)

    def prepare_model_outputs(self: Any, output: Any, output_args: Any, micro_batch: Any,
                              logits_processor_func: Any) -> Any:  # verl passes every argument by keyword
        if _KEY not in output_args:
            return outputs(self, output, output_args, micro_batch, logits_processor_func)
        return tree_outputs(self, output, output_args, micro_batch)

    for name, fn in (("forward_backward_batch", forward_backward_batch), ("forward_step", forward_step),
                     ("prepare_model_inputs", prepare_model_inputs), ("prepare_model_outputs", prepare_model_outputs)):
        _WRAPPED.append((cls, name, cls.__dict__.get(name)))
        setattr(cls, name, fn)


def unwrap() -> None:
    _own_attention()
    while _WRAPPED:
        cls, name, original = _WRAPPED.pop()
        if original is None:
            delattr(cls, name)
        else:
            setattr(cls, name, original)
    STATE.update(share=False, engine=None)


def _shares(engine: Any, cls: Any) -> bool:
    """The LM-head engine itself (a value head scores differently) without Ulysses SP."""
    lm_head = type(engine).prepare_model_outputs is cls.prepare_model_outputs
    return lm_head and not getattr(engine, "use_ulysses_sp", False)


# -- the tree row ----------------------------------------------------------------------------------

def trie(micro_batch: Any) -> Any:
    """The micro-batch's samples as one prefix-tree row (a ``PackedMicro``), or None when no two
    samples share a token (verl's own packed row is then the same work)."""
    from ..prefix import find_shared_prefixes, micro_tree
    from ..torch import pack_micro
    from ..types import Micro
    ids = micro_batch["input_ids"]
    offsets = ids.offsets().cpu()
    flat = ids.values().cpu()
    lens = offsets.diff().numpy().astype(np.int64)
    tokens = [flat[int(offsets[i]):int(offsets[i + 1])] for i in range(lens.size)]
    parent, shared = find_shared_prefixes(tokens)
    if not (shared > 0).any():
        return None
    members = np.arange(lens.size, dtype=np.int64)
    micro = Micro(members, lens, np.maximum(lens - 1, 0), np.zeros(lens.size),
                  tree=micro_tree(parent, shared, lens, members))
    packed = pack_micro(micro, tokens)
    STATE["last_tree"] = micro  # the meter prices this micro-batch's time by its trie (_verl_meter)
    STATE["computed"] += packed.num_tokens
    STATE["unshared"] += int(lens.sum())
    STATE["micro_batches"] += 1
    return packed


def tree_inputs(packed: Any, micro_batch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``prepare_model_inputs`` for a tree row: (model inputs, output args carrying the trie)."""
    import torch
    ids = micro_batch["input_ids"]
    device = ids.device
    model_inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in packed.model_inputs().items()}
    model_inputs["attention_mask"] = None
    args = {_KEY: packed.tree.flat_rows.to(device), "labels": torch.roll(ids.values(), shifts=-1, dims=0),
            "temperature": micro_batch["temperature"]}
    return model_inputs, args


def tree_outputs(engine: Any, output: Any, output_args: dict[str, Any], micro_batch: Any) -> dict[str, Any]:
    """``prepare_model_outputs`` for a tree row: verl's ``model_output`` dict, jagged per sample."""
    import torch
    import verl.utils.torch_functional as verl_F
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp.transformer_impl import _is_scalar_unit_temperature, _scale_logits_by_temperature
    get = lambda key: tu.get_non_tensor_data(data=micro_batch, key=key, default=False)  # noqa: E731
    ids = micro_batch["input_ids"]
    rows, labels = output_args[_KEY], output_args["labels"]
    temperature = output_args["temperature"]
    unit = _is_scalar_unit_temperature(temperature)
    if torch.is_tensor(temperature) and temperature.numel() > 1:  # per sample: one class per distinct value
        per_token = verl_F.expand_as_nested(temperature.to(torch.float32), ids).values()
        temps, t_class = torch.unique(per_token, return_inverse=True)
    else:
        temps = torch.tensor([float(temperature)], device=labels.device)
        t_class = torch.zeros_like(labels)
    from torch.distributed.tensor import DTensor
    logits = output.logits[0]
    if isinstance(logits, DTensor):  # TP shards the vocab: gather it, as verl does
        logits = logits.full_tensor()
    V = logits.shape[-1]
    key = (rows * V + labels) * temps.numel() + t_class  # distinct (row, label, temperature) triples
    uniq, inverse = torch.unique(key, return_inverse=True)
    t_u = temps.to(torch.float32)[uniq % temps.numel()]
    pair_rows = uniq // temps.numel() // V
    pair_labels = uniq // temps.numel() % V
    scored = _scale_logits_by_temperature(logits.index_select(0, pair_rows), t_u.unsqueeze(-1),
                                          is_unit_temperature=unit)
    cu = ids.offsets()
    out: dict[str, Any] = {}
    entropy = get("calculate_entropy")
    out["log_probs"] = _jagged(verl_F.logprobs_from_logits(logits=scored, labels=pair_labels,
                                                           inplace_backward=not entropy), inverse, cu)
    if entropy:
        out["entropy"] = _jagged(_entropy(engine, scored), inverse, cu)
    if get("calculate_sum_pi_squared"):
        out["sum_pi_squared"] = _jagged(verl_F.calculate_sum_pi_squared_from_logits(scored), inverse, cu)
    return out


def _entropy(engine: Any, logits: Any) -> Any:
    """verl's entropy, with its chunking / checkpointing options."""
    import torch
    cfg = engine.engine_config
    if getattr(cfg, "entropy_checkpointing", False):
        return torch.utils.checkpoint.checkpoint(engine.compute_entropy_from_logits, logits)
    if getattr(cfg, "entropy_from_logits_with_chunking", False):
        return engine.compute_entropy_from_logits(logits, chunk_size=cfg.entropy_from_logits_chunk_size)
    return engine.compute_entropy_from_logits(logits)


def _jagged(values: Any, inverse: Any, cu: Any) -> Any:
    import torch
    return torch.nested.nested_tensor_from_jagged(values.index_select(0, inverse), cu)


def _arange_positions(offsets: Any) -> Any:
    import torch
    lens = offsets.diff()
    total = int(offsets[-1])
    return torch.arange(total, dtype=torch.long) - torch.repeat_interleave(offsets[:-1].long(), lens)


def _hf_model(module: Any) -> Any:
    """The transformers model inside verl's wrappers (FSDP1 / DDP ``.module``; FSDP2 is the model)."""
    m = module
    for _ in range(8):
        if hasattr(m, "set_attn_implementation"):
            return m
        inner = getattr(m, "module", None) or getattr(m, "_fsdp_wrapped_module", None)
        if inner is None:
            break
        m = inner
    from ..errors import PlanError
    raise PlanError(f"share_prefixes: verl's module {type(module).__name__} holds no transformers model "
                    "(set_attn_implementation); install(share_prefixes=False) for this engine.")


def _tree_attention(module: Any) -> None:
    """The model runs microplan's attention (it reads the trie's path table) from now on.

    Not a context around ``forward_step``: verl runs the micro-batch's backward after
    ``forward_step`` returns, and gradient checkpointing re-runs the layers' forward there, which
    must see the same attention. :func:`_own_attention` puts the model's own back before the next
    flat micro-batch and when the loop ends."""
    from ..torch import register_attention
    model = _hf_model(module)
    name = register_attention()
    if STATE.get("restore") is not None and STATE["restore"][0] is model:
        return
    _own_attention()
    STATE["restore"] = (model, model.config._attn_implementation)
    model.set_attn_implementation(name)


def _own_attention() -> None:
    held = STATE.get("restore")
    if held is not None:
        STATE["restore"] = None
        held[0].set_attn_implementation(held[1])
