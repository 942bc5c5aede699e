"""Peak bytes from a Hugging Face config: the derivation behind ``MemoryModel.from_hf_config``.

Design note (docs/memory.md has the worked example and the sources). Elements a token keeps per
decoder layer for the backward, in the layout of Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", table 2, there ``sbh(34 + 5as/h)`` bytes at 16 bits
with dropout) for a modern decoder (no dropout, RMSNorm, GQA, gated MLP):

    layer = 2h (input norm: input, output) + q + k + v (attention inputs) + o (attention output)
          + 2h (post-attention norm) + mlp,   mlp = 4f gated (gate, up, act(gate), product) | 2f plain

with h the hidden size, q = heads·d_qk, k + v = kv_heads·(d_qk + d_v), o = heads·d_v, f the MLP
width of that layer (an MoE layer: top-k experts' widths plus the shared experts'; a model's dense
layers — DeepSeek's first ones, Qwen's ``mlp_only_layers`` — ``intermediate_size``, as the cost
model reads them). Under tensor parallelism with sequence parallelism every term divides by t
(Megatron's ``theoretical_memory_usage.py``). ``layers·layer`` below is the sum over the layers;
a lone ``layer`` is the largest one.

- Without recomputation the backward starts with every layer saved and the logits alive:
  ``per_token = e·(layers·layer + 3h) + logits``, 3h for the embedding output and the final norm.
- Full recomputation (``gradient_checkpointing``) keeps each layer's input (h) and rebuilds one
  layer at a time after the logits are freed: ``e·(layers·h + 3h) + max(logits, e·layer)``.
- Logits (V/t columns): the model's logits (e), their upcast copy (4 bytes unless e is already
  float32), the log-softmax output, and in training its two gradients: ``V/t·(e + up + 3·le)``;
  the forward-only pass ``V/t·(e + up + le)`` (``microplan.logits_bytes`` counts the same copies).
- Attention: ``fa2``/``fa3`` keep O(T) softmax statistics (no quadratic term). ``eager``
  materialises each head's scores over the row it is given, saved per layer:
  ``per_sample_sq = per_row_sq = layers·heads·e/t`` (×3 with attention dropout: mask and dropout
  output, Korthikanti's 5as²); with recomputation one layer at a time (×2: scores and their
  gradient). ``sdpa-packed`` (transformers' sdpa over a packed row): a lone sample runs the
  unmasked causal kernel (no quadratic term), two or more samples a 1-byte boolean ``[T, T]``
  mask plus the two float32 ``[T, T]`` copies the CPU kernel makes of it: ``per_row_sq = 9``;
  under recomputation the copies come and go while less is alive and the boolean mask is what
  shows: ``per_row_sq = 1``.
- Forward-only pass: nothing is saved; the peak is the larger of one layer's transients and the
  logits, above the hidden state: ``e·(3h + layer) `` vs ``e·3h + logits``.
- Prefix trees (``share_prefixes``): on GPU microplan's tree attention runs flash-attn's varlen
  kernel over each segment's gathered path keys and keeps path tables; ``tree_factor`` (default
  1.25) is that overhead over the flat row of the same unique tokens (on CPU the split tree
  attention reads shared keys in place and needs none); ``profile_memory(trees=True)`` measures
  it for a real model.
- Context parallel: each GPU keeps the gathered keys/values of the whole row, per layer
  (``kv_per_token = e·layers·(k + v)/t``; one layer under recomputation).

Trade-off: the formula ignores the allocator's rounding and fragmentation, the optimizer and
what the framework keeps around; hence ``margin`` (default 10 %) and ``profile_memory``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from .._checks import float_field, int_field
from ..cost.hf import _attention, _Config, _infer_gated, _is_moe_layer
from ..errors import PlanError

__all__ = ["MEMORY_ATTENTION", "LayerElements", "dtype_bytes", "memory_from_hf_config", "layer_elements"]

#: Attention kernels ``from_hf_config`` knows (the cost model's names, plus eager).
MEMORY_ATTENTION = ("fa2", "fa3", "sdpa-packed", "eager")
_DTYPES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float32": 4, "fp32": 4, "float": 4,
           "float64": 8, "double": 8, "fp8": 1, "float8_e4m3fn": 1}
#: sdpa over a packed row on CPU: the 1-byte boolean mask and two float32 copies per [T, T] pair
#: (under recomputation: the boolean mask).
SDPA_MASK_BYTES = 9.0
SDPA_MASK_BYTES_RECOMPUTE = 1.0
#: prefix-tree micro-batches: bytes over what their unique tokens predict (measured 1.18-1.21x on CPU)
TREE_FACTOR = 1.25


def dtype_bytes(dtype: Any, what: str = "dtype") -> int:
    """Bytes per element of a dtype given by name (``"bfloat16"``) or as a torch dtype."""
    name = str(dtype).removeprefix("torch.").lower()
    if name not in _DTYPES:
        raise PlanError(f"{what}={dtype!r} is not a dtype microplan knows; pass one of "
                        f"{', '.join(sorted(_DTYPES))} (or the torch dtype).")
    return _DTYPES[name]


def _mlp_widths(cfg: _Config) -> list[int]:
    """The MLP width of every decoder layer: ``intermediate_size`` for a dense layer; for an MoE
    layer (``cost.hf._is_moe_layer``: DeepSeek's first dense layers, Qwen's ``mlp_only_layers``
    and sparse steps) the top-k routed experts' width plus the shared experts'."""
    layers = cfg.get_int("num_hidden_layers")
    experts = cfg.get_int("num_experts", default=0, minimum=0)
    if not experts:
        return [cfg.get_int("intermediate_size")] * layers
    topk = cfg.get_int("num_experts_per_tok", default=1)
    dense_only = cfg.get_ints("mlp_only_layers")
    moe = [_is_moe_layer(i, cfg, dense_only) for i in range(layers)]
    # intermediate_size: the dense layers' width, and the experts' when moe_intermediate_size is absent (Mixtral)
    f = 0 if all(moe) and cfg.find("moe_intermediate_size") is not None else cfg.get_int("intermediate_size")
    f_e = cfg.get_int("moe_intermediate_size", default=f)
    shared = cfg.get_int("shared_expert_intermediate_size", default=0, minimum=0) or \
        cfg.get_int("n_shared_experts", default=0, minimum=0) * f_e
    return [topk * f_e + shared if m else f for m in moe]


class LayerElements(NamedTuple):
    """Elements one token keeps per decoder layer (module note), from a config.

    Attributes:
        total: Σ over the decoder layers (dense and MoE layers differ in their MLP width).
        largest: the largest single layer (what one recomputed or forward-only layer holds).
        hidden: the hidden size h.
        layers: decoder layers.
        kv: key + value elements per layer.
    """

    total: int
    largest: int
    hidden: int
    layers: int
    kv: int


def layer_elements(config: Mapping[str, Any] | object, gated_mlp: bool | None = None) -> LayerElements:
    """Elements a token keeps per decoder layer (:class:`LayerElements`); ``gated_mlp`` None:
    inferred from the config."""
    cfg = _Config(config)
    h, heads = cfg.get_int("hidden_size"), cfg.get_int("num_attention_heads")
    layers = cfg.get_int("num_hidden_layers")
    _, d_qk, d_v = _attention(cfg, h, heads)
    kv_heads = heads if cfg.get_int("kv_lora_rank", default=0, minimum=0) else \
        cfg.get_int("num_key_value_heads", default=heads)
    gated = _infer_gated(cfg) if gated_mlp is None else bool(gated_mlp)
    kv = kv_heads * (d_qk + d_v)
    base = 4 * h + heads * d_qk + kv + heads * d_v
    per_layer = [base + (4 * f if gated else 2 * f) for f in _mlp_widths(cfg)]
    return LayerElements(sum(per_layer), max(per_layer), h, layers, kv)


def _dropout(config: Any) -> bool:
    cfg = _Config(config)
    for key in ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"):
        v = cfg._raw(key)
        if v is not None and float(v) > 0:
            return True
    return False


def memory_from_hf_config(cls: Any, config: Mapping[str, Any] | object, *, dtype: Any, attention: str,
                          gradient_checkpointing: bool, logits_dtype: Any, tensor_parallel: int,
                          margin: float, gated_mlp: bool | None = None) -> Any:
    """The body of ``MemoryModel.from_hf_config`` (see the module note for every term)."""
    if attention not in MEMORY_ATTENTION:
        raise PlanError(f"MemoryModel.from_hf_config(attention={attention!r}): name the kernel the model runs, one "
                        f"of {', '.join(MEMORY_ATTENTION)} (memory depends on it: eager and packed sdpa hold "
                        "[T, T] tensors, flash kernels do not); profile_memory measures any other.")
    if not isinstance(gradient_checkpointing, bool):
        raise PlanError(f"gradient_checkpointing={gradient_checkpointing!r} must be True or False.")
    e, le = dtype_bytes(dtype), dtype_bytes(logits_dtype, "logits_dtype")
    t = int_field("tensor_parallel", tensor_parallel, minimum=1)
    m = float_field("margin", margin, minimum=0.0)
    el = layer_elements(config, gated_mlp)
    layer, h, layers, kv = el.largest, el.hidden, el.layers, el.kv
    heads = _Config(config).get_int("num_attention_heads")
    vocab = _Config(config).get_int("vocab_size")
    up = 0 if le == e else le
    logits_fwd = vocab / t * (e + up + le)
    logits_train = vocab / t * (e + up + 3 * le)
    rest = 3.0 * h * e / t
    if gradient_checkpointing:
        per_token = e * layers * h / t + rest + max(logits_train, e * layer / t)
        copies, score_layers, kv_layers = 2, 1, 1
    else:
        per_token = e * el.total / t + rest + logits_train
        copies, score_layers, kv_layers = (3 if _dropout(config) else 1), layers, layers
    scores = score_layers * heads * e * copies / t
    sample_sq, row_sq = {"fa2": (0.0, 0.0), "fa3": (0.0, 0.0), "eager": (scores, scores),
                         "sdpa-packed": (0.0, SDPA_MASK_BYTES_RECOMPUTE if gradient_checkpointing
                                         else SDPA_MASK_BYTES)}[attention]
    fwd_scores = heads * e / t if attention == "eager" else 0.0
    fwd = cls(per_token=rest + max(logits_fwd, e * layer / t), per_sample_sq=fwd_scores,
              per_row_sq=SDPA_MASK_BYTES if attention == "sdpa-packed" else fwd_scores,
              kv_per_token=e * kv / t, margin=m, tree_factor=TREE_FACTOR,
              note=f"from_hf_config forward-only, {attention}, {dtype}")
    return cls(per_token=per_token, per_sample_sq=sample_sq, per_row_sq=row_sq, kv_per_token=e * kv_layers * kv / t,
               margin=m, forward=fwd, tree_factor=TREE_FACTOR,
               note=f"from_hf_config, {attention}, {dtype}, checkpointing {'on' if gradient_checkpointing else 'off'}")
