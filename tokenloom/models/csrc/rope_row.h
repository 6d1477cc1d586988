// Rotate-half RoPE of one head row, shared by the fused rope op (fused_cpu.cpp) and the
// fused decode attention (attention/csrc/paged_decode_cpu.cpp), so a key rotated while
// decoding has the same bits as the same key rotated in a prefill chunk.
#pragma once
#include <cstdint>

// y[d] = x[d] cos[d] - x[d + D/2] sin[d] (first half), x[d] cos[d] + x[d - D/2] sin[d] (second).
// y may not alias x.
inline void rope_row(const float* x, const float* c, const float* s, float* y, int64_t D) {
  const int64_t half = D / 2;
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) y[d] = x[d] * c[d] + (-x[d + half]) * s[d];
#pragma omp simd
  for (int64_t d = half; d < D; ++d) y[d] = x[d] * c[d] + x[d - half] * s[d];
}
