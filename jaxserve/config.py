"""Model configuration: a frozen, validated view of a Hugging Face ``config.json``.

Read once at start-up (``models/families/registry.load_model_config``, which finds the family
of its ``model_type``) and passed down to the weights loader, the model and the runner. One
generic parser (``parse_model_config``) reads every family: what a family turns on is its
``ConfigFeatures``, data and small readers its record in ``models/families/`` gives; nothing
here names a family. Parsing goes through transformers' ``AutoConfig`` so both the classic
``rope_theta`` / ``rope_scaling`` keys and transformers 5's ``rope_parameters`` are understood,
including Gemma 3's rope parameters per layer type (one base for local, one for global layers).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jaxserve.config_fields import ConfigError, ConfigFields

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SLIDING, FULL = "sliding_attention", "full_attention"  # Hugging Face's layer_types values
MOE_SCORINGS = ("softmax", "sigmoid")

_LOG = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling, one ``rope_type`` of Hugging Face's ``rope_parameters``.

    linear: positions divided by ``factor``. dynamic: NTK, the base grows with the position once
    it passes ``original_max_position_embeddings``. yarn: frequencies blended between scaled
    and unscaled by wavelength (``beta_fast`` / ``beta_slow``), cos/sin times
    ``attention_factor``. longrope (Phi-3, once spelled ``su``): per-frequency ``short_factor``
    below ``original_max_position_embeddings``, ``long_factor`` from there on. llama3: long
    wavelengths slowed by ``factor``, short ones kept, smooth in between.
    """

    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0
    rope_type: str = "llama3"
    attention_factor: float = 1.0  # yarn, longrope: scale of cos and sin
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions
    short_factor: tuple[float, ...] = ()  # longrope, one per frequency
    long_factor: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"rope_type={self.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        if self.factor <= 0:
            raise ConfigError(f"rope factor={self.factor} must be positive")
        if self.rope_type in ("dynamic", "yarn", "longrope", "llama3"):
            if self.original_max_position_embeddings <= 0:
                raise ConfigError(
                    f"rope_type={self.rope_type!r} needs a positive original_max_position_"
                    f"embeddings, got {self.original_max_position_embeddings}"
                )
        if self.rope_type == "longrope" and len(self.short_factor) != len(self.long_factor):
            raise ConfigError(
                f"longrope short_factor ({len(self.short_factor)} values) and long_factor "
                f"({len(self.long_factor)}) must have one value per rotary frequency each"
            )


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A mixture of experts' router and experts (Mixtral, Qwen3-MoE; DeepSeek's routing).

    Each token's router scores (softmax or sigmoid of the router logits) pick ``top_k`` of
    ``num_experts`` experts. DeepSeek's grouped top-k first keeps the ``topk_group`` best of
    ``n_group`` expert groups (a group scores the sum of its two best experts, each biased by
    ``e_score_correction_bias``), then picks among their experts; the bias steers the choice
    only, not the weights. ``norm_topk_prob`` rescales the picked weights to sum to one, then
    all are times ``routed_scaling_factor``. Shared experts (``shared_intermediate_size`` > 0)
    are a dense MLP every token also goes through, its output optionally times a sigmoid gate.
    """

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    scoring: str = "softmax"
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    has_correction_bias: bool = False  # e_score_correction_bias (DeepSeek-V3)
    shared_intermediate_size: int = 0  # 0: no shared expert
    has_shared_gate: bool = False  # the shared expert's output times sigmoid(x @ gate)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead of experts
    # GPT-OSS: biases on the router logits and on the experts' gate, up and down projections,
    # and the clamped swiglu ``(up + 1) * gate * sigmoid(alpha * gate)`` (gate clamped above
    # at the limit, up to [-limit, limit]) in place of ``act(gate) * up``.
    has_biases: bool = False
    swiglu_limit: float | None = None  # None: the plain ``act(gate) * up``
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok={self.top_k} exceeds num_experts={self.num_experts}"
            )
        if self.scoring not in MOE_SCORINGS:
            raise ConfigError(
                f"scoring_func={self.scoring!r} is not supported; supported: "
                f"{', '.join(MOE_SCORINGS)}"
            )
        if self.num_experts % self.n_group:
            raise ConfigError(f"n_group={self.n_group} must divide num_experts={self.num_experts}")
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
        if self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ConfigError(
                f"n_group={self.n_group} leaves fewer than 2 experts per group "
                f"(num_experts={self.num_experts}); a group scores its two best"
            )
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ConfigError(
                f"num_experts_per_tok={self.top_k} exceeds the {self.topk_group} groups' "
                f"{self.topk_group * (self.num_experts // self.n_group)} experts"
            )
        if self.shared_intermediate_size < 0:
            raise ConfigError(
                f"shared_intermediate_size={self.shared_intermediate_size} must be >= 0"
            )
        if self.swiglu_limit is not None and not self.swiglu_limit > 0:
            raise ConfigError(f"swiglu_limit={self.swiglu_limit} must be positive")


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values come from one latent.

    Each token's hidden state is compressed to ``kv_lora_rank`` (then RMSNorm) and a shared
    rotary key of ``qk_rope_head_dim``; per head, the key's ``qk_nope_head_dim`` part and the
    value (``v_head_dim``) are expanded from the latent by ``kv_b_proj``. The query comes from
    ``q_proj``, or through a ``q_lora_rank`` bottleneck (q_a_proj, RMSNorm, q_b_proj).
    ``rope_interleave``: the rotary dims are pairs (x0, x1), (x2, x3), ... as DeepSeek's
    checkpoints lay them out, not halves. ``softmax_scale``: the attention scores' scale,
    (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 times YaRN's mscale(factor, mscale_all_dim)
    squared, as transformers computes it.
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: a plain q_proj
    rope_interleave: bool = True
    softmax_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.q_lora_rank is not None and (
            not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0
        ):
            raise ConfigError(
                f"q_lora_rank={self.q_lora_rank!r} must be a positive integer or null"
            )
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3, Gemma 3)
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    hidden_act: str = "silu"  # the MLP's gate activation
    # Per layer, SLIDING or FULL; empty: every layer slides when sliding_window is set.
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # Gemma 3: unscaled rope base of the sliding layers
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the output logits
    query_pre_attn_scalar: float | None = None  # attention scale scalar ** -0.5 (Gemma)
    # Gemma: RMSNorm scales by (1 + weight), embeddings times sqrt(hidden_size), and norms after
    # attention and after the MLP as well as before them.
    is_gemma: bool = False
    moe: MoeConfig | None = None  # a mixture of experts (Mixtral, Qwen3-MoE); None: dense
    # GPT-OSS: a learned logit per query head that joins each row's softmax denominator
    # (attention sinks), and a bias on the attention's output projection.
    attention_sinks: bool = False
    o_proj_bias: bool = False
    # DeepSeek-V3: multi-head latent attention; the cache holds one latent per token.
    mla: MlaConfig | None = None
    # max_position_embeddings already counts the rope scaling's stretch (Gemma 3).
    max_positions_are_scaled: bool = False

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.num_q_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_q_heads={self.num_q_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                f"hidden_act={self.hidden_act!r} is not supported; supported: "
                f"{', '.join(ACTIVATIONS)}"
            )
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ConfigError(
                    f"layer_types has {len(self.layer_types)} entries, "
                    f"num_hidden_layers={self.num_layers}"
                )
            unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
            if unknown:
                raise ConfigError(f"layer_types: {unknown} not one of {SLIDING!r}, {FULL!r}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window={self.sliding_window} must be positive")
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "longrope":
            if len(scaling.short_factor) != self.head_dim // 2:
                raise ConfigError(
                    f"longrope short_factor has {len(scaling.short_factor)} values, "
                    f"head_dim={self.head_dim} needs {self.head_dim // 2}"
                )
        if self.moe is not None:
            outside = [i for i in self.moe.dense_layers if not 0 <= i < self.num_layers]
            if outside:
                raise ConfigError(
                    f"mlp_only_layers {outside} outside num_hidden_layers={self.num_layers}"
                )

    @property
    def derived_max_model_len(self) -> int:
        """The longest context the model was made for, by vLLM's rule: max_position_embeddings,
        times the rope factor where the rope stretches it (linear, dynamic; yarn from its
        original length). llama3, longrope and Gemma 3 count it in max_position_embeddings."""
        scaling = self.rope_scaling
        if (
            scaling is None
            or scaling.rope_type in ("llama3", "longrope")
            or self.max_positions_are_scaled
        ):
            return self.max_position_embeddings
        is_yarn = scaling.rope_type == "yarn"
        base = scaling.original_max_position_embeddings if is_yarn else self.max_position_embeddings
        return int(base * scaling.factor)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` runs experts (else its dense MLP)."""
        return self.moe is not None and layer not in self.moe.dense_layers

    @property
    def q_size(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def sm_scale(self) -> float:
        """The attention scores' scale."""
        if self.mla is not None:
            return self.mla.softmax_scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of one token's entry in each of a layer's two page arrays: K and V;
        for multi-head latent attention the latent c_kv [1, kv_lora_rank] and the rotated
        shared key k_pe [1, qk_rope_head_dim] (``models/mla.py``)."""
        if self.mla is not None:
            return (1, self.mla.kv_lora_rank), (1, self.mla.qk_rope_head_dim)
        return (self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim)

    def is_sliding_layer(self, layer: int) -> bool:
        if self.sliding_window is None:
            return False
        return not self.layer_types or self.layer_types[layer] == SLIDING

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer``, or None where it attends to every token."""
        return self.sliding_window if self.is_sliding_layer(layer) else None

    @property
    def all_layers_window(self) -> int | None:
        """The sliding window when every layer has one, else None. Only then can a sequence's
        KV blocks behind the window be freed: one KV pool serves every layer, so a hybrid
        model (Gemma 2/3, with global layers) keeps all of them."""
        if self.sliding_window is None or not all(
            self.is_sliding_layer(i) for i in range(self.num_layers)
        ):
            return None
        return self.sliding_window

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(rope base, scaling) of layer ``layer``: Gemma 3's local layers have their own."""
        if self.rope_local_theta is not None and self.is_sliding_layer(layer):
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling


def _attention_bias_key(hf: ConfigFields) -> bool:
    return hf.boolean("attention_bias", False)


@dataclasses.dataclass(frozen=True)
class ConfigFeatures:
    """What a model family turns on in ``parse_model_config``: flags, and readers of the
    config.json fields only that family has. Each family's record in ``models/families/`` gives
    its own; the defaults are Llama's."""

    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3, Gemma 3)
    # Whether the layers have q/k/v biases; by default config.json's ``attention_bias``.
    attention_bias: Callable[[ConfigFields], bool] = _attention_bias_key
    # ``sliding_window`` counts only with ``use_sliding_window`` (Qwen).
    sliding_window_opt_in: bool = False
    # (1 + weight) RMSNorm, scaled embeddings, norms after attention and MLP (Gemma).
    is_gemma: bool = False
    # Each layer's SLIDING or FULL, from config.json and the sliding window (None: every layer
    # slides when the config has a window).
    layer_types: Callable[[ConfigFields, int | None], tuple[str, ...]] | None = None
    # rope_parameters per layer type: the sliding layers' own unscaled base (Gemma 3).
    local_rope: bool = False
    max_positions_are_scaled: bool = False  # ModelConfig's, for derived_max_model_len
    # The family's experts, from config.json (None: a dense MLP).
    moe: Callable[[ConfigFields], MoeConfig] | None = None
    # Multi-head latent attention, from config.json and its rope parameters (DeepSeek-V3).
    mla: Callable[[ConfigFields, ConfigFields], MlaConfig] | None = None
    attention_sinks: bool = False  # a sink logit per query head (GPT-OSS)
    o_proj_bias: bool = False  # ``attention_bias`` biases the output projection too (GPT-OSS)


def read_config_json(config_path: Path) -> dict[str, Any]:
    """A model directory's config.json, as a dict (missing or not JSON: a ``ConfigError``)."""
    if not config_path.is_file():
        raise ConfigError(f"{config_path} not found: a model directory needs config.json")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{config_path} is not valid JSON: {exc}") from exc
    return raw


def parse_model_config(raw: dict[str, Any], features: ConfigFeatures) -> ModelConfig:
    """A config.json dict (either rope key spelling), read as its family's ``features`` say
    (``models/families/registry.model_config_from_dict`` finds them)."""
    raw = _rename_su(raw)
    _check_rope_fields(raw)  # before transformers, whose checks name no field
    try:
        from transformers import AutoConfig

        # a copy: transformers moves fields into the nested rope dict of what it is given
        hf = AutoConfig.for_model(**copy.deepcopy(raw)).to_dict()
    except Exception as exc:  # transformers rejects malformed fields with many exception types
        raise ConfigError(f"config.json could not be parsed: {exc}") from exc
    return _from_parsed(ConfigFields(hf), features)


def _from_parsed(hf: ConfigFields, features: ConfigFeatures) -> ModelConfig:
    """Every field read through ``ConfigFields``: a wrong type is a ``ConfigError`` that names
    it."""
    num_q_heads = hf.required_integer("num_attention_heads")
    hidden_size = hf.required_integer("hidden_size")
    head_dim = hf.optional_integer("head_dim") or hidden_size // max(num_q_heads, 1)
    rope, rope_local_theta = _rope_sections(hf, features)
    sliding_window = hf.optional_integer("sliding_window")
    if features.sliding_window_opt_in and not hf.boolean("use_sliding_window", False):
        sliding_window = None
    mla = features.mla(hf, rope) if features.mla is not None else None
    layer_types: tuple[str, ...] = ()
    if features.layer_types is not None:
        layer_types = features.layer_types(hf, sliding_window)
    attention_bias = hf.boolean("attention_bias", False)
    return ModelConfig(
        model_type=hf.string("model_type") or "",
        vocab_size=hf.required_integer("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=hf.required_integer("intermediate_size"),
        num_layers=hf.required_integer("num_hidden_layers"),
        num_q_heads=num_q_heads,
        # MLA: one latent, shared by every query head, is what the cache holds per token.
        num_kv_heads=1 if mla else hf.optional_integer("num_key_value_heads") or num_q_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.number("rms_norm_eps", 1e-6),
        rope_theta=rope.number("rope_theta", 10000.0),
        rope_scaling=_rope_scaling(rope, hf),
        max_position_embeddings=hf.optional_integer("max_position_embeddings") or 4096,
        tie_word_embeddings=hf.boolean("tie_word_embeddings", False),
        attention_bias=features.attention_bias(hf),
        qk_norm=features.qk_norm,
        sliding_window=sliding_window,
        bos_token_id=hf.optional_integer("bos_token_id"),
        eos_token_ids=hf.integers("eos_token_id"),
        hidden_act=hf.string("hidden_activation") or hf.string("hidden_act") or "silu",
        layer_types=layer_types,
        rope_local_theta=rope_local_theta,
        attn_logit_softcap=hf.optional_number("attn_logit_softcapping"),
        final_logit_softcap=hf.optional_number("final_logit_softcapping"),
        query_pre_attn_scalar=hf.optional_number("query_pre_attn_scalar"),
        is_gemma=features.is_gemma,
        moe=features.moe(hf) if features.moe is not None else None,
        attention_sinks=features.attention_sinks,
        o_proj_bias=features.o_proj_bias and attention_bias,
        mla=mla,
        max_positions_are_scaled=features.max_positions_are_scaled,
    )


def _rope_sections(hf: ConfigFields, features: ConfigFeatures) -> tuple[ConfigFields, float | None]:
    """The (global) layers' rope parameters, either spelling, and the local layers' rope base
    where the family has one (``features.local_rope``), else None."""
    rope = hf.section("rope_parameters")
    local_rope = None
    if FULL in rope or SLIDING in rope:  # per layer type (Gemma 3)
        local_rope = rope.section(SLIDING)
        rope = rope.section(FULL)
    if not rope.raw:  # older transformers spelling
        rope = hf.section("rope_scaling")
        rope = ConfigFields(
            {"rope_theta": hf.number("rope_theta", 10000.0), **rope.raw}, rope.prefix
        )
    partial = rope.optional_number("partial_rotary_factor") or hf.number(
        "partial_rotary_factor", 1.0
    )
    if partial != 1.0:
        raise ConfigError(f"partial_rotary_factor={partial} is not supported; only 1.0")
    if local_rope is None or not features.local_rope:
        return rope, None
    if rope_type_of(local_rope) != "default":
        raise ConfigError(
            f"rope_parameters[{SLIDING!r}]: rope_type={rope_type_of(local_rope)!r} is not "
            "supported for the local layers; only default"
        )
    return rope, local_rope.number("rope_theta", 10000.0)


def rope_type_of(rope: ConfigFields) -> str:
    return rope.string("rope_type") or rope.string("type") or "default"


ROPE_NUMBERS = (
    "rope_theta",
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "partial_rotary_factor",
)


def _check_rope_fields(raw: dict[str, Any]) -> None:
    """The types of the rope fields config.py reads, in either spelling and per layer type."""
    for key in ("rope_parameters", "rope_scaling"):
        if raw.get(key) is None:
            continue
        ropes = [ConfigFields(raw).section(key)]
        ropes += [ropes[0].section(t) for t in (FULL, SLIDING) if ropes[0].raw.get(t) is not None]
        for rope in ropes:
            for name in ROPE_NUMBERS:
                rope.optional_number(name)
            rope.optional_integer("original_max_position_embeddings")
            rope.string("rope_type")
            rope.string("type")
            rope.numbers("short_factor")
            rope.numbers("long_factor")
            rope.boolean("truncate", True)


def _rename_su(raw: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's first long-context configs call longrope ``su``; transformers wants longrope."""
    for key in ("rope_scaling", "rope_parameters"):
        rope = raw.get(key)
        if isinstance(rope, dict) and "su" in (rope.get("type"), rope.get("rope_type")):
            rope = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": "longrope"}
            raw = raw | {key: rope}
    return raw


def _rope_scaling(rope: ConfigFields, hf: ConfigFields) -> RopeScaling | None:
    """The scaling of one rope parameter dict (None for the unscaled default)."""
    rope_type = rope_type_of(rope)
    if rope_type == "default":
        return None
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"rope_type={rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    max_positions = hf.optional_integer("max_position_embeddings") or 4096
    # NOTE: dynamic NTK counts from max_position_embeddings, as transformers does; Phi-3 keeps
    # its pretraining length outside the rope dict.
    original = rope.optional_integer("original_max_position_embeddings") or hf.optional_integer(
        "original_max_position_embeddings"
    )
    if rope_type == "dynamic":
        original = max_positions
    factor = rope.optional_number("factor")
    if factor is None:  # yarn, longrope: the ratio of the two lengths
        factor = max_positions / original if original else 1.0
    return RopeScaling(
        rope_type=rope_type,
        factor=factor,
        low_freq_factor=rope.number("low_freq_factor", 1.0),
        high_freq_factor=rope.number("high_freq_factor", 4.0),
        original_max_position_embeddings=original or 0,
        attention_factor=_attention_factor(rope_type, rope, factor, original),
        beta_fast=rope.optional_number("beta_fast") or 32.0,
        beta_slow=rope.optional_number("beta_slow") or 1.0,
        truncate=rope.boolean("truncate", True),
        short_factor=rope.numbers("short_factor"),
        long_factor=rope.numbers("long_factor"),
    )


def _attention_factor(
    rope_type: str, rope: ConfigFields, factor: float, original: int | None
) -> float:
    """The cos/sin scale of yarn and longrope: the config's, else the papers' rule."""
    attention_factor = rope.optional_number("attention_factor")
    if attention_factor is not None:
        return attention_factor
    if rope_type == "yarn":

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        m, m_all = rope.optional_number("mscale"), rope.optional_number("mscale_all_dim")
        if m and m_all:
            return mscale(factor, m) / mscale(factor, m_all)
        return mscale(factor)
    if rope_type == "longrope" and factor > 1.0 and original:
        return math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


def builtin_config_dir(name: str) -> Path:
    """Directory of a config shipped with the package (``llama-3-8b``, ``qwen3-8b``, ...)."""
    return Path(__file__).parent / "assets" / "configs" / name
