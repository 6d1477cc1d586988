"""Write a tiny HF folder as a GGUF file laid out the way llama.cpp's convert_hf_to_gguf.py
lays one out: its architecture names and metadata keys, its tensor names, Llama's Q/K rows
permuted for interleaved rope, experts stacked into (experts, rows, cols) tensors, the
shared-expert gate as a vector, StableLM's per-head q/k norms stacked into (heads, head_dim),
the tokenizer as a byte-level BPE vocabulary with merges.

Written from llama.cpp's conventions (gguf-py's tensor table), not from tokenloom's loader,
so a test that reads the file back checks the loader against them.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import gguf
import torch
from safetensors.torch import load_file

GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Olmo2ForCausalLM": "olmo2",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "OlmoeForCausalLM": "olmoe",
    "StableLmForCausalLM": "stablelm",
    "SmolLM3ForCausalLM": "smollm3",
    "Olmo3ForCausalLM": "olmo2",  # with a sliding window, as conversion/olmo.py writes it
    "Glm4ForCausalLM": "glm4",
    "Cohere2ForCausalLM": "cohere2",
    "GptOssForCausalLM": "gpt-oss",
    "GraniteForCausalLM": "granite",
    "GraniteMoeForCausalLM": "granitemoe",
    "GraniteMoeSharedForCausalLM": "granitemoe",
    "GraniteMoeHybridForCausalLM": "granitehybrid",
    "DeepseekV2ForCausalLM": "deepseek2",
    "DeepseekV3ForCausalLM": "deepseek2",
    "Qwen3NextForCausalLM": "qwen3next",
}

# HF layer sub-name -> llama.cpp's blk.N.<name>
_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "post_feedforward_layernorm": "post_ffw_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused tensors
}
_OLMO2_BLOCK = _BLOCK | {"post_attention_layernorm": "post_attention_norm"}
_GEMMA_BLOCK = _BLOCK | {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm"}
_GLM4_BLOCK = _BLOCK | {
    "post_self_attn_layernorm": "post_attention_norm",
    "post_mlp_layernorm": "post_ffw_norm",
    "mlp.gate_up_proj": "ffn_up",
}
_GPT_OSS_BLOCK = _BLOCK | {
    "post_attention_layernorm": "post_attention_norm",
    "mlp.router": "ffn_gate_inp",
}
_DEEPSEEK2_BLOCK = _BLOCK | {
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
# Granite MoE's JetMoE experts: input_linear (experts, gate rows then up rows, hidden), output_linear
_JETMOE = re.compile(
    r"model\.layers\.(\d+)\.(block_sparse_moe|shared_mlp)\.(input_linear|output_linear|router\.layer)\.weight"
)
# gpt-oss's stacked experts: (experts, in, out) matrices with gate and up interleaved by column
_GPT_OSS_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")
_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_KIND = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_QWEN3NEXT_BLOCK = _BLOCK | {"post_attention_layernorm": "post_attention_norm"}
_QUANTIZED = re.compile(
    r"blk\.\d+\.(attn_[qkv]|attn_q_[ab]|attn_kv_a_mqa|attn_[kv]_b|attn_output|attn_qkv|attn_gate|ssm_in|ssm_out|ssm_ba"
    r"|ffn_(gate|up|down)(_exps|_shexp)?)\.weight"
)


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    folder: Path,
    path: Path,
    quantize: str | None = None,
    stack_experts: bool = True,
    extra: dict[str, int | float] | None = None,
    split_max_tensors: int = 0,
    experts_only: bool = False,
    pre: str = "gpt-2",
    split_kv_b: bool = True,
) -> Path:
    """`folder` (config.json, model.safetensors, tokenizer.json) -> GGUF at `path`; matrices as
    `quantize` ("Q8_0", "Q4_0", ...) where their rows fit its blocks, else float32. Experts are
    stacked (ffn_gate_exps) unless `stack_experts` is False: one tensor each (ffn_gate.E, as
    the first Mixtral GGUFs were written). `extra`: more metadata keys (ints as uint32, floats
    as float32), e.g. general.sampling.*. `split_max_tensors`: shards of at most that many
    tensors, named PATH-0000i-of-0000N.gguf as llama.cpp's gguf-split names them (the first
    shard's path is returned). `experts_only`: quantize the stacked experts alone (gpt-oss's GGUFs
    keep MXFP4 experts beside wider attention weights). `pre`: tokenizer.ggml.pre (gpt-oss's files
    say "gpt-4o"). `split_kv_b`: DeepSeek's kv_b_proj as attn_k_b and attn_v_b (as llama.cpp writes
    it now), else as one attn_kv_b (older files)."""
    cfg = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    _write_metadata(w, arch, cfg)
    for key, value in (extra or {}).items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(key, value)
    _write_tokenizer(w, folder, cfg["vocab_size"], pre)
    state = load_file(str(folder / "model.safetensors"))
    for name, tensor in _gguf_tensors(state, arch, cfg, stack_experts, split_kv_b):
        array = tensor.float().numpy()
        chosen = _QUANTIZED.fullmatch(name) and (not experts_only or "_exps." in name)
        if quantize and chosen and array.shape[-1] % 32 == 0:
            kind = gguf.GGMLQuantizationType[quantize]
            w.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(Path(path))[0]


def _write_deepseek2_metadata(w: gguf.GGUFWriter, cfg: dict) -> None:
    """conversion/deepseek.py's DeepseekV2Model.set_gguf_parameters: MLA as one kv head of the
    latent (key_length kv_lora_rank + rope, value_length kv_lora_rank), the per-head sizes as
    *_mla, the mixture's keys, V3's sigmoid gating, YaRN's mscale_all_dim times 0.1."""
    rank, rope_dim = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    ints = {
        "attention.head_count_kv": 1,
        "attention.key_length": rank + rope_dim,
        "attention.value_length": rank,
        "attention.key_length_mla": cfg["qk_nope_head_dim"] + rope_dim,
        "attention.value_length_mla": cfg["v_head_dim"],
        "attention.kv_lora_rank": rank,
        "rope.dimension_count": rope_dim,
        "leading_dense_block_count": cfg["first_k_dense_replace"],
        "expert_count": cfg["n_routed_experts"],
        "expert_used_count": cfg["num_experts_per_tok"],
        "expert_feed_forward_length": cfg["moe_intermediate_size"],
        "expert_shared_count": cfg["n_shared_experts"],
        "expert_group_count": cfg["n_group"],
        "expert_group_used_count": cfg["topk_group"],
        "expert_gating_func": 2 if cfg["architectures"][0] == "DeepseekV3ForCausalLM" else 1,
    }
    if cfg.get("q_lora_rank"):
        ints["attention.q_lora_rank"] = cfg["q_lora_rank"]
    for key, value in ints.items():
        w.add_uint32(f"deepseek2.{key}", value)
    w.add_float32("deepseek2.expert_weights_scale", cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_bool("deepseek2.expert_weights_norm", True)
    rope = cfg.get("rope_parameters") or {}
    if rope.get("mscale_all_dim") is not None:
        w.add_float32("deepseek2.rope.scaling.yarn_log_multiplier", 0.1 * rope["mscale_all_dim"])


def _write_granite_hybrid_metadata(w: gguf.GGUFWriter, cfg: dict) -> None:
    """conversion/granite.py's GraniteHybridModel: the Mamba-2 sizes as ssm.* (the heads as
    time_step_rank), head_count_kv per layer (0 for a Mamba layer), rope switched off
    (rope.scaling.finetuned false) for a model with Mamba layers."""
    kinds = cfg["layer_types"]
    w.add_uint32("granitehybrid.ssm.conv_kernel", cfg["mamba_d_conv"])
    w.add_uint32("granitehybrid.ssm.state_size", cfg["mamba_d_state"])
    w.add_uint32("granitehybrid.ssm.group_count", cfg["mamba_n_groups"])
    w.add_uint32("granitehybrid.ssm.inner_size", cfg["mamba_expand"] * cfg["hidden_size"])
    w.add_uint32("granitehybrid.ssm.time_step_rank", cfg["mamba_n_heads"])
    kv = [cfg["num_key_value_heads"] if k in ("attention", "full_attention") else 0 for k in kinds]
    w.add_array("granitehybrid.attention.head_count_kv", kv)
    w.add_bool("granitehybrid.rope.scaling.finetuned", 0 not in kv)  # rope only without Mamba layers


def _mamba_tensors(layer: int, sub: str, tensor: torch.Tensor, cfg: dict):
    """conversion/mamba.py's Mamba2Model.modify_tensors: the conv weight squeezed to (channels,
    kernel), A_log stored as A = -exp(A_log) and A, D as (heads, 1), the gated norm's weight as
    (groups, inner / groups); dt_bias named as dt_proj's bias."""
    name = _SSM_NAMES[sub]
    if sub == "conv1d.weight":
        tensor = tensor.squeeze(1)
    elif sub == "A_log":
        tensor = (-torch.exp(tensor)).reshape(-1, 1)
    elif sub == "D":
        tensor = tensor.reshape(-1, 1)
    elif sub == "norm.weight":
        tensor = tensor.reshape(cfg["mamba_n_groups"], -1)
    yield f"blk.{layer}.{name}", tensor


# a recurrent layer's HF sub-name -> llama.cpp's blk.N.<name> (conversion/mamba.py, conversion/qwen.py)
_SSM_NAMES = {
    "in_proj.weight": "ssm_in.weight",
    "in_proj_ba.weight": "ssm_ba.weight",
    "conv1d.weight": "ssm_conv1d.weight",
    "conv1d.bias": "ssm_conv1d.bias",
    "dt_bias": "ssm_dt.bias",
    "A_log": "ssm_a",
    "D": "ssm_d",
    "norm.weight": "ssm_norm.weight",
    "out_proj.weight": "ssm_out.weight",
}


def _write_qwen3next_metadata(w: gguf.GGUFWriter, cfg: dict) -> None:
    """conversion/qwen.py's Qwen3NextModel.set_gguf_parameters: the DeltaNet's sizes as ssm.* (key
    heads as group_count, value heads as time_step_rank), the recurrent layers listed, the rope's
    dims a quarter of head_dim unless the config says otherwise."""
    w.add_uint32("qwen3next.ssm.conv_kernel", cfg["linear_conv_kernel_dim"])
    w.add_uint32("qwen3next.ssm.state_size", cfg["linear_key_head_dim"])
    w.add_uint32("qwen3next.ssm.group_count", cfg["linear_num_key_heads"])
    w.add_uint32("qwen3next.ssm.time_step_rank", cfg["linear_num_value_heads"])
    w.add_uint32("qwen3next.ssm.inner_size", cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_array("qwen3next.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]])
    w.add_uint32("qwen3next.full_attention_interval", cfg.get("full_attention_interval", 4))


def _qwen3next_tensors(layer: int, sub: str, tensor: torch.Tensor, cfg: dict):
    """conversion/qwen.py's Qwen3NextModel.modify_tensors for a linear_attn tensor: in_proj_qkvz
    from per-key-head [q, k, v, z] groups to attn_qkv ([q | k | v]) and attn_gate (z), A_log as
    A = -exp(A_log), the conv weight squeezed, dt_bias named as dt_proj's bias."""
    if sub == "in_proj_qkvz.weight":
        r = cfg["linear_num_value_heads"] // cfg["linear_num_key_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        grouped = tensor.view(cfg["linear_num_key_heads"], -1, tensor.shape[1])
        q, k, v, z = (t.reshape(-1, tensor.shape[1]) for t in grouped.split([dk, dk, r * dv, r * dv], dim=1))
        yield f"blk.{layer}.attn_qkv.weight", torch.cat([q, k, v])
        yield f"blk.{layer}.attn_gate.weight", z
        return
    name = _SSM_NAMES[sub]
    if sub == "conv1d.weight":
        tensor = tensor.squeeze(1)
    elif sub == "A_log":
        tensor = -torch.exp(tensor)
    yield f"blk.{layer}.{name}", tensor


def _write_metadata(w: gguf.GGUFWriter, arch: str, cfg: dict) -> None:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or {}
    ints = {
        "block_count": cfg["num_hidden_layers"],
        "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"],
        "feed_forward_length": cfg["intermediate_size"],
        "attention.head_count": heads,
        "attention.head_count_kv": cfg.get("num_key_value_heads") or heads,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
    }
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        ints |= {"expert_count": experts, "expert_used_count": cfg["num_experts_per_tok"]}
        if "moe_intermediate_size" in cfg:
            ints["expert_feed_forward_length"] = cfg["moe_intermediate_size"]
        if arch == "gpt-oss":  # conversion/gpt_oss.py: each expert's size is the MLP's
            ints["expert_feed_forward_length"] = cfg["intermediate_size"]
            ints["attention.sliding_window"] = cfg["sliding_window"]
    # conversion/granite.py writes the shared MLP's width whether or not there are experts
    shared = cfg.get("shared_expert_intermediate_size") or cfg.get("shared_intermediate_size")
    if shared and (experts or arch == "granitehybrid"):
        ints["expert_shared_feed_forward_length"] = shared
    if arch == "deepseek2":  # its own sizes (below)
        ints = {k: v for k, v in ints.items() if not k.startswith("attention.") or k == "attention.head_count"}
    if arch == "granitehybrid":  # per layer (below)
        del ints["attention.head_count_kv"]
    for key, value in ints.items():
        w.add_uint32(f"{arch}.{key}", value)
    if arch == "deepseek2":
        _write_deepseek2_metadata(w, cfg)
    else:
        w.add_uint32(f"{arch}.rope.dimension_count", int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if arch == "stablelm":  # LayerNorm; conversion's StableLMModel
        w.add_float32("stablelm.attention.layer_norm_epsilon", cfg["layer_norm_eps"])
        w.add_bool("stablelm.use_parallel_residual", cfg["use_parallel_residual"])
    elif arch == "cohere2":  # LayerNorm; conversion/command_r.py's Cohere2Model
        w.add_float32("cohere2.attention.layer_norm_epsilon", cfg["layer_norm_eps"])
        w.add_float32("cohere2.logit_scale", cfg["logit_scale"])
        w.add_uint32("cohere2.attention.sliding_window", cfg["sliding_window"])
    else:
        w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    full = rope.get("full_attention") or rope  # per layer type (OLMo 3): the full layers' base
    w.add_float32(f"{arch}.rope.freq_base", full.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if cfg["architectures"][0] == "Olmo3ForCausalLM":  # conversion/olmo.py; the swa base as llama.cpp reads it
        w.add_uint32("olmo2.attention.sliding_window", cfg["sliding_window"])
        w.add_array("olmo2.attention.sliding_window_pattern", [t == "sliding_attention" for t in cfg["layer_types"]])
        w.add_float32("olmo2.rope.freq_base_swa", cfg["rope_parameters"]["sliding_attention"]["rope_theta"])
    if arch == "phi3":
        w.add_uint32("phi3.attention.sliding_window", cfg.get("sliding_window") or 0)
    if arch == "granitehybrid":
        _write_granite_hybrid_metadata(w, cfg)
    if arch == "qwen3next":
        _write_qwen3next_metadata(w, cfg)
    if arch in ("granite", "granitemoe", "granitehybrid"):  # conversion/granite.py: the multipliers as *_scale
        w.add_float32(f"{arch}.attention.scale", cfg["attention_multiplier"])
        w.add_float32(f"{arch}.embedding_scale", cfg["embedding_multiplier"])
        w.add_float32(f"{arch}.residual_scale", cfg["residual_multiplier"])
        w.add_float32(f"{arch}.logit_scale", cfg["logits_scaling"])
    if rope.get("rope_type") == "yarn":  # TextModel.set_gguf_parameters
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", rope["original_max_position_embeddings"])
    if arch == "gemma2":
        w.add_uint32("gemma2.attention.sliding_window", cfg["sliding_window"])
        w.add_float32("gemma2.attn_logit_softcapping", cfg["attn_logit_softcapping"])
        w.add_float32("gemma2.final_logit_softcapping", cfg["final_logit_softcapping"])
    if rope.get("rope_type") == "longrope":  # conversion/phi.py
        original = rope["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", original)
        w.add_float32(
            f"{arch}.rope.scaling.attn_factor",
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0,
        )


def rope_tensors(cfg: dict) -> dict[str, torch.Tensor]:
    """The rope factors llama.cpp's converter writes as tensors: Phi-3's long and short sets, and
    Llama 3.1's llama3 scaling precomputed per frequency (conversion/llama.py)."""
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "longrope":
        return {
            "rope_factors_long.weight": torch.tensor(rope["long_factor"], dtype=torch.float32),
            "rope_factors_short.weight": torch.tensor(rope["short_factor"], dtype=torch.float32),
        }
    if rope.get("rope_type") != "llama3":
        return {}
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_len = rope["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return {"rope_freqs.weight": torch.tensor(factors, dtype=torch.float32)}


def _write_tokenizer(w: gguf.GGUFWriter, folder: Path, vocab_size: int, pre: str = "gpt-2") -> None:
    """The tokenizer's tokens padded to the model's vocabulary with unused [PADn] (as the converter does)."""
    tk = json.loads((folder / "tokenizer.json").read_text())
    vocab = {t: i for t, i in tk["model"]["vocab"].items()} | {a["content"]: a["id"] for a in tk["added_tokens"]}
    tokens = sorted(vocab, key=vocab.get)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    special = {a["content"] for a in tk["added_tokens"] if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tk["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)  # "gpt-2": llama.cpp's name for the GPT-2 split
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 5 if t.startswith("[PAD") else 1 for t in tokens])
    w.add_token_merges(merges)


def _gguf_tensors(state: dict[str, torch.Tensor], arch: str, cfg: dict, stack_experts: bool, split_kv_b: bool):
    """(llama.cpp name, tensor) pairs; each layer's experts stacked into one tensor per kind."""
    block = {
        "olmo2": _OLMO2_BLOCK,
        "gemma2": _GEMMA_BLOCK,
        "glm4": _GLM4_BLOCK,
        "gpt-oss": _GPT_OSS_BLOCK,
        "deepseek2": _DEEPSEEK2_BLOCK,
        "qwen3next": _QWEN3NEXT_BLOCK,
    }.get(arch, _BLOCK)
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    stacks: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "model.norm.bias": "output_norm.bias",
        "lm_head.weight": "output.weight",
    }
    head_norms: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        if arch == "cohere2" and name.endswith(".bias"):  # the converter drops them: all zero, it checks
            assert not tensor.any(), f"{name} is not zero"
            continue
        if m := re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.([qk])_layernorm\.norms\.(\d+)\.weight", name):
            head_norms.setdefault((int(m.group(1)), m.group(2)), {})[int(m.group(3))] = tensor
        elif m := _GPT_OSS_EXPERTS.fullmatch(name):
            yield from _gpt_oss_experts(int(m.group(1)), m.group(2), tensor, bias=bool(m.group(3)))
        elif m := re.fullmatch(r"model\.layers\.(\d+)\.linear_attn\.(.+)", name):
            yield from _qwen3next_tensors(int(m.group(1)), m.group(2), tensor, cfg)
        elif m := re.fullmatch(r"model\.layers\.(\d+)\.mamba\.(.+)", name):
            yield from _mamba_tensors(int(m.group(1)), m.group(2), tensor, cfg)
        elif m := _JETMOE.fullmatch(name):
            dense = arch == "granitehybrid" and not cfg.get("num_local_experts")
            yield from _jetmoe_tensors(int(m.group(1)), m.group(2), m.group(3), tensor, dense)
        elif m := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.gate\.e_score_correction_bias", name):
            yield f"blk.{m.group(1)}.exp_probs_b.bias", tensor
        elif split_kv_b and (m := re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.kv_b_proj\.weight", name)):
            yield from _deepseek_kv_b(int(m.group(1)), tensor, cfg)
        elif m := re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.sinks", name):
            yield f"blk.{m.group(1)}.attn_sinks.weight", tensor  # conversion/gpt_oss.py adds .weight
        elif name in top:
            yield top[name], tensor + 1 if arch in ("gemma2", "qwen3next") and name == "model.norm.weight" else tensor
        elif m := _EXPERT.fullmatch(name):
            stacks.setdefault((int(m.group(1)), _EXPERT_KIND[m.group(3)]), {})[int(m.group(2))] = tensor
        else:
            layer, sub, kind = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name).groups()
            if arch in ("llama", "smollm3", "granite", "granitemoe", "granitehybrid") and sub in (
                "self_attn.q_proj",
                "self_attn.k_proj",
            ):
                tensor = llama_cpp_permute(tensor, heads if sub.endswith("q_proj") else kv_heads)
            if sub == "mlp.shared_expert_gate":
                tensor = tensor.reshape(-1)
            if arch in ("gemma2", "qwen3next") and sub.endswith("norm"):
                tensor = tensor + 1  # the converter stores Gemma's and Qwen3-Next's (1 + w)
            yield f"blk.{layer}.{block[sub]}.{kind}", tensor
    yield from rope_tensors(cfg).items()
    for (layer, kind), norms in sorted(head_norms.items()):  # StableLMModel._stack_qk_norm
        yield f"blk.{layer}.attn_{kind}_norm.weight", torch.stack([norms[h] for h in sorted(norms)])
    for (layer, kind), experts in sorted(stacks.items()):
        if stack_experts:
            yield f"blk.{layer}.ffn_{kind}_exps.weight", torch.stack([experts[e] for e in sorted(experts)])
        else:
            yield from ((f"blk.{layer}.ffn_{kind}.{e}.weight", experts[e]) for e in sorted(experts))


def _gpt_oss_experts(layer: int, kind: str, tensor: torch.Tensor, bias: bool):
    """conversion/gpt_oss.py's split of a stacked gpt-oss expert tensor: matrices transposed to
    (experts, out, in), gate_up's interleaved columns into ffn_gate_exps and ffn_up_exps."""
    part = "bias" if bias else "weight"
    t = tensor if bias else tensor.transpose(1, 2)  # (experts, out[, in])
    if kind == "down_proj":
        yield f"blk.{layer}.ffn_down_exps.{part}", t.contiguous()
    else:
        yield f"blk.{layer}.ffn_gate_exps.{part}", t[:, ::2].contiguous()
        yield f"blk.{layer}.ffn_up_exps.{part}", t[:, 1::2].contiguous()


def _deepseek_kv_b(layer: int, tensor: torch.Tensor, cfg: dict):
    """conversion/deepseek.py's split of kv_b_proj: per head, the key rows transposed into
    attn_k_b (heads, kv_lora_rank, nope) and the value rows as attn_v_b (heads, v_dim, kv_lora_rank)."""
    nope, v_dim = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    kv_b = tensor.view(cfg["num_attention_heads"], nope + v_dim, tensor.shape[-1])
    k_b, v_b = torch.split(kv_b, [nope, v_dim], dim=1)
    yield f"blk.{layer}.attn_k_b.weight", k_b.transpose(1, 2).contiguous()
    yield f"blk.{layer}.attn_v_b.weight", v_b.contiguous()


def _jetmoe_tensors(layer: int, block: str, kind: str, tensor: torch.Tensor, dense: bool = False):
    """conversion/granite.py's GraniteMoeModel: input_linear split into gate and up (stacked experts,
    or the shared expert's), output_linear as the down projection, the router as ffn_gate_inp; in a
    model without experts (`dense`) the shared MLP as the plain ffn_gate/up/down."""
    if kind == "router.layer":
        yield f"blk.{layer}.ffn_gate_inp.weight", tensor
        return
    suffix = "_exps" if block == "block_sparse_moe" else "" if dense else "_shexp"
    if kind == "output_linear":
        yield f"blk.{layer}.ffn_down{suffix}.weight", tensor
        return
    gate, up = tensor.split(tensor.shape[-2] // 2, dim=-2)
    yield f"blk.{layer}.ffn_gate{suffix}.weight", gate.contiguous()
    yield f"blk.{layer}.ffn_up{suffix}.weight", up.contiguous()
