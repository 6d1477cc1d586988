"""A Llama-family step on the CPU in float32, without walking the module tree.

At batch 1 with quantized weights the matmuls take ~3.5 ms of a ~6 ms decode step and the
rest is ~30 layers x (7 module calls + ~20 small ops and checks) of Python; a serving step
that mixes decodes with a prompt chunk spent ~25 ms of ~130 outside its projections. Where
every sequence of a step either decodes one token or is a prompt chunk the prefill kernel
takes, ``run`` calls the same ops in the same order as LlamaDecoderLayer (the fused
add+norm, the projections' own forward, the same rope arithmetic, cache writes and
attention kernels, the fused silu*up), so the hidden states are the same bits (tested),
in ~8 op calls per layer. Module hooks are not called on this path.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from tokenloom.attention import cpu_decode, cpu_prefill
from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.models import fused

# (layer index, qkv (T, (heads + 2 kv_heads) head_dim)) -> attention output (T, heads head_dim)
Attention = Callable[[int, torch.Tensor], torch.Tensor]


def applies(model, h: torch.Tensor, cos: torch.Tensor, meta: AttentionMetadata, kv_cache) -> bool:
    """This step can take ``run``: float32 CPU kernels built, a plain (not int8) cache, rope
    over whole heads, no q/k norm, a silu MLP; and every sequence decoding one token, or
    the decoding ones first and the rest prompt chunks the prefill kernel takes."""
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    if not (not attn.qk_norm and mlp.act is F.silu and fused.enabled(h)
            and cpu_decode.usable(h, kv_cache.keys[0]) and cos.shape[-1] == attn.head_dim
            and cos.is_contiguous() and cos.dtype == torch.float32):
        return False
    decoding = cpu_decode.decode_rows(meta)
    if len(decoding) == meta.num_seqs:
        return h.shape[0] == meta.num_seqs
    return (cpu_prefill.takes(attn.head_dim, kv_cache.keys[0]) and (not decoding or decoding[-1] == len(decoding) - 1)
            and len(cpu_prefill.prefill_rows(meta)) == meta.num_seqs - len(decoding))


def run(model, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
        kv_cache) -> torch.Tensor:
    """h (T, hidden) embeddings of the step's tokens -> final normed hidden (T, hidden);
    writes each layer's keys/values. Call only where ``applies``."""
    attend = _attention(model, cos, sin, meta, kv_cache)
    residual = None
    for i, layer in enumerate(model.model.layers):
        ln1, attn, ln2, mlp = layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp
        if residual is None:
            residual, x = h, fused.rms_norm(h, ln1.weight, ln1.eps)
        else:
            x, residual = fused.add_rms_norm(h, residual, ln1.weight, ln1.eps)
        a = attend(i, attn.qkv_proj.forward(x))                                # (T, heads * head_dim)
        x, residual = fused.add_rms_norm(attn.o_proj.forward(a), residual, ln2.weight, ln2.eps)
        h = mlp.down_proj.forward(mlp.gated(x))
    norm = model.model.norm
    return fused.add_rms_norm(h, residual, norm.weight, norm.eps)[0]


def _attention(model, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, kv_cache) -> Attention:
    """This step's attention block (rope, cache write, attention) as one function of the layer
    and its qkv: one kernel call when every sequence decodes; else the rope and cache write
    of all rows, decode attention into the first rows and prompt attention into the rest."""
    first = model.model.layers[0].self_attn
    heads, head_dim, scale = first.num_heads, first.head_dim, first.scale
    slots, window = meta.slot_mapping, meta.sliding_window or 0
    decoding = cpu_decode.decode_rows(meta)
    decode = cpu_decode.ops()
    tables, ctx = cpu_decode.decode_inputs(meta) if decoding else (None, None)
    keys, values = kv_cache.keys, kv_cache.values
    if len(decoding) == meta.num_seqs:
        return lambda i, qkv: decode.rope_write_decode(qkv, cos, sin, keys[i], values[i], slots, tables, ctx,
                                                       heads, scale, window)
    prompts = cpu_prefill.prefill_rows(meta)
    n = len(decoding)

    def mixed(i: int, qkv: torch.Tensor) -> torch.Tensor:
        T = qkv.shape[0]
        q = decode.rope_write(qkv, cos, sin, keys[i], values[i], slots, heads)  # (T, heads, head_dim)
        out = qkv.new_empty(T, heads * head_dim)
        if n:
            decode.paged_decode_out(q[:n], keys[i], values[i], tables, ctx, scale, window,
                                    out[:n].view(n, heads, head_dim))
        cpu_prefill.attend_into(out.view(T, heads, head_dim), q, keys[i], values[i], meta, prompts, scale)
        return out
    return mixed
