#!/usr/bin/env python
"""A GGUF file of a real model's shapes with random weights, for timing engines on the same file.

Speed does not depend on the weights' values, so the blocks are written as random bytes of the
target type (random codes, scales of a trained model's size) instead of quantizing random floats
(the `gguf` package's MXFP4 quantizer runs at ~10 M values/s: minutes a layer). The tensors carry
llama.cpp's names and layout and the metadata its loader reads; the vocabulary is the model's size
of placeholder tokens (256 bytes, then unused [PADn]), which is all a benchmark of random token ids
needs.

Shapes (``SHAPES``):
- ``gpt-oss-20b``: 2880 wide, 64 query / 8 KV heads of 64, 32 experts of 2880 (top 4) in MXFP4,
  the rest Q8_0 as ggml-org's gpt-oss-20b GGUF ships it; 24 layers.
- ``deepseek-v2-lite``: 2048 wide, 16 heads of latent attention (kv_lora_rank 512, rope 64,
  nope 128, values 128, no q bottleneck), a dense first layer of 10944, then 64 experts of 1408
  (top 6) and 2 shared; Q4_K where rows hold 256-value blocks, Q8_0 elsewhere (the 1408-wide down
  projections, k_b); 27 layers.
- ``granite-4.0-h-tiny``: 1536 wide, Mamba-2 mixers (48 heads of 64, state 128, one group, conv 4)
  in 9 of every 10 layers, attention (12 query / 4 KV heads of 128, no rope) in the others (layer
  5, 15, ...), every layer's MLP 64 experts of 512 (top 6) beside a shared MLP of 1024; embeddings
  tied; Q4_K where rows hold 256-value blocks (every matrix here), the Mamba vectors float32;
  40 layers (write at least 6: layer 5 is the first that attends).
- ``qwen3-next-80b-a3b``: 2048 wide, Gated DeltaNet mixers (16 key heads of 128 shared by 32 value
  heads of 128, conv 4) in three of every four layers, gated attention (16 query / 2 KV heads of 256,
  a quarter of each head turned) in the others (layer 3, 7, ...), every layer's MLP 512 experts of
  512 (top 10) beside a gated shared expert of 512; Q4_K where rows hold 256-value blocks (every
  matrix here), the DeltaNet's vectors and conv float32; 48 layers (write at least 4: layer 3 is the
  first that attends).
- ``qwen2.5-1.5b``: dense, 1536 wide, 12 query / 2 KV heads of 128 (q/k/v with biases), MLP of
  8960, vocabulary 151936, embeddings tied (no output.weight); every matrix Q8_0, as
  ``convert_hf_to_gguf.py --outtype q8_0`` writes it (``llama-quantize --allow-requantize`` makes a
  Q4_K_M of it); 28 layers.
--layers of them here.

    python benchmarks/shaped_gguf.py gpt-oss-20b --layers 8 -o /tmp/gpt-oss-20b-8l.gguf
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from tqdm import tqdm

MXFP4, Q8_0, Q4_K = gguf.GGMLQuantizationType.MXFP4, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_K


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_ffn: int
    vocab: int
    layers: int
    context: int
    dense_ffn: int = 0  # the dense first layer's (DeepSeek)
    shared_experts: int = 0
    shared_ffn: int = 0  # the shared MLP's width (Granite)


SHAPES = {
    "gpt-oss-20b": Shape("gpt-oss", 2880, 64, 8, 64, 32, 4, 2880, 201088, 24, 131072),
    "deepseek-v2-lite": Shape("deepseek2", 2048, 16, 1, 576, 64, 6, 1408, 102400, 27, 163840, 10944, 2),
    "granite-4.0-h-tiny": Shape("granitehybrid", 1536, 12, 4, 128, 64, 6, 512, 100352, 40, 131072, shared_ffn=1024),
    "qwen3-next-80b-a3b": Shape("qwen3next", 2048, 16, 2, 256, 512, 10, 512, 151936, 48, 262144, shared_ffn=512),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 12, 2, 128, 0, 0, 8960, 151936, 28, 32768),
}
# Granite 4.0-H-Tiny's Mamba-2 mixers: heads x head_dim = 2 x hidden; one attention layer in ten
MAMBA_HEADS, MAMBA_HEAD_DIM, MAMBA_STATE, MAMBA_GROUPS, MAMBA_CONV = 48, 64, 128, 1, 4


def granite_attends(layer: int) -> bool:
    return layer % 10 == 5


# Qwen3-Next's Gated DeltaNet: key heads, value heads, both heads' dims, conv taps
DELTA_K_HEADS, DELTA_V_HEADS, DELTA_HEAD_DIM, DELTA_CONV = 16, 32, 128, 4


def qwen3next_attends(layer: int) -> bool:
    return layer % 4 == 3


# DeepSeek-V2-Lite's latent attention
KV_LORA, ROPE, NOPE, V_DIM = 512, 64, 128, 128


def random_blocks(kind: gguf.GGMLQuantizationType, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `kind` for a tensor of `shape` (..., cols): codes uniform, scales ~ a trained
    weight's (values of magnitude ~0.02)."""
    values, nbytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // values, nbytes), dtype=np.uint8)
    if kind == MXFP4:
        blocks[..., 0] = rng.integers(119, 123, size=blocks.shape[:-1])  # 2^(e - 127): 2^-8 .. 2^-5
    elif kind == Q8_0:
        scale = np.full(blocks.shape[:-1], 0.02 / 127, dtype=np.float16)
        blocks[..., :2] = scale.view(np.uint8).reshape(*blocks.shape[:-1], 2)
        codes = blocks[..., 2:]
        codes[codes == 0x80] = 0x81  # -127..127, as llama.cpp's quantizer writes them (never -128)
    elif kind == Q4_K:  # d and dmin (float16) first, then 6-bit scales and 4-bit codes
        scales = np.full((*blocks.shape[:-1], 2), 0.02 / (32 * 8), dtype=np.float16)
        blocks[..., :4] = scales.view(np.uint8).reshape(*blocks.shape[:-1], 4)
    return blocks.reshape(*shape[:-1], -1)


def floats(shape: tuple[int, ...], rng: np.random.Generator, scale: float = 0.02, mean: float = 0.0) -> np.ndarray:
    return (mean + scale * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)


def write_tokens(w: gguf.GGUFWriter, s: Shape) -> None:
    """The vocabulary's size of placeholder tokens: 256 bytes, one merge, then unused [PADn]."""
    tokens = [bytes([b]).decode("latin-1") for b in range(256)] + ["ab"] + [f"[PAD{i}]" for i in range(257, s.vocab)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [5] * (s.vocab - 257))
    w.add_token_merges(["a b"])  # llama.cpp refuses a BPE vocabulary without merges
    w.add_eos_token_id(0)


def sizes(s: Shape, layers: int) -> dict[str, int]:
    """The size keys every shape's file starts with (an expert's width as the MLP's)."""
    return {
        "block_count": layers,
        "context_length": s.context,
        "embedding_length": s.hidden,
        "feed_forward_length": s.expert_ffn,
        "expert_feed_forward_length": s.expert_ffn,
    }


def write_metadata(w: gguf.GGUFWriter, s: Shape, layers: int) -> None:
    if s.arch == "deepseek2":
        return write_deepseek2_metadata(w, s, layers)
    if s.arch == "granitehybrid":
        return write_granite_hybrid_metadata(w, s, layers)
    if s.arch == "qwen3next":
        return write_qwen3next_metadata(w, s, layers)
    if s.arch == "qwen2":
        return write_qwen2_metadata(w, s, layers)
    a = s.arch
    for key, value in {
        **sizes(s, layers),
        "attention.head_count": s.heads,
        "attention.head_count_kv": s.kv_heads,
        "attention.key_length": s.head_dim,
        "attention.value_length": s.head_dim,
        "attention.sliding_window": 128,
        "expert_count": s.experts,
        "expert_used_count": s.top_k,
        "rope.dimension_count": s.head_dim,
        "rope.scaling.original_context_length": 4096,
    }.items():
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{a}.rope.freq_base", 150000.0)
    w.add_string(f"{a}.rope.scaling.type", "yarn")
    w.add_float32(f"{a}.rope.scaling.factor", 32.0)
    write_tokens(w, s)


def write_qwen2_metadata(w: gguf.GGUFWriter, s: Shape, layers: int) -> None:
    """conversion's Qwen2Model keys: a dense Llama-like model (rope theta 1e6)."""
    for key, value in {
        "block_count": layers,
        "context_length": s.context,
        "embedding_length": s.hidden,
        "feed_forward_length": s.expert_ffn,
        "attention.head_count": s.heads,
        "attention.head_count_kv": s.kv_heads,
    }.items():
        w.add_uint32(f"qwen2.{key}", value)
    w.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("qwen2.rope.freq_base", 1000000.0)
    write_tokens(w, s)


def write_deepseek2_metadata(w: gguf.GGUFWriter, s: Shape, layers: int) -> None:
    """conversion/deepseek.py's keys for DeepSeek-V2-Lite: MLA as one 576-wide kv head, no q
    bottleneck (q_lora_rank 0), softmax gating without groups, YaRN x40 with mscale_all_dim 0.707."""
    for key, value in {
        "block_count": layers,
        "context_length": s.context,
        "embedding_length": s.hidden,
        "feed_forward_length": s.dense_ffn,
        "expert_feed_forward_length": s.expert_ffn,
        "attention.head_count": s.heads,
        "attention.head_count_kv": 1,
        "attention.key_length": KV_LORA + ROPE,
        "attention.value_length": KV_LORA,
        "attention.key_length_mla": NOPE + ROPE,
        "attention.value_length_mla": V_DIM,
        "attention.kv_lora_rank": KV_LORA,
        "attention.q_lora_rank": 0,
        "leading_dense_block_count": 1,
        "expert_count": s.experts,
        "expert_used_count": s.top_k,
        "expert_shared_count": s.shared_experts,
        "expert_gating_func": 1,
        "rope.dimension_count": ROPE,
        "rope.scaling.original_context_length": 4096,
    }.items():
        w.add_uint32(f"deepseek2.{key}", value)
    w.add_float32("deepseek2.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32("deepseek2.rope.freq_base", 10000.0)
    w.add_float32("deepseek2.expert_weights_scale", 1.0)
    w.add_string("deepseek2.rope.scaling.type", "yarn")
    w.add_float32("deepseek2.rope.scaling.factor", 40.0)
    w.add_float32("deepseek2.rope.scaling.yarn_log_multiplier", 0.0707)
    write_tokens(w, s)


def write_granite_hybrid_metadata(w: gguf.GGUFWriter, s: Shape, layers: int) -> None:
    """conversion/granite.py's GraniteHybridModel keys: the Mamba sizes as ssm.* (heads as
    time_step_rank), head_count_kv per layer (0 for Mamba), rope off, Granite's multipliers."""
    a = "granitehybrid"
    for key, value in {
        **sizes(s, layers),
        "expert_shared_feed_forward_length": s.shared_ffn,
        "expert_count": s.experts,
        "expert_used_count": s.top_k,
        "attention.head_count": s.heads,
        "rope.dimension_count": s.head_dim,
        "ssm.conv_kernel": MAMBA_CONV,
        "ssm.state_size": MAMBA_STATE,
        "ssm.group_count": MAMBA_GROUPS,
        "ssm.inner_size": MAMBA_HEADS * MAMBA_HEAD_DIM,
        "ssm.time_step_rank": MAMBA_HEADS,
    }.items():
        w.add_uint32(f"{a}.{key}", value)
    w.add_array(f"{a}.attention.head_count_kv", [s.kv_heads if granite_attends(i) else 0 for i in range(layers)])
    w.add_bool(f"{a}.rope.scaling.finetuned", False)
    w.add_float32(f"{a}.rope.freq_base", 10000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    for key, value in {
        "attention.scale": 1 / 128,
        "embedding_scale": 12.0,
        "residual_scale": 0.22,
        "logit_scale": 6.0,
    }.items():
        w.add_float32(f"{a}.{key}", value)
    write_tokens(w, s)


def write_qwen3next_metadata(w: gguf.GGUFWriter, s: Shape, layers: int) -> None:
    """conversion/qwen.py's Qwen3NextModel keys: the DeltaNet's sizes as ssm.* (key heads as
    group_count, value heads as time_step_rank), attention every fourth layer, a quarter of each
    head's dims turned, the mixture with its shared expert."""
    a = "qwen3next"
    for key, value in {
        **sizes(s, layers),
        "expert_shared_feed_forward_length": s.shared_ffn,
        "expert_count": s.experts,
        "expert_used_count": s.top_k,
        "attention.head_count": s.heads,
        "attention.head_count_kv": s.kv_heads,
        "attention.key_length": s.head_dim,
        "attention.value_length": s.head_dim,
        "rope.dimension_count": s.head_dim // 4,
        "ssm.conv_kernel": DELTA_CONV,
        "ssm.state_size": DELTA_HEAD_DIM,
        "ssm.group_count": DELTA_K_HEADS,
        "ssm.inner_size": DELTA_V_HEADS * DELTA_HEAD_DIM,
        "ssm.time_step_rank": DELTA_V_HEADS,
        "full_attention_interval": 4,
    }.items():
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.rope.freq_base", 10_000_000.0)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    write_tokens(w, s)


def qwen3next_tensors(s: Shape, layers: int, rng: np.random.Generator):
    """(name, array, raw type or None) in llama.cpp's qwen3next layout (src/models/qwen3next.cpp)."""
    key, value = DELTA_K_HEADS * DELTA_HEAD_DIM, DELTA_V_HEADS * DELTA_HEAD_DIM
    yield "token_embd.weight", *matrix(s.vocab, s.hidden, rng)
    yield "output_norm.weight", floats((s.hidden,), rng, 0.1, 1.0), None
    yield "output.weight", *matrix(s.vocab, s.hidden, rng)
    for i in range(layers):
        b = f"blk.{i}"
        yield f"{b}.attn_norm.weight", floats((s.hidden,), rng, 0.1, 1.0), None
        yield f"{b}.post_attention_norm.weight", floats((s.hidden,), rng, 0.1, 1.0), None
        if qwen3next_attends(i):
            q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
            for name, rows in (("attn_q", 2 * q), ("attn_k", kv), ("attn_v", kv)):  # q: query and gate
                yield f"{b}.{name}.weight", *matrix(rows, s.hidden, rng)
            yield f"{b}.attn_q_norm.weight", floats((s.head_dim,), rng, 0.1, 1.0), None
            yield f"{b}.attn_k_norm.weight", floats((s.head_dim,), rng, 0.1, 1.0), None
            yield f"{b}.attn_output.weight", *matrix(s.hidden, q, rng)
        else:
            yield f"{b}.attn_qkv.weight", *matrix(2 * key + value, s.hidden, rng)
            yield f"{b}.attn_gate.weight", *matrix(value, s.hidden, rng)
            yield f"{b}.ssm_ba.weight", *matrix(2 * DELTA_V_HEADS, s.hidden, rng)  # llama-quantize takes it
            yield f"{b}.ssm_conv1d.weight", floats((2 * key + value, DELTA_CONV), rng, 0.2), None
            yield f"{b}.ssm_dt.bias", floats((DELTA_V_HEADS,), rng, 0.5, 1.0), None
            yield f"{b}.ssm_a", -np.linspace(0.1, 16, DELTA_V_HEADS, dtype=np.float32), None
            yield f"{b}.ssm_norm.weight", floats((DELTA_HEAD_DIM,), rng, 0.1, 1.0), None
            yield f"{b}.ssm_out.weight", *matrix(s.hidden, value, rng)
        yield f"{b}.ffn_gate_inp_shexp.weight", floats((s.hidden,), rng), None
        yield from experts_beside_shared_mlp(b, s, rng)


def granite_hybrid_tensors(s: Shape, layers: int, rng: np.random.Generator):
    """(name, array, raw type or None) in llama.cpp's granitehybrid layout (src/models/granite-hybrid.cpp)."""
    inner = MAMBA_HEADS * MAMBA_HEAD_DIM
    conv = inner + 2 * MAMBA_GROUPS * MAMBA_STATE
    yield "token_embd.weight", *matrix(s.vocab, s.hidden, rng)
    yield "output_norm.weight", floats((s.hidden,), rng, 0.1, 1.0), None
    for i in range(layers):
        b = f"blk.{i}"
        yield f"{b}.attn_norm.weight", floats((s.hidden,), rng, 0.1, 1.0), None
        yield f"{b}.ffn_norm.weight", floats((s.hidden,), rng, 0.1, 1.0), None
        if granite_attends(i):
            q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
            for name, rows, cols in (("attn_q", q, s.hidden), ("attn_k", kv, s.hidden), ("attn_v", kv, s.hidden)):
                yield f"{b}.{name}.weight", *matrix(rows, cols, rng)
            yield f"{b}.attn_output.weight", *matrix(s.hidden, q, rng)
        else:
            yield f"{b}.ssm_in.weight", *matrix(inner + conv + MAMBA_HEADS, s.hidden, rng)
            yield f"{b}.ssm_conv1d.weight", floats((conv, MAMBA_CONV), rng, 0.2), None
            yield f"{b}.ssm_conv1d.bias", floats((conv,), rng), None
            yield f"{b}.ssm_dt.bias", floats((MAMBA_HEADS,), rng, 0.5, -2.0), None
            yield f"{b}.ssm_a", -np.arange(1, MAMBA_HEADS + 1, dtype=np.float32).reshape(-1, 1), None
            yield f"{b}.ssm_d", np.ones((MAMBA_HEADS, 1), dtype=np.float32), None
            yield f"{b}.ssm_norm.weight", floats((MAMBA_GROUPS, inner // MAMBA_GROUPS), rng, 0.1, 1.0), None
            yield f"{b}.ssm_out.weight", *matrix(s.hidden, inner, rng)
        yield from experts_beside_shared_mlp(b, s, rng)


def experts_beside_shared_mlp(b: str, s: Shape, rng: np.random.Generator):
    """A layer's router, its stacked experts and its shared MLP (shared_ffn wide)."""
    yield f"{b}.ffn_gate_inp.weight", floats((s.experts, s.hidden), rng), None
    for name, rows, cols, experts in (
        ("ffn_gate_exps", s.expert_ffn, s.hidden, s.experts),
        ("ffn_up_exps", s.expert_ffn, s.hidden, s.experts),
        ("ffn_down_exps", s.hidden, s.expert_ffn, s.experts),
        ("ffn_gate_shexp", s.shared_ffn, s.hidden, 0),
        ("ffn_up_shexp", s.shared_ffn, s.hidden, 0),
        ("ffn_down_shexp", s.hidden, s.shared_ffn, 0),
    ):
        yield f"{b}.{name}.weight", *matrix(rows, cols, rng, experts)


def matrix(rows: int, cols: int, rng: np.random.Generator, experts: int = 0):
    """A (experts,) rows x cols matrix as Q4_K where its rows hold 256-value blocks, else Q8_0."""
    kind = Q4_K if cols % 256 == 0 else Q8_0
    return random_blocks(kind, (experts, rows, cols) if experts else (rows, cols), rng), kind


def deepseek2_tensors(s: Shape, layers: int, rng: np.random.Generator):
    """(name, array, raw type or None) in llama.cpp's deepseek2 layout (src/models/deepseek2.cpp)."""
    yield "token_embd.weight", *matrix(s.vocab, s.hidden, rng)
    yield "output_norm.weight", floats((s.hidden,), rng, 0.1, 1.0), None
    yield "output.weight", *matrix(s.vocab, s.hidden, rng)
    for i in range(layers):
        b = f"blk.{i}"
        yield f"{b}.attn_norm.weight", floats((s.hidden,), rng, 0.1, 1.0), None
        yield f"{b}.ffn_norm.weight", floats((s.hidden,), rng, 0.1, 1.0), None
        yield f"{b}.attn_kv_a_norm.weight", floats((KV_LORA,), rng, 0.1, 1.0), None
        yield f"{b}.attn_q.weight", *matrix(s.heads * (NOPE + ROPE), s.hidden, rng)
        yield f"{b}.attn_kv_a_mqa.weight", *matrix(KV_LORA + ROPE, s.hidden, rng)
        yield f"{b}.attn_k_b.weight", random_blocks(Q8_0, (s.heads, KV_LORA, NOPE), rng), Q8_0
        yield f"{b}.attn_v_b.weight", random_blocks(Q8_0, (s.heads, V_DIM, KV_LORA), rng), Q8_0
        yield f"{b}.attn_output.weight", *matrix(s.hidden, s.heads * V_DIM, rng)
        if i == 0:  # the dense first layer
            for name, rows, cols in (("ffn_gate", s.dense_ffn, s.hidden), ("ffn_up", s.dense_ffn, s.hidden)):
                yield f"{b}.{name}.weight", *matrix(rows, cols, rng)
            yield f"{b}.ffn_down.weight", *matrix(s.hidden, s.dense_ffn, rng)
            continue
        yield f"{b}.ffn_gate_inp.weight", floats((s.experts, s.hidden), rng), None
        shared = s.expert_ffn * s.shared_experts
        for name, rows, cols, experts in (
            ("ffn_gate_exps", s.expert_ffn, s.hidden, s.experts),
            ("ffn_up_exps", s.expert_ffn, s.hidden, s.experts),
            ("ffn_down_exps", s.hidden, s.expert_ffn, s.experts),
            ("ffn_gate_shexp", shared, s.hidden, 0),
            ("ffn_up_shexp", shared, s.hidden, 0),
            ("ffn_down_shexp", s.hidden, shared, 0),
        ):
            yield f"{b}.{name}.weight", *matrix(rows, cols, rng, experts)


def tensors(s: Shape, layers: int, rng: np.random.Generator):
    """(name, array, raw type or None) in llama.cpp's layout of the shape's family."""
    if s.arch == "deepseek2":
        yield from deepseek2_tensors(s, layers, rng)
        return
    if s.arch == "granitehybrid":
        yield from granite_hybrid_tensors(s, layers, rng)
        return
    if s.arch == "qwen3next":
        yield from qwen3next_tensors(s, layers, rng)
        return
    if s.arch == "qwen2":
        yield from qwen2_tensors(s, layers, rng)
        return
    yield from gpt_oss_tensors(s, layers, rng)


def qwen2_tensors(s: Shape, layers: int, rng: np.random.Generator):
    """(name, array, raw type or None) in llama.cpp's qwen2 layout, every matrix Q8_0, embeddings tied."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    yield "token_embd.weight", random_blocks(Q8_0, (s.vocab, s.hidden), rng), Q8_0
    yield "output_norm.weight", floats((s.hidden,), rng, 0.1, 1.0), None
    for i in range(layers):
        b = f"blk.{i}"
        yield f"{b}.attn_norm.weight", floats((s.hidden,), rng, 0.1, 1.0), None
        yield f"{b}.ffn_norm.weight", floats((s.hidden,), rng, 0.1, 1.0), None
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            yield f"{b}.{name}.weight", random_blocks(Q8_0, (rows, s.hidden), rng), Q8_0
            yield f"{b}.{name}.bias", floats((rows,), rng), None
        for name, rows, cols in (
            ("attn_output", s.hidden, q),
            ("ffn_gate", s.expert_ffn, s.hidden),
            ("ffn_up", s.expert_ffn, s.hidden),
            ("ffn_down", s.hidden, s.expert_ffn),
        ):
            yield f"{b}.{name}.weight", random_blocks(Q8_0, (rows, cols), rng), Q8_0


def gpt_oss_tensors(s: Shape, layers: int, rng: np.random.Generator):
    """(name, array, raw type or None) in llama.cpp's gpt-oss layout (llama-model.cpp's tensor shapes)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    yield "token_embd.weight", random_blocks(Q8_0, (s.vocab, s.hidden), rng), Q8_0
    yield "output_norm.weight", floats((s.hidden,), rng, 0.1, 1.0), None
    yield "output.weight", random_blocks(Q8_0, (s.vocab, s.hidden), rng), Q8_0
    for i in range(layers):
        b = f"blk.{i}"
        yield f"{b}.attn_norm.weight", floats((s.hidden,), rng, 0.1, 1.0), None
        yield f"{b}.post_attention_norm.weight", floats((s.hidden,), rng, 0.1, 1.0), None
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            yield f"{b}.{name}.weight", random_blocks(Q8_0, (rows, s.hidden), rng), Q8_0
            yield f"{b}.{name}.bias", floats((rows,), rng), None
        yield f"{b}.attn_output.weight", random_blocks(Q8_0, (s.hidden, q), rng), Q8_0
        yield f"{b}.attn_output.bias", floats((s.hidden,), rng), None
        yield f"{b}.attn_sinks.weight", floats((s.heads,), rng, 1.0), None
        yield f"{b}.ffn_gate_inp.weight", floats((s.experts, s.hidden), rng), None
        yield f"{b}.ffn_gate_inp.bias", floats((s.experts,), rng), None
        for name, rows, cols in (
            ("ffn_gate_exps", s.expert_ffn, s.hidden),
            ("ffn_up_exps", s.expert_ffn, s.hidden),
            ("ffn_down_exps", s.hidden, s.expert_ffn),
        ):
            yield f"{b}.{name}.weight", random_blocks(MXFP4, (s.experts, rows, cols), rng), MXFP4
            yield f"{b}.{name}.bias", floats((s.experts, rows), rng), None


def write(name: str, layers: int, out: Path, seed: int = 0) -> Path:
    s = SHAPES[name]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), s.arch)
    write_metadata(w, s, layers)
    items = list(tqdm(tensors(s, layers, rng), desc=f"{name} x{layers} layers", unit="tensor"))
    for tensor_name, array, kind in items:
        w.add_tensor(tensor_name, array, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, default=None, help="layers to write (default: the model's)")
    p.add_argument("-o", "--out", type=Path, required=True)
    args = p.parse_args()
    layers = args.layers or SHAPES[args.shape].layers
    print(write(args.shape, layers, args.out))


if __name__ == "__main__":
    main()
