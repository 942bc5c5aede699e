"""Model FLOPs from a Hugging Face-style config: the derivation behind ``FlopsCost.from_hf_config``.

Design note:

1. Read the config (a dict or any object with attributes, e.g. a transformers
   ``PretrainedConfig``; a multimodal config's ``text_config`` is used when the top level has
   no hidden size) through a fixed alias table; ``None`` counts as missing, except where the
   model family documents what None means (GPT-2 style ``n_inner=None``: 4 × hidden).
2. Count the weights one token multiplies by, layer by layer: attention projections (GQA or
   DeepSeek MLA), the MLP of a dense layer, or router + top-k routed + shared experts of an MoE
   layer (which layers are MoE follows the config's own keys), plus the LM head once.
3. forward = 2·weights·L + attention·L², attention = Σ_layers 2·heads·(d_qk + d_v) per
   query/key pair, L²/2 pairs when causal.

Guarantees: every missing or inconsistent key is a :class:`PlanError` naming the key, its
aliases and the fix; no constant belongs to any one model. Trade-off (measured in
``tests/test_cost.py`` against the weights of the transformers meta-device models): counting
matmul weights only and ignoring norms, rotary, softmax and the causal diagonal (L/2 pairs)
moves the linear term by < 0.01 % for Llama-3-8B, Qwen3-30B-A3B and DeepSeek-V3.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._checks import int_field
from ..errors import PlanError

__all__ = ["ForwardFlops", "forward_flops", "kv_values_per_token"]

# --------------------------------------------------------------------------------------------
# Model FLOPs from a Hugging Face-style config
# --------------------------------------------------------------------------------------------

_ALIASES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "d_model", "n_embd"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads", "n_kv_heads"),
    "head_dim": ("head_dim",),
    "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "num_experts_per_tok": ("num_experts_per_tok", "moe_topk", "experts_per_token"),
    "moe_intermediate_size": ("moe_intermediate_size",),
    "n_shared_experts": ("n_shared_experts", "num_shared_experts"),
    "shared_expert_intermediate_size": ("shared_expert_intermediate_size",),
    "hidden_act": ("hidden_act", "hidden_activation", "activation_function"),
    "model_type": ("model_type",),
    # DeepSeek multi-head latent attention (MLA); present <=> kv_lora_rank is set.
    "kv_lora_rank": ("kv_lora_rank",),
    "q_lora_rank": ("q_lora_rank",),
    "qk_nope_head_dim": ("qk_nope_head_dim",),
    "qk_rope_head_dim": ("qk_rope_head_dim",),
    "v_head_dim": ("v_head_dim",),
    # Which layers are MoE (all neutral when absent).
    "first_k_dense_replace": ("first_k_dense_replace",),
    "moe_layer_freq": ("moe_layer_freq",),
    "decoder_sparse_step": ("decoder_sparse_step",),
    "mlp_only_layers": ("mlp_only_layers",),
}

# Families whose MLP is gated (gate·act(up), 3 matrices) or plain (2 matrices) whatever the
# activation is called. Outside these lists the activation name decides (see forward_flops).
_GATED_TYPES = frozenset({
    "llama", "llama4_text", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
    "deepseek_v2", "deepseek_v3", "gemma", "gemma2", "gemma3", "gemma3_text", "phi3", "olmo",
    "olmo2", "olmoe", "granite", "granitemoe", "cohere", "cohere2", "glm", "glm4", "glm4_moe",
    "internlm2", "gpt_oss", "ernie4_5", "ernie4_5_moe", "hunyuan_v1_dense", "hunyuan_v1_moe",
    "minimax", "smollm3", "exaone4", "seed_oss"})
_PLAIN_TYPES = frozenset({
    "gpt2", "gpt_neox", "gptj", "gpt_bigcode", "opt", "bloom", "falcon", "phi", "starcoder2",
    "mpt", "codegen", "bert", "roberta"})
_GATED_ACTS = ("silu", "swish", "swiglu", "geglu", "reglu")

# Documented defaults of keys a config may leave null. GPT-2 style configs (transformers'
# GPT2Config, GPTJConfig, GPTBigCodeConfig, CodeGenConfig: ``n_inner=None``) mean an MLP of
# 4 × hidden; their config.json files hold ``"n_inner": null``.
_FFN_4X_TYPES = frozenset({"gpt2", "gptj", "gpt_bigcode", "codegen", "imagegpt", "decision_transformer"})


class _Config:
    """Alias-aware read access to a dict-like or attribute-style config."""

    def __init__(self, config: Any) -> None:
        if config is None or isinstance(config, (str, bytes, int, float, Sequence)):
            raise PlanError(f"from_hf_config needs a config dict or a config object (e.g. "
                            f"transformers.AutoConfig.from_pretrained(...)), got {type(config).__name__}.")
        self._cfg = config
        if self.find("hidden_size") is None:  # multimodal wrapper: use its language model
            text = self._raw("text_config")
            if text is not None:
                self._cfg = text

    def _raw(self, key: str) -> Any:
        if isinstance(self._cfg, Mapping):
            return self._cfg.get(key)
        return getattr(self._cfg, key, None)

    def find(self, field: str) -> tuple[str, Any] | None:
        """(alias that matched, value) for the first alias present and not None."""
        for alias in _ALIASES[field]:
            value = self._raw(alias)
            if value is not None:
                return alias, value
        return None

    def get_int(self, field: str, *, default: int | None = None, minimum: int = 1,
            why: str = "") -> int:
        hit = self.find(field)
        if hit is None and field == "intermediate_size" and self.get_text("model_type") in _FFN_4X_TYPES:
            return 4 * self.get_int("hidden_size")   # n_inner=None: the documented 4 × n_embd
        if hit is None:
            if default is not None:
                return default
            aliases = ", ".join(repr(a) for a in _ALIASES[field])
            nulls = [a for a in _ALIASES[field] if self._has(a)]
            null = (f" ({', '.join(repr(a) for a in nulls)} is null: the model library fills in a default microplan "
                    "does not know for this model_type)" if nulls else "")
            raise PlanError(f"model config has no value for {field!r}{why}{null}; accepted keys: {aliases}. Set one "
                            f"to the model's real value (e.g. the MLP width for intermediate_size), as a number.")
        return int_field(f"config[{hit[0]!r}]", hit[1], minimum=minimum)

    def _has(self, key: str) -> bool:
        """``key`` is present (possibly null)."""
        return key in self._cfg if isinstance(self._cfg, Mapping) else hasattr(self._cfg, key)

    def get_ints(self, field: str) -> frozenset[int]:
        hit = self.find(field)
        if hit is None:
            return frozenset()
        if isinstance(hit[1], (str, bytes)) or not isinstance(hit[1], Sequence):
            raise PlanError(f"config[{hit[0]!r}]={hit[1]!r} must be a list of layer indices.")
        return frozenset(int_field(f"config[{hit[0]!r}][{i}]", v, minimum=0) for i, v in enumerate(hit[1]))

    def get_text(self, field: str) -> str | None:
        hit = self.find(field)
        return None if hit is None else str(hit[1]).lower()


@dataclass(frozen=True, kw_only=True)
class ForwardFlops:
    """Forward FLOPs of one sequence of L tokens: ``linear·L + quadratic·L²``.

    Attributes (weights are counted per token, i.e. the weights one token is multiplied by):
        layers: decoder layers; moe_layers: how many of them are MoE.
        attention_params: q/k/v/o (or MLA) projection weights, all layers.
        mlp_params: dense-layer MLPs plus, in MoE layers, the top-k routed and the shared experts.
        router_params: the hidden×experts router of every MoE layer.
        lm_head_params: hidden×vocab, counted once (tied or not).
        attention_flops: forward FLOPs per L² of the score (QKᵀ) and value (AV) products, all layers.
        gated_mlp, causal: the choices the counts were made with.
    """

    layers: int
    moe_layers: int
    attention_params: int
    mlp_params: int
    router_params: int
    lm_head_params: int
    attention_flops: float
    gated_mlp: bool
    causal: bool

    @property
    def active_params(self) -> int:
        """Weights touched per token, excluding the (free) embedding lookup: the N of "6N"."""
        return self.attention_params + self.mlp_params + self.router_params + self.lm_head_params

    @property
    def linear(self) -> float:
        """Forward FLOPs per token: one multiply-add (2 FLOPs) per touched weight."""
        return 2.0 * self.active_params

    @property
    def quadratic(self) -> float:
        """Forward FLOPs per squared token of one sequence."""
        return self.attention_flops


def _infer_gated(cfg: _Config) -> bool:
    model_type = cfg.get_text("model_type")
    if model_type in _GATED_TYPES:
        return True
    if model_type in _PLAIN_TYPES:
        return False
    act = cfg.get_text("hidden_act")
    if act is None:
        raise PlanError(f"cannot tell whether the MLP is gated: model_type={model_type!r} is not a known "
                        f"family and the config has no activation ({', '.join(_ALIASES['hidden_act'])}); "
                        f"pass gated_mlp=True (SwiGLU/GeGLU, 3 matrices) or gated_mlp=False (2 matrices).")
    return act.startswith(_GATED_ACTS) or act.endswith("glu")


def _attention(cfg: _Config, hidden: int, heads: int) -> tuple[int, int, int]:
    """(projection weights per layer, d_qk, d_v) for GQA/MHA/MQA or DeepSeek MLA."""
    kv_rank = cfg.get_int("kv_lora_rank", default=0, minimum=0)
    if kv_rank:  # MLA, training-time (non-absorbed) form
        why = " (kv_lora_rank is set, so the config describes multi-head latent attention)"
        nope = cfg.get_int("qk_nope_head_dim", minimum=0, why=why)
        rope = cfg.get_int("qk_rope_head_dim", minimum=0, why=why)
        d_v = cfg.get_int("v_head_dim", why=why)
        d_qk = nope + rope
        if d_qk == 0:
            raise PlanError("config['qk_nope_head_dim'] + config['qk_rope_head_dim'] is 0; the query/key "
                            "head dimension must be >= 1.")
        q_rank = cfg.get_int("q_lora_rank", default=0, minimum=0)
        q = hidden * q_rank + q_rank * heads * d_qk if q_rank else hidden * heads * d_qk
        kv = hidden * (kv_rank + rope) + kv_rank * heads * (nope + d_v)
        return q + kv + heads * d_v * hidden, d_qk, d_v
    kv_heads = cfg.get_int("num_key_value_heads", default=heads)  # absent = multi-head attention (HF default)
    if heads % kv_heads:
        raise PlanError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}; "
                        f"grouped-query attention shares each kv head among a whole number of query heads.")
    head_dim = cfg.get_int("head_dim", default=0)
    if not head_dim:
        if hidden % heads:
            raise PlanError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads} and the "
                            f"config has no 'head_dim'; add head_dim to the config.")
        head_dim = hidden // heads
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim, head_dim, head_dim


def _is_moe_layer(i: int, cfg: _Config, dense_layers: frozenset[int]) -> bool:
    """Layer i is MoE unless one of the config's own layout keys makes it dense (DeepSeek:
    i < first_k_dense_replace or i % moe_layer_freq != 0; Qwen: i in mlp_only_layers or
    (i+1) % decoder_sparse_step != 0). Absent keys are neutral: Mixtral has none (all MoE)."""
    if i in dense_layers or i < cfg.get_int("first_k_dense_replace", default=0, minimum=0):
        return False
    if i % cfg.get_int("moe_layer_freq", default=1):
        return False
    return (i + 1) % cfg.get_int("decoder_sparse_step", default=1) == 0


def forward_flops(config: Mapping[str, Any] | object, *, causal: bool = True,
                  gated_mlp: bool | None = None) -> ForwardFlops:
    """Count the forward FLOPs of a decoder-only transformer from its Hugging Face config.

    Per token and layer: attention projections (q, o: hidden×heads·head_dim; k, v:
    hidden×kv_heads·head_dim; ``head_dim`` defaults to hidden/heads; MLA when ``kv_lora_rank``
    is set) and either a dense MLP (``intermediate_size``) or an MoE block (router
    hidden×experts, top-k routed experts of ``moe_intermediate_size`` — ``intermediate_size``
    when absent, as in Mixtral — plus shared experts: ``shared_expert_intermediate_size`` if
    given, else ``n_shared_experts × moe_intermediate_size``). Then the LM head hidden×vocab
    once. Each weight costs 2 FLOPs per token. Attention scores and values cost
    2·heads·(d_qk + d_v) FLOPs per query/key pair and layer; a causal sequence has L²/2 pairs
    (the L/2 diagonal is dropped), a non-causal one L².

    Gated-MLP rule (``gated_mlp=None``): ``model_type`` in a list of gated families (Llama,
    Mistral/Mixtral, Qwen2/3(-MoE), DeepSeek, Gemma, Phi-3, OLMo, GLM, gpt-oss, ...) → 3
    matrices; in a list of plain families (GPT-2, GPT-NeoX, OPT, BLOOM, Falcon, Phi-1/2,
    StarCoder2, ...) → 2; otherwise the activation decides: silu/swish or a name ending in "glu"
    → gated, anything else (gelu, relu, ...) → plain.

    Raises:
        PlanError: a required key is missing or malformed; the message names the key and aliases.
    """
    if not isinstance(causal, bool):
        raise PlanError(f"causal={causal!r} must be True or False.")
    if gated_mlp is not None and not isinstance(gated_mlp, bool):
        raise PlanError(f"gated_mlp={gated_mlp!r} must be True, False or None (infer from the config).")
    cfg = _Config(config)
    hidden = cfg.get_int("hidden_size")
    layers = cfg.get_int("num_hidden_layers")
    heads = cfg.get_int("num_attention_heads")
    vocab = cfg.get_int("vocab_size")
    attn_per_layer, d_qk, d_v = _attention(cfg, hidden, heads)
    gated = _infer_gated(cfg) if gated_mlp is None else gated_mlp
    mats = 3 if gated else 2

    experts = cfg.get_int("num_experts", default=0, minimum=0)
    dense_only = cfg.get_ints("mlp_only_layers")
    moe_layers = sum(_is_moe_layer(i, cfg, dense_only) for i in range(layers)) if experts else 0
    mlp = 0
    router = 0
    if layers - moe_layers:
        why = f" ({layers - moe_layers} of {layers} layers have a dense MLP)"
        mlp += (layers - moe_layers) * mats * hidden * cfg.get_int("intermediate_size", why=why)
    if moe_layers:
        why = f" (the config has {experts} experts)"
        top_k = cfg.get_int("num_experts_per_tok", why=why)
        if top_k > experts:
            raise PlanError(f"num_experts_per_tok={top_k} exceeds the number of experts {experts}; "
                            f"check the MoE keys of the config.")
        if cfg.find("moe_intermediate_size") is not None:
            expert_ffn = cfg.get_int("moe_intermediate_size")
        else:
            expert_ffn = cfg.get_int("intermediate_size", why=why + " and no 'moe_intermediate_size'")
        shared_ffn = cfg.get_int("shared_expert_intermediate_size", default=0, minimum=0)
        if not shared_ffn:
            shared_ffn = cfg.get_int("n_shared_experts", default=0, minimum=0) * expert_ffn
        mlp += moe_layers * mats * hidden * (top_k * expert_ffn + shared_ffn)
        router = moe_layers * hidden * experts
    pairs = 0.5 if causal else 1.0
    return ForwardFlops(layers=layers, moe_layers=moe_layers, attention_params=layers * attn_per_layer,
                        mlp_params=mlp, router_params=router, lm_head_params=hidden * vocab,
                        attention_flops=layers * 2.0 * heads * (d_qk + d_v) * pairs,
                        gated_mlp=gated, causal=causal)


def kv_values_per_token(config: Mapping[str, Any] | object) -> int:
    """Key and value elements one token carries over all layers: what a CP group all-gathers.

    GQA/MHA/MQA: ``2 · num_key_value_heads · head_dim · layers`` (head_dim defaults to
    hidden/heads); DeepSeek MLA in its training-time form: ``heads · (d_qk + d_v) · layers``.
    """
    cfg = _Config(config)
    hidden, heads = cfg.get_int("hidden_size"), cfg.get_int("num_attention_heads")
    layers = cfg.get_int("num_hidden_layers")
    _, d_qk, d_v = _attention(cfg, hidden, heads)
    if cfg.get_int("kv_lora_rank", default=0, minimum=0):
        return layers * heads * (d_qk + d_v)
    return layers * cfg.get_int("num_key_value_heads", default=heads) * (d_qk + d_v)
