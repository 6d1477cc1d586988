"""Llama-family decoder: Llama 2/3, Mistral, SmolLM2/3, TinyLlama, Qwen2, Qwen3.

The members differ only in flags on ModelConfig: q/k/v bias (Qwen2), per-head
q/k RMSNorm (Qwen3), rope scaling (Llama 3), sliding window (Mistral), tied
embeddings (SmolLM2, small Qwens), layers without rope (SmolLM3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from tokenloom.attention.backend import AttentionShape, LayerwiseAttention, StepAttention, plan_attention
from tokenloom.kv_cache.paged import PagedKVCache
from tokenloom.layers.embedding import uninitialized_embedding
from tokenloom.layers.mlp import GatedMLP
from tokenloom.layers.norms import RMSNorm
from tokenloom.layers.rope import interleaved_to_halves, rope_attention_factor, rope_cos_sin, rope_inv_freq
from tokenloom.models.base import CausalLM
from tokenloom.models.config import ModelConfig

if TYPE_CHECKING:
    from tokenloom.attention.backend import QKNorms


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.norms: QKNorms | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.norms = (self.q_norm, self.k_norm)

    def forward(self, x: torch.Tensor, attend: StepAttention, layer: int) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); writes this layer's keys/values of the step's tokens."""
        return self.o_proj.forward(attend(layer, self.qkv_proj.forward(x), self.norms))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn: nn.Module = LlamaAttention(cfg)  # DeepSeek's is latent attention
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, attend: StepAttention, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (the embeddings for layer 0, with residual None);
        returns (this layer's MLP output, the residual stream before it is added). Deferring
        each residual add into the next norm makes it one fused op; the sums are the same.
        Submodules are called through ``forward`` (no module hooks): ~8 op calls a layer."""
        if residual is None:
            residual, normed = x, self.input_layernorm.forward(x)
        else:
            normed, residual = self.input_layernorm.add_forward(x, residual)
        attn = self.mix(normed, attend, layer)
        normed, residual = self.post_attention_layernorm.add_forward(attn, residual)
        return self.mlp.forward(normed), residual

    def mix(self, x: torch.Tensor, attend: StepAttention, layer: int) -> torch.Tensor:
        """The token mixer: attention (a hybrid's recurrent layers mix otherwise)."""
        return self.self_attn.forward(x, attend, layer)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, decoder_layer: type[nn.Module] = LlamaDecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = uninitialized_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(decoder_layer(cfg) for _ in range(cfg.num_layers))
        self.norm: Any = RMSNorm(cfg.hidden_size, cfg.norm_eps)  # StableLM puts a LayerNorm here


class LlamaForCausalLM(CausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | None]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    input_embedding_name = "model.embed_tokens"
    ignored_checkpoint_keys: tuple[str, ...] = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
    # a family that differs only inside its layers (Gemma 3, OLMo 2) names its own
    decoder_layer: ClassVar[type[nn.Module]] = LlamaDecoderLayer
    replayable_layers = True
    plans_window_pools = True

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        assert cfg.rope is not None  # rotary positions (only GPT-2 has none)
        self.model = LlamaModel(cfg, self.decoder_layer)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rope, cfg.rotary_dim, cfg.max_model_len), persistent=False)
        self.rope_scale = rope_attention_factor(cfg.rope)
        scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.attention_shape = AttentionShape(
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            scale,
            cfg.layer_windows(),
            cfg.attn_logit_softcapping,
            cfg.attention_sinks,
        )
        if cfg.local_rope is not None:  # sliding layers turn by their own base (Gemma 3, OLMo 3)
            local = rope_inv_freq(cfg.local_rope, cfg.rotary_dim, cfg.max_model_len)
            self.register_buffer("local_inv_freq", local, persistent=False)
            self.local_rope_scale = rope_attention_factor(cfg.local_rope)
        self.rope_of_layer = _rope_of_layer(cfg)
        self._qk_rows = None  # q and k rows in the order rotate-half rope needs (interleaved rope)
        if cfg.rope_interleaved:
            self._qk_rows = (
                interleaved_to_halves(cfg.head_dim, cfg.rotary_dim, cfg.num_heads),
                interleaved_to_halves(cfg.head_dim, cfg.rotary_dim, cfg.num_kv_heads),
            )
        self.tie_weights()

    def checkpoint_rows(self, name: str) -> torch.Tensor | None:
        """With an interleaved rope (GLM-4, Cohere 2): q and k projections (weights and biases)
        read with each head's rotary pairs as rotate-half pairs (rope.interleaved_to_halves)."""
        if self._qk_rows is not None and ".self_attn.q_proj." in name:
            return self._qk_rows[0]
        if self._qk_rows is not None and ".self_attn.k_proj." in name:
            return self._qk_rows[1]
        return None

    def init_buffers(self, device: torch.device | str) -> None:
        c = self.config
        assert c.rope is not None  # rotary positions (only GPT-2 has none)
        self.inv_freq = rope_inv_freq(c.rope, c.rotary_dim, c.max_model_len).to(device)
        if c.local_rope is not None:
            self.local_inv_freq = rope_inv_freq(c.local_rope, c.rotary_dim, c.max_model_len).to(device)

    def key_turns(self, delta: int) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per layer, (cos, sin) of the angle -delta x inv_freq (rotary_dim,) float32 (the model's
        rope, a sliding layer's local rope, or None for a layer without rope), with no attention
        factor: a cached key already carries yarn's, and a turn keeps a vector's length."""
        c = self.config
        if c.mla is not None or c.recurrent is not None:
            raise NotImplementedError(
                f"context shift is not implemented for {type(self).__name__}: "
                + ("its latent cache" if c.mla is not None else "a recurrent layer cannot forget tokens")
            )
        back = torch.tensor([-delta], device=self.inv_freq.device)

        def turn(inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            cos, sin = rope_cos_sin(inv_freq, back, torch.float32)  # each (1, 1, rotary_dim)
            return cos.reshape(-1), sin.reshape(-1)

        model = turn(self.inv_freq)
        if self.rope_of_layer is None:
            return [model] * c.num_layers
        local = turn(self.local_inv_freq) if c.local_rope is not None else None
        return [[model, local, None][r] for r in self.rope_of_layer]

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):  # not when quantized
            self.lm_head.weight = self.model.embed_tokens.weight

    def shard_rows(self, param_name: str, shard_id: str) -> slice:
        """q/k/v rows of qkv_proj; gate/up halves of a gate_up_proj (whose size differs between
        the dense MLP, each expert and a shared expert, so it is read off the module)."""
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        if shard_id in ("gate", "up"):
            proj: Any = self.get_submodule(param_name.rsplit(".", 1)[0])  # a linear layer, maybe quantized
            inter = proj.out_features // 2
            return slice(0, inter) if shard_id == "gate" else slice(inter, 2 * inter)
        return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}[shard_id]

    def embed_and_plan(self, input_ids, positions, meta, kv_cache: PagedKVCache) -> tuple[torch.Tensor, StepAttention]:
        """The step's embeddings (T, hidden) and its attention op (rope (T, 1, rotary_dim) planned in)."""
        h = self.model.embed_tokens(input_ids)
        return h, self.plan(positions, meta, kv_cache, h.dtype)

    def plan(self, positions, meta, kv_cache: PagedKVCache, dtype: torch.dtype) -> StepAttention:
        """The step's attention op for activations of `dtype`, rope planned in: one op per rope
        the layers use (``_rope_of_layer``) and, where the window layers keep blocks of their own
        (``meta.window``), per side of that split. Sliding layers of a model with a local rope turn
        by its tables; layers without rope (ModelConfig.rope_layers: SmolLM3) attend through an op
        planned with the identity turn (cos 1, sin 0: q and k come out bit for bit as they went
        in), so every backend serves them all."""
        cos, sin = rope_cos_sin(self.inv_freq, positions, dtype, self.rope_scale)  # (T, 1, rotary_dim)
        if self.rope_of_layer is None and meta.window is None:
            return plan_attention(self.attention_shape, meta, kv_cache, (cos, sin))
        ropes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {0: (cos, sin)}
        if self.config.local_rope is not None:
            ropes[1] = rope_cos_sin(self.local_inv_freq, positions, dtype, self.local_rope_scale)
        if self.config.rope_layers is not None:
            ropes[2] = (torch.ones_like(cos), torch.zeros_like(sin))
        shape = self.attention_shape
        ops: list[StepAttention] = []
        op_of: dict[tuple[int, bool], int] = {}  # (rope, windowed) -> its op
        op_of_layer = []
        for layer in range(self.config.num_layers):
            key = (self.rope_of_layer[layer] if self.rope_of_layer else 0, shape.window(layer) is not None)
            if key not in op_of:
                op_of[key] = len(ops)
                rope = ropes.get(key[0], ropes[0])
                ops.append(plan_attention(shape, meta.for_window_layers(key[1]), kv_cache, rope))
            op_of_layer.append(op_of[key])
        return LayerwiseAttention(ops, op_of_layer)

    def run_layers(self, h: torch.Tensor, attend: StepAttention) -> torch.Tensor:
        h, residual = self.run_layer_range(h, None, attend, range(len(self.model.layers)))
        assert residual is not None  # a model has layers
        return self.model.norm.add_forward(h, residual)[0]

    def run_layer_range(
        self, h: torch.Tensor, residual: torch.Tensor | None, attend: StepAttention, layers: range
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers `layers` only (a pipeline stage's): (h, residual) in, (h, residual) out, the
        residual add deferred as in LlamaDecoderLayer.forward (None before the first layer)."""
        for i in layers:
            h, residual = self.model.layers[i].forward(h, residual, attend, i)
        return h, residual


def _rope_of_layer(cfg: ModelConfig) -> list[int] | None:
    """Per layer, the rope its attention turns by (plan's ops): 0 the model's, 1 the local rope of
    a sliding layer, 2 none; None where every layer uses the model's."""
    if cfg.local_rope is None and cfg.rope_layers is None:
        return None
    windows, turns = cfg.layer_windows(), cfg.rope_layers or (True,) * cfg.num_layers
    local = cfg.local_rope is not None
    return [2 if not turns[i] else 1 if local and windows[i] is not None else 0 for i in range(cfg.num_layers)]
