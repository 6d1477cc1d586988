"""GGUF files: config, tensors (dequantized) and tokenizer from one file.

Everything is translated into HF terms (config.json keys, HF tensor names and
layouts, a ``tokenizers`` tokenizer), so the rest of the engine sees a GGUF
checkpoint exactly as it sees an HF folder.

llama.cpp permutes the rows of Llama-architecture Q and K projections for its
interleaved rotary embedding; we undo that on load and keep HF's rotate-half.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from tokenloom.loader.gguf_reader import GGUFFormatError, GGUFReader, GGUFTensorInfo
from tokenloom.loader.safetensors import CheckpointError
from tokenloom.models.config import UnsupportedModelError
from tokenloom.quant.gguf.tensor import KERNEL_TYPES, GGMLTensor, type_name
from tokenloom.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_QWEN2_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
)
_LLAMA3_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
)
# o200k (gpt-oss): the regex of its tokenizer.json, which llama.cpp's GPT4O pre-type rewrites
# without the case-insensitive groups its regex engine lacks
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regexes llama.cpp splits with, applied in order.
_PRE_TOKENIZER_SPLITS = {
    "gpt2": [_GPT2_SPLIT],
    "gpt-2": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],
    "starcoder": [r"\p{N}", _GPT2_SPLIT],
    "qwen2": [_QWEN2_SPLIT],
    "stablelm2": [_QWEN2_SPLIT],  # llama.cpp splits StableLM 2's Arcade100k text as Qwen2's
    "llama-bpe": [_LLAMA3_SPLIT],
    "gpt-4o": [_GPT4O_SPLIT],
}
# end tokens llama.cpp adds by their text where the file names only one (gpt-oss's: <|return|>)
_END_TEXTS = {"gpt-oss": ("<|return|>", "<|call|>", "<|endoftext|>")}
_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED = 3, 4

# Float tensor types: read as float32 (lossless).
_FLOAT_TYPES = {0: np.float32, 1: np.float16}
_BF16 = 30

# a "llama" file with experts is Mixtral (hf_config)
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",  # V3 where its experts are scored by sigmoid (hf_config)
    "granite": "GraniteForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",  # GraniteMoeShared where it has a shared expert (hf_config)
    "granitehybrid": "GraniteMoeHybridForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}
# llama.cpp's converter interleaves q/k rows of these (LlamaModel.permute): undone on load
_PERMUTED_QK = ("llama", "smollm3", "granite", "granitemoe", "granitehybrid")
# llama.cpp renormalizes the chosen experts' weights for these (build_moe_ffn's norm_w)
_NORMALIZED_TOP_K = {
    "llama": True,
    "qwen2moe": False,
    "qwen3moe": True,
    "olmoe": False,
    "gpt-oss": True,
    "granitemoe": True,
    "granitehybrid": True,
    "qwen3next": True,
}
_GATING_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax, the default)

_LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LLAMA_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts (the stacked ffn_*_exps tensors are split per expert in _hf_tensors)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# (experts, rows, cols) stacked; gpt-oss's biases (experts, rows)
_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)")
_ROUTER = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight")
_ONE_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")  # older Mixtral files: one each
_HEAD_NORMS = re.compile(r"blk\.(\d+)\.attn_([qk])_norm\.weight")  # StableLM: (heads, head_dim) stacked
_ROPE_FACTOR_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# Phi-3 stores q/k/v and gate/up fused, as tokenloom does
_PHI3_BLOCK_NAMES = _LLAMA_BLOCK_NAMES | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# OLMo 2's norms come after attention and the MLP
_OLMO2_BLOCK_NAMES = _LLAMA_BLOCK_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma's four norms a layer (llama.cpp's ffn_norm is the norm before the MLP there)
_GEMMA_BLOCK_NAMES = _LLAMA_BLOCK_NAMES | {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# GLM-4's four norms under its own HF names, and its gate and up stored as one ffn_up
_GLM4_BLOCK_NAMES = _LLAMA_BLOCK_NAMES | {
    "post_attention_norm": "post_self_attn_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_mlp_layernorm",
    "ffn_up": "mlp.gate_up_proj",
}
# gpt-oss: the norm before the MLP named as OLMo 2's after-attention norm, and the sink logits
_GPT_OSS_BLOCK_NAMES = _LLAMA_BLOCK_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks",
}
# DeepSeek's latent attention and mixture (conversion/deepseek.py's names)
_DEEPSEEK2_BLOCK_NAMES = _LLAMA_BLOCK_NAMES | {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # older files; newer ones store it split:
    "attn_k_b": "self_attn.k_b",
    "attn_v_b": "self_attn.v_b",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",
}
# Granite 4.0-H's Mamba-2 mixers (conversion/mamba.py's names)
_GRANITE_HYBRID_BLOCK_NAMES = _LLAMA_BLOCK_NAMES | {
    "ssm_in": "mamba.in_proj",
    "ssm_conv1d": "mamba.conv1d",
    "ssm_dt": "mamba.dt_bias",
    "ssm_norm": "mamba.norm",
    "ssm_out": "mamba.out_proj",
}
# Qwen3-Next's Gated DeltaNet (conversion/qwen.py's Qwen3NextModel: in_proj_qkvz split into
# [q | k | v] and z; older files keep it whole as ssm_in) and its norm after attention
_QWEN3NEXT_BLOCK_NAMES = _LLAMA_BLOCK_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_in": "linear_attn.in_proj_qkvz",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt": "linear_attn.dt_bias",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
# stored without a .weight suffix: blk.N.ssm_a (A = -exp(A_log)), blk.N.ssm_d
_SSM_A_D = re.compile(r"blk\.(\d+)\.ssm_([ad])")
# block tensors that are parameters of their own in HF, not a module's weight or bias
_BARE_PARAMETERS = ("attn_sinks", "exp_probs_b", "ssm_dt")
_GPT2_NAMES = {
    "token_embd.weight": "transformer.wte.weight",
    "position_embd.weight": "transformer.wpe.weight",
    "output_norm.weight": "transformer.ln_f.weight",
    "output_norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
}
_GPT2_BLOCK_NAMES = {
    "attn_norm": "ln_1",
    "ffn_norm": "ln_2",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}

# StableLM's LayerNorms carry a bias
_STABLELM_NAMES = _LLAMA_NAMES | {"output_norm.bias": "model.norm.bias"}

# architecture -> (whole-model names, per-block names); Llama's where not listed
_NAME_TABLES = {
    "gpt2": (_GPT2_NAMES, _GPT2_BLOCK_NAMES),
    "gemma3": (_LLAMA_NAMES, _GEMMA_BLOCK_NAMES),
    "gemma2": (_LLAMA_NAMES, _GEMMA_BLOCK_NAMES),
    "olmo2": (_LLAMA_NAMES, _OLMO2_BLOCK_NAMES),
    "glm4": (_LLAMA_NAMES, _GLM4_BLOCK_NAMES),
    "phi3": (_LLAMA_NAMES, _PHI3_BLOCK_NAMES),
    "stablelm": (_STABLELM_NAMES, _LLAMA_BLOCK_NAMES),
    "gpt-oss": (_LLAMA_NAMES, _GPT_OSS_BLOCK_NAMES),
    "deepseek2": (_LLAMA_NAMES, _DEEPSEEK2_BLOCK_NAMES),
    "granitehybrid": (_LLAMA_NAMES, _GRANITE_HYBRID_BLOCK_NAMES),
    "qwen3next": (_LLAMA_NAMES, _QWEN3NEXT_BLOCK_NAMES),
}


def _gemma_query_scalar(cfg: dict, wide_layers: int) -> int:
    """llama.cpp's Gemma attention scale: head_dim, but hidden / heads for the 27B (its layer count)."""
    return (
        cfg["hidden_size"] // cfg["num_attention_heads"] if cfg["num_hidden_layers"] == wide_layers else cfg["head_dim"]
    )


def _expert_name(layer: int | str, expert: int | str, kind: str, part: str = "weight") -> str:
    """The HF name of one expert's gate/up/down matrix (or bias)."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{kind}_proj.{part}"


_SHARD = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")


def _read(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (GGUFFormatError, OSError) as e:
        raise CheckpointError(f"{path} is not a readable GGUF file (corrupt or truncated?): {e}") from e


class GGUFFile:
    """An opened GGUF file: metadata fields and tensors (memory-mapped, read on demand); a split
    model's shards are read as one file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = _read(self.path)
        shards = self._other_shards()  # before the architecture: a later shard does not name it
        self.arch = self.field("general.architecture")
        if self.arch not in _ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {self.arch!r} is not supported (supported: {', '.join(_ARCHITECTURES)})"
            )
        self.tensors = [t for reader in [self.reader, *shards] for t in reader.tensors]
        self._hf_config: dict | None = None
        self._said_mtp = False

    def _other_shards(self) -> list[GGUFReader]:
        """A split model's shards after this first one (``NAME-0000i-of-0000N.gguf`` side by side,
        as llama.cpp's gguf-split writes them; metadata is the first shard's)."""
        count = self.field("split.count", 1) or 1
        if count <= 1:
            return []
        name = _SHARD.fullmatch(self.path.name)
        if self.field("split.no", 0) != 0 or name is None:
            raise CheckpointError(
                f"{self.path.name} is one shard of a split GGUF of {count}: open its first shard "
                f"(...-00001-of-{count:05d}.gguf)"
            )
        paths = [self.path.with_name(f"{name[1]}-{i:05d}-of-{count:05d}.gguf") for i in range(2, count + 1)]
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise CheckpointError(
                f"{self.path.name} is split in {count} shards and {', '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} missing beside it"
            )
        return [_read(p) for p in paths]

    def field(self, key: str, default=None):
        return self.reader.fields.get(key, default)

    def arch_field(self, key: str, default=None):
        return self.field(f"{self.arch}.{key}", default)

    @property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self.tensors}

    def hf_config(self) -> dict:
        """The equivalent HF config.json (built once per file: it reads the rope factor tensors and
        scans the tensor list; each call gets its own copy)."""
        if self._hf_config is None:
            self._hf_config = self._build_hf_config()
        return dict(self._hf_config)

    def _build_hf_config(self) -> dict:
        tokens = self.field("tokenizer.ggml.tokens") or []
        cfg = {
            "architectures": [_ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "vocab_size": self.arch_field("vocab_size", len(tokens)),
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": sorted(self.eos_token_ids()),
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
        }
        heads = self.arch_field("attention.head_count")
        if self.arch == "gpt2":
            return cfg | {
                "n_embd": self.arch_field("embedding_length"),
                "n_layer": self.arch_field("block_count"),
                "n_head": heads,
                "n_positions": self.arch_field("context_length"),
                "n_inner": self.arch_field("feed_forward_length"),
                "layer_norm_epsilon": self.arch_field("attention.layer_norm_epsilon", 1e-5),
            }
        hidden = self.arch_field("embedding_length")
        cfg |= {
            "hidden_size": hidden,
            "intermediate_size": self.arch_field("feed_forward_length"),
            "num_hidden_layers": self.arch_field("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.arch_field("attention.head_count_kv", heads),
            "head_dim": self.arch_field("attention.key_length", hidden // heads),
            "max_position_embeddings": self.arch_field("context_length"),
            "rms_norm_eps": self.arch_field("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self.arch_field("rope.freq_base", 10000.0),
        }
        cfg |= self._rope_fields(cfg)
        if self.arch == "phi3":
            cfg["sliding_window"] = self.arch_field("attention.sliding_window") or None  # 0: none (Phi-4)
        if self.arch == "gemma3":
            cfg |= self._gemma3_fields(cfg)
        if self.arch == "gemma2":
            cfg |= self._gemma2_fields(cfg)
        if self.arch == "stablelm":
            cfg |= self._stablelm_fields(cfg)
        if self.arch == "smollm3":  # llama.cpp's smollm3.cpp: every fourth layer without rope, fixed
            cfg["no_rope_layer_interval"] = 4
        if self.arch == "glm4":  # q/k/v bias where the file has it
            cfg["attention_bias"] = "blk.0.attn_q.bias" in self.tensor_names
            # rope.dimension_count equal to head_dim (no factor set above) means every dim turns:
            # said outright, since GLM's HF default is half
            cfg.setdefault("partial_rotary_factor", 1.0)
        if self.arch == "cohere2":  # llama.cpp's cohere2.cpp: LayerNorm, every fourth layer full, no biases kept
            cfg |= {
                "layer_norm_eps": self.arch_field("attention.layer_norm_epsilon", 1e-5),
                "logit_scale": self.arch_field("logit_scale", 1.0),
                "sliding_window": self.arch_field("attention.sliding_window"),
                "attention_bias": "blk.0.attn_q.bias" in self.tensor_names,
            }
        if self.arch == "olmo2" and self.arch_field("attention.sliding_window"):
            cfg |= self._olmo3_fields(cfg)
        if self.arch == "gpt-oss":
            cfg |= self._gpt_oss_fields(cfg)
        if self.arch == "deepseek2":
            return cfg | self._deepseek2_fields(cfg)
        if self.arch == "granitehybrid":
            cfg |= self._granite_hybrid_fields(cfg)
        if self.arch == "qwen3next":
            cfg |= self._qwen3next_fields(cfg)
        if self.arch in ("granite", "granitemoe", "granitehybrid"):  # conversion/granite.py's *_scale keys
            cfg |= {
                "embedding_multiplier": self.arch_field("embedding_scale", 1.0),
                "residual_multiplier": self.arch_field("residual_scale", 1.0),
                "attention_multiplier": self.arch_field("attention.scale", 1.0),
                "logits_scaling": self.arch_field("logit_scale", 1.0),
            }
        if self.arch_field("expert_count", 0):
            cfg |= self._moe_fields(cfg)
        return cfg

    def _gemma2_fields(self, cfg: dict) -> dict:
        """Gemma 2 as llama.cpp runs it: even layers slide, scores and logits soft-capped, the
        attention scale from head_dim (hidden / heads for the 46-layer 27B)."""
        return {
            "sliding_window": self.arch_field("attention.sliding_window", 4096),
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": _gemma_query_scalar(cfg, 46),
            "attn_logit_softcapping": self.arch_field("attn_logit_softcapping"),
            "final_logit_softcapping": self.arch_field("final_logit_softcapping"),
        }

    def _olmo3_fields(self, cfg: dict) -> dict:
        """OLMo 3, which llama.cpp writes as `olmo2` with a sliding window: its sliding layers
        (sliding_window_pattern, else all but every fourth) turn by rope.freq_base_swa (else the
        model's base) without the full layers' rope scaling, as llama.cpp's olmo2.cpp runs them."""
        layers = cfg["num_hidden_layers"]
        pattern = self.arch_field("attention.sliding_window_pattern") or [(i + 1) % 4 != 0 for i in range(layers)]
        full = {"rope_theta": cfg["rope_theta"]} | dict(cfg.pop("rope_scaling", None) or {})
        local = {"rope_theta": self.arch_field("rope.freq_base_swa", cfg["rope_theta"])}
        return {
            "architectures": ["Olmo3ForCausalLM"],
            "model_type": "olmo3",
            "sliding_window": self.arch_field("attention.sliding_window"),
            "layer_types": ["sliding_attention" if slides else "full_attention" for slides in pattern],
            "rope_parameters": {"full_attention": full, "sliding_attention": local},
        }

    def _gpt_oss_fields(self, cfg: dict) -> dict:
        """gpt-oss as its HF config describes it (llama.cpp's openai-moe.cpp): every other layer
        sliding from the first, each expert's size as the MLP's, YaRN with gpt-oss's bounds (not
        truncated, as transformers computes them) over the file's original context."""
        fields: dict = {
            "sliding_window": self.arch_field("attention.sliding_window", 128),
            "intermediate_size": self.arch_field("expert_feed_forward_length"),
            "attention_bias": True,
        }
        if self.arch_field("rope.scaling.type") == "yarn":
            fields["rope_parameters"] = {
                "rope_type": "yarn",
                "rope_theta": cfg["rope_theta"],
                "factor": self.arch_field("rope.scaling.factor", 32.0),
                "original_max_position_embeddings": self.arch_field("rope.scaling.original_context_length", 4096),
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            }
        return fields

    def _deepseek2_fields(self, cfg: dict) -> dict:
        """DeepSeek-V2/V3 as their HF configs say it (llama.cpp's deepseek2.cpp): V3 where the experts
        are scored by sigmoid, the latent attention's sizes (key_length_mla and value_length_mla, or
        in older files key_length and value_length), rope pairs interleaved, YaRN's mscale from
        yarn_log_multiplier (written as 0.1 mscale_all_dim), the mixture from the expert keys."""
        rope = self.arch_field("rope.dimension_count", 64)
        v3 = self.arch_field("expert_gating_func") == _GATING_SIGMOID
        experts = self.arch_field("expert_count", 0)
        groups = self.arch_field("expert_group_count", 1) or 1
        fields: dict = {
            "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v3" if v3 else "deepseek_v2",
            "kv_lora_rank": self.arch_field("attention.kv_lora_rank"),
            "q_lora_rank": self.arch_field("attention.q_lora_rank") or None,
            "qk_rope_head_dim": rope,
            "qk_nope_head_dim": self.arch_field("attention.key_length_mla", cfg["head_dim"]) - rope,
            "v_head_dim": self.arch_field("attention.value_length_mla", self.arch_field("attention.value_length")),
            "rope_interleave": True,
            "first_k_dense_replace": self.arch_field("leading_dense_block_count", 0),
            "n_routed_experts": experts or None,
            "num_experts_per_tok": self.arch_field("expert_used_count"),
            "moe_intermediate_size": self.arch_field("expert_feed_forward_length"),
            "n_shared_experts": self.arch_field("expert_shared_count", 0),
            "routed_scaling_factor": self.arch_field("expert_weights_scale", 1.0),
            "norm_topk_prob": bool(self.arch_field("expert_weights_norm", False)),
            "n_group": groups,
            "topk_group": self.arch_field("expert_group_used_count", 1) or 1,
            "topk_method": "group_limited_greedy" if groups > 1 else "greedy",
        }
        if self.arch_field("rope.scaling.type") == "yarn":
            mscale = self.arch_field("rope.scaling.yarn_log_multiplier", 0.0) / 0.1
            fields["rope_parameters"] = {
                "rope_type": "yarn",
                "rope_theta": cfg["rope_theta"],
                "factor": self.arch_field("rope.scaling.factor", 1.0),
                "original_max_position_embeddings": self.arch_field("rope.scaling.original_context_length"),
                "beta_fast": self.arch_field("rope.scaling.yarn_beta_fast", 32.0),
                "beta_slow": self.arch_field("rope.scaling.yarn_beta_slow", 1.0),
                "mscale": mscale,
                "mscale_all_dim": mscale,
            }
        return fields

    def _qwen3next_fields(self, cfg: dict) -> dict:
        """Qwen3-Next as conversion/qwen.py writes it: the DeltaNet's sizes under ssm.* (key heads as
        group_count, their dims as state_size, value heads as time_step_rank, all value dims as
        inner_size), its layers from attention.recurrent_layers (else all but every
        full_attention_interval-th), the rope's dims as a fraction of head_dim, the
        multi-token-prediction blocks (nextn_predict_layers) past the model's layers."""
        layers = cfg["num_hidden_layers"] - self.arch_field("nextn_predict_layers", 0)
        interval = self.arch_field("full_attention_interval", 4)
        recurrent = self.arch_field("attention.recurrent_layers") or [(i + 1) % interval != 0 for i in range(layers)]
        v_heads = self.arch_field("ssm.time_step_rank")
        return {
            "num_hidden_layers": layers,
            "layer_types": ["linear_attention" if r else "full_attention" for r in list(recurrent)[:layers]],
            "linear_conv_kernel_dim": self.arch_field("ssm.conv_kernel"),
            "linear_num_key_heads": self.arch_field("ssm.group_count"),
            "linear_key_head_dim": self.arch_field("ssm.state_size"),
            "linear_num_value_heads": v_heads,
            "linear_value_head_dim": self.arch_field("ssm.inner_size") // v_heads,
            "partial_rotary_factor": self.arch_field("rope.dimension_count", cfg["head_dim"] // 4) / cfg["head_dim"],
        }

    def _granite_hybrid_fields(self, cfg: dict) -> dict:
        """Granite 4.0-H as conversion/granite.py writes it: a layer with no kv heads
        (attention.head_count_kv per layer) is a Mamba-2 layer, the Mamba sizes under ssm.* (the
        heads as time_step_rank), rope only where rope.scaling.finetuned says (llama.cpp's switch
        for Granite; true when absent); the shared MLP's width (the whole MLP's without experts)."""
        kv = self.arch_field("attention.head_count_kv")
        kv = list(kv) if isinstance(kv, (list, tuple)) else [kv] * cfg["num_hidden_layers"]
        inner, heads = self.arch_field("ssm.inner_size"), self.arch_field("ssm.time_step_rank")
        if inner % cfg["hidden_size"]:
            raise UnsupportedModelError(f"{self.path.name}: ssm.inner_size {inner} is not a multiple of the width")
        return {
            "num_key_value_heads": max(kv),
            "layer_types": ["attention" if n else "mamba" for n in kv],
            "mamba_n_heads": heads,
            "mamba_d_head": inner // heads,
            "mamba_expand": inner // cfg["hidden_size"],
            "mamba_d_state": self.arch_field("ssm.state_size"),
            "mamba_n_groups": self.arch_field("ssm.group_count", 1),
            "mamba_d_conv": self.arch_field("ssm.conv_kernel", 4),
            "mamba_conv_bias": any(t.name.endswith("ssm_conv1d.bias") for t in self.tensors),
            "mamba_proj_bias": any(t.name.endswith("ssm_in.bias") for t in self.tensors),
            "position_embedding_type": "rope" if self.arch_field("rope.scaling.finetuned", True) else "nope",
            "shared_intermediate_size": self.arch_field("expert_shared_feed_forward_length")
            or cfg["intermediate_size"],
            "num_local_experts": self.arch_field("expert_count", 0),
        }

    def _stablelm_fields(self, cfg: dict) -> dict:
        """StableLM's options, read where llama.cpp keeps them: q/k/v bias and per-head q/k norms
        from the tensors present, the rotated share of each head always (its HF default is 0.25)."""
        names = self.tensor_names
        return {
            "layer_norm_eps": self.arch_field("attention.layer_norm_epsilon", 1e-5),
            "use_parallel_residual": bool(self.arch_field("use_parallel_residual", False)),
            "use_qkv_bias": "blk.0.attn_q.bias" in names,
            "qk_layernorm": "blk.0.attn_q_norm.weight" in names,
            "partial_rotary_factor": self.arch_field("rope.dimension_count", cfg["head_dim"]) / cfg["head_dim"],
        }

    def _rope_fields(self, cfg: dict) -> dict:
        """Rope scaling as transformers' configs say it. llama.cpp stores per-frequency divisors as
        tensors: Llama 3.1's rope_freqs (its llama3 scaling, precomputed) and Phi-3's long/short
        sets; both are longrope's arithmetic (inv_freq / factor), a single set where short = long."""
        fields: dict = {}
        rotary = self.arch_field("rope.dimension_count")
        if rotary is not None and rotary != cfg["head_dim"]:
            fields["partial_rotary_factor"] = rotary / cfg["head_dim"]
        scaling = self.arch_field("rope.scaling.type")
        if scaling not in (None, "none"):
            fields["rope_scaling"] = {"rope_type": scaling, "factor": self.arch_field("rope.scaling.factor", 1.0)}
        factors = {t.name: t for t in self.tensors if t.name in _ROPE_FACTOR_TENSORS}
        if "rope_freqs.weight" in factors:
            one_set = self._floats(factors["rope_freqs.weight"])
            fields["rope_scaling"] = {
                "rope_type": "longrope",
                "short_factor": one_set,
                "long_factor": one_set,
                "factor": 1.0,
                "original_max_position_embeddings": cfg["max_position_embeddings"],
            }
        elif factors:
            fields["rope_scaling"] = {
                "rope_type": "longrope",
                "short_factor": self._floats(factors["rope_factors_short.weight"]),
                "long_factor": self._floats(factors["rope_factors_long.weight"]),
                "original_max_position_embeddings": self.arch_field("rope.scaling.original_context_length"),
                "attention_factor": self.arch_field("rope.scaling.attn_factor"),
            }
        return fields

    @staticmethod
    def _floats(t: GGUFTensorInfo) -> list[float]:
        if t.type != 0:
            raise CheckpointError(f"rope factor tensor {t.name} should be F32, is {type_name(t.type)}")
        return t.raw().view(np.float32).tolist()

    def _moe_fields(self, cfg: dict) -> dict:
        """Experts as transformers' configs name them; a "llama" file with experts is Mixtral. The
        layers without a router tensor are dense (mlp_only_layers)."""
        if self.arch not in _NORMALIZED_TOP_K:
            raise UnsupportedModelError(
                f"{self.path.name}: mixture of experts in a GGUF {self.arch!r} file is not "
                f"supported (supported: {', '.join(_NORMALIZED_TOP_K)})"
            )
        if self.arch_field("expert_weights_scale", 1.0) != 1.0:
            raise UnsupportedModelError(
                f"{self.path.name}: expert_weights_scale {self.arch_field('expert_weights_scale')} is not supported"
            )
        experts = self.arch_field("expert_count")
        routed = {int(m.group(1)) for t in self.tensors if (m := _ROUTER.fullmatch(t.name))}
        fields = {
            "num_local_experts": experts,
            "num_experts": experts,
            "num_experts_per_tok": self.arch_field("expert_used_count"),
            "moe_intermediate_size": self.arch_field("expert_feed_forward_length", cfg["intermediate_size"]),
            "shared_expert_intermediate_size": self.arch_field("expert_shared_feed_forward_length", 0),
            "norm_topk_prob": _NORMALIZED_TOP_K[self.arch],
            "mlp_only_layers": [i for i in range(cfg["num_hidden_layers"]) if i not in routed],
        }
        if self.arch == "granitemoe" and fields["shared_expert_intermediate_size"]:
            fields["architectures"] = ["GraniteMoeSharedForCausalLM"]
        if self.arch == "llama":
            fields |= {
                "architectures": ["MixtralForCausalLM"],
                "model_type": "mixtral",
                "intermediate_size": fields["moe_intermediate_size"],
            }
        return fields

    def _gemma3_fields(self, cfg: dict) -> dict:
        """What llama.cpp fixes for gemma3 rather than storing: every 6th layer global, the sliding
        layers' rope base 10000, the attention scale from head_dim (hidden / heads for the 62-layer 27B)."""
        return {
            "sliding_window": self.arch_field("attention.sliding_window", 4096),
            "sliding_window_pattern": 6,
            "rope_local_base_freq": 10_000.0,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": _gemma_query_scalar(cfg, 62),
            "final_logit_softcapping": self.arch_field("final_logit_softcapping"),
        }

    def eos_token_ids(self) -> set[int]:
        """The file's end tokens, and those of its family's that llama.cpp finds by their text
        (gpt-oss's <|call|> ends a turn that calls a tool)."""
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        found = {v for k in keys if (v := self.field(k)) is not None}
        texts = _END_TEXTS.get(self.arch, ())
        if texts:
            tokens = self.field("tokenizer.ggml.tokens") or []
            found |= {i for i, token in enumerate(tokens) if token in texts}
        return found

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor | GGMLTensor]]:
        """(HF name, tensor in HF layout) for every tensor in the file.

        Matrices of a type the GGML kernels run come as GGMLTensors viewing the file's own
        blocks (no copy; rows un-permuted where llama.cpp permuted them); float types as
        float32 tensors; any other type is dequantized to float32, with a warning that names
        it and what it costs.
        """
        cfg = self.hf_config()
        for t in self.tensors:
            if t.name in _ROPE_FACTOR_TENSORS:  # read into the config (rope_scaling)
                continue
            if self._past_the_layers(t.name, cfg["num_hidden_layers"]):
                continue
            names = self._hf_names(t)
            tensor = self._to_hf_layout(t.name, self._tensor(t), cfg)
            if self.arch == "stablelm" and _HEAD_NORMS.fullmatch(t.name):  # per-head norms: (heads, head_dim)
                yield from zip(names, tensor)
            elif len(names) == 1:
                yield names[0], tensor
            elif names[0].endswith(".bias"):  # stacked expert biases: (experts, rows)
                yield from zip(names, tensor)
            else:  # stacked experts: (experts * rows, cols)
                rows = tensor.shape[0] // len(names)
                for i, name in enumerate(names):
                    yield (
                        name,
                        tensor.rows(slice(i * rows, (i + 1) * rows))
                        if isinstance(tensor, GGMLTensor)
                        else tensor[i * rows : (i + 1) * rows],
                    )
            t.release_pages()  # the consumer has copied it (or views it)

    def tensor_types(self) -> dict[str, int]:
        """HF tensor name -> the GGML type it is stored as."""
        layers = self.hf_config()["num_hidden_layers"]
        return {
            name: t.type
            for t in self.tensors
            if t.name not in _ROPE_FACTOR_TENSORS and not self._past_the_layers(t.name, layers)
            for name in self._hf_names(t)
        }

    def _past_the_layers(self, name: str, layers: int) -> bool:
        """A Qwen3-Next block past the model's layers (its multi-token-prediction layer): not run,
        skipped (said once)."""
        m = re.match(r"blk\.(\d+)\.", name)
        if self.arch != "qwen3next" or m is None or int(m.group(1)) < layers:
            return False
        if not self._said_mtp:
            self._said_mtp = True
            name = self.path.name
            log.info("%s: skipping blocks from %d on: the multi-token-prediction layer is not run", name, layers)
        return True

    def _hf_names(self, t: GGUFTensorInfo) -> list[str]:
        """The HF names a file tensor holds: one, or one per expert of a stacked ffn_*_exps tensor,
        or one per head of StableLM's stacked q/k norms."""
        if self.arch == "stablelm" and (m := _HEAD_NORMS.fullmatch(t.name)):
            layer, kind = m.groups()
            return [f"model.layers.{layer}.self_attn.{kind}_layernorm.norms.{h}.weight" for h in range(t.shape[0])]
        m = _EXPERTS.fullmatch(t.name)
        if m is None:
            return [self._hf_name(t.name)]
        layer, kind, part = m.groups()
        return [_expert_name(layer, e, kind, part) for e in range(t.shape[0])]

    def _tensor(self, t: GGUFTensorInfo) -> torch.Tensor | GGMLTensor:
        raw = t.raw()
        if t.type in KERNEL_TYPES and len(t.shape) in (2, 3):  # 3: stacked experts, rows joined
            rows = int(np.prod(t.shape[:-1]))
            data = torch.from_numpy(raw).view(rows, -1)
            row_bytes = data.shape[1]
            return GGMLTensor(
                t.type, data, t.shape[-1], lambda index: torch.from_numpy(t.read_rows(index.tolist(), row_bytes))
            )
        shape = (-1, t.shape[-1]) if len(t.shape) == 3 else t.shape
        if t.type in _FLOAT_TYPES:
            return torch.from_numpy(raw.view(_FLOAT_TYPES[t.type]).astype(np.float32)).view(shape)
        if t.type == _BF16:
            return (torch.from_numpy(raw.view(np.int16).astype(np.int32) << 16).view(torch.float32)).view(shape)
        from gguf import GGMLQuantizationType, quants

        log.warning(
            "%s: %s blocks have no tokenloom kernel; dequantized to float32 (%.1f MB instead of %.1f MB)",
            t.name,
            type_name(t.type),
            4 * np.prod(t.shape) / 1e6,
            t.nbytes / 1e6,
        )
        array = quants.dequantize(raw, GGMLQuantizationType(t.type)).reshape(shape)
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))

    def hf_name(self, name: str) -> str:
        """The HF name of file tensor `name` (one that holds one HF tensor); CheckpointError if unknown."""
        return self._hf_name(name)

    def float_tensor(self, t: GGUFTensorInfo) -> torch.Tensor:
        """Tensor `t` as stored (llama.cpp's layout), as float32."""
        tensor = self._tensor(t)
        return tensor.dequantize() if isinstance(tensor, GGMLTensor) else tensor

    @property
    def permutes_qk(self) -> bool:
        """llama.cpp interleaved this architecture's q/k rows (unpermute_rope_rows undoes it)."""
        return self.arch in _PERMUTED_QK

    def _hf_name(self, name: str) -> str:
        flat, block = _NAME_TABLES.get(self.arch, (_LLAMA_NAMES, _LLAMA_BLOCK_NAMES))
        if name in flat:
            return flat[name]
        if m := _ONE_EXPERT.fullmatch(name):
            return _expert_name(m.group(1), m.group(3), m.group(2))
        if self.arch == "granitehybrid" and (m := _SSM_A_D.fullmatch(name)):
            return f"model.layers.{m.group(1)}.mamba.{'A_log' if m.group(2) == 'a' else 'D'}"
        if self.arch == "qwen3next" and (m := _SSM_A_D.fullmatch(name)) and m.group(2) == "a":
            return f"model.layers.{m.group(1)}.linear_attn.A_log"
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
        if m and m.group(2) in _BARE_PARAMETERS and m.group(2) in block:
            return f"model.layers.{m.group(1)}.{block[m.group(2)]}"
        if m and m.group(2) in block:
            prefix = "transformer.h" if self.arch == "gpt2" else "model.layers"
            return f"{prefix}.{m.group(1)}.{block[m.group(2)]}.{m.group(3)}"
        raise CheckpointError(f"GGUF tensor {name!r} has no known meaning for architecture {self.arch!r}")

    def _to_hf_layout(self, name: str, tensor, cfg: dict):
        if self.arch in _PERMUTED_QK and re.search(r"\.attn_[qk]\.", name):
            heads = cfg["num_attention_heads"] if ".attn_q." in name else cfg["num_key_value_heads"]
            if isinstance(tensor, GGMLTensor):  # rows are independent blocks: permute them
                return tensor.rows(unpermute_rope_rows(torch.arange(tensor.shape[0]), heads))
            return unpermute_rope_rows(tensor, heads)
        if isinstance(tensor, GGMLTensor):  # blocks are (out, in) rows: nn.Linear's layout already
            return tensor
        if self.arch == "gpt2" and tensor.dim() == 2 and re.search(r"\.(attn_qkv|attn_output|ffn_up|ffn_down)\.", name):
            return tensor.t().contiguous()  # back to HF Conv1D's (in, out)
        if self.arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            return tensor - 1  # llama.cpp stores Gemma's 1 + w; HF's checkpoints hold w
        if name.endswith("ffn_gate_inp_shexp.weight"):
            return tensor.view(1, -1)  # llama.cpp stores the shared expert's gate as a vector
        if self.arch == "qwen3next" and name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
            return tensor - 1  # conversion/qwen.py stores Qwen3-Next's (1 + w) norms as 1 + w
        if self.arch in ("granitehybrid", "qwen3next"):
            return _mamba_to_hf(name, tensor)
        return tensor

    def tokenizer(self) -> Tokenizer:
        return gguf_tokenizer(self)


def _mamba_to_hf(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A Mamba-2 tensor as HF stores it: conversion/mamba.py squeezed the conv weight to
    (channels, kernel), stored A = -exp(A_log) and D as (heads, 1), the gated norm as (groups,
    inner / groups)."""
    if name.endswith("ssm_conv1d.weight"):
        return tensor.unsqueeze(1)
    if _SSM_A_D.fullmatch(name):
        flat = tensor.reshape(-1)
        return torch.log(-flat) if name.endswith("ssm_a") else flat
    if name.endswith("ssm_norm.weight"):
        return tensor.reshape(-1)
    return tensor


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved -> rotate-half pairs); w: (rows, ...) ."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tokenizer(g: GGUFFile) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` rebuilt from GGUF metadata (byte-level BPE or SentencePiece)."""
    kind = g.field("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' "
            "byte-level BPE, 'llama' SentencePiece); load an HF folder with tokenizer.json"
        )
    tokens = g.field("tokenizer.ggml.tokens")
    types = g.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    tk = _byte_level_bpe(g, tokens) if kind == "gpt2" else _sentencepiece_bpe(g, tokens)
    tk.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _TOKEN_TYPE_CONTROL]
    )
    tk.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == _TOKEN_TYPE_USER_DEFINED
        ]
    )
    bos_id, eos_id = g.field("tokenizer.ggml.bos_token_id"), g.field("tokenizer.ggml.eos_token_id")
    bos = tokens[bos_id] if bos_id is not None else None
    if g.field("tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    eos = tokens[eos_id] if eos_id is not None else None
    return Tokenizer(tk, g.field("tokenizer.chat_template"), bos, eos)


def _byte_level_bpe(g: GGUFFile, tokens: list[str]) -> HFTokenizer:
    """GPT-2 style BPE: llama.cpp's pre-tokenizer regexes, then bytes mapped to unicode."""
    pre = g.field("tokenizer.ggml.pre", "gpt2")
    if pre not in _PRE_TOKENIZER_SPLITS:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(_PRE_TOKENIZER_SPLITS)})"
        )
    merges = [tuple(m.split(" ", 1)) for m in g.field("tokenizer.ggml.merges") or []]
    tk = HFTokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=pre == "llama-bpe")
    )
    if pre == "qwen2":
        tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_TOKENIZER_SPLITS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece_bpe(g: GGUFFile, tokens: list[str]) -> HFTokenizer:
    """SentencePiece BPE (Llama 2, TinyLlama, Mistral): spaces as U+2581, byte fallback.

    SentencePiece merges the adjacent pair whose merged piece scores highest; a BPE
    whose merges are ranked by that score does the same (HF's LlamaConverter).
    """
    scores = g.field("tokenizer.ggml.scores")
    if scores is None:
        raise CheckpointError(f"{g.path.name}: SentencePiece tokenizer without tokenizer.ggml.scores")
    unk_id = g.field("tokenizer.ggml.unknown_token_id", 0)
    tk = HFTokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=_merges_by_score(tokens, scores),
            unk_token=tokens[unk_id],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    prefix = g.field("tokenizer.ggml.add_space_prefix", True)
    tk.normalizer = normalizers.Sequence(
        ([normalizers.Prepend("\u2581")] if prefix else []) + [normalizers.Replace(" ", "\u2581")]
    )
    tk.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prefix else [])
    )
    return tk


def _merges_by_score(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces of the vocabulary, best-scoring merged piece first;
    ties in vocabulary order, a piece's splits by (left id, right id)."""
    ids = {t: i for i, t in enumerate(tokens)}
    get = ids.get
    pieces, lefts, rights = [], [], []
    for i, piece in enumerate(tokens):
        for k in range(1, len(piece)):
            left = get(piece[:k])
            if left is not None and (right := get(piece[k:])) is not None:
                pieces.append(i)
                lefts.append(left)
                rights.append(right)
    p, left_ids, right_ids = np.array(pieces, dtype=np.int64), np.array(lefts), np.array(rights)
    order = np.lexsort((right_ids, left_ids, p, -np.asarray(scores, dtype=np.float64)[p]))  # last key first
    return [(tokens[a], tokens[b]) for a, b in zip(left_ids[order].tolist(), right_ids[order].tolist())]
