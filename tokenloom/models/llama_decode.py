"""A Llama-family decode step on the CPU in float32, without walking the module tree.

At batch 1 with quantized weights the matmuls take ~3.5 ms of a ~6 ms step and the rest is
~30 layers x (7 module calls + ~20 small ops and checks) of Python. When every sequence of
the step decodes, ``run`` calls the same ops in the same order as LlamaDecoderLayer (the
fused add+norm, the projections' own forward, one rope + cache write + attention kernel,
the fused silu*up), so the hidden states are the same bits (tested), in ~8 op calls per
layer. Module hooks are not called on this path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenloom.attention import cpu_decode
from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.models import fused


def applies(model, h: torch.Tensor, cos: torch.Tensor, meta: AttentionMetadata, kv_cache) -> bool:
    """This step can take ``run``: float32 CPU kernels built, a plain (not int8) cache, every
    sequence decoding one token, rope over whole heads, no q/k norm, a silu MLP."""
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    return (not attn.qk_norm and mlp.act is F.silu and fused.enabled(h) and h.shape[0] == meta.num_seqs
            and cpu_decode.usable(h, kv_cache.keys[0]) and len(cpu_decode.decode_rows(meta)) == meta.num_seqs
            and cos.shape[-1] == attn.head_dim and cos.is_contiguous() and cos.dtype == torch.float32)


def run(model, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
        kv_cache) -> torch.Tensor:
    """h (S, hidden) embeddings of one token per sequence -> final normed hidden (S, hidden);
    writes each layer's keys/values. Call only where ``applies``."""
    attend = cpu_decode.ops().rope_write_decode
    tables, ctx = cpu_decode.decode_inputs(meta)
    slots, window = meta.slot_mapping, meta.sliding_window or 0
    first = model.model.layers[0].self_attn
    heads, scale = first.num_heads, first.scale
    residual = None
    for i, layer in enumerate(model.model.layers):
        ln1, attn, ln2, mlp = layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp
        if residual is None:
            residual, x = h, fused.rms_norm(h, ln1.weight, ln1.eps)
        else:
            x, residual = fused.add_rms_norm(h, residual, ln1.weight, ln1.eps)
        a = attend(attn.qkv_proj.forward(x), cos, sin, kv_cache.keys[i], kv_cache.values[i], slots, tables, ctx,
                   heads, scale, window)                                       # (S, heads * head_dim)
        x, residual = fused.add_rms_norm(attn.o_proj.forward(a), residual, ln2.weight, ln2.eps)
        h = mlp.down_proj.forward(mlp.gated(x))
    norm = model.model.norm
    return fused.add_rms_norm(h, residual, norm.weight, norm.eps)[0]
