"""A checkpoint's config translated from Hugging Face (config.json) into ``ModelConfig``, validated
in ``__post_init__``.

``ModelConfig`` is the engine's normalized view of a checkpoint's config: every
supported architecture (Llama family, Mistral, Qwen2, Qwen3, GPT-2) is described
by the same fields, so the model code reads flags instead of architecture names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenloom.models.architectures import BY_MODEL_TYPE, SUPPORTED_ARCHITECTURES

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or feature tokenloom cannot run."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a user-facing dtype name onto a torch dtype (ValueError if unknown).

    "auto" computes in float32 and keeps a GGUF file's weights as stored.
    """
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


@dataclass(slots=True)
class RopeConfig:
    """Rotary embedding parameters (HF ``rope_parameters`` / ``rope_scaling``)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn (transformers' _compute_yarn_parameters; None: its defaults)
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # longrope (Phi-3): per-frequency divisors, the long set where the context exceeds the original
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope type {self.rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})"
            )
        if self.rope_type == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise ValueError("longrope scaling needs short_factor and long_factor")


@dataclass(slots=True)
class MoeConfig:
    """A mixture-of-experts MLP: each token runs the `top_k` experts its router scores highest,
    weighted by their softmax probabilities (renormalized over the chosen ones when
    `normalize_top_k`), plus a sigmoid-gated shared expert when `shared_intermediate_size`."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the mixture (the rest dense)
    normalize_top_k: bool = True
    shared_intermediate_size: int = 0  # 0: no shared expert (Qwen2-MoE has one)
    router_bias: bool = False  # the router's projection has a bias (gpt-oss)
    # DeepSeek's routing (models/moe.py route): scores by softmax (V2) or sigmoid (V3, with
    # a correction bias added for the choice only), experts chosen within the topk_groups best of
    # `groups` groups, the weights times routed_scaling; a shared expert without a gate
    scoring: str = "softmax"
    groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    correction_bias: bool = False
    shared_gated: bool = True  # the shared expert's output is scaled by sigmoid(gate(x)) (Qwen2-MoE)
    # experts (with biases) in gpt-oss's clamped SwiGLU (layers/mlp.py ClampedSwiGLUMLP); None:
    # the model's gated MLP without bias
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"experts per token ({self.top_k}) must be in [1, num_experts={self.num_experts}]")
        if self.intermediate_size <= 0:
            raise ValueError(f"expert intermediate size must be positive, got {self.intermediate_size}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise UnsupportedModelError(f"expert scoring {self.scoring!r} is not supported (softmax, sigmoid)")
        if self.num_experts % self.groups or not 1 <= self.topk_groups <= self.groups:
            raise ValueError(
                f"{self.num_experts} experts in {self.groups} groups, {self.topk_groups} chosen: "
                "the groups must divide the experts and at least one be chosen"
            )


@dataclass(frozen=True, slots=True)
class MlaConfig:
    """DeepSeek's multi-head latent attention: each token's keys and values are one compressed
    latent of `kv_lora_rank` dims plus a rope key of `qk_rope_head_dim` dims shared by every head;
    each head's key is its own projection of the latent (`qk_nope_head_dim`) and the rope key,
    its value another projection of the latent (`v_head_dim`). Queries come straight from the
    hidden state, or through a rank-`q_lora_rank` bottleneck with an RMSNorm (None: none)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    @property
    def latent_dim(self) -> int:
        """A cached key: the rope key then the latent (the values are its last kv_lora_rank dims)."""
        return self.qk_rope_head_dim + self.kv_lora_rank

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class MambaConfig:
    """The Mamba-2 mixers of a hybrid model (Granite 4.0-H): layers `layers` run one instead of
    attention. in_proj maps a token to [z (inner), xBC (conv_dim), dt (heads)]; xBC goes through a
    causal depthwise conv of `conv_kernel` taps and SiLU and splits into x (heads x head_dim) and B, C
    (n_groups x state_size each); per head, h = exp(dt A) h + dt x B^T and y = h C + D x, with
    dt = softplus(dt + dt_bias) clamped to time_step_limit; y times SiLU(z), RMS-normed per group,
    goes through out_proj. A sequence's state is the conv's last conv_kernel - 1 inputs and h.
    (The checkpoint's mamba_chunk_size is not kept: the scan is exact for any block, and
    layers/mamba2.py picks its own.)"""

    layers: tuple[int, ...]  # the recurrent layers (the others attend)
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))

    def __post_init__(self) -> None:
        if self.num_heads % self.n_groups:
            raise ValueError(f"{self.num_heads} Mamba heads do not split into {self.n_groups} groups")
        if min(self.num_heads, self.head_dim, self.state_size, self.conv_kernel) <= 0:
            raise ValueError("Mamba heads, head_dim, state_size and conv_kernel must be positive")

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x, then B, then C."""
        return self.inner_size + 2 * self.n_groups * self.state_size

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """A sequence's state in one recurrent layer: the conv's last inputs (kept in the model's
        dtype) and the SSM state (kept in float32)."""
        return {
            "conv": (self.conv_dim, self.conv_kernel - 1),
            "state": (self.num_heads, self.head_dim, self.state_size),
        }


@dataclass(frozen=True, slots=True)
class DeltaNetConfig:
    """The Gated DeltaNet mixers of a hybrid model (Qwen3-Next): layers `layers` run one instead of
    attention. Per token, in_proj gives q, k (num_k_heads x k_head_dim each), v and z (num_v_heads x
    v_head_dim each), b and a (num_v_heads each); [q, k, v] go through a causal depthwise conv of
    `conv_kernel` taps (no bias) and SiLU; q and k are L2-normed and each serves
    num_v_heads / num_k_heads consecutive value heads. Per value head, with beta = sigmoid(b) and
    g = -exp(A_log) softplus(a + dt_bias): S = exp(g) S, S += k (beta (v - S^T k))^T,
    o = S^T q / sqrt(k_head_dim); o is RMS-normed per head, times norm.weight and SiLU(z), and goes
    through out_proj. A sequence's state is the conv's last conv_kernel - 1 inputs and S."""

    layers: tuple[int, ...]  # the recurrent layers (the others attend)
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        if min(self.num_k_heads, self.num_v_heads, self.k_head_dim, self.v_head_dim, self.conv_kernel) <= 0:
            raise ValueError("Gated DeltaNet heads, head dims and conv_kernel must be positive")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"{self.num_v_heads} value heads do not share {self.num_k_heads} key heads evenly")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, then k, then v."""
        return 2 * self.key_dim + self.value_dim

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """A sequence's state in one recurrent layer: the conv's last inputs (kept in the model's
        dtype) and S per value head (kept in float32)."""
        return {
            "conv": (self.conv_dim, self.conv_kernel - 1),
            "state": (self.num_v_heads, self.k_head_dim, self.v_head_dim),
        }


@dataclass(slots=True)
class ModelConfig:
    """Architecture hyper-parameters shared by every supported model family."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_model_len: int
    norm_eps: float = 1e-6
    rope: RopeConfig | None = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    o_proj_bias: bool = False  # bias on the output projection
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    sliding_window: int | None = None
    # per layer "full_attention" or "sliding_attention" (HF layer_types); None: every layer
    # slides when sliding_window is set (Mistral)
    layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma); None: head_dim
    local_rope: RopeConfig | None = None  # rope of sliding-window layers where it differs (Gemma 3)
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # attention scores soft-capped (Gemma 2)
    moe: MoeConfig | None = None  # mixture-of-experts MLPs (Mixtral, Qwen2/3-MoE)
    partial_rotary_factor: float = 1.0  # rope turns the first head_dim * this dims of each head
    # per layer: whether rope turns q and k (SmolLM3 leaves every fourth layer unturned); None: every layer
    rope_layers: tuple[bool, ...] | None = None
    # rope turns pairs (2i, 2i + 1) of each head, not (i, i + d/2) (GLM-4, Cohere 2): the q/k rows
    # are read re-ordered at load (LlamaForCausalLM.checkpoint_rows), the same scores
    rope_interleaved: bool = False
    logit_scale: float = 1.0  # logits times this (Cohere 2; Granite: 1 / logits_scaling)
    # Granite's multipliers (models/granite.py): embeddings times embedding_multiplier, each sublayer's
    # output times residual_multiplier, the attention softmax scaled by attention_multiplier itself
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    attention_sinks: bool = False  # a learned sink logit per head in each softmax (gpt-oss)
    parallel_residual: bool = False  # x + attn(ln(x)) + mlp(ln(x)) (StableLM's option)
    # multi-head latent attention (DeepSeek-V2/V3): the cache holds one key a token, of
    # head_dim = mla.latent_dim, whose last kv_lora_rank dims are also its value (num_kv_heads 1)
    mla: MlaConfig | None = None
    # a hybrid's recurrent layers (Granite 4.0-H's Mamba-2, Qwen3-Next's Gated DeltaNet): they keep
    # a per-sequence state (kv_cache/recurrent.py), not keys and values; the other layers attend
    recurrent: MambaConfig | DeltaNetConfig | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    learned_positions: int = 0  # rows of a learned position table (GPT-2's n_positions); 0: none

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_model_len",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.mla is not None and (self.num_kv_heads, self.head_dim) != (1, self.mla.latent_dim):
            raise ValueError(f"latent attention caches one key of {self.mla.latent_dim} dims a token")
        if self.recurrent is not None and not all(0 <= i < self.num_layers for i in self.recurrent.layers):
            raise ValueError(f"recurrent layers {self.recurrent.layers} are not all among {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.rope_layers is not None and len(self.rope_layers) != self.num_layers:
            raise ValueError(f"rope_layers names {len(self.rope_layers)} layers, the model has {self.num_layers}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types names {len(self.layer_types)} layers, the model has {self.num_layers}")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                raise UnsupportedModelError(f"layer type(s) {unknown} are not supported (supported: {LAYER_TYPES})")

    @property
    def rotary_dim(self) -> int:
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def value_dim(self) -> int:
        """Dims of a cached value: head_dim, or with latent attention the latent's, read from the keys."""
        return self.mla.kv_lora_rank if self.mla is not None else self.head_dim

    def attention_layers(self, layers: range | None = None) -> list[int]:
        """Of `layers` (None: all), those that attend and so keep keys and values."""
        skip = set(self.recurrent.layers) if self.recurrent is not None else set()
        return [i for i in (range(self.num_layers) if layers is None else layers) if i not in skip]

    def context_limit(self) -> int:
        """The longest context this model can be run at: its own, or with dynamic rope scaling
        its own times the factor (the base stretched for the longer context, as vLLM does)."""
        if self.rope is not None and self.rope.rope_type == "dynamic":
            return int(self.max_model_len * self.rope.factor)
        return self.max_model_len

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window in positions (None: the whole context)."""
        if self.sliding_window is None:
            return (None,) * self.num_layers
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a HF ``config.json`` dict (transformers 4.x and 5.x spellings)."""
        arch = _architecture_of(hf)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        common = dict(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            tie_word_embeddings=hf.get("tie_word_embeddings", arch in _TIED_BY_DEFAULT),
        )
        if arch == "GPT2LMHeadModel":
            hidden, heads = hf["n_embd"], hf["n_head"]
            return cls(
                **common,
                hidden_size=hidden,
                num_layers=hf["n_layer"],
                num_heads=heads,
                num_kv_heads=heads,
                head_dim=hidden // heads,
                intermediate_size=hf.get("n_inner") or 4 * hidden,
                max_model_len=hf["n_positions"],
                learned_positions=hf["n_positions"],
                norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                rope=None,
                attention_bias=True,
                o_proj_bias=True,
                mlp_bias=True,
                hidden_act=hf.get("activation_function", "gelu_new"),
            )
        _refuse_unimplemented(hf, arch, _IMPLEMENTED.get(arch, ()))
        fields = _llama_fields(hf, arch)
        if arch in _FAMILY_FIELDS:
            fields |= _FAMILY_FIELDS[arch](hf)
        if arch in _MOE_ARCHITECTURES:
            fields["moe"] = _moe_of(hf, arch)
        if arch in _DEEPSEEK_ARCHITECTURES:
            fields["moe"] = _deepseek_moe(hf, arch)
        return cls(**common, **fields)


def _llama_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """ModelConfig fields of a Llama-shaped config.json (Llama, Mistral, Qwen2/3, OLMo 2, Gemma 3)."""
    heads = hf["num_attention_heads"]
    is_qwen2 = arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
    sliding, layer_types = _sliding_of(hf, arch)
    return dict(
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        intermediate_size=hf["intermediate_size"],
        max_model_len=hf.get("max_position_embeddings", 2048),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope=_rope_of(hf),
        attention_bias=hf.get("qkv_bias", True) if is_qwen2 else hf.get("attention_bias", False),
        o_proj_bias=(not is_qwen2) and hf.get("attention_bias", False),
        mlp_bias=hf.get("mlp_bias", False),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        sliding_window=sliding,
        layer_types=layer_types,
        hidden_act=hf.get("hidden_act", "silu"),
        partial_rotary_factor=_rope_params(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor") or 1.0),
    )


_TIED_BY_DEFAULT = (
    "GPT2LMHeadModel",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Cohere2ForCausalLM",
)
_MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "GptOssForCausalLM",
    "GraniteMoeForCausalLM",
    "GraniteMoeSharedForCausalLM",
    "GraniteMoeHybridForCausalLM",
    "Qwen3NextForCausalLM",
)
_DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_QWEN_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def _moe_of(hf: dict[str, Any], arch: str) -> MoeConfig | None:
    """The mixture as transformers builds it: Mixtral mixes every layer and renormalizes its top-k,
    OLMoE mixes every layer and renormalizes per norm_topk_prob;
    Qwen2/3-MoE mix every decoder_sparse_step-th layer outside mlp_only_layers, renormalize per
    norm_topk_prob, and Qwen2-MoE adds a shared expert."""
    layers = hf["num_hidden_layers"]
    experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
    if arch == "GraniteMoeHybridForCausalLM":  # transformers' GraniteMoeHybridConfig default
        experts = hf.get("num_local_experts", 8)
    if arch == "MixtralForCausalLM":
        return MoeConfig(experts, hf.get("num_experts_per_tok", 2), hf["intermediate_size"], tuple(range(layers)))
    if arch == "GptOssForCausalLM":
        return MoeConfig(
            experts,
            hf.get("num_experts_per_tok", 4),
            hf["intermediate_size"],
            tuple(range(layers)),
            router_bias=True,
            swiglu_limit=hf.get("swiglu_limit", 7.0),
            swiglu_alpha=hf.get("swiglu_alpha", 1.702),
        )
    if arch in ("GraniteMoeForCausalLM", "GraniteMoeSharedForCausalLM", "GraniteMoeHybridForCausalLM"):
        if not experts:  # Granite 4.0-H's dense members: the shared MLP alone (the model's MLP)
            return None
        return MoeConfig(  # softmax over the top-k logits
            experts,
            hf.get("num_experts_per_tok", 2),
            hf["intermediate_size"],
            tuple(range(layers)),
            shared_intermediate_size=hf.get("shared_intermediate_size")
            or hf.get("shared_expert_intermediate_size")
            or 0,
            shared_gated=False,
        )
    if arch == "OlmoeForCausalLM":
        return MoeConfig(
            experts,
            hf.get("num_experts_per_tok", 8),
            hf["intermediate_size"],
            tuple(range(layers)),
            normalize_top_k=hf.get("norm_topk_prob", False),
        )
    step, dense = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    gated_shared = ("Qwen2MoeForCausalLM", "Qwen3NextForCausalLM")
    shared = hf.get("shared_expert_intermediate_size", 0) if arch in gated_shared else 0
    return MoeConfig(
        experts,
        hf.get("num_experts_per_tok", 1),
        hf["moe_intermediate_size"],
        sparse,
        # transformers' defaults: Qwen3-Next renormalizes its top-k, Qwen2/3-MoE do not
        normalize_top_k=hf.get("norm_topk_prob", arch == "Qwen3NextForCausalLM"),
        shared_intermediate_size=shared,
    )


def _gemma3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 3 reads differently from a Llama config (transformers' Gemma3TextConfig defaults)."""
    full, local = _gemma3_ropes(hf)
    return dict(
        head_dim=hf.get("head_dim", 256),
        max_model_len=hf.get("max_position_embeddings", 32768),
        rope=full,
        local_rope=local,
        qk_norm=True,
        sliding_window=hf.get("sliding_window", 4096),
        layer_types=_layer_types(hf, 6),
        hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
    )


def _gemma2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 (transformers' Gemma2Config defaults): Gemma 3's layout without q/k norm or a second
    rope base, with attention scores soft-capped; every other layer slides, the first one included."""
    layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]
    return dict(
        head_dim=hf.get("head_dim", 256),
        max_model_len=hf.get("max_position_embeddings", 8192),
        sliding_window=hf.get("sliding_window", 4096),
        layer_types=tuple(layer_types),
        hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        final_logit_softcapping=hf.get("final_logit_softcapping", 30.0),
        attn_logit_softcapping=hf.get("attn_logit_softcapping", 50.0),
    )


def _smollm3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """SmolLM3: a Llama whose every no_rope_layer_interval-th layer (default 4) attends without rope;
    transformers' no_rope_layers lists it per layer (1: rope)."""
    layers, interval = hf["num_hidden_layers"], hf.get("no_rope_layer_interval", 4)
    flags = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    return dict(rope_layers=tuple(bool(f) for f in flags), max_model_len=hf.get("max_position_embeddings", 32768))


def _cohere2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Cohere 2 (transformers' Cohere2Config defaults): LayerNorm epsilon, attention and the MLP on
    one normed input, every fourth layer full attention and without rope, the others sliding and
    turned in interleaved pairs; logits scaled."""
    layer_types = _layer_types(hf, 4)
    return dict(
        norm_eps=hf.get("layer_norm_eps", 1e-5),
        parallel_residual=True,
        sliding_window=hf.get("sliding_window", 4096),
        layer_types=layer_types,
        rope_layers=tuple(t == "sliding_attention" for t in layer_types),
        rope_interleaved=True,
        logit_scale=hf.get("logit_scale", 0.0625),
        max_model_len=hf.get("max_position_embeddings", 8192),
    )


def _glm4_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """GLM-4 (transformers' Glm4Config defaults): q/k/v bias without an output bias, half of each
    head turned by rope."""
    partial = _rope_params(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor") or 0.5)
    return dict(
        attention_bias=hf.get("attention_bias", True),
        o_proj_bias=False,
        partial_rotary_factor=partial,
        rope_interleaved=True,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        max_model_len=hf.get("max_position_embeddings", 131072),
    )


def _olmo3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """OLMo 3 (transformers' Olmo3Config): OLMo 2's layers, every fourth one full attention and the
    rest sliding (layer_types); rope parameters per layer type, rope scaling on the full layers
    only (the older spelling: rope_theta for both, rope_scaling for the full ones)."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    else:
        theta = params.get("rope_theta", hf.get("rope_theta", 500_000.0))
        full, local = dict(hf.get("rope_scaling") or {}) | {"rope_theta": theta}, {"rope_theta": theta}
    full.setdefault("rope_theta", 500_000.0)
    local.setdefault("rope_theta", full["rope_theta"])
    rope, local_rope = _rope_of(hf | {"rope_parameters": full}), _rope_of(hf | {"rope_parameters": local})
    return dict(
        layer_types=_layer_types(hf, 4),
        sliding_window=hf.get("sliding_window", 4096),
        rope=rope,
        local_rope=None if local_rope == rope else local_rope,
        max_model_len=hf.get("max_position_embeddings", 65536),
    )


def _gpt_oss_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss (transformers' GptOssConfig defaults): q/k/v/o biases, sink logits, sliding and full
    layers alternating from a sliding first one, YaRN (factor 32 over 4096 positions, bounds not
    truncated) on rope base 150000."""
    rope = (
        hf.get("rope_parameters")
        or hf.get("rope_scaling")
        or {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        }
    )
    rope = {"rope_theta": hf.get("rope_theta", 150000.0)} | dict(rope)
    return dict(
        attention_bias=hf.get("attention_bias", True),
        o_proj_bias=hf.get("attention_bias", True),
        attention_sinks=True,
        head_dim=hf.get("head_dim") or 64,
        sliding_window=hf.get("sliding_window", 128),
        layer_types=_layer_types(hf, 2),
        rope=_rope_of(hf | {"rope_parameters": rope}),
        max_model_len=hf.get("max_position_embeddings", 131072),
        norm_eps=hf.get("rms_norm_eps", 1e-5),
    )


def _deepseek_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V3 (transformers' DeepseekV2Config / DeepseekV3Config defaults): latent attention
    (MlaConfig) whose rope dims turn in interleaved pairs (V3 unless rope_interleave is false), the
    softmax scaled by YaRN's mscale(factor, mscale_all_dim) squared (AttentionShape.scale), q/k/v/o
    biases where attention_bias says."""
    mla = MlaConfig(
        kv_lora_rank=hf.get("kv_lora_rank", 512),
        qk_rope_head_dim=hf.get("qk_rope_head_dim", 64),
        qk_nope_head_dim=hf.get("qk_nope_head_dim", 128),
        v_head_dim=hf.get("v_head_dim", 128),
        q_lora_rank=hf.get("q_lora_rank", 1536),
    )
    v2 = _architecture_of(hf) == "DeepseekV2ForCausalLM"
    return dict(
        num_kv_heads=1,
        head_dim=mla.latent_dim,
        mla=mla,
        rope_interleaved=True if v2 else hf.get("rope_interleave", True),
        attention_bias=hf.get("attention_bias", False),
        o_proj_bias=hf.get("attention_bias", False),
        mlp_bias=hf.get("mlp_bias", False),
        max_model_len=hf.get("max_position_embeddings", 2048 if v2 else 4096),
    )


def _deepseek_moe(hf: dict[str, Any], arch: str) -> MoeConfig | None:
    """DeepSeek's mixture as its own modeling code routes it (models/moe.py route): the layers from
    first_k_dense_replace on (every moe_layer_freq-th) mix; V2 by softmax, its groups only under
    topk_method group_limited_greedy, renormalized where norm_topk_prob says (transformers' V2
    never renormalizes; the released V2 models do not ask to); V3 by sigmoid with a correction bias,
    groups ranked by their two best; the chosen weights times routed_scaling_factor; shared experts
    (n_shared_experts wide) ungated. None without routed experts."""
    experts = hf.get("n_routed_experts")
    if not experts:
        return None
    v3 = arch == "DeepseekV3ForCausalLM"
    first, freq = hf.get("first_k_dense_replace", 0), hf.get("moe_layer_freq", 1)
    grouped = v3 or hf.get("topk_method") == "group_limited_greedy"
    return MoeConfig(
        experts,
        hf.get("num_experts_per_tok", 8 if v3 else 6),
        hf["moe_intermediate_size"],
        tuple(i for i in range(hf["num_hidden_layers"]) if i >= first and i % freq == 0),
        normalize_top_k=hf.get("norm_topk_prob", v3),
        shared_intermediate_size=hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0),
        scoring="sigmoid" if v3 else "softmax",
        groups=hf.get("n_group", 8) if grouped else 1,
        topk_groups=hf.get("topk_group", 4) if grouped else 1,
        routed_scaling=hf.get("routed_scaling_factor", 2.5 if v3 else 1.0),
        correction_bias=v3,
        shared_gated=False,
    )


def _granite_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Granite (transformers' GraniteConfig defaults): its four multipliers, the logits' divisor kept
    as its reciprocal (ModelConfig.logit_scale)."""
    return dict(
        embedding_multiplier=float(hf.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(hf.get("residual_multiplier", 1.0)),
        attention_multiplier=float(hf.get("attention_multiplier", 1.0)),
        logit_scale=1.0 / float(hf.get("logits_scaling", 1.0)),
    )


_MAMBA_KINDS, _ATTENTION_KINDS = ("mamba", "linear_attention"), ("attention", "full_attention")


def _granite_hybrid_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Granite 4.0-H (transformers' GraniteMoeHybridConfig defaults): Granite's multipliers, Mamba-2
    mixers in the layers layer_types names "mamba" (transformers 5: "linear_attention"), attention
    without rope unless position_embedding_type is "rope", and where it has no experts the shared
    MLP as the model's MLP."""
    layers, hidden = hf["num_hidden_layers"], hf["hidden_size"]
    kinds = hf.get("layer_types") or hf.get("layers_block_type") or ["mamba"] * layers
    unknown = sorted(set(kinds) - set(_MAMBA_KINDS) - set(_ATTENTION_KINDS))
    if unknown:
        raise UnsupportedModelError(f"Granite hybrid layer type(s) {unknown} are not supported (mamba, attention)")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"Mamba-2 layers with activation {hf['hidden_act']!r} are not implemented (silu)")
    heads, inner = hf.get("mamba_n_heads", 128), hf.get("mamba_expand", 2) * hidden
    head_dim = hf.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else head_dim
    if heads * head_dim != inner:
        raise ValueError(f"{heads} Mamba heads of {head_dim} do not make mamba_expand x hidden_size = {inner}")
    if not any(kind in _ATTENTION_KINDS for kind in kinds):
        raise UnsupportedModelError(
            "a Granite hybrid without attention layers (every layer Mamba-2) is not supported: its layer_types "
            "name no attention layer"
        )
    limit = tuple(_float_of(v) for v in hf.get("time_step_limit") or (0.0, float("inf")))
    mamba = MambaConfig(
        layers=tuple(i for i, kind in enumerate(kinds) if kind in _MAMBA_KINDS),
        num_heads=heads,
        head_dim=head_dim,
        state_size=hf.get("mamba_d_state", 256),
        n_groups=hf.get("mamba_n_groups", 1),
        conv_kernel=hf.get("mamba_d_conv", 4),
        conv_bias=hf.get("mamba_conv_bias", True),
        proj_bias=hf.get("mamba_proj_bias", False),
        time_step_limit=(limit[0], limit[1]),
    )
    fields = _granite_fields(hf) | dict(
        recurrent=mamba, layer_types=None, max_model_len=hf.get("max_position_embeddings", 2048)
    )
    if hf.get("position_embedding_type") != "rope":
        fields["rope_layers"] = (False,) * layers
    if not hf.get("num_local_experts", 8):
        fields["intermediate_size"] = hf.get("shared_intermediate_size", 1024)
    return fields


def _qwen3_next_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next (transformers' Qwen3NextConfig defaults): Gated DeltaNet mixers in the layers
    layer_types names "linear_attention" (else all but every full_attention_interval-th), attention
    with q/k norm, an output gate and a quarter of each head turned, (1 + w) RMSNorms (kept as 1 + w
    at load: models/qwen3_next.py)."""
    layers = hf["num_hidden_layers"]
    interval = hf.get("full_attention_interval", 4)
    kinds = hf.get("layer_types") or [
        "linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)
    ]
    unknown = sorted(set(kinds) - {"linear_attention", "full_attention"})
    if unknown:
        raise UnsupportedModelError(
            f"Qwen3-Next layer type(s) {unknown} are not supported (linear_attention, full_attention)"
        )
    if "full_attention" not in kinds:
        raise UnsupportedModelError("a Qwen3-Next model without full_attention layers is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(
            f"Gated DeltaNet layers with activation {hf['hidden_act']!r} are not implemented (silu)"
        )
    deltanet = DeltaNetConfig(
        layers=tuple(i for i, kind in enumerate(kinds) if kind == "linear_attention"),
        num_k_heads=hf.get("linear_num_key_heads", 16),
        num_v_heads=hf.get("linear_num_value_heads", 32),
        k_head_dim=hf.get("linear_key_head_dim", 128),
        v_head_dim=hf.get("linear_value_head_dim", 128),
        conv_kernel=hf.get("linear_conv_kernel_dim", 4),
    )
    partial = _rope_params(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor") or 0.25)
    return dict(
        recurrent=deltanet,
        layer_types=None,
        qk_norm=True,
        partial_rotary_factor=partial,
        head_dim=hf.get("head_dim") or 256,
        max_model_len=hf.get("max_position_embeddings", 32768),
    )


def _float_of(value: Any) -> float:
    """A float as config.json spells it: a number, "inf"/"Infinity", or transformers 5's
    {"__float__": "Infinity"}."""
    if isinstance(value, dict):
        value = value.get("__float__")
    return float(value)


def _stablelm_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """StableLM (transformers' StableLmConfig defaults): LayerNorm epsilon, q/k/v bias and per-head
    q/k LayerNorm by their own names, a quarter of each head rotated, optional parallel residual."""
    return dict(
        norm_eps=hf.get("layer_norm_eps", 1e-5),
        attention_bias=hf.get("use_qkv_bias", False),
        qk_norm=hf.get("qk_layernorm", False),
        parallel_residual=hf.get("use_parallel_residual", False),
        max_model_len=hf.get("max_position_embeddings", 4096),
        partial_rotary_factor=_rope_params(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor") or 0.25),
    )


# what a family reads differently from a Llama config.json, on top of _llama_fields
_FAMILY_FIELDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "Gemma3ForCausalLM": _gemma3_fields,
    "Gemma2ForCausalLM": _gemma2_fields,
    "StableLmForCausalLM": _stablelm_fields,
    "SmolLM3ForCausalLM": _smollm3_fields,
    "Olmo3ForCausalLM": _olmo3_fields,
    "Glm4ForCausalLM": _glm4_fields,
    "Cohere2ForCausalLM": _cohere2_fields,
    "GptOssForCausalLM": _gpt_oss_fields,
    "DeepseekV2ForCausalLM": _deepseek_fields,
    "DeepseekV3ForCausalLM": _deepseek_fields,
    "GraniteForCausalLM": _granite_fields,
    "GraniteMoeForCausalLM": _granite_fields,
    "GraniteMoeSharedForCausalLM": _granite_fields,
    "GraniteMoeHybridForCausalLM": _granite_hybrid_fields,
    "Qwen3NextForCausalLM": _qwen3_next_fields,
}

# fields an architecture implements among those _refuse_unimplemented checks
_GRANITE_MULTIPLIERS = ("logits_scaling", "embedding_multiplier", "residual_multiplier", "attention_multiplier")
_IMPLEMENTED = {
    "GraniteForCausalLM": _GRANITE_MULTIPLIERS,
    "GraniteMoeForCausalLM": _GRANITE_MULTIPLIERS,
    "GraniteMoeSharedForCausalLM": _GRANITE_MULTIPLIERS,
    "GraniteMoeHybridForCausalLM": _GRANITE_MULTIPLIERS,
    "Gemma3ForCausalLM": ("query_pre_attn_scalar", "final_logit_softcapping"),
    "Gemma2ForCausalLM": ("query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping"),
}


# config fields that change a Llama-family forward pass, with the value that leaves it unchanged
_NEUTRAL_FIELDS = {
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "query_pre_attn_scalar": None,
    "use_qk_norm": False,
    "logits_scaling": 1.0,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": None,
    "clip_qkv": None,
}


def _refuse_unimplemented(hf: dict[str, Any], arch: str, implemented: tuple[str, ...] = ()) -> None:
    """An error naming each field that would change the math and is not implemented (never ignored)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    params = params if all(not isinstance(v, dict) for v in params.values()) else {}
    found = {k: hf.get(k, params.get(k)) for k in _NEUTRAL_FIELDS if (k in hf or k in params) and k not in implemented}
    wrong = {k: v for k, v in found.items() if v != _NEUTRAL_FIELDS[k]}
    if hf.get("use_bidirectional_attention"):
        wrong["use_bidirectional_attention"] = True
    if wrong:
        raise UnsupportedModelError(
            f"config field(s) {wrong} change the model's arithmetic and are not implemented for {arch}"
        )


def _layer_types(hf: dict[str, Any], pattern: int) -> tuple[str, ...]:
    """HF's layer_types, else every sliding_window_pattern-th layer full (default `pattern`: Gemma 3
    6, OLMo 3 and Cohere 2 4) and the others sliding."""
    every = hf.get("sliding_window_pattern", pattern)
    return tuple(
        hf.get("layer_types")
        or ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(hf["num_hidden_layers"])]
    )


def _sliding_of(hf: dict[str, Any], arch: str) -> tuple[int | None, tuple[str, ...] | None]:
    """(window, per-layer types) as transformers reads them: Qwen2/Qwen3 slide only with
    use_sliding_window, and then only layers from max_window_layers on, unless the config
    lists its layer_types."""
    sliding = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if arch in _QWEN_ARCHITECTURES:
        sliding = sliding if hf.get("use_sliding_window", False) else None
        if layer_types is None and sliding is not None:
            first = hf.get("max_window_layers", hf["num_hidden_layers"])
            layer_types = [
                "sliding_attention" if i >= first else "full_attention" for i in range(hf["num_hidden_layers"])
            ]
    return sliding, tuple(layer_types) if layer_types is not None else None


def _gemma3_ropes(hf: dict[str, Any]) -> tuple[RopeConfig, RopeConfig]:
    """(full-attention rope, sliding-window rope): transformers 5's rope_parameters keyed by
    layer type, or the older rope_theta / rope_scaling / rope_local_base_freq."""
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    else:
        full = dict(hf.get("rope_scaling") or {}) | {"rope_theta": hf.get("rope_theta", 1_000_000.0)}
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}
    full.setdefault("rope_theta", 1_000_000.0)
    local.setdefault("rope_theta", 10_000.0)
    return _rope_of(hf | {"rope_parameters": full}), _rope_of(hf | {"rope_parameters": local})


def _architecture_of(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    if archs:
        return archs[0]
    model_type = hf.get("model_type")
    if model_type in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[model_type].hf_name
    raise UnsupportedModelError(
        f"config names neither a supported architecture nor model_type (got "
        f"architectures={archs!r}, model_type={model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
    )


def _rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    return dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})


def _rope_of(hf: dict[str, Any]) -> RopeConfig:
    params = _rope_params(hf)
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "longrope" if rope_type == "su" else rope_type  # Phi-3's first configs
    keys = (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    )
    kwargs = {k: params[k] for k in keys if params.get(k) is not None}
    max_pos = hf.get("max_position_embeddings", 2048)
    if rope_type == "longrope":  # transformers' _compute_longrope_parameters
        kwargs.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings", max_pos))
        kwargs.setdefault("factor", max_pos / kwargs["original_max_position_embeddings"])
        kwargs |= {k: tuple(params[k]) for k in ("short_factor", "long_factor") if params.get(k) is not None}
    if rope_type == "dynamic":  # stretches past max_position_embeddings (the original length)
        kwargs["original_max_position_embeddings"] = max_pos
    if rope_type == "yarn":
        kwargs.setdefault("original_max_position_embeddings", max_pos)
        if "factor" not in kwargs:  # DeepSeek-style: the factor is the context's growth
            kwargs["factor"] = max_pos / kwargs["original_max_position_embeddings"]
    return RopeConfig(theta=float(theta), rope_type=rope_type, **kwargs)
