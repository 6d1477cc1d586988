// Argument checks for a stored-format KV cache's arrays (kv_cache/quantized.py's layers), shared
// by the decode (paged_decode_cpu.cpp) and prompt (paged_prefill_cpu.cpp) attention kernels, so
// both accept the same layouts.
#pragma once
#include <ATen/ATen.h>

// A 16-bit cache's arrays: elements (blocks, block_size, kv_heads, head_dim), keys' and values' both
// float16 or both bfloat16, contiguous.
inline void check_half_cache(const at::Tensor& k_data, const at::Tensor& v_data) {
  const auto kind = k_data.scalar_type();
  TORCH_CHECK((kind == at::kHalf || kind == at::kBFloat16) && k_data.dim() == 4 && k_data.is_contiguous() &&
                  v_data.sizes() == k_data.sizes() && v_data.scalar_type() == kind && v_data.is_contiguous(),
              "caches must be contiguous (blocks, block_size, kv_heads, head_dim), both float16 or both bfloat16");
}

// An int8 cache's arrays: codes (blocks, block_size, kv_heads, head_dim) int8, scales (blocks,
// block_size, kv_heads) float32, keys' and values' alike, all contiguous.
inline void check_int8_cache(const at::Tensor& k_data, const at::Tensor& k_scales, const at::Tensor& v_data,
                             const at::Tensor& v_scales) {
  TORCH_CHECK(k_data.dim() == 4 && k_data.scalar_type() == at::kChar && k_data.is_contiguous() &&
              v_data.sizes() == k_data.sizes() && v_data.scalar_type() == at::kChar && v_data.is_contiguous(),
              "codes must be contiguous (blocks, block_size, kv_heads, head_dim) int8");
  TORCH_CHECK(k_scales.sizes() == k_data.sizes().slice(0, 3) && k_scales.scalar_type() == at::kFloat &&
              k_scales.is_contiguous() && v_scales.sizes() == k_scales.sizes() &&
              v_scales.scalar_type() == at::kFloat && v_scales.is_contiguous(),
              "scales must be contiguous (blocks, block_size, kv_heads) float32");
}

// An int4 cache's arrays for head_dim D: codes (blocks, block_size, kv_heads, D / 2) uint8, scales
// (blocks, block_size, kv_heads, D / 32) float16, keys' and values' alike, all contiguous.
inline void check_int4_cache(const at::Tensor& k_data, const at::Tensor& k_scales, const at::Tensor& v_data,
                             const at::Tensor& v_scales, int64_t D) {
  TORCH_CHECK(k_data.dim() == 4 && k_data.scalar_type() == at::kByte && k_data.is_contiguous() &&
              v_data.sizes() == k_data.sizes() && v_data.scalar_type() == at::kByte && v_data.is_contiguous(),
              "codes must be contiguous (blocks, block_size, kv_heads, head_dim / 2) uint8");
  TORCH_CHECK(D % 32 == 0 && k_data.size(3) * 2 == D, "head_dim must be a multiple of 32 and twice the codes' last size");
  TORCH_CHECK(k_scales.dim() == 4 && k_scales.sizes().slice(0, 3) == k_data.sizes().slice(0, 3) &&
              k_scales.size(3) == D / 32 && k_scales.scalar_type() == at::kHalf && k_scales.is_contiguous() &&
              v_scales.sizes() == k_scales.sizes() && v_scales.scalar_type() == at::kHalf && v_scales.is_contiguous(),
              "scales must be contiguous (blocks, block_size, kv_heads, head_dim / 32) float16");
}
